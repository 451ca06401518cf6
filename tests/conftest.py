"""Fixtures several test files share, the two test tiers, and the guard that the checkout stays clean.

Tiers. ``integration``: every test that starts a vLLM engine, runs Kedro (a ``kedro`` CLI
process or an in-process ``KedroSession``) or starts a service (PostgreSQL and ``mlflow server``,
``services``). It is never set by hand:
``pytest_collection_modifyitems`` gives it to each test marked ``vllm``, ``kedro_run`` or ``services`` and
to each test that uses a fixture whose code starts one of them (it calls ``RolloutEngine``,
``KedroSession`` or one of the Kedro helpers of ``tests/helpers/project.py``). The rest is
the fast tier, ``pytest -m "not integration"``. The fast tier is enforced, not only
selected: while a test without ``integration`` runs, starting the Kedro CLI or the engine
server (``python -m qerl_pipeline.rollout.server``) as a subprocess raises, so does
``KedroSession.create``, and the test fails even if it caught that error. The subprocess
guard covers the Python processes such a test starts too (a ``sitecustomize`` on their
``PYTHONPATH`` installs it there): one check per process start, and it cannot be forgotten
by the test author the way a marker can.

Kedro in tests runs only in a throw-away copy of the project (``tests/helpers/project.py``),
so data/, mlruns/, mlflow.db, .viz/ and build/ of the checkout never change under a test
run; ``pytest_sessionfinish`` checks that and names what changed (a failure under CI, a
warning on a working tree others may be running Kedro in). Plain helpers live in
``tests/helpers/``; this file holds only fixtures and hooks.
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import signal
import tempfile
from pathlib import Path

import mlflow
import pytest
from kedro.framework.session import KedroSession

from qerl_pipeline.models import tiny_model_folder
from tests.helpers.models import packed_tiny_base
from tests.helpers.project import PROJECT, SHARED

pytest_plugins = ["pytester"]  # tests/test_project.py runs a pytest of its own on the tier hooks

os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the Hub is unreachable here: fail fast, not after DNS timeouts

# A background job of a non-interactive shell (`.ci/run` starts each tier with `&`) inherits SIGINT
# ignored, and an ignored signal stays ignored across exec: every `kedro run` the tests start would
# then shrug off the Ctrl-C they send it (hooks.RunStatusHook keeps an ignored SIGINT ignored, as a
# background job expects). A handler, unlike SIG_IGN, is reset to the default by exec, so the
# children start with SIGINT as a terminal user's process has it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# ----------------------------------------------------------------------------- paths and models
@pytest.fixture(scope="session")
def project_path() -> Path:
    return PROJECT


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = SHARED / "data"
    if not path.is_dir():
        pytest.skip(f"offline data copies not found at {path} (../shared beside the checkout)")
    return path


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    path = SHARED / "golden" / "nvfp4a16"
    if not path.is_dir():
        pytest.skip(f"golden NVFP4 files not found at {path} (../shared beside the checkout)")
    return path


@pytest.fixture()
def sqlite_store(tmp_path, monkeypatch) -> str:
    """An empty embedded MLflow store in ``tmp_path`` (its URI), set for this process and its children."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.chdir(tmp_path)  # the store's default artifact root is ./mlruns: never the checkout's
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    yield uri
    while mlflow.active_run():
        mlflow.end_run()
    mlflow.set_tracking_uri(None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random tiny Llama (hidden 128, 2 heads of 64, 2 layers) with the SmolLM2 tokenizer."""
    return tiny_model_folder(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """A tiny packed NVFP4 base to train (``helpers.models.packed_tiny_base``), one per test module."""
    return packed_tiny_base(tmp_path_factory.mktemp("pu") / "nvfp4")


#: what Kedro and MLflow write where they run: a test run leaves these in the checkout as it found them
CHECKOUT_OUTPUTS = ("data", "mlruns", "mlartifacts", "mlflow.db", "build", ".viz")
_OUTPUTS = pytest.StashKey[dict]()


def _checkout_outputs() -> dict[str, tuple[int, int]]:
    """Every file under ``CHECKOUT_OUTPUTS`` of the checkout: relative path -> (mtime_ns, size)."""
    state = {}
    for name in CHECKOUT_OUTPUTS:
        top = PROJECT / name
        for path in [top] if top.is_file() else top.rglob("*") if top.is_dir() else []:
            try:
                if path.is_file():
                    st = path.stat()
                    state[str(path.relative_to(PROJECT))] = (st.st_mtime_ns, st.st_size)
            except OSError:  # removed while listed
                pass
    return state


def pytest_sessionstart(session):
    session.config.stash[_OUTPUTS] = _checkout_outputs()


def pytest_sessionfinish(session, exitstatus):
    """Name what the run wrote into the checkout's data/, mlruns/, mlflow.db, build/, .viz/;
    under CI (a fresh clone, nothing else running) that fails the run. On a shared working
    tree someone else's ``kedro run`` can write there too, so elsewhere it is a warning."""
    before = session.config.stash.get(_OUTPUTS, None)
    if before is None:
        return
    after = _checkout_outputs()
    changed = sorted(p for p, st in after.items() if before.get(p) != st)
    if not changed:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    fatal = bool(os.environ.get("CI"))
    if reporter is not None:
        reporter.write_line("")
        reporter.write_line(
            f"{'ERROR' if fatal else 'WARNING'}: {len(changed)} file(s) written into the checkout "
            f"during the test run (tests must use project_copy): {', '.join(changed[:10])}",
            red=fatal,
            yellow=not fatal,
        )
    if fatal and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True, scope="module")
def no_leftover_mlflow_run():
    """kedro-mlflow leaves its run active after an in-process session (a CLI run ends with its
    process); close any such run around each test module so one module's sessions never log
    into another module's run."""
    while mlflow.active_run():
        mlflow.end_run()
    yield
    while mlflow.active_run():
        mlflow.end_run()


# ----------------------------------------------------------------------------- tiers
#: set while a fast-tier test runs: the file its guard violations are written to (the guard
#: below spells it out itself: it is copied into the children's sitecustomize)
FAST_TIER_ENV = "QERL_FAST_TIER_REPORT"
#: what in a fixture's code makes its tests integration tests
HEAVY_CALLS = re.compile(r"\b(RolloutEngine|KedroSession|kedro_session|run_kedro|start_kedro|wait_kedro)\b")
_GUARD_DIR = pytest.StashKey[Path]()  # the folder of the sitecustomize and the violations file
_ARMED = pytest.StashKey[bool]()  # on a test whose run the guard watches


def _install_heavy_process_guard():
    """While ``QERL_FAST_TIER_REPORT`` is set: starting the Kedro CLI or the vLLM engine server
    as a subprocess is written to that file and raises. Returns the reporting function.

    Self-contained (its source is copied into the children's ``sitecustomize``)."""
    import os
    import shlex
    import subprocess

    def refuse(what):
        report = os.environ.get("QERL_FAST_TIER_REPORT")
        if not report:
            return
        msg = f"{what} started by a fast-tier test: mark it (or the tests of its fixture) vllm or kedro_run"
        with open(report, "a") as fh:
            fh.write(msg + "\n")
        raise RuntimeError(msg)

    original = subprocess.Popen._execute_child
    if getattr(original, "qerl_guard", False):
        return refuse

    def _execute_child(self, args, *rest, **kwargs):
        if os.environ.get("QERL_FAST_TIER_REPORT"):
            if isinstance(args, (str, bytes, os.PathLike)):
                argv = shlex.split(os.fsdecode(args))
            else:
                argv = [os.fsdecode(a) for a in args]
            if "qerl_pipeline.rollout.server" in argv:
                refuse(f"the vLLM rollout engine ({' '.join(argv[:4])})")
            kedro_cli = (argv and os.path.basename(argv[0]) == "kedro") or any(
                argv[i : i + 2] == ["-m", "kedro"] for i in range(len(argv))
            )
            if kedro_cli:
                refuse(f"the Kedro CLI ({' '.join(argv[:4])})")
        return original(self, args, *rest, **kwargs)

    _execute_child.qerl_guard = True
    subprocess.Popen._execute_child = _execute_child
    return refuse


def pytest_configure(config):
    refuse = _install_heavy_process_guard()
    create = KedroSession.create.__func__

    def guarded_create(cls, *args, **kwargs):
        refuse("a KedroSession")
        return create(cls, *args, **kwargs)

    KedroSession.create = classmethod(guarded_create)
    # the children's copy of the guard: a sitecustomize on their PYTHONPATH (fast-tier tests only)
    folder = Path(tempfile.mkdtemp(prefix="qerl-tier-guard-"))
    (folder / "sitecustomize.py").write_text(
        '"""Written by tests/conftest.py for the processes of a fast-tier test."""\n\n'
        + inspect.getsource(_install_heavy_process_guard)
        + "\n\n_install_heavy_process_guard()\n"
    )
    config.stash[_GUARD_DIR] = folder


def pytest_unconfigure(config):
    folder = config.stash.get(_GUARD_DIR, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def _uses_heavy_fixture(item, cache: dict[int, bool]) -> bool:
    """Whether one of the fixtures ``item`` uses (its whole closure) starts an engine or Kedro."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for name in getattr(item, "fixturenames", ()):
        for fixturedef in defs.get(name, ()):
            if id(fixturedef) not in cache:
                try:
                    cache[id(fixturedef)] = bool(HEAVY_CALLS.search(inspect.getsource(fixturedef.func)))
                except (OSError, TypeError):  # pytest's own fixtures without source
                    cache[id(fixturedef)] = False
            if cache[id(fixturedef)]:
                return True
    return False


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection
def pytest_collection_modifyitems(config, items):
    cache: dict[int, bool] = {}
    for item in items:
        marked = any(item.get_closest_marker(m) for m in ("vllm", "kedro_run", "services"))
        if marked or _uses_heavy_fixture(item, cache):
            item.add_marker(pytest.mark.integration)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    """Arm the guard before the test's fixtures are set up (a module fixture may start an engine)."""
    if item.get_closest_marker("integration") is None:
        folder = item.config.stash[_GUARD_DIR]
        report = folder / "violations.txt"
        report.write_text("")
        os.environ[FAST_TIER_ENV] = str(report)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
        item.stash[_ARMED] = True
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Disarm after the test's teardown; fail it if it started an engine or Kedro (even caught)."""
    try:
        return (yield)
    finally:
        if item.stash.get(_ARMED, False):
            del item.stash[_ARMED]
            report = Path(os.environ.pop(FAST_TIER_ENV))
            folder = str(item.config.stash[_GUARD_DIR])
            rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != folder]
            if rest:
                os.environ["PYTHONPATH"] = os.pathsep.join(rest)
            else:
                os.environ.pop("PYTHONPATH", None)
            violations = report.read_text().splitlines()
            if violations:
                pytest.fail("fast tier: " + "; ".join(dict.fromkeys(violations)), pytrace=False)
