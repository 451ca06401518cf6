"""export: a trained policy -> folders that transformers, PEFT, vLLM and MLflow load without this project.

``kedro run --pipelines=export --params method=qerl`` after ``train`` (same ``--env`` and method,
``train.seed`` the training's). It includes the cheap upstream it needs: data_prep's
``prepare_eval_prompts`` (the problems the 4-bit policy is scored on). The base is read from
``existing_base_models`` (its path even when nothing is there), so a missing training is reported
before anything else, by the export node itself.

Datasets (conf/base/catalog_export.yml):

* ``exports``: one ``<method>/`` folder per export (``export/folders.py``: ``adapter/``, ``base/``,
  ``merged/``, ``merged_nvfp4/``, ``merged_nf4/`` for qlora, ``vllm_lora/`` with trained norms,
  ``export.json``), moved in atomically; the lineage runs train -> trained_adapters -> exports;
* ``export_eval_result``: the evaluation of ``trained`` (+ ``base``) and ``merged_nvfp4`` (JSON);
* ``export_report``: folders, load commands, 4-bit weight error, accuracies with intervals, the 4-bit
  cost, the registered model version (JSON, logged to the run under ``export/``).

``export_nodes(method)`` is the template compare instantiates per method (namespace
``compare.<method>``, on the branch's ``base_<format>``): every seed, with ``export.in_compare``,
after the branch's evaluation (whose logged evaluation of ``trained`` it reuses); the compare
report comes after it.
"""

from kedro.pipeline import Node, Pipeline

from qerl_pipeline.pipelines.export.nodes import evaluate_exports, export_policy, report_exports
from qerl_pipeline.pipelines.train.pipeline import config_node

PROMPTS_DATASET = "eval_prompts"
ADAPTERS_DATASET = "trained_adapters"
#: Standalone: the folder of bases (existing or not, ``missing_ok``); compare maps ``base_model`` to ``base_<format>``.
BASES_DATASET = "existing_base_models"
BRANCH_BASE_DATASET = "base_model"


def _upstream() -> Pipeline:
    from qerl_pipeline.pipelines.data_prep.pipeline import create_pipeline as data_prep

    return data_prep().to_outputs(PROMPTS_DATASET)


#: Parameter sections the export nodes read, gathered (with the method) into ``export_config``.
SECTIONS = ("export", "train", "quantize", "evaluate", "reward", "model", "rollout", "data")


def export_nodes(method: str | None = None) -> Pipeline:
    """``export_config``; ``export_policy`` -> ``exports`` -> ``evaluate_export`` -> ``export_eval_result`` ->
    ``report_export``."""
    in_compare = method is not None
    common = {"trained_adapters": ADAPTERS_DATASET, "cfg": "export_config"}
    group = {"compare_group": "compare_group"} if in_compare else {}
    evaluate_inputs = {
        **common,
        "exports": "exports",
        "base": BRANCH_BASE_DATASET if in_compare else BASES_DATASET,
        "eval_prompts": PROMPTS_DATASET,
    }
    if in_compare:  # after the branch's evaluation, whose logged evaluation of `trained` is then reused
        evaluate_inputs["eval_result"] = "eval_result"
    return Pipeline(
        [
            config_node("export_config", (*SECTIONS, "compare") if in_compare else SECTIONS, method),
            Node(export_policy, {**common, "base": evaluate_inputs["base"], **group}, "exports", name="export_policy"),
            Node(evaluate_exports, evaluate_inputs, "export_eval_result", name="evaluate_export"),
            Node(
                report_exports,
                {**common, "export_eval_result": "export_eval_result", "exports": "exports", **group},
                "export_report",
                name="report_export",
            ),
        ],
        tags="export",
    )


def create_pipeline(**kwargs) -> Pipeline:
    """Upstream (the evaluation prompts) + export, evaluate, report."""
    return _upstream() + export_nodes()
