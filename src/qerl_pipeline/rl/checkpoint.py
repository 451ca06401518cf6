"""Training checkpoints: written atomically, found by step, loaded for an exact resume.

Layout under ``<run_dir>/checkpoints/``::

    step-000010/
        adapter/            PEFT ``save_pretrained`` folder (what the engine and evaluation load)
        trainable.pt        every trainable parameter by name (LoRA and trainable norms), exact
        state.pt            optimizer, LR scheduler, RNG states, trainer state (step, AQN
                            stage/sigma, data position, MLflow run id, ...)
        meta.json           the manifest, written last inside the stage: step, each file's size
                            and sha256 (adapter/ included), and its own sha256

A checkpoint is assembled in a hidden stage next to its final place and renamed there
(``atomic.staged_dir``), so a crash (or SIGKILL) mid-write leaves either the previous
checkpoints or the complete new one, never a half-written folder that looks valid.
``find_latest`` only accepts folders holding ``meta.json``; hidden leftovers of a save cut
off mid-write are removed at the next save. ``keep_last`` bounds disk use (older complete checkpoints are deleted
after the new one is in place). A full disk ends the save with ``atomic.DiskFull`` naming the
checkpoint folder and the free space; the stage is removed and earlier checkpoints stay.

Verified resume. A file can still be damaged after its save (a disk fault, a copy cut short,
an edit). ``verify_checkpoint`` compares every file with the manifest (sizes first, then the
sha256 at about 1 GB/s: a tenth of a second for the 135M model's rank-16 LoRA checkpoint
with Adam's moments (~80 MB), about a second for a 7B one's; the save hashes what it wrote
at the same rate)
and names the first file that is missing or differs, or a manifest that is missing,
unreadable or not matching its own hash. ``find_resumable`` walks from the newest checkpoint
down to the first intact one, logging each damaged one it skips; when none is intact it
raises ``CheckpointDamaged`` listing them, never falling back to a fresh start over them.
``set_aside_damaged`` then renames the skipped ones to ``step-NNNNNN.damaged`` (``-1``, ``-2``,
... when taken): kept byte for byte, never deleted, and out of reach of the ``keep_last``
pruning, the hidden-leftover cleanup, a later save of the same step and later resumes (none of
them looks at a name that is not ``step-NNNNNN`` or hidden). Checkpoints written before
manifests held sizes and hashes (``meta.json`` with a plain file list) are checked for the
listed files' presence and, for the ``.pt`` files, the CRC of each record of their zip
container (what ``torch.save`` writes); their adapter files are checked for presence only.
Any checkpoint file torch cannot read raises ``CheckpointDamaged`` naming it.

``trainable.pt`` is saved besides the adapter because the adapter folder is the portable
artefact (PEFT format), while an exact resume needs every trainable tensor bit for bit,
including norm weights that PEFT may not put into the adapter file.

Run folders (``<output_dir>/<method>``) are never shared between two runs: a fresh run over
an earlier run's folder moves it aside first (``move_aside``: renamed to the sibling
``<method>.previous-<UTC timestamp>``, ``-1``, ``-2``, ... when taken, never overwritten, never
deleted). The rule itself lives in ``trainer.open_run_dir``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import zipfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qerl_pipeline.atomic import file_manifest, manifest_damage, staged_dir
from qerl_pipeline.quantization.policy import trainable_state_dict

CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
#: ``<run folder name>.previous-<UTC timestamp>[-<n>]``: where ``move_aside`` puts an earlier run.
PREVIOUS = ".previous-"
_STAMP = "%Y%m%dT%H%M%SZ"
#: The manifest of a checkpoint (written last) and its layout version.
MANIFEST = "meta.json"
MANIFEST_SCHEMA = 2
#: Suffix of a damaged checkpoint that a resume skipped (``set_aside_damaged``).
DAMAGED = ".damaged"

log = logging.getLogger(__name__)


class CheckpointDamaged(RuntimeError):
    """A checkpoint file cannot be read or differs from its manifest, or no intact checkpoint is left to resume."""


@dataclass(frozen=True)
class Damage:
    """What is wrong with one checkpoint: ``folder / file``, ``problem`` (missing, size or hash mismatch, ...)."""

    folder: Path
    file: str
    problem: str

    def __str__(self) -> str:
        return f"{self.folder / self.file}: {self.problem}"


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
    return _free_name(run_dir.with_name(f"{run_dir.name}{PREVIOUS}{stamp}"))


def _free_name(base: Path) -> Path:
    """``base`` when nothing is there, else the first free ``<base>-1``, ``<base>-2``, ..."""
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
        stamp, _, n = p.name[len(prefix) :].partition("-")
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
    """Write checkpoint ``step`` (number of completed steps) atomically, with its manifest; returns its folder.

    ``keep_last`` prunes complete ``step-NNNNNN`` checkpoints only: a damaged one a resume set
    aside (``step-NNNNNN.damaged``) is never pruned."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".*"):  # hidden entries are stages of saves cut off mid-write
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step-{step:06d}"
    with staged_dir(final, what="checkpoint") as stage:
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
        record = {"schema": MANIFEST_SCHEMA, "step": step, "files": file_manifest(stage)}
        record["sha256"] = _manifest_digest(record)
        (stage / MANIFEST).write_text(json.dumps(record, indent=1))
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
    load_trainable_state(policy, _read(path / "trainable.pt"))
    blob = _read(path / "state.pt", weights_only=False)
    if optimizer is not None:
        optimizer.load_state_dict(blob["optimizer"])
    if scheduler is not None and blob["scheduler"] is not None:
        scheduler.load_state_dict(blob["scheduler"])
    if restore_rng:
        set_rng_state(blob["rng"])
    return blob["trainer"]


def peek_state(path: Path | str) -> dict[str, Any]:
    """The trainer state of a checkpoint (step, data cursor, run id, ...) without restoring anything."""
    blob = _read(Path(path) / "state.pt", weights_only=False)
    return blob["trainer"]


def _read(path: Path, **kwargs: Any) -> Any:
    """``torch.load`` of a checkpoint file to the CPU; any failure becomes ``CheckpointDamaged`` naming the file."""
    try:
        return torch.load(path, map_location="cpu", **kwargs)
    except Exception as err:  # zip, unpickling and I/O errors name no file
        first = (str(err).strip().splitlines() or [""])[0]
        raise CheckpointDamaged(f"{path}: cannot be read ({type(err).__name__}: {first})") from err


# ------------------------------------------------------------------------------ verification
def _manifest_digest(record: dict[str, Any]) -> str:
    body = {k: v for k, v in record.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _zip_damage(folder: Path, names: list[str]) -> tuple[str, str] | None:
    """A manifest without hashes: the first ``.pt`` file whose zip container is broken or fails a record's CRC."""
    for name in names:
        if name.endswith(".pt"):
            try:
                with zipfile.ZipFile(folder / name) as zf:
                    bad = zf.testzip()
            except (zipfile.BadZipFile, OSError, ValueError) as err:
                return name, f"not a readable torch file ({err})"
            if bad is not None:
                return name, f"CRC mismatch in its record {bad}"
    return None


def verify_checkpoint(path: Path | str) -> Damage | None:
    """What is damaged in checkpoint ``path`` (the first file found), or None when it is intact (module docstring)."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        return Damage(path, MANIFEST, "missing (the checkpoint's manifest)")
    try:
        record = json.loads((path / MANIFEST).read_text())
        files = record["files"]
        if not isinstance(files, (dict, list)):
            raise ValueError("'files' is neither a mapping nor a list")
    except (OSError, ValueError, TypeError, KeyError) as err:
        return Damage(path, MANIFEST, f"unreadable manifest ({type(err).__name__}: {err})")
    if isinstance(files, list):  # written before manifests held sizes and hashes
        names = [str(n) for n in files]
        found = manifest_damage(path, {n: {} for n in names}) or _zip_damage(path, names)
    elif record.get("sha256") != _manifest_digest(record):
        return Damage(path, MANIFEST, "manifest hash mismatch (its content is not what was written)")
    else:
        found = manifest_damage(path, files)
    return None if found is None else Damage(path, *found)


def _step_folders(run_dir: Path | str) -> list[tuple[int, Path]]:
    """Every ``step-NNNNNN`` folder of the run's checkpoints, with or without a manifest, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted((step, child) for child in root.iterdir() if (step := step_of(child)) is not None and child.is_dir())


def find_resumable(run_dir: Path | str) -> Path | None:
    """The newest intact checkpoint of ``run_dir``, or None when it holds no checkpoint folder at all.

    Newer damaged ones are skipped, each logged at WARNING naming its file and what is wrong.
    When every checkpoint folder is damaged: ``CheckpointDamaged`` listing them (nothing is moved
    or deleted; ``train.resume: false`` starts anew, moving the run folder aside whole).
    """
    damaged: list[Damage] = []
    for _, folder in reversed(_step_folders(run_dir)):
        found = verify_checkpoint(folder)
        if found is None:
            if damaged:
                log.warning("resuming from %s, the newest intact checkpoint", folder)
            return folder
        log.warning("checkpoint %s is damaged, skipped: %s", folder.name, found)
        damaged.append(found)
    if damaged:
        raise CheckpointDamaged(
            f"no intact checkpoint to resume in {checkpoint_root(run_dir)}: "
            + "; ".join(map(str, damaged))
            + " (nothing was deleted; train.resume=false starts anew and moves this run folder aside)"
        )
    return None


def set_aside_damaged(run_dir: Path | str, resumed: Path | str) -> list[tuple[Damage, Path]]:
    """Rename each damaged checkpoint newer than ``resumed`` (what ``find_resumable`` skipped) to
    ``step-NNNNNN.damaged`` (``-1``, ... when taken); ``(damage, new path)`` for each, logged at WARNING."""
    after = step_of(resumed)
    kept = []
    for step, folder in _step_folders(run_dir):
        if after is not None and step > after and (found := verify_checkpoint(folder)) is not None:
            target = _free_name(folder.with_name(folder.name + DAMAGED))
            os.rename(folder, target)
            log.warning("the damaged checkpoint %s is kept as %s (%s)", folder, target.name, found)
            kept.append((found, target))
    return kept
