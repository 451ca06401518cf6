"""train: (the method's quantized base, the training prompts) -> GRPO/DAPO training -> adapter + summary.

``kedro run --pipeline=train`` must work on a fresh checkout, so this pipeline includes
what it needs upstream: data_prep's nodes up to ``train_prompts`` and the quantize nodes
up to ``base_model`` (the base folder of ``params:method``). Kedro skips nothing by
itself; the upstream nodes are cheap next to training (seconds on the default model).

Outputs (conf/base/catalog_train.yml): ``train_summary`` (JSON: adapter folder, run id,
per-step metrics). The adapter itself is written by the trainer to
``<train.output_dir>/<method>/final_adapter`` (evaluate reads it there) and logged to
MLflow.
"""

from kedro.pipeline import Node, Pipeline

from qerl_pipeline.pipelines.train.nodes import train_policy

#: Upstream datasets the train node consumes.
PROMPTS_DATASET = "train_prompts"
BASE_DATASET = "base_model"


def _upstream() -> Pipeline:
    from qerl_pipeline.pipelines.data_prep.pipeline import create_pipeline as data_prep
    from qerl_pipeline.pipelines.quantize.pipeline import create_pipeline as quantize

    return data_prep().to_outputs(PROMPTS_DATASET) + quantize().to_outputs(BASE_DATASET)


def create_pipeline(**kwargs) -> Pipeline:
    """Upstream (prompts, base) + the training node."""
    training = Pipeline(
        [
            Node(
                train_policy,
                [PROMPTS_DATASET, BASE_DATASET, "params:method", "params:model", "params:lora", "params:rollout",
                 "params:grpo", "params:aqn", "params:optim", "params:train", "params:reward", "params:data"],
                "train_summary",
                name="train_policy",
            )
        ],
        tags="train",
    )
    return _upstream() + training
