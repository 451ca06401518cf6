"""Atomic writes: the one home for "a reader never sees half a file or half a folder".

* ``write_atomic(path, data)``: a file (bytes, or str as UTF-8, or a JSON-able object with
  ``as_json=True``) is written to a temporary sibling, flushed, then swapped in with
  ``os.replace`` (atomic on POSIX within one filesystem).
* ``replace_dir(src, dst)``: a finished folder ``src`` takes the place of ``dst`` with renames
  only; an existing ``dst`` is renamed away first and deleted after the swap.
* ``staging_dir(dst)``: a fresh temporary sibling folder of ``dst`` to build a folder in,
  then ``replace_dir`` it (same filesystem, so the final step is a rename).

Checkpoints, adapters, bases, reports and result files all go through these.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
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


def staging_dir(dst: str | Path) -> Path:
    """A new empty temporary folder beside ``dst`` (``.<name>.tmp-XXXX``)."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))


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
