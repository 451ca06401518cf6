"""The Kedro project as a user meets it: pipelines registered, lineage renders.

The CLI runs in a throw-away project copy (``kedro viz build`` writes ``build/`` where it
runs), through the conftest's ``run_kedro``.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from .conftest import PROJECT, project_copy, run_kedro

PIPELINES = {"data_prep", "quantize", "train", "evaluate", "compare", "benchmark"}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return project_copy(tmp_path_factory.mktemp("cli") / "project")


@pytest.mark.kedro_run
def test_registry_lists_every_pipeline(project):
    out = run_kedro(project, "registry", "list", timeout=300)
    listed = {line.strip()[2:] for line in out.stdout.splitlines() if line.strip().startswith("- ")}
    assert PIPELINES | {"__default__"} <= listed, out.stdout[-3000:]


def test_default_pipeline_is_data_prep_then_train():
    from kedro.framework.project import configure_project, pipelines

    configure_project("qerl_pipeline")
    default = pipelines["__default__"]
    names = {n.name for n in default.nodes}
    assert {n.name for n in pipelines["data_prep"].nodes} <= names
    assert {n.name for n in pipelines["train"].nodes} <= names


@pytest.mark.kedro_run
def test_viz_build_renders_lineage(project):
    run_kedro(project, "viz", "build", timeout=300)
    graph = json.loads((project / "build" / "api" / "main").read_text())
    node_names = {n["name"] for n in graph["nodes"]}
    assert len(graph["nodes"]) > 10 and graph["edges"]
    assert any("train" in name for name in node_names)


# ----------------------------------------------------------------------------- the test tiers
TIER_TESTS = '''
import subprocess, sys
from pathlib import Path

import pytest

from tests.conftest import run_kedro

KEDRO = str(Path(sys.executable).with_name("kedro"))


@pytest.fixture
def pipeline_run(tmp_path):
    return run_kedro(tmp_path, "run")  # never runs: its tests are integration tests


def test_uses_a_kedro_fixture(pipeline_run):
    pass


@pytest.mark.vllm
def test_marked():
    pass


def test_cli_error_swallowed():
    try:
        subprocess.run([KEDRO, "--version"])
    except RuntimeError:
        pass


def test_cli_from_a_child_process():
    code = f"import subprocess; subprocess.run([{KEDRO!r}, '--version'])"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode != 0


def test_in_process_session(tmp_path):
    from kedro.framework.session import KedroSession

    with pytest.raises(RuntimeError):
        KedroSession.create(project_path=tmp_path)


def test_engine(tmp_path):
    from qerl_pipeline.rollout.engine import RolloutEngine

    with pytest.raises(RuntimeError, match="rollout engine"):
        RolloutEngine(tmp_path, max_model_len=8)


def test_plain_subprocess():
    assert subprocess.run([sys.executable, "-c", "print(1)"]).returncode == 0
'''


def test_fast_tier_deselects_integration_and_fails_tests_that_start_kedro_or_an_engine(pytester, monkeypatch):
    """``-m "not integration"``: marked tests and tests of a Kedro fixture are left out, and a test
    that starts the Kedro CLI (also from a child process, also when it swallows the error), a
    KedroSession or the engine server fails; other subprocesses run."""
    monkeypatch.delenv("QERL_FAST_TIER_REPORT", raising=False)  # the outer test's guard: the inner run has its own
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(PROJECT), os.environ.get("PYTHONPATH", "")) if p))
    pytester.makeconftest("from tests.conftest import *  # noqa: F401,F403  (the hooks and helpers under test)\n")
    pytester.makeini("[pytest]\nmarkers =\n    integration\n    vllm\n    kedro_run\n    gpu\n")
    pytester.makepyfile(test_tiers=TIER_TESTS)
    result = pytester.runpytest_subprocess("-m", "not integration", "-p", "no:cacheprovider", "-rA")
    out = result.stdout.str()
    outcomes = result.parseoutcomes()
    assert outcomes.get("deselected") == 2, out[-4000:]
    for name in ("test_cli_error_swallowed", "test_cli_from_a_child_process", "test_in_process_session", "test_engine"):
        assert re.search(rf"ERROR at teardown of {name}\b", out), (name, out[-6000:])
    assert "fast tier: the Kedro CLI" in out and "fast tier: a KedroSession" in out
    assert "fast tier: the vLLM rollout engine" in out
    assert outcomes.get("errors") == 4 and re.search(r"PASSED test_tiers.py::test_plain_subprocess", out), out[-4000:]
