"""`kedro run --pipeline=compare` in the smoke env: four methods trained and evaluated, one report.

One compare run for the whole module (it is the slowest test here: a few minutes); every
assertion reads what that run left: the report files, the MLflow runs, and the notebook
executed headless against the same runs.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.kedro_run, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["qerl", "qerl_noaqn", "qlora", "lora"]
SMOKE_STEPS = 3  # conf/smoke/parameters.yml train.steps


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare")
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp / 'mlflow.db'}", KEDRO_DISABLE_TELEMETRY="true", HF_HUB_OFFLINE="1")
    params = f"train.output_dir={tmp / 'train'},compare.report_dir={tmp / 'report'}"
    cmd = [str(Path(sys.executable).with_name("kedro")), "run", "--pipeline=compare", "--env=smoke", f"--params={params}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    print(f"compare smoke run: {seconds:.0f} s")  # measured, not asserted
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("qerl_pipeline")
    runs = client.search_runs([exp.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("qerl.role") == "compare"]
    children = [r for r in runs if r.data.tags.get("qerl.compare_group") == parent.info.run_id]
    return {"tmp": tmp, "uri": env["MLFLOW_TRACKING_URI"], "client": client, "parent": parent, "children": children}


def test_one_finished_run_per_method_with_curves_and_eval(compared):
    client, children = compared["client"], compared["children"]
    assert sorted(r.data.tags["method"] for r in children) == sorted(METHODS)
    for run in children:
        assert run.info.status == "FINISHED"
        assert run.data.params["method"] == run.data.tags["method"]
        rewards = client.get_metric_history(run.info.run_id, "reward/mean")
        assert [m.step for m in rewards] == list(range(1, SMOKE_STEPS + 1))
        assert len(client.get_metric_history(run.info.run_id, "policy/entropy")) == SMOKE_STEPS
        m = run.data.metrics
        for bench in ("generator", "gsm8k"):
            assert m[f"eval/trained/{bench}/n_problems"] == 4
            assert m[f"eval/base/{bench}/n_problems"] == 4
            assert 0 <= m[f"eval/trained/{bench}/pass1_ci_low"] <= m[f"eval/trained/{bench}/pass1"] <= m[f"eval/trained/{bench}/pass1_ci_high"] <= 1
        assert m["base/weight_mib"] > 0
    # AQN only in qerl: its sigma is positive after stage 0, the others' stays 0
    sigma = {r.data.tags["method"]: [x.value for x in client.get_metric_history(r.info.run_id, "aqn/sigma")] for r in children}
    assert max(sigma["qerl"]) > 0 and max(sigma["qerl_noaqn"]) == 0 and max(sigma["lora"]) == 0
    # same config and seeds: every run logged the same parameters except the method
    params = [{k: v for k, v in r.data.params.items() if k != "method"} for r in children]
    assert all(p == params[0] for p in params)


def test_report_files_contain_every_method(compared):
    report = compared["tmp"] / "report"
    for stem in ("reward_curves", "entropy_curves", "accuracy", "system"):
        assert (report / f"{stem}.png").read_bytes()[:4] == b"\x89PNG"
    page = (report / "report.html").read_text()
    for m in METHODS:
        assert m in page
    imgs = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(imgs) == 4 and all(base64.b64decode(i)[:4] == b"\x89PNG" for i in imgs)
    table = (report / "accuracy.csv").read_text().splitlines()
    assert len(table) == 1 + len(METHODS) * 2 * 2  # methods x policies x benchmarks
    # logged to the compare run too
    names = {Path(a.path).name for a in compared["client"].list_artifacts(compared["parent"].info.run_id, "report")}
    assert {"report.html", "reward_curves.png", "entropy_curves.png", "accuracy.png", "system.png"} <= names


def test_notebook_draws_the_smoke_runs(compared, monkeypatch):
    import nbclient
    import nbformat

    monkeypatch.setenv("MLFLOW_TRACKING_URI", compared["uri"])
    monkeypatch.setenv("QERL_COMPARE_GROUP", compared["parent"].info.run_id)
    nb = nbformat.read(ROOT / "notebooks" / "compare_runs.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 4
    text = json.dumps([o.get("data", {}).get("text/html", "") for o in outputs])
    for m in METHODS:
        assert m in text


def test_reuse_runs_rebuilds_the_report_without_training(compared):
    tmp, parent = compared["tmp"], compared["parent"].info.run_id
    env = dict(os.environ, MLFLOW_TRACKING_URI=compared["uri"], KEDRO_DISABLE_TELEMETRY="true", HF_HUB_OFFLINE="1")
    params = f"train.output_dir={tmp / 'train_unused'},compare.report_dir={tmp / 'report2'},compare.reuse_runs=true,compare.reuse_group={parent}"
    cmd = [str(Path(sys.executable).with_name("kedro")), "run", "--pipeline=compare", "--env=smoke", f"--params={params}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert not (tmp / "train_unused").exists()  # nothing trained
    page = (tmp / "report2" / "report.html").read_text()
    for run in compared["children"]:
        assert run.info.run_id in page  # the same runs, by id
