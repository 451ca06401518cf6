"""A full disk during an atomic write (``atomic.py``): one line naming the folder and the free space.

The disk fills through a patched write: ``torch.save`` or the adapter's ``save_pretrained``
raising what each raises on a full disk (measured on a 1 MiB tmpfs: torch's ``RuntimeError:
[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598`` with 0 bytes free,
safetensors' ``I/O error: No space left on device (os error 28)``, Python's ``OSError`` errno
28), and ``shutil.disk_usage`` reporting the free space of a full disk where the check reads
it. The stage is removed, earlier checkpoints stay as they were.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from qerl_pipeline import atomic
from qerl_pipeline.rl import checkpoint as ckpt

TORCH_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
Usage = namedtuple("Usage", "total used free")


class _Policy(torch.nn.Module):
    def __init__(self, fail: Exception | None = None) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4))
        self.fail = fail

    def save_pretrained(self, path: str) -> None:
        Path(path).mkdir(parents=True)
        if self.fail is not None:
            raise self.fail
        (Path(path) / "adapter_config.json").write_text("{}")


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _save(run_dir: Path, step: int, policy: _Policy | None = None) -> Path:
    policy = policy or _Policy()
    opt = torch.optim.AdamW(policy.parameters())
    return ckpt.save_checkpoint(run_dir, step, policy=policy, optimizer=opt, scheduler=None, state={"step": step})


def _full_disk(monkeypatch, free: int = 3 * 2**20) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: Usage(2**30, 2**30 - free, free))


def _raise_on_state(monkeypatch, exc: Exception) -> None:
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if Path(f).name == "state.pt":
            Path(f).write_bytes(b"partial")  # what a write cut short leaves
            raise exc
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


@pytest.mark.parametrize(
    "exc",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError(TORCH_FULL),
    ],
    ids=["oserror", "torch"],
)
def test_a_checkpoint_on_a_full_disk_says_so_in_one_line(tmp_path, monkeypatch, exc):
    first = _save(tmp_path, 1)
    before = _tree(first)
    _full_disk(monkeypatch)
    _raise_on_state(monkeypatch, exc)
    with pytest.raises(atomic.DiskFull) as err:
        _save(tmp_path, 2)
    final = ckpt.checkpoint_root(tmp_path) / "step-000002"
    assert str(err.value) == f"no space left on device writing checkpoint {final}: 3.0 MiB free"
    assert isinstance(err.value, OSError) and err.value.errno == errno.ENOSPC and err.value.filename == str(final)
    assert err.value.__cause__ is exc  # the original stays in the traceback, above the one line
    assert sorted(p.name for p in ckpt.checkpoint_root(tmp_path).iterdir()) == ["step-000001"]  # no stage left
    assert _tree(first) == before and ckpt.verify_checkpoint(first) is None
    assert pickle.loads(pickle.dumps(err.value)).args == err.value.args  # crosses process boundaries


def test_safetensors_out_of_space_in_the_adapter_is_a_full_disk(tmp_path):
    """safetensors' Rust I/O error carries no errno, only its text (and removes its partial file)."""

    class SafetensorError(Exception):
        pass

    fail = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    with pytest.raises(
        atomic.DiskFull, match=r"^no space left on device writing checkpoint .*step-000001: [\d.]+ MiB free$"
    ):
        _save(tmp_path, 1, _Policy(fail=fail))


def test_torchs_short_write_with_space_left_is_not_called_a_full_disk(tmp_path, monkeypatch):
    """The same torch message with plenty of space (a quota, another fault) stays what it was."""
    _full_disk(monkeypatch, free=50 * 2**30)
    _raise_on_state(monkeypatch, RuntimeError(TORCH_FULL))
    with pytest.raises(RuntimeError, match="unexpected pos") as err:
        _save(tmp_path, 1)
    assert not isinstance(err.value, atomic.DiskFull)
    assert not any(ckpt.checkpoint_root(tmp_path).iterdir())


def test_write_atomic_on_a_full_disk_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    path = tmp_path / "report.json"
    path.write_text("old")

    def fsync(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(atomic.DiskFull, match=rf"^no space left on device writing {path}: [\d.]+ MiB free$"):
        atomic.write_atomic(path, {"a": 1}, as_json=True)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_staged_dir_names_what_it_writes(tmp_path):
    with pytest.raises(atomic.DiskFull, match=rf"^no space left on device writing base {tmp_path / 'base_nvfp4'}: "):
        with atomic.staged_dir(tmp_path / "base_nvfp4", what="base"):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert not any(tmp_path.iterdir())
