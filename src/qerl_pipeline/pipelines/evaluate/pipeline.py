"""evaluate: the trained policy (base + adapter of ``params:method``) and the base alone on the benchmarks.

``kedro run --pipeline=evaluate`` after ``train`` (same ``--env`` and ``method``). It includes
the cheap upstream it needs: data_prep's ``prepare_eval_prompts`` (the benchmark prompt
records, from the current config) and quantize's ``select_base`` (the method's existing
base folder, never re-quantized). The adapter is read from
``<train.output_dir>/<method>/final_adapter``.

Outputs (conf/base/catalog_evaluate.yml): ``eval_records`` (per problem), ``eval_accuracy``
(per policy and benchmark, with 95% intervals), ``eval_metrics`` (MLflow metrics), all
logged to the run's MLflow run.
"""

from kedro.pipeline import Node, Pipeline

from qerl_pipeline.pipelines.evaluate.nodes import eval_outputs, run_evaluation

PROMPTS_DATASET = "eval_prompts"
#: The quantize pipeline's dataset holding the base folder of ``params:method``.
BASE_DATASET = "base_model"


def _upstream() -> Pipeline:
    from qerl_pipeline.pipelines.data_prep.pipeline import create_pipeline as data_prep
    from qerl_pipeline.pipelines.quantize.pipeline import create_pipeline as quantize

    return data_prep().to_outputs(PROMPTS_DATASET) + quantize().only_nodes("select_base")


def create_pipeline(**kwargs) -> Pipeline:
    """Upstream (prompts, base folder) + evaluate (engine + scoring) + outputs."""
    evaluation = Pipeline(
        [
            Node(
                run_evaluation,
                [PROMPTS_DATASET, BASE_DATASET, "params:method", "params:evaluate", "params:reward", "params:model",
                 "params:rollout", "params:train"],
                "eval_result",
                name="evaluate_policies",
            ),
            Node(eval_outputs, "eval_result", ["eval_records", "eval_accuracy", "eval_metrics"], name="evaluation_outputs"),
        ],
        tags="evaluate",
    )
    return _upstream() + evaluation
