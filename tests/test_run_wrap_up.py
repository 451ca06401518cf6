"""A training killed during its wrap-up (after its last checkpoint, before its final adapter and curves reach the
tracking store) is finished by the next call, not taken as done: ``trainer.train`` on the fake engine, a kill
raised where a signal can land (KeyboardInterrupt, as SIGINT is), then the same call again."""

from __future__ import annotations

import pytest

from qerl_pipeline.adapter import adapter_meta
from qerl_pipeline.config import QerlConfig
from qerl_pipeline.tracking import KILLED_BY_TAG, MemoryLogger

RECORDS = [
    {"id": str(i), "messages": [{"role": "user", "content": f"What is {i} plus {i}?"}], "gold": str(2 * i)}
    for i in range(1, 5)
]


class KilledAt(MemoryLogger):
    """A logger that raises KeyboardInterrupt when the artifact ``kill_at`` is logged (None: never)."""

    def __init__(self) -> None:
        super().__init__()
        self.kill_at: str | None = None

    def log_artifact(self, path, artifact_path=None):
        if artifact_path == self.kill_at:
            raise KeyboardInterrupt
        super().log_artifact(path, artifact_path)


def _cfg(out, steps: int) -> QerlConfig:
    return QerlConfig.model_validate(
        {
            "method": "lora",
            "model": {"dtype": "float32", "max_seq_len": 128},
            "lora": {"rank": 2, "alpha": 4},
            "grpo": {"num_generations": 2},
            "rollout": {"max_new_tokens": 4, "temperature": 1.0, "sync": "adapter"},
            "train": {
                "steps": steps,
                "prompts_per_step": 1,
                "micro_batch_size": 2,
                "checkpoint_every": 1,
                "output_dir": str(out),
                "reward_fn": "tests.helpers.rewards:letter_fraction",
            },
        }
    )


@pytest.fixture
def base(tiny_model_dir, tmp_path):
    from tests.helpers.models import tokenized_base

    return tokenized_base(tiny_model_dir, "bf16", tmp_path / "bf16")


def _train(cfg, base, logger):
    from qerl_pipeline.rl import trainer
    from qerl_pipeline.rl.run_setup import Reporting
    from tests.helpers.engines import FakeEngine

    return trainer.train(
        cfg,
        base,
        RECORDS,
        engine=FakeEngine(cuda=False),
        reporting=Reporting(make_logger=lambda _rid: logger, progress=False),
    )


def test_a_run_killed_after_its_final_adapter_is_finished_by_the_next_call_without_training(base, tmp_path):
    logger = KilledAt()
    logger.kill_at = "plots"  # after the final adapter is on disk and logged, before the curves
    cfg = _cfg(tmp_path / "out", steps=2)
    with pytest.raises(KeyboardInterrupt):
        _train(cfg, base, logger)
    run_dir = tmp_path / "out" / "lora"
    assert (run_dir / "final_adapter").is_dir() and not (run_dir / "final_logged.json").exists()
    assert KILLED_BY_TAG in logger.tags and logger.tags["qerl.last_completed_step"] == "2", (
        logger.tags
    )  # marked KILLED
    assert "plots/train_curves.png" not in logger.artifacts

    logger.kill_at, logger.artifacts = None, {}
    again = _train(cfg, base, logger)
    assert again.reused and again.resumed_from == 2  # nothing trained again
    assert "plots/train_curves.png" in logger.artifacts and "final_adapter/final_adapter" in logger.artifacts
    assert (run_dir / "final_logged.json").exists()
    logger.artifacts = {}
    assert _train(cfg, base, logger).reused and logger.artifacts == {}  # wrapped up: the next reuse logs nothing


def test_a_run_resumed_with_more_steps_and_killed_before_its_final_adapter_is_not_the_shorter_runs(
    base, tmp_path, monkeypatch
):
    from qerl_pipeline.rl import trainer

    logger = KilledAt()
    _train(_cfg(tmp_path / "out", steps=2), base, logger)
    final = tmp_path / "out" / "lora" / "final_adapter"
    assert adapter_meta(final)["steps"] == 2

    def killed(*_args, **_kw):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:  # killed after the step-3 checkpoint, before its final adapter
        patch.setattr(trainer, "_save_final_adapter", killed)
        with pytest.raises(KeyboardInterrupt):
            _train(_cfg(tmp_path / "out", steps=3), base, logger)
    assert adapter_meta(final)["steps"] == 2
    result = _train(_cfg(tmp_path / "out", steps=3), base, logger)
    assert not result.reused and result.resumed_from == 3  # resumed at its step-3 checkpoint, nothing left to train
    assert adapter_meta(final)["steps"] == 3
