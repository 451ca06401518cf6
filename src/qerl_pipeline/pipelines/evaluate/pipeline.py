"""evaluate: the trained policy (base + adapter of ``params:method``) and the base alone on the benchmarks.

Inputs: ``eval_prompts`` (data_prep), the method's quantized base (quantize) and the
final adapter under ``<train.output_dir>/<method>/final_adapter`` (train).
Outputs (conf/base/catalog_evaluate.yml): ``eval_records`` (per problem), ``eval_accuracy``
(per policy and benchmark, with 95% intervals), ``eval_metrics`` (MLflow metrics), all
logged to the run's MLflow run.
"""

from kedro.pipeline import Node, Pipeline

from qerl_pipeline.pipelines.evaluate.nodes import eval_outputs, run_evaluation

#: The quantize pipeline's dataset holding the base folder of ``params:method``.
BASE_DATASET = "base_model"


def create_pipeline(**kwargs) -> Pipeline:
    """Two nodes: evaluate (engine + scoring), then shape the outputs."""
    return Pipeline(
        [
            Node(
                run_evaluation,
                ["eval_prompts", BASE_DATASET, "params:method", "params:evaluate", "params:reward", "params:model", "params:rollout", "params:train"],
                "eval_result",
                name="evaluate_policies",
            ),
            Node(eval_outputs, "eval_result", ["eval_records", "eval_accuracy", "eval_metrics"], name="evaluation_outputs"),
        ],
        tags="evaluate",
    )
