"""Whether a folder was left untouched or swapped in anew: inode, mtime_ns and size of every file.

A rewrite, even of identical bytes, makes new files (new inodes), so the inode tells a kept
base from a rewritten one where the bytes cannot.
"""

from __future__ import annotations

from pathlib import Path


def snapshot(folder: Path) -> dict[str, tuple[int, int, int]]:
    """``{relative path: (inode, mtime_ns, size)}`` of every file and folder under ``folder`` (and itself)."""
    out = {".": (folder.stat().st_ino, folder.stat().st_mtime_ns, 0)}
    for p in sorted(folder.rglob("*")):
        st = p.stat()
        out[p.relative_to(folder).as_posix()] = (st.st_ino, st.st_mtime_ns, st.st_size if p.is_file() else 0)
    return out


def rewritten(before: dict, after: dict) -> bool:
    """Every file of ``before`` that is still there has a new inode (the folder was swapped in anew)."""
    common = [k for k in before if k in after and k != "."]
    return bool(common) and all(before[k][0] != after[k][0] for k in common)
