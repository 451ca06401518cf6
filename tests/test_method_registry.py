"""A method is one registration (``config.register_method``): its learning rate, base format and AQN come from
its ``MethodSpec``; ``optim.lr`` overrides the rates it names and leaves the others their own; a compare branch
needs no entry of its own in parameters.yml. ``toy_lora`` below is registered from this file alone and trained
a step through the real trainer (fake engine: no vLLM in the fast tier)."""

from __future__ import annotations

import pytest

from qerl_pipeline import config, metric_names
from qerl_pipeline.config import MethodSpec, OptimConfig, QerlConfig, register_method

RECORDS = [
    {"id": str(i), "messages": [{"role": "user", "content": f"What is {i} plus {i}?"}], "gold": str(2 * i)}
    for i in range(1, 5)
]


@pytest.fixture
def toy():
    spec = register_method(MethodSpec("toy_lora", "bf16", False, 2.5e-3, "Toy BF16 LoRA"))
    try:
        yield spec
    finally:
        config.METHOD_SPECS.pop(spec.name, None)


def test_optim_lr_overrides_the_rates_it_names_and_leaves_the_others_their_registered_ones():
    given = OptimConfig(lr={"qerl": 3e-4})
    assert given.lr["qerl"] == 3e-4
    assert {m: r for m, r in given.lr.items() if m != "qerl"} == {
        m: s.lr for m, s in config.METHOD_SPECS.items() if m != "qerl"
    }
    assert given.lr["lora"] == 5e-6  # the paper's BF16 LoRA rate, its registration's


def test_the_shipped_conf_without_a_methods_entries_gives_it_its_registered_rate(toy):
    """What used to fail after the base had loaded (a KeyError in rl/optim.py): a method parameters.yml
    does not list trains at its registration's rate."""
    from qerl_pipeline.planner.inputs import load_config
    from tests.helpers.project import PROJECT

    cfg = load_config("smoke", "method=toy_lora", conf_dir=PROJECT / "conf")
    assert cfg.method == "toy_lora" and cfg.optim.lr["toy_lora"] == 2.5e-3
    assert cfg.optim.lr["lora"] == 1.5e-4  # the shipped CPU-scale rate still overrides lora's own


def test_a_method_registered_in_a_test_file_trains_a_step_at_its_own_rate(toy, tiny_model_dir, tmp_path):
    from qerl_pipeline.rl import trainer
    from qerl_pipeline.rl.optim import lr_factor
    from qerl_pipeline.rl.run_setup import Reporting
    from qerl_pipeline.tracking import MemoryLogger
    from tests.helpers.engines import FakeEngine
    from tests.helpers.models import tokenized_base

    cfg = QerlConfig.model_validate(
        {
            "method": "toy_lora",
            "model": {"dtype": "float32", "max_seq_len": 128},
            "lora": {"rank": 2, "alpha": 4},
            "grpo": {"num_generations": 2},
            "optim": {"lr": {"qerl": 3e-4}, "warmup_steps": 0, "schedule": "constant"},
            "rollout": {"max_new_tokens": 4, "temperature": 1.0, "sync": "adapter"},
            "train": {
                "steps": 1,
                "prompts_per_step": 1,
                "micro_batch_size": 2,
                "output_dir": str(tmp_path / "out"),
                "reward_fn": "tests.helpers.rewards:letter_fraction",
            },
        }
    )
    assert not cfg.aqn_enabled()  # its registration's
    logger = MemoryLogger()
    result = trainer.train(
        cfg,
        tokenized_base(tiny_model_dir, "bf16", tmp_path / "bf16"),
        RECORDS,
        engine=FakeEngine(cuda=False),
        reporting=Reporting(make_logger=lambda _rid: logger, progress=False),
    )
    assert result.steps == 1 and (result.adapter_dir / "adapter_model.safetensors").is_file()
    assert result.run_dir.name == "toy_lora"
    ((step, lr),) = logger.history([metric_names.LEARNING_RATE])[metric_names.LEARNING_RATE]
    assert step == 1 and lr == pytest.approx(2.5e-3 * lr_factor(1, warmup=0, total=1, schedule="constant"))
    # what MLflow's runs list sorts by (tracking_view.py): its format and seed, its prompts as a dataset input, and
    # the summary of its curve
    assert logger.tags["format"] == "bf16" and logger.tags["seed"] == "0"
    ((dataset, context),) = logger.inputs
    assert context == "training" and dataset["name"] == "prompts" and dataset["digest"]  # no source/split
    ((_, reward),) = logger.history([metric_names.REWARD_MEAN])[metric_names.REWARD_MEAN]
    summary = {m: logger.metrics[m] for m in (metric_names.REWARD_AREA, metric_names.FINAL_REWARD)}
    assert summary == {metric_names.REWARD_AREA: [(1, reward)], metric_names.FINAL_REWARD: [(1, reward)]}
    assert logger.metrics[metric_names.MEAN_STEP_S][0][1] > 0


@pytest.fixture(scope="module")
def without_lora(tmp_path_factory):
    """A project copy whose conf/base/parameters.yml lists nothing of lora (its ``optim.lr`` rate taken out)."""
    from tests.helpers.project import project_copy

    root = project_copy(tmp_path_factory.mktemp("method") / "project", shared=["gsm8k/test.jsonl"])
    params = root / "conf" / "base" / "parameters.yml"
    text = params.read_text()
    assert text.count("lora: 1.5e-4, ") == 1 and "compare.lora" not in text and "\n  lora: {" not in text
    params.write_text(text.replace("lora: 1.5e-4, ", ""))
    return root


@pytest.mark.kedro_run
@pytest.mark.vllm
def test_lora_trains_and_compares_from_a_conf_that_lists_nothing_of_it(without_lora):
    """The smoke training of lora and a one-branch compare of it, at lora's registered rate (5e-6)."""
    from mlflow.tracking import MlflowClient

    from tests.helpers.project import run_kedro, tracking_uri

    root = without_lora
    run_kedro(root, "run", "--pipelines=train", "--env=smoke", "--params=method=lora", timeout=900)
    run_kedro(
        root,
        "run",
        "--pipelines=compare",
        "--env=smoke",
        "--params=compare.methods=lora,compare.seeds=[0],evaluate.greedy=false",
        timeout=1200,
    )
    client = MlflowClient(tracking_uri=tracking_uri(root))
    exp = client.get_experiment_by_name("qerl_pipeline")
    trained = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("qerl.role") == "train"]
    assert sorted("qerl.compare_group" in r.data.tags for r in trained) == [False, True]  # standalone, branch
    for run in trained:
        assert run.info.status == "FINISHED" and run.data.tags["method"] == "lora"
        rates = [m.value for m in client.get_metric_history(run.info.run_id, metric_names.LEARNING_RATE)]
        assert rates and 0 < max(rates) <= config.METHOD_SPECS["lora"].lr, rates
    runs = (root / "data/08_reporting/smoke/compare/runs.json").read_text()
    assert [r.info.run_id for r in trained if "qerl.compare_group" in r.data.tags][0] in runs
