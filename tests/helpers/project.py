"""The one way tests run Kedro: in a throw-away copy of the project, never in the checkout.

``project_copy`` makes the copy; ``run_kedro``/``start_kedro`` run the venv's CLI there
(telemetry off, the MLflow store ``<copy>/mlflow.db``, artifacts under ``<copy>/mlruns``),
``kedro_session`` does the same in process. So data/, mlruns/, mlflow.db, .viz/ and build/
of the checkout never change under a test run (tests/conftest.py checks that).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import mlflow
import pytest
from kedro.framework.session import KedroSession
from kedro.framework.startup import bootstrap_project

PROJECT = Path(__file__).resolve().parents[2]
SHARED = PROJECT.parent / "shared"
KEDRO = Path(sys.executable).with_name("kedro")


def project_copy(root: Path, shared: Iterable[str] = ()) -> Path:
    """A throw-away Kedro project at ``root``: this checkout's conf and metadata, the package installed.

    Pipeline tests run there so their data, checkpoints, ``mlflow.db`` and ``mlruns/`` never
    touch the checkout. ``shared``: files under ``../shared/data`` (relative paths) copied to
    ``root.parent / "shared" / "data"``, where the copy's ``../shared`` points; give ``root``
    a parent of its own (``tmp_path / "project"``) when using it. The test skips when one of
    them is missing.
    """
    files = [SHARED / "data" / rel for rel in shared]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        pytest.skip(f"offline data copies not found: {', '.join(missing)} (../shared beside the checkout)")
    shutil.copytree(PROJECT / "conf", root / "conf", ignore=shutil.ignore_patterns("local"))
    (root / "conf" / "local").mkdir()
    (root / "src").mkdir()  # Kedro wants the source dir; the package itself is installed
    for name in ("pyproject.toml", ".kedro.yml"):
        shutil.copy(PROJECT / name, root / name)
    for rel, src in zip(shared, files, strict=True):
        dest = root.parent / "shared" / "data" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, dest)
    return root


def tracking_uri(root: Path) -> str:
    """The MLflow store of the project copy at ``root`` (what ``run_kedro``/``kedro_session`` log to)."""
    return f"sqlite:///{root / 'mlflow.db'}"


def kedro_env(root: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a Kedro process in the copy at ``root``: this one's, with no MLflow
    setting of the caller's, the copy's store, telemetry and the Hub off, unbuffered, wide
    log lines (rich wraps at 80 columns otherwise and splits the paths tests look for), and
    the checkout root on ``PYTHONPATH`` (``train.reward_fn=tests.helpers.rewards:...``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(
        MLFLOW_TRACKING_URI=tracking_uri(root),
        KEDRO_DISABLE_TELEMETRY="true",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        COLUMNS="400",
        PYTHONPATH=os.pathsep.join(p for p in (str(PROJECT), os.environ.get("PYTHONPATH", "")) if p),
    )
    env.update(extra or {})
    return env


def start_kedro(root: Path, *args: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``kedro <args>`` (the venv's CLI) started in the copy at ``root``, output appended to ``log``.

    Its own process group (``stop_kedro`` ends it with the engine below it); ``env``: extra
    variables over ``kedro_env``.
    """
    with open(log, "ab") as fh:
        return subprocess.Popen(
            [str(KEDRO), *args],
            cwd=root,
            env=kedro_env(root, env),
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop_kedro(proc: subprocess.Popen) -> None:
    """SIGKILL a ``start_kedro`` process and its whole group (engine processes, in their own session, end
    through their guards: rollout/server.py)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def wait_kedro(
    proc: subprocess.Popen, log: Path, timeout: float = 900, check: bool = True
) -> subprocess.CompletedProcess:
    """Wait for a ``start_kedro`` process: its exit code and whole log (``stdout``); a timeout
    kills it and fails the test, so does a non-zero exit with ``check``, with the log's tail."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_kedro(proc)
        pytest.fail(
            f"kedro {' '.join(proc.args[1:])}: no exit within {timeout} s\n{log.read_text(errors='replace')[-6000:]}"
        )
    text = log.read_text(errors="replace")
    if check and rc != 0:
        pytest.fail(f"kedro {' '.join(proc.args[1:])}: exit {rc} (log {log})\n{text[-6000:]}")
    return subprocess.CompletedProcess(proc.args, rc, text, "")


def run_kedro(
    root: Path,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 900,
    check: bool = True,
    log: Path | None = None,
) -> subprocess.CompletedProcess:
    """``kedro <args>`` in the project copy at ``root``, to the end: ``stdout`` holds stdout and
    stderr in order (also kept in ``log``, by default ``<root>/kedro-<n>.log``)."""
    if log is None:
        log = root / f"kedro-{len(list(root.glob('kedro-*.log')))}.log"
    return wait_kedro(start_kedro(root, *args, log=log, env=env), log, timeout=timeout, check=check)


@contextmanager
def kedro_session(root: Path, env: str = "smoke", runtime_params: dict | None = None) -> Iterator:
    """An in-process ``KedroSession`` on the copy at ``root`` (cwd and MLflow store there).

    kedro-mlflow leaves its run active after an in-process ``session.run`` (a CLI run ends
    with its process): it is ended on exit, so two sessions never log into one run.
    """
    mp = pytest.MonkeyPatch()
    for key in [k for k in os.environ if k.startswith("MLFLOW_")]:
        mp.delenv(key)
    mp.setenv("MLFLOW_TRACKING_URI", tracking_uri(root))
    mp.chdir(root)
    try:
        bootstrap_project(root)
        with KedroSession.create(project_path=root, env=env, runtime_params=runtime_params) as session:
            yield session
    finally:
        while mlflow.active_run():
            mlflow.end_run()
        mp.undo()
