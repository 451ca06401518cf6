"""`kedro run --pipelines=compare` in the smoke env: killed during its third branch, resumed, one report.

One compare for the whole module (the slowest test here: a few minutes). It is SIGKILLed
(its process group; its engines end with it, rollout/server.py) right after the third
branch's training wrote its step-2 checkpoint, then started again with the same command.
Every assertion reads what the two runs left: the logs, the report files, the MLflow runs,
and the notebook executed headless against the same runs.

What the resume must show (issue "Reuse, never redo"): the first two branches keep their
MLflow runs and are not trained again, the interrupted one resumes from its checkpoint
into its own run, the fourth starts; the bases are reused (same fingerprint); the report
holds all four methods.
"""

from __future__ import annotations

import base64
import json
import re
import time
from pathlib import Path

import pytest

from tests.conftest import PROJECT, project_copy, run_kedro, start_kedro, stop_kedro, tracking_uri, wait_kedro

pytestmark = [pytest.mark.kedro_run, pytest.mark.vllm]

METHODS = ["qerl", "qerl_noaqn", "qlora", "lora"]
SMOKE_STEPS = 3  # conf/smoke/parameters.yml train.steps
ARGS = ("run", "--pipelines=compare", "--env=smoke")
BRANCH = re.compile(r"compare branch (\w+): run folder")


def _branches(text: str) -> list[str]:
    return BRANCH.findall(text)


def _child_runs(client, parent_id: str) -> dict[str, object]:
    exp = client.get_experiment_by_name("qerl_pipeline")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`qerl.compare_group` = '{parent_id}'")
    return {r.data.tags["method"]: r for r in runs}


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    from mlflow.tracking import MlflowClient

    root = project_copy(tmp_path_factory.mktemp("compare") / "project", shared=["gsm8k/test.jsonl"])
    log1 = root / "first.log"
    proc = start_kedro(root, *ARGS, log=log1)
    third, deadline = None, time.monotonic() + 1500
    try:
        while time.monotonic() < deadline:
            text = log1.read_text(errors="replace")
            names = _branches(text)
            if len(names) >= 3:
                third = names[2]
                tail = text[text.rindex(f"compare branch {third}"):]
                if re.search(rf"step 2/{SMOKE_STEPS} ", tail):
                    break
            if proc.poll() is not None:
                pytest.fail(f"compare ended (rc {proc.returncode}) before its third branch's step 2\n{text[-6000:]}")
            time.sleep(0.5)
        else:
            pytest.fail("no third branch at step 2 within the deadline\n" + log1.read_text(errors="replace")[-6000:])
    finally:
        stop_kedro(proc)  # SIGKILL of kedro's process group; the engines end through their guards (rollout/server.py)
    client = MlflowClient(tracking_uri=tracking_uri(root))
    exp = client.get_experiment_by_name("qerl_pipeline")
    first_parent = next(r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("qerl.role") == "compare")
    before = {m: r.info.run_id for m, r in _child_runs(client, first_parent.info.run_id).items()}
    first_names = _branches(log1.read_text(errors="replace"))

    log2 = root / "second.log"
    t0 = time.perf_counter()
    resumed = wait_kedro(start_kedro(root, *ARGS, log=log2), log2, timeout=1500)
    print(f"resumed compare: {time.perf_counter() - t0:.0f} s")  # measured, not asserted
    parents = [r for r in client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
               if r.data.tags.get("qerl.role") == "compare"]
    parent = parents[0]
    children = list(_child_runs(client, parent.info.run_id).values())
    return {"root": root, "uri": tracking_uri(root), "client": client, "parent": parent, "children": children,
            "before": before, "order": first_names, "second": resumed.stdout, "report": root / "data/08_reporting/smoke/compare"}


def test_resume_keeps_finished_branches_and_resumes_the_interrupted_one(compared):
    order, before, second = compared["order"], compared["before"], compared["second"]
    first, second_done, third = order[:3]
    assert set(before) == {first, second_done, third}  # the fourth never started
    after = {r.data.tags["method"]: r for r in compared["children"]}
    assert set(after) == set(METHODS)
    for m in (first, second_done, third):
        assert after[m].info.run_id == before[m], f"{m}: a new run instead of its own"
    for m in (first, second_done):
        assert re.search(rf"{m}: already trained to step {SMOKE_STEPS} in .* reusing it", second), m
    assert after[third].data.tags.get("qerl.resumed_at_step") == "2"
    assert "resuming from" in second and f"compare/{third}/checkpoints/step-000002" in second
    for fmt in ("nvfp4", "nf4", "bf16"):
        assert re.search(rf"base_{fmt} reused", second), fmt


def test_one_finished_run_per_method_with_curves_and_eval(compared):
    client, children = compared["client"], compared["children"]
    assert sorted(r.data.tags["method"] for r in children) == sorted(METHODS)
    for run in children:
        assert run.info.status == "FINISHED"
        assert run.data.params["method"] == run.data.tags["method"]
        assert run.data.tags["mlflow.runName"] == f"train {run.data.tags['method']} · random · seed 0"
        rewards = client.get_metric_history(run.info.run_id, "reward/mean")
        assert sorted(m.step for m in rewards) == list(range(1, SMOKE_STEPS + 1))
        assert len(client.get_metric_history(run.info.run_id, "policy/entropy")) == SMOKE_STEPS
        m = run.data.metrics
        for bench in ("generator", "gsm8k"):
            assert m[f"eval/trained/{bench}/n_problems"] == 4
            assert m[f"eval/base/{bench}/n_problems"] == 4
            assert 0 <= m[f"eval/trained/{bench}/pass1_ci_low"] <= m[f"eval/trained/{bench}/pass1"] <= m[f"eval/trained/{bench}/pass1_ci_high"] <= 1
        assert m["base/weight_mib"] > 0 and 0 < m["quantize/linear_bytes_ratio"] <= 1
        arts = {a.path for a in client.list_artifacts(run.info.run_id, "eval")}
        assert {"eval/accuracy.json", "eval/records.json", "eval/result.json"} <= arts
        # the run holds what it was trained on and what it made (issue "MLflow holds every artifact")
        top = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"config", "data", "quantize", "final_adapter", "completions", "plots"} <= top, top
        assert {"quantize/report.json", "quantize/fingerprint.json"} <= {a.path for a in client.list_artifacts(run.info.run_id, "quantize")}
        assert "data/report.json" in {a.path for a in client.list_artifacts(run.info.run_id, "data")}
    # AQN only in qerl: its sigma is positive after stage 0, the others' stays 0
    sigma = {r.data.tags["method"]: [x.value for x in client.get_metric_history(r.info.run_id, "aqn/sigma")] for r in children}
    assert max(sigma["qerl"]) > 0 and max(sigma["qerl_noaqn"]) == 0 and max(sigma["lora"]) == 0
    # same config and seeds: every run logged the same parameters except the method
    params = [{k: v for k, v in r.data.params.items() if k != "method"} for r in children]
    assert all(p == params[0] for p in params)


def test_branch_outputs_are_datasets(compared):
    """Each branch's adapter and evaluation are files of its namespace's datasets."""
    root = compared["root"]
    for m in METHODS:
        adapter = root / "data/06_models/smoke/adapters/compare" / m
        meta = json.loads((adapter / "qerl_adapter.json").read_text())
        run = next(r for r in compared["children"] if r.data.tags["method"] == m)
        assert meta["method"] == m and meta["mlflow_run_id"] == run.info.run_id
        summary = json.loads((compared["report"] / m / "train_summary.json").read_text())
        assert summary["mlflow_run_id"] == run.info.run_id
        assert (compared["report"] / m / "eval_accuracy.csv").read_text().count("\n") == 1 + 2 * 2


def test_report_files_contain_every_method(compared):
    report = compared["report"]
    for stem in ("reward_curves", "entropy_curves", "accuracy", "system"):
        assert (report / f"{stem}.png").read_bytes()[:4] == b"\x89PNG"
    page = (report / "report.html").read_text()
    for run in compared["children"]:
        assert run.data.tags["method"] in page and run.info.run_id in page
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
    nb = nbformat.read(PROJECT / "notebooks" / "compare_runs.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(PROJECT / "notebooks")}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 4
    text = json.dumps([o.get("data", {}).get("text/html", "") for o in outputs])
    for m in METHODS:
        assert m in text


def test_compare_report_rebuilds_the_report_without_training(compared):
    root, parent = compared["root"], compared["parent"].info.run_id
    out = root / "report2"
    proc = run_kedro(root, "run", "--pipelines=compare_report", "--env=smoke",
                     f"--params=compare.report_dir={out},compare.reuse_group={parent}", timeout=600)
    assert "Running node: train_policy" not in proc.stdout  # nothing trained
    page = (out / "report.html").read_text()
    for run in compared["children"]:
        assert run.info.run_id in page  # the same runs, by id


def test_one_branch_alone_reuses_its_training_and_evaluation(compared):
    """``--namespaces=compare.qlora``: Kedro's own selection runs one branch; finished, it redoes nothing."""
    root = compared["root"]
    proc = run_kedro(root, "run", "--pipelines=compare", "--env=smoke", "--namespaces=compare.qlora", timeout=600)
    ran = re.findall(r"Running node: ([\w.]+)", proc.stdout)
    assert ran and all(n.startswith("compare.qlora.") or n in {"train_policy", "evaluate_policies", "evaluation_outputs"}
                       for n in ran), ran
    assert re.search(rf"qlora: already trained to step {SMOKE_STEPS} in .* reusing it", proc.stdout)
    assert "already holds this evaluation" in proc.stdout
    assert "shared engine started" not in proc.stdout  # nothing needed an engine
