"""The Kedro project as a user meets it: pipelines registered, lineage renders.

The CLI runs in a throw-away project copy (``kedro viz build`` writes ``build/`` where it
runs), through ``tests/helpers/project.py``'s ``run_kedro``.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from tests.helpers.project import PROJECT, project_copy, run_kedro

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
TIER_TESTS = """
import subprocess, sys
from pathlib import Path

import pytest

from tests.helpers.project import run_kedro

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
"""


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
    for name in (
        "test_cli_error_swallowed",
        "test_cli_from_a_child_process",
        "test_in_process_session",
        "test_engine",
    ):
        assert re.search(rf"ERROR at teardown of {name}\b", out), (name, out[-6000:])
    assert "fast tier: the Kedro CLI" in out and "fast tier: a KedroSession" in out
    assert "fast tier: the vLLM rollout engine" in out
    assert outcomes.get("errors") == 4 and re.search(r"PASSED test_tiers.py::test_plain_subprocess", out), out[-4000:]


# ----------------------------------------------------------------------------- the README and docs/
README_MAX_LINES = 250
FIRST_SCREEN = 40
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.+)$", text, flags=re.M)}


def test_readme_is_the_newcomers_page():
    """At most 250 lines, and both commands (install, tests) on its first screen."""
    lines = (PROJECT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)
    first_screen = "\n".join(lines[:FIRST_SCREEN])
    assert "bash install.sh" in first_screen and ".venv/bin/python -m pytest" in first_screen


def _readme_section(heading: str) -> str:
    text = (PROJECT / "README.md").read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def test_readme_comparison_tables_are_the_committed_reports():
    """README "The first comparison": each claim of docs/results/cpu_compare/claims.csv (the report of that run)
    is a row with its difference, interval, verdict and, for "cannot tell", its seed estimate; each method of
    accuracy_summary.csv and system.csv a row with its pass@1 (base, trained), interval and step time; those
    methods are conf/cpu_compare's compare.methods, and the command named is that environment's."""
    import csv

    import yaml

    section = _readme_section("The first comparison")
    results = PROJECT / "docs/results/cpu_compare"
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in section.splitlines()
        if line.startswith("| ")
    }
    claims = list(csv.DictReader((results / "claims.csv").open()))
    assert claims
    for c in claims:
        (key,) = [k for k in rows if k.startswith(f"`{c['claim']}`")]
        cells = rows[key]
        assert cells[0] == f"{float(c['difference']):.3f}", (key, cells)
        assert cells[1] == f"[{float(c['ci_low']):.3f}, {float(c['ci_high']):.3f}]", (key, cells)
        assert cells[2] == c["verdict"], (key, cells)
        assert cells[3] == c["seeds_needed_note"], (key, cells)
        assert (c["verdict"] == "cannot tell") == bool(c["seeds_needed"]), c  # every "cannot tell" has its estimate
    acc = list(csv.DictReader((results / "accuracy_summary.csv").open()))
    step = {r["method"]: float(r["Step time (s)"]) for r in csv.DictReader((results / "system.csv").open())}
    params = yaml.safe_load((PROJECT / "conf/cpu_compare/parameters.yml").read_text())
    methods = params["compare"]["methods"]
    assert [r["method"] for r in acc if r["policy"] == "trained"] == methods == list(step)
    for m in methods:
        (base,) = [r for r in acc if r["method"] == m and r["policy"] == "base"]
        (trained,) = [r for r in acc if r["method"] == m and r["policy"] == "trained"]
        assert int(trained["n_seeds"]) == len(params["compare"]["seeds"])
        assert rows[m] == [
            f"{float(base['pass1']):.3f}",
            f"{float(trained['pass1']):.3f}",
            f"[{float(trained['pass1_ci_low']):.3f}, {float(trained['pass1_ci_high']):.3f}]",
            f"{step[m]:.1f}",
        ], (m, rows[m])
    assert "`kedro run --pipelines=compare --env cpu_compare`" in section
    assert f"{params['train']['steps']} steps x {params['train']['prompts_per_step']} prompts" in section


def test_every_relative_link_in_readme_and_docs_resolves():
    """Each relative link in README.md and docs/*.md names an existing file, and its #anchor a heading there."""
    pages = [PROJECT / "README.md", *sorted((PROJECT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        text = re.sub(r"`[^`\n]*`", "", text)
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_every_module_path_in_readme_and_docs_exists():
    """Each ``dir/file.py`` that README.md or docs/*.md names (from the root or under src/qerl_pipeline) exists."""
    pages = [PROJECT / "README.md", *sorted((PROJECT / "docs").glob("*.md"))]
    missing = [
        f"{page.name}: {path}"
        for page in pages
        for path in re.findall(r"`([\w./-]+/[\w.-]+\.py)(?:::\w+)?`", page.read_text())
        if not ((PROJECT / path).exists() or (PROJECT / "src" / "qerl_pipeline" / path).exists())
    ]
    assert not missing, missing
