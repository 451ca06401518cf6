"""``atomic.staged_dir``: a folder is replaced only by a complete new one, and no stage is left behind."""

from __future__ import annotations

import pytest

from qerl_pipeline.atomic import staged_dir


def _tree(folder):
    return {p.relative_to(folder).as_posix(): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_success_replaces_the_target_and_leaves_no_stage(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with staged_dir(target) as stage:
        assert stage.is_dir() and not any(stage.iterdir()) and stage.name == "out" and stage.parent != tmp_path
        (stage / "sub").mkdir()
        (stage / "sub" / "new.txt").write_text("new")
        assert _tree(target) == {"old.txt": "old"}  # nothing visible before the block ends
    assert _tree(target) == {"sub/new.txt": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_failing_body_leaves_the_target_unchanged_and_no_stage(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="boom"):
        with staged_dir(target) as stage:
            (stage / "half.txt").write_text("half")
            raise RuntimeError("boom")
    assert _tree(target) == {"old.txt": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_failing_body_creates_no_target(tmp_path):
    target = tmp_path / "deeper" / "out"
    with pytest.raises(KeyboardInterrupt):
        with staged_dir(target) as stage:
            (stage / "half.txt").write_text("half")
            raise KeyboardInterrupt
    assert not target.exists() and list(target.parent.iterdir()) == []


def test_create_false_yields_a_free_path(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a")
    with staged_dir(tmp_path / "out", create=False) as stage:
        assert not stage.exists()
        src.rename(stage)
    assert _tree(tmp_path / "out") == {"a.txt": "a"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_replace_false_keeps_a_finished_target(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "theirs.txt").write_text("theirs")
    with pytest.raises(FileExistsError):
        with staged_dir(target, replace=False) as stage:
            (stage / "ours.txt").write_text("ours")
    assert _tree(target) == {"theirs.txt": "theirs"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with staged_dir(tmp_path / "fresh", replace=False) as stage:
        (stage / "ours.txt").write_text("ours")
    assert _tree(tmp_path / "fresh") == {"ours.txt": "ours"}


def test_a_checkpoint_save_that_fails_leaves_the_earlier_one_and_no_stage(tmp_path):
    """``rl.checkpoint.save_checkpoint`` builds in a stage: a failure mid-write shows nothing new."""
    import torch

    from qerl_pipeline.rl import checkpoint as ckpt

    class Policy(torch.nn.Module):
        def __init__(self, fail: bool) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(2))
            self.fail = fail

        def save_pretrained(self, path: str) -> None:
            (tmp_path / "seen").mkdir(exist_ok=True)
            if self.fail:
                raise OSError("disk full")
            torch.save({}, f"{path}.pt")

    ok = Policy(fail=False)
    opt = torch.optim.AdamW(ok.parameters())
    first = ckpt.save_checkpoint(tmp_path, 1, policy=ok, optimizer=opt, scheduler=None, state={"step": 1})
    before = _tree_bytes(first)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(tmp_path, 1, policy=Policy(fail=True), optimizer=opt, scheduler=None, state={"step": 1})
    assert _tree_bytes(first) == before
    assert [p.name for p in ckpt.checkpoint_root(tmp_path).iterdir()] == ["step-000001"]
    # SIGKILL mid-save
    (ckpt.checkpoint_root(tmp_path) / ".step-000002.tmp-killed" / "step-000002").mkdir(parents=True)
    ckpt.save_checkpoint(tmp_path, 2, policy=ok, optimizer=opt, scheduler=None, state={"step": 2})
    assert sorted(p.name for p in ckpt.checkpoint_root(tmp_path).iterdir()) == ["step-000001", "step-000002"]


def _tree_bytes(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
