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
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def write_atomic(path: str | Path, data: bytes | str | Any, *, as_json: bool = False, mode: int = 0o644) -> Path:
    """Write ``data`` to ``path`` atomically; ``as_json``: ``data`` is dumped as indented JSON."""
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
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@contextmanager
def staged_dir(target: str | Path, *, create: bool = True, replace: bool = True) -> Iterator[Path]:
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
