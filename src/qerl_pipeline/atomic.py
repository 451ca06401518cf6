"""Atomic writes: the one home for "a reader never sees half a file or half a folder".

* ``write_atomic(path, data)``: a file (bytes, or str as UTF-8, or a JSON-able object with
  ``as_json=True``) is written to a temporary sibling, flushed, then swapped in with
  ``os.replace`` (atomic on POSIX within one filesystem).
* ``staged_dir(target)``: a context manager yielding a folder to build ``target`` in. The
  folder lives in a hidden temporary sibling of ``target`` (same filesystem, so the final
  step is a rename). When the block ends normally the stage takes ``target``'s place
  (``replace_dir``); when it raises, ``target`` is left as it was. Either way nothing of
  the stage remains. ``replace=False`` never moves an existing ``target`` away (see there).
* ``replace_dir(src, dst)``: a finished folder ``src`` takes the place of ``dst`` with renames
  only; an existing ``dst`` is renamed away first and deleted after the swap, so until the
  new folder is in place the old one stays complete.

Checkpoints, adapters, bases, model folders, reports and result files all go through these.

A disk that fills up during a write ends it with ``DiskFull`` (an ``OSError`` with errno
``ENOSPC``), one line naming the file or folder and the free space left once the partial
copy is gone: ``no space left on device writing checkpoint <folder>: 12.0 MiB free``. Recognised
are an ``ENOSPC`` anywhere in the exception's chain, the "No space left on device (os error
28)" text of safetensors' Rust I/O error, and torch's short write, ``[enforce fail at
inline_container.cc:...] unexpected pos N vs M`` (a ``RuntimeError`` carrying no errno),
which counts only while the target's filesystem has less than ``LOW_SPACE_BYTES`` free (that
message also stands for a short write of another cause, a quota say, where space is left).

Verified folders: ``file_manifest(folder)`` records each file's size and sha256 (written
beside the files: a checkpoint's ``meta.json``, a base's stamp); ``manifest_damage(folder,
files)`` names the first file that is missing or differs in size or hash (sizes first, so a
truncated file is found without hashing the rest). sha256 reads 0.5-2 GB/s on one core (about
0.9 GB/s measured on this project's CI-class CPU).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: Free space below which a torch short write (``unexpected pos``) is taken for a full disk.
LOW_SPACE_BYTES = 16 * 2**20
_TORCH_SHORT_WRITE = ("unexpected pos", "PytorchStreamWriter failed", "file write failed")
_NO_SPACE_TEXT = ("No space left on device", "os error 28")


class DiskFull(OSError):
    """A write ran out of disk space: errno ``ENOSPC``, ``str()`` the one line naming where and what is free."""

    def __str__(self) -> str:
        return str(self.strerror)


def _free_bytes(where: Path) -> int | None:
    for folder in (where, *where.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def _chain(err: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while err is not None and all(err is not e for e in seen):
        seen.append(err)
        err = err.__cause__ or err.__context__
    return seen


def is_disk_full(err: BaseException, where: str | Path) -> bool:
    """Whether ``err``, raised while writing under ``where``, means the disk is full (module docstring)."""
    chain = _chain(err)
    if any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in chain):
        return True
    if any(t in str(e) for e in chain for t in _NO_SPACE_TEXT):
        return True
    if any(isinstance(e, RuntimeError) and any(t in str(e) for t in _TORCH_SHORT_WRITE) for e in chain):
        free = _free_bytes(Path(where))
        return free is not None and free < LOW_SPACE_BYTES
    return False


def disk_full(where: str | Path, what: str | None = None) -> DiskFull:
    """The ``DiskFull`` for a write of ``where`` (``what``: "checkpoint", "base", ...),
    with its filesystem's free space now."""
    free = _free_bytes(Path(where))
    shown = "unknown space" if free is None else f"{free / 2**20:.1f} MiB"
    label = f"{what} " if what else ""
    return DiskFull(errno.ENOSPC, f"no space left on device writing {label}{where}: {shown} free", str(where))


def write_atomic(path: str | Path, data: bytes | str | Any, *, as_json: bool = False, mode: int = 0o644) -> Path:
    """Write ``data`` to ``path`` atomically; ``as_json``: ``data`` is dumped as indented JSON.

    A full disk raises ``DiskFull`` naming ``path`` (the temporary file removed, ``path`` as it was)."""
    path = Path(path)
    if as_json:
        data = json.dumps(data, indent=1, sort_keys=False, default=str) + "\n"
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException as err:
        full = is_disk_full(err, path.parent)
        Path(tmp).unlink(missing_ok=True)
        if full:
            raise disk_full(path) from err
        raise
    return path


@contextmanager
def staged_dir(
    target: str | Path, *, create: bool = True, replace: bool = True, what: str | None = None
) -> Iterator[Path]:
    """Build the folder ``target`` in a stage that replaces it only when the block succeeds.

    Yields ``<parent>/.<name>.tmp-XXXX/<name>``: a path on ``target``'s filesystem, created
    empty (with the permissions a plain ``mkdir`` gives) unless ``create=False``, for writers
    that create the folder themselves (``shutil.move``, ``copytree``, a writer that refuses an
    existing folder). On success it takes ``target``'s place with ``replace_dir``; on any
    exception ``target`` is untouched. The temporary sibling is removed in both cases.

    ``replace=False``: the final step is one ``os.replace``, which fails with
    ``FileExistsError`` when ``target`` is already a non-empty folder (another process
    finished it meanwhile): a folder that readers may be using is never moved away.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    holder = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    stage = holder / target.name
    try:
        if create:
            stage.mkdir()
        yield stage
        if replace:
            replace_dir(stage, target)
        else:
            try:
                os.replace(stage, target)
            except OSError as err:
                if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise FileExistsError(errno.EEXIST, "folder already there", str(target)) from err
                raise
    except BaseException as err:
        full = is_disk_full(err, holder)  # before the stage goes: its bytes are what filled the disk
        shutil.rmtree(holder, ignore_errors=True)
        if full:
            raise disk_full(target, what) from err
        raise
    finally:
        shutil.rmtree(holder, ignore_errors=True)


def replace_dir(src: str | Path, dst: str | Path) -> Path:
    """Move the finished folder ``src`` to ``dst``, replacing an existing ``dst`` by renames."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a folder")
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
    return dst


# ------------------------------------------------------------------------------ verified folders
def sha256_file(path: str | Path) -> str:
    """The hex sha256 of a file's bytes (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_manifest(folder: str | Path, *, skip: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """``{relative posix path: {"size": bytes, "sha256": hex}}`` of every file under ``folder`` but ``skip``."""
    folder = Path(folder)
    return {
        p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.relative_to(folder).as_posix() not in skip
    }


def manifest_damage(
    folder: str | Path, files: dict[str, dict[str, Any]], *, hashes: bool = True
) -> tuple[str, str] | None:
    """``(relative path, what is wrong)`` for the first listed file that is missing, of another size or
    (``hashes``) another sha256 than ``files`` records; None when every one matches. An entry without
    ``sha256`` is checked by size, one without ``size`` by presence."""
    folder = Path(folder)
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            return name, "missing"
        size = path.stat().st_size
        if want.get("size") is not None and size != want["size"]:
            return name, f"size mismatch: {size} bytes, {want['size']} when written"
    if hashes:
        for name, want in files.items():
            if want.get("sha256") and (got := sha256_file(folder / name)) != want["sha256"]:
                return name, f"hash mismatch: sha256 {got[:12]}..., {want['sha256'][:12]}... when written"
    return None
