"""Run folders: a fresh run over an earlier one starts clean (issue "Lineage you can browse").

The rule (``rl/trainer.py: open_run_dir``): one ``<output_dir>/<method>`` holds one run. A
fresh run (``train.resume: false``, or no complete checkpoint) over an earlier run's files
moves that folder aside to ``<method>.previous-<UTC timestamp>[-n]``, never deleted, never
overwritten, never mixed in; a resume keeps the folder. The adapter cleanup keeps the last
two step folders of this run and never the one the engine is about to load.

Fast unit tests of that logic here. The real run (a ``kedro run --pipeline=train`` with
``train.resume=false`` over a finished run's folder, which used to die at step 2 with
``FileNotFoundError: .../adapters/step-000001``) is
``tests/test_trainer.py::test_a_fresh_run_over_an_earlier_run_moves_it_aside_intact``: it
shares that module's runs instead of starting two engines of its own.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from pathlib import Path

import torch

from qerl_pipeline.config import QerlConfig
from qerl_pipeline.rl import checkpoint as ckpt
from qerl_pipeline.rl import trainer

NOW = datetime(2026, 12, 1, 10, 15, 2, tzinfo=timezone.utc)
STAMP = "20261201T101502Z"


def _cfg(out: Path, resume: bool) -> QerlConfig:
    return QerlConfig.model_validate({"method": "qerl", "train": {"output_dir": str(out), "resume": resume}})


def _fake_checkpoint(run_dir: Path, step: int, run_id: str = "r") -> Path:
    """A complete checkpoint folder as far as ``find_latest``/``peek_state`` look (meta.json, state.pt)."""
    folder = ckpt.checkpoint_root(run_dir) / f"step-{step:06d}"
    folder.mkdir(parents=True)
    torch.save({"trainer": {"step": step, "run_id": run_id}}, folder / "state.pt")
    (folder / "meta.json").write_text(json.dumps({"step": step, "files": ["state.pt"]}))
    return folder


def _finished_run(run_dir: Path, steps: int = 3, marker: str = "first") -> None:
    """The files a finished 3-step run leaves: last two adapters, checkpoints 2 and 3, final adapter."""
    for s in (steps - 1, steps):
        (run_dir / "adapters" / f"step-{s:06d}").mkdir(parents=True)
        _fake_checkpoint(run_dir, s, run_id=marker)
    (run_dir / "final_adapter").mkdir()
    (run_dir / "final_adapter" / "adapter_model.safetensors").write_text(marker)


# ------------------------------------------------------------------ naming
def test_aside_name_is_a_utc_stamped_sibling_with_a_counter_when_taken(tmp_path):
    run_dir = tmp_path / "out" / "qerl"
    run_dir.mkdir(parents=True)
    assert ckpt.aside_path(run_dir, NOW) == tmp_path / "out" / f"qerl.previous-{STAMP}"
    # a non-UTC clock gives the same UTC stamp
    from datetime import timedelta

    assert ckpt.aside_path(run_dir, NOW.astimezone(timezone(timedelta(hours=5)))).name == f"qerl.previous-{STAMP}"
    (tmp_path / "out" / f"qerl.previous-{STAMP}").mkdir()
    assert ckpt.aside_path(run_dir, NOW).name == f"qerl.previous-{STAMP}-1"
    (tmp_path / "out" / f"qerl.previous-{STAMP}-1").write_text("a file takes the name too")
    assert ckpt.aside_path(run_dir, NOW).name == f"qerl.previous-{STAMP}-2"


def test_move_aside_never_overwrites_an_earlier_moved_aside_folder(tmp_path):
    run_dir = tmp_path / "qerl"
    moved = []
    for i in range(3):  # three runs moved aside within the same second
        run_dir.mkdir()
        (run_dir / "who").write_text(str(i))
        moved.append(ckpt.move_aside(run_dir, NOW))
        assert not run_dir.exists()
    assert [p.name for p in moved] == [
        f"qerl.previous-{STAMP}",
        f"qerl.previous-{STAMP}-1",
        f"qerl.previous-{STAMP}-2",
    ]
    assert [(p / "who").read_text() for p in moved] == ["0", "1", "2"]  # each kept its own files
    later = NOW.replace(second=3)
    run_dir.mkdir()
    moved.append(ckpt.move_aside(run_dir, later))
    assert ckpt.previous_runs(run_dir) == moved  # oldest first
    assert ckpt.previous_runs(tmp_path / "lora") == []


# ------------------------------------------------------------------ open_run_dir
def test_fresh_run_over_a_finished_run_moves_it_aside_and_says_so(tmp_path, caplog):
    run_dir = tmp_path / "qerl"
    _finished_run(run_dir)
    with caplog.at_level(logging.WARNING, logger="qerl_pipeline.rl.trainer"):
        got, latest, moved = trainer.open_run_dir(_cfg(tmp_path, resume=False))
    assert got == run_dir and latest is None
    assert moved is not None and moved.parent == tmp_path and moved.name.startswith("qerl.previous-")
    assert run_dir.is_dir() and not any(run_dir.iterdir())  # the new run starts empty
    assert ckpt.find_latest(run_dir) is None
    # the earlier run is intact where it was moved
    assert (moved / "final_adapter" / "adapter_model.safetensors").read_text() == "first"
    assert [s for s, _ in ckpt.list_checkpoints(moved)] == [2, 3]
    assert sorted(p.name for p in (moved / "adapters").iterdir()) == ["step-000002", "step-000003"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        len(warnings) == 1 and str(moved) in warnings[0].getMessage() and "resume is false" in warnings[0].getMessage()
    )


def test_fresh_run_twice_keeps_both_earlier_runs(tmp_path):
    run_dir = tmp_path / "qerl"
    _finished_run(run_dir, marker="first")
    _, _, first = trainer.open_run_dir(_cfg(tmp_path, resume=False))
    _finished_run(run_dir, marker="second")
    _, _, second = trainer.open_run_dir(_cfg(tmp_path, resume=False))
    assert first != second and ckpt.previous_runs(run_dir) == sorted([first, second], key=lambda p: p.name)
    assert (first / "final_adapter" / "adapter_model.safetensors").read_text() == "first"
    assert (second / "final_adapter" / "adapter_model.safetensors").read_text() == "second"


def test_resume_with_a_checkpoint_keeps_the_folder(tmp_path, caplog):
    run_dir = tmp_path / "qerl"
    _fake_checkpoint(run_dir, 2)
    (run_dir / "adapters" / "step-000003").mkdir(parents=True)  # written after the checkpoint, before a kill
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    with caplog.at_level(logging.WARNING, logger="qerl_pipeline.rl.trainer"):
        got, latest, moved = trainer.open_run_dir(_cfg(tmp_path, resume=True))
    assert got == run_dir and latest == run_dir / "checkpoints" / "step-000002" and moved is None
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before
    assert ckpt.previous_runs(run_dir) == [] and not caplog.records


def test_resume_without_a_checkpoint_but_leftovers_starts_clean(tmp_path):
    """A run killed before its first checkpoint: nothing to resume, so its files go aside too."""
    run_dir = tmp_path / "qerl"
    (run_dir / "adapters" / "step-000001").mkdir(parents=True)
    (run_dir / "checkpoints" / ".step-000002.tmp-x1y2" / "step-000002").mkdir(parents=True)  # a save cut off mid-write
    _, latest, moved = trainer.open_run_dir(_cfg(tmp_path, resume=True))
    assert latest is None and moved is not None
    assert (moved / "adapters" / "step-000001").is_dir() and not any(run_dir.iterdir())


def test_missing_or_empty_folder_is_used_as_it_is(tmp_path):
    run_dir, latest, moved = trainer.open_run_dir(_cfg(tmp_path, resume=False))
    assert run_dir.is_dir() and latest is None and moved is None
    run_dir, latest, moved = trainer.open_run_dir(_cfg(tmp_path, resume=True))  # empty now
    assert latest is None and moved is None and ckpt.previous_runs(run_dir) == []


# ------------------------------------------------------------------ adapter cleanup
def _loop_saves(adapters: Path, start: int, steps: int) -> None:
    """What train() does with adapter folders: save start, then each step; prune after each step."""

    def save(step: int) -> Path:
        folder = adapters / f"step-{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "step").write_text(str(step))
        return folder

    written = [save(start)]
    for step in range(start, steps):
        current = save(step + 1)
        written = [*written[-1:], current]
        trainer.prune_adapters(adapters, written)
        assert (current / "step").read_text() == str(step + 1)  # the folder the engine loads next is there
        assert sorted(p.name for p in adapters.iterdir() if ckpt.step_of(p) is not None) == sorted(
            p.name for p in written
        )


def test_cleanup_keeps_the_last_two_of_this_run(tmp_path):
    adapters = tmp_path / "adapters"
    _loop_saves(adapters, 0, 5)
    assert sorted(p.name for p in adapters.iterdir()) == ["step-000004", "step-000005"]


def test_cleanup_never_deletes_the_newest_even_beside_higher_steps(tmp_path):
    """The old sort-by-name cleanup deleted step-000001 here (a higher-numbered earlier run sorted after it)."""
    adapters = tmp_path / "adapters"
    for s in (2, 3):  # left by an interrupted process beyond its last checkpoint (or an earlier run)
        (adapters / f"step-{s:06d}").mkdir(parents=True)
    (adapters / ".step-000009.tmp").mkdir()  # not a step folder: left alone
    _loop_saves(adapters, 0, 1)
    assert sorted(p.name for p in adapters.iterdir()) == [".step-000009.tmp", "step-000000", "step-000001"]


class _TinyPolicy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2))

    def save_pretrained(self, path: str) -> None:
        Path(path).mkdir(parents=True)
        (Path(path) / "adapter_config.json").write_text("{}")


def test_checkpoint_cleanup_never_deletes_the_one_just_written(tmp_path):
    policy = _TinyPolicy()
    opt = torch.optim.AdamW(policy.parameters())
    for s in (5, 6):
        _fake_checkpoint(tmp_path, s)
    written = ckpt.save_checkpoint(tmp_path, 1, policy=policy, optimizer=opt, scheduler=None, state={"step": 1})
    assert (written / "meta.json").is_file()
    ckpt.save_checkpoint(tmp_path, 2, policy=policy, optimizer=opt, scheduler=None, state={"step": 2})
    assert (tmp_path / "checkpoints" / "step-000002" / "meta.json").is_file()
    # and in a folder of one run the usual keep_last=2 holds
    other = tmp_path / "one_run"
    for s in (1, 2, 3):
        ckpt.save_checkpoint(other, s, policy=policy, optimizer=opt, scheduler=None, state={"step": s})
    assert [s for s, _ in ckpt.list_checkpoints(other)] == [2, 3]


def _checkpoint_with_config(run_dir: Path, step: int, cfg: QerlConfig) -> None:
    folder = _fake_checkpoint(run_dir, step)
    torch.save({"trainer": {"step": step, "run_id": "r", "config": trainer.resume_config(cfg)}}, folder / "state.pt")


def test_a_checkpoint_of_other_settings_is_never_resumed(tmp_path, caplog):
    """Resume only what this config would have trained: another lr (or model, data, ...) is another
    run, so its folder goes aside, named in the log with the keys that differ."""
    run_dir = tmp_path / "qerl"
    other = QerlConfig.model_validate(
        {"method": "qerl", "train": {"output_dir": str(tmp_path)}, "optim": {"lr": {"qerl": 1e-3}}}
    )
    _checkpoint_with_config(run_dir, 2, other)
    with caplog.at_level(logging.WARNING, logger="qerl_pipeline.rl.trainer"):
        _, latest, moved = trainer.open_run_dir(_cfg(tmp_path, resume=True))
    assert latest is None and moved is not None and (moved / "checkpoints" / "step-000002").is_dir()
    assert "optim.lr.qerl" in caplog.text and "other settings" in caplog.text


def test_a_checkpoint_of_the_same_settings_resumes_with_more_steps_or_another_folder(tmp_path):
    """What a resume may change: the step count, the save/log intervals, where the folder lives."""
    run_dir = tmp_path / "qerl"
    before = QerlConfig.model_validate(
        {"method": "qerl", "train": {"output_dir": "/elsewhere", "steps": 5, "checkpoint_every": 1}}
    )
    _checkpoint_with_config(run_dir, 2, before)
    got, latest, moved = trainer.open_run_dir(_cfg(tmp_path, resume=True))
    assert latest == run_dir / "checkpoints" / "step-000002" and moved is None


def test_a_checkpoint_older_than_a_setting_resumes_when_the_setting_is_at_its_default(tmp_path):
    """A checkpoint written before a setting existed lacks its key: at its default that is no change
    (a new setting's default keeps the old behaviour); set to anything else it is another run."""
    run_dir = tmp_path / "qerl"
    folder = _fake_checkpoint(run_dir, 2)
    saved = trainer.resume_config(_cfg(tmp_path, resume=True))
    del saved["grpo.entropy_coef"]
    torch.save({"trainer": {"step": 2, "run_id": "r", "config": saved}}, folder / "state.pt")
    _, latest, moved = trainer.open_run_dir(_cfg(tmp_path, resume=True))
    assert latest == folder and moved is None
    bonus = _cfg(tmp_path, resume=True).model_copy(
        update={"grpo": _cfg(tmp_path, True).grpo.model_copy(update={"entropy_coef": 0.01})}
    )
    _, latest, moved = trainer.open_run_dir(bonus)
    assert latest is None and moved is not None
