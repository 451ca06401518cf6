"""The project's tracking store (``python -m qerl_pipeline.tracking_server``) as the service tests start it:
its own folder under /tmp on free ports, each command under a timeout, whatever is left killed by its PIDs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

COMMAND = [sys.executable, "-m", "qerl_pipeline.tracking_server"]


def store_command(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The project's store command, to its end (its own start/stop timeouts are 120 s each)."""
    proc = subprocess.run(
        [*COMMAND, *args, "--timeout", "120"],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"{args[0]}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def exported_uri(proc: subprocess.CompletedProcess) -> str:
    """The URI a ``start`` prints last (``export MLFLOW_TRACKING_URI=...``)."""
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("export MLFLOW_TRACKING_URI="), proc.stdout
    return last.split("=", 1)[1]


def kill_recorded(folder: Path, which: tuple[str, ...] = ("mlflow_pid", "pg_pid")) -> None:
    """SIGKILL the store's recorded processes (the MLflow server with its process group)."""
    try:
        state = json.loads((folder / "store.json").read_text())
    except (OSError, ValueError):
        return
    for key in which:
        try:
            (os.killpg if key == "mlflow_pid" else os.kill)(state[key], signal.SIGKILL)
        except (KeyError, TypeError, ProcessLookupError, PermissionError):
            pass


@contextmanager
def store_folder() -> Iterator[Path]:
    """A store folder under /tmp, open to the postgres user (PostgreSQL runs as that user when the tests run as
    root; pytest's tmp_path sits under a 0700 folder); at the end its processes are killed and it is removed."""
    top = Path(tempfile.mkdtemp(prefix="qerl-store-"))
    top.chmod(0o755)
    try:
        yield top / "store"
    finally:
        kill_recorded(top / "store")
        shutil.rmtree(top, ignore_errors=True)
