"""train: (the method's quantized base, the training prompts) -> GRPO/DAPO training -> adapter + summary.

``kedro run --pipelines=train`` must work on a fresh checkout, so this pipeline includes
what it needs upstream: data_prep's nodes up to ``train_prompts`` and the quantize nodes
up to ``base_model`` (the base folder of ``params:method``; reused, not rewritten, when
its fingerprint matches: ``quantization/store.py``).

Datasets (conf/base/catalog_train.yml):

* ``trained_adapters``: the folder of trained adapters, one ``<method>/`` each (PEFT files,
  trained norms, ``qerl_adapter.json`` naming the training's MLflow run); the evaluate
  pipeline reads it, so the lineage runs train -> adapter -> evaluate.
* ``train_summary``: JSON (adapter folder, run id, per-step metrics).

``training_nodes(method)`` is the template compare instantiates once per method (Kedro
namespace ``compare.<method>``, the method bound: ``with_method``); there the node also takes
``compare_group`` (the compare run) and ``params:compare``, and trains once per seed, each in a
child MLflow run, or nothing when ``compare.methods`` leaves its method out. Its sections come
typed, gathered by the ``training_config`` node (``config_node``) into the one config it takes.
"""

from functools import partial, update_wrapper
from typing import Any

from kedro.pipeline import Node, Pipeline

from qerl_pipeline.config import gather
from qerl_pipeline.pipelines.train.nodes import train_policy

#: Upstream datasets the train node consumes.
PROMPTS_DATASET = "train_prompts"
BASE_DATASET = "base_model"
#: data_prep's report (counts, dropped rows): logged into the training run with the base's quantize report.
DATA_REPORT = "data_prep_report"
#: Parameter sections the training reads, gathered (with its method) into ``training_config`` (``config.gather``).
SECTIONS = ("model", "lora", "rollout", "grpo", "aqn", "optim", "train", "reward", "data", "tracking")
#: compare's section: its templates train and evaluate each of ``compare.seeds``, and nothing when
#: ``compare.methods`` leaves their method out.
COMPARE_PARAM = "params:compare"


def _upstream() -> Pipeline:
    from qerl_pipeline.pipelines.data_prep.pipeline import create_pipeline as data_prep
    from qerl_pipeline.pipelines.quantize.pipeline import create_pipeline as quantize

    return data_prep().to_outputs(PROMPTS_DATASET, DATA_REPORT) + quantize().to_outputs(BASE_DATASET)


def with_method(func, inputs: dict[str, str], method: str | None) -> tuple[Any, dict[str, str]]:
    """A template node's function and inputs for its ``method`` argument: standalone (``method`` None) the
    ``params:method`` parameter; in a compare branch the branch's method, bound (a method is its registration:
    no ``compare.<method>`` entry in parameters.yml)."""
    if method is None:
        return func, {**inputs, "method": "params:method"}
    return update_wrapper(partial(func, method=method), func), inputs


def config_node(name: str, sections: tuple[str, ...], method: str | None) -> Node:
    """The node gathering ``sections`` (typed, as the config hook hands them) and the method into the ``name``
    dataset, the one config object of the nodes after it (``config.gather``); ``kedro viz`` draws what it reads."""
    return Node(*with_method(gather, {s: f"params:{s}" for s in sections}, method), name, name=name)


def training_nodes(method: str | None = None) -> Pipeline:
    """``training_config``, then the training node: prompts + base + config -> ``trained_adapters``,
    ``train_summary``; ``method``: compare's branch of that method."""
    inputs = {
        "train_prompts": PROMPTS_DATASET,
        "base_model": BASE_DATASET,
        "data_report": DATA_REPORT,
        "cfg": "training_config",
    }
    # one training per seed of compare.seeds, in the compare run, if compare.methods has it (train/nodes.py)
    if method is not None:
        inputs["compare_group"] = "compare_group"
        inputs["compare"] = COMPARE_PARAM
    return Pipeline(
        [
            config_node("training_config", SECTIONS, method),
            Node(train_policy, inputs, ["trained_adapters", "train_summary"], name="train_policy"),
        ],
        tags="train",
    )


def create_pipeline(**kwargs) -> Pipeline:
    """Upstream (prompts, base) + the training node."""
    return _upstream() + training_nodes()
