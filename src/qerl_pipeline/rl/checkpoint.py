"""Training checkpoints: written atomically, found by step, loaded for an exact resume.

Layout under ``<run_dir>/checkpoints/``::

    step-000010/
        adapter/            PEFT ``save_pretrained`` folder (what the engine and evaluation load)
        trainable.pt        every trainable parameter by name (LoRA and trainable norms), exact
        state.pt            optimizer, LR scheduler, RNG states, trainer state (step, AQN
                            stage/sigma, data position, MLflow run id, ...)
        meta.json           written last inside the stage: step + file list

A checkpoint is assembled in a hidden stage next to its final place and renamed there
(``atomic.staged_dir``), so a crash (or SIGKILL) mid-write leaves either the previous
checkpoints or the complete new one, never a half-written folder that looks valid.
``find_latest`` only accepts folders holding ``meta.json``; hidden leftovers of a save cut
off mid-write are removed at the next save. ``keep_last`` bounds disk use (older complete checkpoints are deleted
after the new one is in place).

``trainable.pt`` is saved besides the adapter because the adapter folder is the portable
artefact (PEFT format), while an exact resume needs every trainable tensor bit for bit,
including norm weights that PEFT may not put into the adapter file.

Run folders (``<output_dir>/<method>``) are never shared between two runs: a fresh run over
an earlier run's folder moves it aside first (``move_aside``: renamed to the sibling
``<method>.previous-<UTC timestamp>``, ``-1``, ``-2``, ... when taken, never overwritten, never
deleted). The rule itself lives in ``trainer.open_run_dir``.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qerl_pipeline.atomic import staged_dir
from qerl_pipeline.quantization.policy import trainable_state_dict

CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
#: ``<run folder name>.previous-<UTC timestamp>[-<n>]``: where ``move_aside`` puts an earlier run.
PREVIOUS = ".previous-"
_STAMP = "%Y%m%dT%H%M%SZ"


def step_of(path: Path | str) -> int | None:
    """The step of a ``step-NNNNNN`` folder name (checkpoints, adapters), else None."""
    m = _STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else None


def has_leftovers(run_dir: Path | str) -> bool:
    """Whether ``run_dir`` exists and holds anything (an earlier run's files)."""
    path = Path(run_dir)
    return path.is_dir() and any(path.iterdir())


def aside_path(run_dir: Path | str, now: datetime | None = None) -> Path:
    """The first free sibling ``<name>.previous-<UTC YYYYmmddTHHMMSSZ>``, then ``...-1``, ``...-2``, ..."""
    run_dir = Path(run_dir)
    stamp = (now or datetime.now(timezone.utc)).astimezone(timezone.utc).strftime(_STAMP)
    base = run_dir.with_name(f"{run_dir.name}{PREVIOUS}{stamp}")
    candidate, n = base, 0
    while os.path.lexists(candidate):
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def move_aside(run_dir: Path | str, now: datetime | None = None) -> Path:
    """Rename ``run_dir`` to ``aside_path(run_dir)`` (same parent, one ``os.rename``); returns the new path.

    Nothing is copied or deleted, and an earlier moved-aside folder is never overwritten
    (a taken name gets the next counter).
    """
    run_dir = Path(run_dir)
    target = aside_path(run_dir, now)
    os.rename(run_dir, target)
    return target


def previous_runs(run_dir: Path | str) -> list[Path]:
    """The folders ``move_aside`` made from ``run_dir``, oldest first (by name: timestamp, then counter)."""
    run_dir = Path(run_dir)
    if not run_dir.parent.is_dir():
        return []
    prefix = f"{run_dir.name}{PREVIOUS}"

    def key(p: Path) -> tuple[str, int]:
        stamp, _, n = p.name[len(prefix):].partition("-")
        return stamp, int(n) if n.isdigit() else 0

    return sorted((p for p in run_dir.parent.iterdir() if p.name.startswith(prefix) and p.is_dir()), key=key)


def checkpoint_root(run_dir: Path | str) -> Path:
    """The folder holding the checkpoints of one run directory."""
    return Path(run_dir) / CHECKPOINTS


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU and CUDA) RNG states."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` captured."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable tensor by its policy name (``policy.trainable_state_dict``), as CPU copies."""

    return {n: t.cpu().clone() for n, t in trainable_state_dict(model).items()}


def load_trainable_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy saved trainable tensors back into ``model``; names must match exactly."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(set(params) - set(tensors))
    extra = sorted(set(tensors) - set(params))
    if missing or extra:
        raise ValueError(f"checkpoint does not match the policy: missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name].to(device=p.device, dtype=p.dtype))


def list_checkpoints(run_dir: Path | str) -> list[tuple[int, Path]]:
    """Complete checkpoints as ``(step, path)``, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = step_of(child)
        if step is not None and (child / "meta.json").is_file():
            found.append((step, child))
    return sorted(found)


def find_latest(run_dir: Path | str) -> Path | None:
    """The newest complete checkpoint of ``run_dir``, or None."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def save_checkpoint(
    run_dir: Path | str,
    step: int,
    *,
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: dict[str, Any],
    keep_last: int | None = 2,
) -> Path:
    """Write checkpoint ``step`` (number of completed steps) atomically; returns its folder."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".*"):  # hidden entries are stages of saves cut off mid-write
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step-{step:06d}"
    with staged_dir(final) as stage:
        policy.save_pretrained(str(stage / "adapter"))
        torch.save(trainable_state(policy), stage / "trainable.pt")
        torch.save(
            {
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "rng": rng_state(),
                "trainer": state,
            },
            stage / "state.pt",
        )
        files = sorted(str(p.relative_to(stage)) for p in stage.rglob("*") if p.is_file())
        (stage / "meta.json").write_text(json.dumps({"step": step, "files": files}, indent=1))
    if keep_last is not None:  # never the one just written, even beside stale higher steps
        for _, old in list_checkpoints(run_dir)[:-keep_last]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(
    path: Path | str,
    *,
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restore trainable tensors, optimizer, scheduler and RNG; return the trainer state dict."""
    path = Path(path)
    if not (path / "meta.json").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no meta.json)")
    load_trainable_state(policy, torch.load(path / "trainable.pt", map_location="cpu"))
    blob = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    if optimizer is not None:
        optimizer.load_state_dict(blob["optimizer"])
    if scheduler is not None and blob["scheduler"] is not None:
        scheduler.load_state_dict(blob["scheduler"])
    if restore_rng:
        set_rng_state(blob["rng"])
    return blob["trainer"]


def peek_state(path: Path | str) -> dict[str, Any]:
    """The trainer state of a checkpoint (step, data cursor, run id, ...) without restoring anything."""
    blob = torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=False)
    return blob["trainer"]
