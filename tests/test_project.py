"""The Kedro project as a user meets it: pipelines registered, lineage renders."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .conftest import PROJECT

PIPELINES = {"data_prep", "quantize", "train", "evaluate", "compare", "benchmark"}


def _kedro(*args, timeout=300):
    env = {**os.environ, "KEDRO_DISABLE_TELEMETRY": "true"}
    return subprocess.run([sys.executable, "-m", "kedro", *args], cwd=PROJECT, capture_output=True, text=True, timeout=timeout, env=env)


def test_registry_lists_every_pipeline():
    out = _kedro("registry", "list")
    assert out.returncode == 0, out.stderr[-2000:]
    listed = {line.strip()[2:] for line in out.stdout.splitlines() if line.strip().startswith("- ")}
    assert PIPELINES | {"__default__"} <= listed


def test_default_pipeline_is_data_prep_then_train():
    from kedro.framework.project import configure_project, pipelines

    configure_project("qerl_pipeline")
    default = pipelines["__default__"]
    names = {n.name for n in default.nodes}
    assert {n.name for n in pipelines["data_prep"].nodes} <= names
    assert {n.name for n in pipelines["train"].nodes} <= names


def test_viz_build_renders_lineage():
    out = _kedro("viz", "build")
    assert out.returncode == 0, out.stderr[-2000:]
    main = PROJECT / "build" / "api" / "main"
    graph = json.loads(main.read_text())
    node_names = {n["name"] for n in graph["nodes"]}
    assert len(graph["nodes"]) > 10 and graph["edges"]
    assert any("train" in name for name in node_names)
