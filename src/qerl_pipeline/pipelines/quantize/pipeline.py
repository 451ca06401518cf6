"""quantize: base model -> ``data/06_models/base_<format>/`` for ``params:method``, logged to MLflow.

Datasets (conf/base/catalog_quantize.yml; smoke runs write under ``.../smoke/``):

* ``base_models``: the folder holding every ``base_<format>`` (HFModelFolderDataset); the
  node hands over only the configured method's base, others stay as they were.
* ``base_model``: the path of the method's base folder (memory), what train and evaluate use.
* ``quantize_report``: per-layer errors, bytes, timings (versioned JSON).
* ``quantize_summary``: the report without per-layer rows plus the policy's measured
  resident/peak parameter memory; the same numbers go to the MLflow run.
"""

from kedro.pipeline import Node, Pipeline

from qerl_pipeline.pipelines.quantize.nodes import log_quantize, measure_policy, quantize_base, select_base


def create_pipeline(**kwargs) -> Pipeline:
    """Wire the quantize nodes."""
    return Pipeline(
        [
            Node(quantize_base, ["params:model", "params:quantize", "params:method"], ["base_models", "quantize_report"],
                 name="quantize_base"),
            Node(select_base, ["base_models", "params:method"], "base_model", name="select_base"),
            Node(measure_policy, ["base_model", "params:method", "params:lora", "params:model"], "quantize_policy_memory",
                 name="measure_policy"),
            Node(log_quantize, ["quantize_report", "quantize_policy_memory"], "quantize_summary", name="log_quantize"),
        ],
        tags="quantize",
    )
