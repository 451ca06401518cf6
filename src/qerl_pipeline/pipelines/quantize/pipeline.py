"""quantize: base model -> ``data/06_models/base_<format>/`` for ``params:method``, logged to MLflow.

Datasets (conf/base/catalog_quantize.yml; every path under ``<layer>${globals:env_subdir}``, so
smoke runs write under ``.../smoke/``):

* ``existing_base_models``: ``base_models``' definition under a second name, loaded with
  ``missing_ok`` (its path even before anything was written): what the quantize node reuses
  or updates. A node cannot read its own output, hence the second name.
* ``base_models``: the folder holding every ``base_<format>`` (HFModelFolderDataset); the
  node hands over only the configured method's base, others stay as they were. A base whose
  fingerprint matches is reused and its files are not touched (``quantization/store.py``);
  ``quantize.force: true`` rewrites it.
* ``base_model``: the path of the method's base folder (JSON), what train and evaluate use.
* ``quantize_report``: per-layer errors, bytes, timings (versioned JSON); on reuse the report
  stored with the base, with ``reused: true`` (MLflow tag ``quantize.reused``).
* ``quantize_policy_memory``: the policy's measured resident / peak parameter memory (JSON).
* ``quantize_summary``: the report without per-layer rows plus the policy's measured
  resident/peak parameter memory; the same numbers go to the MLflow run.
* ``base_nvfp4`` / ``base_nf4`` / ``base_bf16``: one format's folder each, written by
  ``format_nodes`` (one node per format, the template compare uses), each with its
  ``quantize_report_<format>``; not used by this pipeline.
"""

from kedro.pipeline import Node, Pipeline

from qerl_pipeline.pipelines.quantize.nodes import (
    log_quantize,
    measure_policy,
    quantize_base,
    quantize_format,
    select_base,
)


def create_pipeline(**kwargs) -> Pipeline:
    """Wire the quantize nodes."""
    return Pipeline(
        [
            Node(
                quantize_base,
                ["params:model", "params:quantize", "params:method", "existing_base_models"],
                ["base_models", "quantize_report"],
                name="quantize_base",
            ),
            Node(select_base, ["base_models", "params:method"], "base_model", name="select_base"),
            Node(
                measure_policy,
                ["base_model", "params:method", "params:lora", "params:model"],
                "quantize_policy_memory",
                name="measure_policy",
            ),
            Node(log_quantize, ["quantize_report", "quantize_policy_memory"], "quantize_summary", name="log_quantize"),
        ],
        tags="quantize",
    )


def _for_format(fmt: str):
    """``quantize_format`` with ``fmt`` bound, as a plain named function (Kedro shows its name)."""

    def quantize_one(model: dict, quantize: dict, existing_base_models, _fmt: str = fmt) -> tuple[str, dict]:
        return quantize_format(model, quantize, existing_base_models, fmt=_fmt)

    quantize_one.__name__ = quantize_one.__qualname__ = f"quantize_{fmt}"
    quantize_one.__doc__ = (
        f"The {fmt} base in ``existing_base_models/base_{fmt}`` (reused when its fingerprint matches)."
    )
    return quantize_one


def format_nodes(formats) -> Pipeline:
    """One node per base format: ``quantize_<fmt>`` -> ``base_<fmt>``, ``quantize_report_<fmt>``."""
    return Pipeline(
        [
            Node(
                _for_format(f),
                ["params:model", "params:quantize", "existing_base_models"],
                [f"base_{f}", f"quantize_report_{f}"],
                name=f"quantize_{f}",
            )
            for f in formats
        ],
        tags="quantize",
    )
