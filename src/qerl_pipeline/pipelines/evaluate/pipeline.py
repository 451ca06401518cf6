"""evaluate: the trained policy (base + adapter of ``params:method``) and the base alone on the benchmarks.

``kedro run --pipelines=evaluate`` after ``train`` (same ``--env`` and ``method``). It includes
the cheap upstream it needs: data_prep's ``prepare_eval_prompts`` (the benchmark prompt
records, from the current config) and quantize's ``select_base`` (the method's existing
base folder, never re-quantized). The adapter is the train pipeline's ``trained_adapters``
dataset (its ``<method>/`` folder), so the lineage runs train -> adapter -> evaluate.

Outputs (conf/base/catalog_evaluate.yml): ``eval_result`` (the evaluation, JSON, what the
outputs node reads), ``eval_records`` (per problem), ``eval_accuracy``
(per policy and benchmark, with 95% intervals), ``eval_metrics`` (MLflow metrics), all
logged to the run's MLflow run (named ``evaluate <method> · <model> · seed <n>``, tagged
``qerl.trained_run_id``).

``evaluation_nodes(method)`` is the template compare instantiates per method
(namespace ``compare.<method>``); there it evaluates every seed of ``compare.seeds``,
each logged into its own training run, or nothing when ``compare.methods`` leaves its method out.
"""

from kedro.pipeline import Node, Pipeline

from qerl_pipeline.pipelines.evaluate.nodes import eval_outputs, run_evaluation
from qerl_pipeline.pipelines.train.pipeline import config_node

PROMPTS_DATASET = "eval_prompts"
#: The quantize pipeline's dataset holding the base folder of ``params:method``.
BASE_DATASET = "base_model"
ADAPTERS_DATASET = "trained_adapters"


def _upstream() -> Pipeline:
    from qerl_pipeline.pipelines.data_prep.pipeline import create_pipeline as data_prep
    from qerl_pipeline.pipelines.quantize.pipeline import create_pipeline as quantize

    return data_prep().to_outputs(PROMPTS_DATASET) + quantize().only_nodes("select_base")


#: Parameter sections the evaluation reads, gathered (with its method) into ``evaluation_config``.
SECTIONS = ("evaluate", "reward", "model", "rollout", "data", "tracking")


def evaluation_nodes(method: str | None = None) -> Pipeline:
    """``evaluation_config``, engine + scoring -> ``eval_result`` -> ``eval_records``, ``eval_accuracy``,
    ``eval_metrics``."""
    inputs = {
        "eval_prompts": PROMPTS_DATASET,
        "base_dir": BASE_DATASET,
        "trained_adapters": ADAPTERS_DATASET,
        "cfg": "evaluation_config",
    }
    sections = SECTIONS
    if method is not None:  # every seed of compare.seeds, each logged into its training run, if compare.methods has it
        inputs["compare_group"] = "compare_group"
        sections = (*SECTIONS, "compare")
    return Pipeline(
        [
            config_node("evaluation_config", sections, method),
            Node(run_evaluation, inputs, "eval_result", name="evaluate_policies"),
            Node(
                eval_outputs,
                "eval_result",
                ["eval_records", "eval_accuracy", "eval_metrics"],
                name="evaluation_outputs",
            ),
        ],
        tags="evaluate",
    )


def create_pipeline(**kwargs) -> Pipeline:
    """Upstream (prompts, base folder) + evaluate (engine + scoring) + outputs."""
    return _upstream() + evaluation_nodes()
