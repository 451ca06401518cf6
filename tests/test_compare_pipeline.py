"""`kedro run --pipelines=compare` in the smoke env: interrupted during its third branch, resumed, one report.

One compare for the whole module (the slowest test here: a few minutes): 5 methods x the smoke
env's ``compare.seeds: [0, 1]``, 10 trainings. It gets SIGINT (Ctrl-C to its process group;
SIGKILL after a grace period, its engines end with it, rollout/server.py) right after the third
branch's first seed wrote its step-2 checkpoint, then is started again with the same command.
The interrupted runs must say so (KILLED, the signal, the last completed step), and the resume
must finish the interrupted training's own run. Every assertion reads what the two runs
left: the logs, the report files, the MLflow runs, and the notebook executed headless against
the same runs.

What the resume must show (issue "Reuse, never redo"): the first two branches keep their
MLflow runs (both seeds) and are not trained again, the interrupted (method, seed) resumes
from its checkpoint into its own run, the others start; the bases are reused (same
fingerprint); the report holds all five methods with intervals over the two seeds and the
paper's three claims stated (issue 12).
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.project import PROJECT, project_copy, run_kedro, start_kedro, stop_kedro, tracking_uri, wait_kedro

pytestmark = [pytest.mark.kedro_run, pytest.mark.vllm]

METHODS = ["qerl", "qerl_noaqn", "qlora", "lora", "lora_aqn"]
SEEDS = [0, 1]  # conf/smoke/parameters.yml compare.seeds
SMOKE_STEPS = 3  # conf/smoke/parameters.yml train.steps
#: CI time: sampled pass@1 only (greedy decoding is the evaluate pipeline's test's); 10 trainings + 10 evaluations
#: otherwise add ~1.5 min to the module. Every compare command here passes the same, so evaluations are reused.
EVAL_PARAMS = "--params=evaluate.greedy=false"
ARGS = ("run", "--pipelines=compare", "--env=smoke", EVAL_PARAMS)
BRANCH = re.compile(r"compare branch (\w+) seed (\d+): run folder")


def _branches(text: str) -> list[str]:
    """The methods in the order their branches started (each once, whatever its seeds)."""
    return list(dict.fromkeys(m for m, _ in BRANCH.findall(text)))


def _child_runs(client, parent_id: str) -> dict[tuple[str, int], object]:
    exp = client.get_experiment_by_name("qerl_pipeline")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`qerl.compare_group` = '{parent_id}'")
    return {(r.data.tags["method"], int(r.data.tags["seed"])): r for r in runs}


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    from mlflow.tracking import MlflowClient

    root = project_copy(tmp_path_factory.mktemp("compare") / "project", shared=["gsm8k/test.jsonl"])
    from qerl_pipeline.rl import checkpoint as ckpt

    log1 = root / "first.log"
    proc = start_kedro(root, *ARGS, log=log1)
    branches = root / "data/06_models/train_smoke/compare" / f"seed-{SEEDS[0]}"
    third, deadline = None, time.monotonic() + 1500
    try:
        # watched on disk, not in the log (block-buffered: its lines can arrive after the branch finished): the
        # third branch is the third run folder of the first seed; a smoke step takes ~0.2 s, so the process group
        # is stopped (SIGSTOP) within one 20 ms poll of the step-2 checkpoint's rename, before SIGINT lands
        while time.monotonic() < deadline:
            started = sorted(p for p in branches.iterdir() if p.is_dir()) if branches.is_dir() else []
            running = [p for p in started if not (p / "final_adapter").exists()]
            if len(started) >= 3 and running and (running[0] / "checkpoints" / "step-000002").is_dir():
                os.killpg(proc.pid, signal.SIGSTOP)
                third = running[0].name
                break
            if proc.poll() is not None:
                text = log1.read_text(errors="replace")
                pytest.fail(f"compare ended (rc {proc.returncode}) before its third branch's step 2\n{text[-6000:]}")
            time.sleep(0.02)
        else:
            pytest.fail("no third branch at step 2 within the deadline\n" + log1.read_text(errors="replace")[-6000:])
    finally:  # Ctrl-C: SIGINT to kedro's process group, then SIGKILL if it has not ended (the engines end with it)
        os.killpg(proc.pid, signal.SIGINT)
        os.killpg(proc.pid, signal.SIGCONT)
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            pass
        stop_kedro(proc)

    # the step the kill left as newest checkpoint: 2, or 3 when SIGINT landed after the last step's checkpoint
    # (then the resume starts from it, or reuses the branch if its final adapter was written too)
    interrupted = branches / third
    newest = ckpt.find_latest(interrupted)
    killed_at = int(ckpt.peek_state(newest)["step"]) if newest is not None else None
    killed_final = (interrupted / "final_adapter").exists()
    client = MlflowClient(tracking_uri=tracking_uri(root))
    exp = client.get_experiment_by_name("qerl_pipeline")
    first_parent = next(
        r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("qerl.role") == "compare"
    )
    killed_runs = _child_runs(client, first_parent.info.run_id)
    before = {m: r.info.run_id for m, r in killed_runs.items()}
    first_names = _branches(log1.read_text(errors="replace"))
    assert first_names[2:3] == [third], first_names  # the log names the branch found on disk

    log2 = root / "second.log"
    t0 = time.perf_counter()
    resumed = wait_kedro(start_kedro(root, *ARGS, log=log2), log2, timeout=1500)
    print(f"resumed compare: {time.perf_counter() - t0:.0f} s")  # measured, not asserted
    parents = [
        r
        for r in client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
        if r.data.tags.get("qerl.role") == "compare"
    ]
    parent = parents[0]
    children = list(_child_runs(client, parent.info.run_id).values())
    return {
        "root": root,
        "uri": tracking_uri(root),
        "client": client,
        "parent": parent,
        "children": children,
        "before": before,
        "order": first_names,
        "second": resumed.stdout,
        "killed_at": killed_at,
        "killed_final": killed_final,
        "report": root / "data/08_reporting/smoke/compare",
        "killed_parent": first_parent,
        "killed_run": killed_runs.get((third, SEEDS[0])),
    }


def test_resume_keeps_finished_branches_and_resumes_the_interrupted_one(compared):
    order, before, second = compared["order"], compared["before"], compared["second"]
    first, second_done, third = order[:3]
    # both seeds of the first two branches, the third's first seed; the rest never started
    assert set(before) == {(first, k) for k in SEEDS} | {(second_done, k) for k in SEEDS} | {(third, SEEDS[0])}
    after = {(r.data.tags["method"], int(r.data.tags["seed"])): r for r in compared["children"]}
    assert set(after) == {(m, k) for m in METHODS for k in SEEDS}
    for key in before:
        assert after[key].info.run_id == before[key], f"{key}: a new run instead of its own"
    for m in (first, second_done):
        found = re.findall(
            rf"{m}: already trained to step {SMOKE_STEPS} in \S*/compare/seed-(\d+)/{m} .* reusing it", second
        )
        assert sorted(map(int, found)) == SEEDS, (m, found)
    killed_at = compared["killed_at"]
    assert killed_at in (2, 3)  # killed after its step-2 checkpoint (module fixture)
    print(f"killed at step {killed_at}, final adapter written: {compared['killed_final']}")  # which case ran
    if compared["killed_final"]:  # SIGINT landed during its wrap-up: reused, the wrap-up finished
        assert re.search(
            rf"{third}: already trained to step {SMOKE_STEPS} in \S*/compare/seed-{SEEDS[0]}/{third} ", second
        )
    else:
        assert after[third, SEEDS[0]].data.tags.get("qerl.resumed_at_step") == str(killed_at)
        step = f"compare/seed-{SEEDS[0]}/{third}/checkpoints/step-{killed_at:06d}"
        assert re.search(rf"resuming from \S*{step} ", second), step
    assert "qerl.resumed_at_step" not in after[third, SEEDS[1]].data.tags  # its second seed started afresh
    for fmt in ("nvfp4", "nf4", "bf16"):
        assert re.search(rf"base_{fmt} reused", second), fmt


def test_the_interrupted_runs_are_killed_with_the_last_step_and_the_resume_finishes_the_same_run(compared):
    """SIGINT leaves the compare run and the interrupted branch's run KILLED (not FINISHED), tagged with the
    signal and the last completed node or step; the resume logs into that same run, which ends FINISHED
    with how it ended before kept in ``qerl.previous_end``."""
    from qerl_pipeline import tracking

    parent, killed = compared["killed_parent"], compared["killed_run"]
    client = compared["client"]
    parent = client.get_run(parent.info.run_id)
    assert parent.info.status == "KILLED" and parent.data.tags[tracking.KILLED_BY_TAG] == "SIGINT", parent.data.tags
    assert tracking.LAST_NODE_TAG in parent.data.tags
    assert killed.info.status == "KILLED" and killed.data.tags[tracking.KILLED_BY_TAG] == "SIGINT", killed.data.tags
    last = int(killed.data.tags[tracking.LAST_STEP_TAG])
    assert compared["killed_at"] <= last <= SMOKE_STEPS  # its newest checkpoint is at or before its last logged step
    resumed = next(r for r in compared["children"] if r.info.run_id == killed.info.run_id)
    assert resumed.info.status == "FINISHED"
    assert not set(tracking.END_TAGS) & set(resumed.data.tags), resumed.data.tags
    assert resumed.data.tags[tracking.PREVIOUS_END_TAG] == f"KILLED; killed_by=SIGINT; last_completed_step={last}"


def test_one_finished_run_per_method_and_seed_with_curves_and_eval(compared):
    from qerl_pipeline.tracking import metric_history

    client, children = compared["client"], compared["children"]
    killed = compared["killed_run"]
    assert sorted((r.data.tags["method"], r.data.tags["seed"]) for r in children) == sorted(
        (m, str(k)) for m in METHODS for k in SEEDS
    )
    for run in children:
        assert run.info.status == "FINISHED"
        assert run.data.params["method"] == run.data.tags["method"]
        seed = run.data.tags["seed"]
        assert run.data.tags["mlflow.runName"] == f"train {run.data.tags['method']} · random · seed {seed}"
        # the seed sets the training's three random streams, nothing else
        assert run.data.params["train.seed"] == run.data.params["rollout.seed"] == run.data.params["aqn.seed"] == seed
        for name in ("reward/mean", "policy/entropy"):  # each step once, as every reader of the curves sees them
            assert [s for s, _ in metric_history(client, run.info.run_id, name)] == list(range(1, SMOKE_STEPS + 1))
            # a step logged twice only in the interrupted run, only past the checkpoint its resume started from
            # (SIGINT can land between a step's metrics and its checkpoint; MLflow cannot delete a point)
            steps = [m.step for m in client.get_metric_history(run.info.run_id, name)]
            again = {s for s in steps if steps.count(s) > 1}
            assert not again or (run.info.run_id == killed.info.run_id and min(again) > compared["killed_at"]), again
        m = run.data.metrics
        for bench in ("generator", "gsm8k"):
            assert m[f"eval/trained/{bench}/n_problems"] == 4
            assert m[f"eval/base/{bench}/n_problems"] == 4
            assert (
                0
                <= m[f"eval/trained/{bench}/pass1_ci_low"]
                <= m[f"eval/trained/{bench}/pass1"]
                <= m[f"eval/trained/{bench}/pass1_ci_high"]
                <= 1
            )
        assert m["base/weight_mib"] > 0 and 0 < m["quantize/linear_bytes_ratio"] <= 1
        arts = {a.path for a in client.list_artifacts(run.info.run_id, "eval")}
        assert {"eval/accuracy.json", "eval/records.json", "eval/result.json"} <= arts
        # the run holds what it was trained on and what it made (issue "MLflow holds every artifact")
        top = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"config", "data", "quantize", "final_adapter", "completions", "plots"} <= top, top
        assert {"quantize/report.json", "quantize/fingerprint.json"} <= {
            a.path for a in client.list_artifacts(run.info.run_id, "quantize")
        }
        assert "data/report.json" in {a.path for a in client.list_artifacts(run.info.run_id, "data")}
    # AQN in qerl and lora_aqn (on the bf16 base): sigma positive after stage 0; the others' stays 0
    for run in children:
        sigma = max(x.value for x in client.get_metric_history(run.info.run_id, "aqn/sigma"))
        assert (sigma > 0) == (run.data.tags["method"] in ("qerl", "lora_aqn")), run.data.tags["method"]
    # same config: every run logged the same parameters except the method and the seeds
    seeds = {"method", "train.seed", "rollout.seed", "aqn.seed"}
    params = [{k: v for k, v in r.data.params.items() if k not in seeds} for r in children]
    assert all(p == params[0] for p in params)


def test_mlflow_opens_on_the_trainings_each_under_its_compare_with_its_prompts_one_dataset(compared):
    """What MLflow's UI shows, asked of its API: the experiment's kind (its training runs, not GenAI traces), each
    training under its compare run with the columns a user sorts by, its prompts a dataset input that is one
    dataset across methods and seeds, and each evaluated benchmark one too."""
    from qerl_pipeline import metric_names
    from qerl_pipeline.config import METHOD_FORMAT
    from qerl_pipeline.tracking import metric_history
    from qerl_pipeline.tracking_view import KIND_TAG, MODEL_DEVELOPMENT

    client, parent, children = compared["client"], compared["parent"], compared["children"]
    assert client.get_experiment(parent.info.experiment_id).tags[KIND_TAG] == MODEL_DEVELOPMENT
    assert len(children) == len(METHODS) * len(SEEDS)
    trained, evaluated = set(), set()
    sort_metrics = (metric_names.REWARD_AREA, metric_names.FINAL_REWARD, metric_names.MEAN_STEP_S)
    for run in children:
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        # the runs list's sort and filter columns: method, format, seed, reward area, final reward, step time,
        # accuracy per benchmark
        tags, metrics = run.data.tags, run.data.metrics
        assert tags["format"] == METHOD_FORMAT[tags["method"]] and int(tags["seed"]) in SEEDS, tags
        assert all(name in metrics for name in sort_metrics), sorted(metrics)
        assert metrics[metric_names.FINAL_REWARD] == metric_history(client, run.info.run_id, "reward/mean")[-1][1]
        assert {m.split("/")[2] for m in metrics if m.startswith("eval/trained/") and m.count("/") == 3} == {
            "generator",
            "gsm8k",
        }
        inputs = client.get_run(run.info.run_id).inputs.dataset_inputs
        by_context = {}
        for i in inputs:
            context = {t.key: t.value for t in i.tags}["mlflow.data.context"]
            by_context.setdefault(context, []).append((i.dataset.name, i.dataset.digest))
        (train,) = by_context["training"]
        trained.add(train)
        evaluated |= set(by_context["evaluation"])
    assert len(trained) == 1, trained  # the same prompts: one dataset for every method and seed
    # one per benchmark of conf/smoke's evaluate.benchmarks, the same subset (evaluate.limit) for all
    assert sorted(name.split("/")[0] for name, _ in evaluated) == ["generator", "gsm8k"], evaluated


def test_branch_outputs_are_datasets(compared):
    """Each branch's adapter and evaluation are files of its namespace's datasets."""
    root = compared["root"]
    for m in METHODS:
        summary = json.loads((compared["report"] / m / "train_summary.json").read_text())
        assert summary["seeds"] == SEEDS
        for k, entry in zip(SEEDS, summary["runs"], strict=True):
            adapter = root / "data/06_models/smoke/adapters/compare" / m / f"seed-{k}"
            meta = json.loads((adapter / "qerl_adapter.json").read_text())
            run = next(r for r in compared["children"] if r.data.tags["method"] == m and r.data.tags["seed"] == str(k))
            assert meta["method"] == m and meta["mlflow_run_id"] == run.info.run_id and meta["seed"] == k
            assert entry["mlflow_run_id"] == run.info.run_id and entry["seed"] == k
        table = (compared["report"] / m / "eval_accuracy.csv").read_text().splitlines()
        assert "seed" in table[0].split(",") and len(table) == 1 + len(SEEDS) * 2 * 2  # seeds x policies x benchmarks


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
    assert len(table) == 1 + len(METHODS) * len(SEEDS) * 2 * 2  # methods x seeds x policies x benchmarks
    # logged to the compare run too
    names = {Path(a.path).name for a in compared["client"].list_artifacts(compared["parent"].info.run_id, "report")}
    assert {
        "report.html",
        "reward_curves.png",
        "entropy_curves.png",
        "accuracy.png",
        "system.png",
        "claims.json",
        "claims.csv",
        "curves.csv",
        "accuracy_summary.csv",
    } <= names


def test_report_has_intervals_over_seeds_and_states_the_claims(compared):
    """Issue 12: per-step bands and accuracy intervals over the 2 seeds; claims (a), (b), (c) with their numbers."""
    import pandas as pd

    report, page = compared["report"], (compared["report"] / "report.html").read_text()
    curves = pd.read_csv(report / "curves.csv")
    assert set(curves["curve"]) == {"reward", "entropy"} and set(curves["method"]) == set(METHODS)
    assert (curves["n_seeds"] == len(SEEDS)).all() and sorted(set(curves["step"])) == list(range(1, SMOKE_STEPS + 1))
    assert (
        curves["ci_low"].notna().all()
        and (curves["ci_low"] <= curves["mean"]).all()
        and (curves["mean"] <= curves["ci_high"]).all()
    )
    acc = pd.read_csv(report / "accuracy_summary.csv")
    trained = acc[acc["policy"] == "trained"]
    assert len(trained) == len(METHODS) * 2 and (trained["n_seeds"] == len(SEEDS)).all()
    assert (trained["interval_over"] == "seeds+problems").all()
    assert ((trained["pass1_ci_low"] <= trained["pass1"]) & (trained["pass1"] <= trained["pass1_ci_high"])).all()
    # the mean over seeds and problems (from the runs' per-problem records) is the mean of the seeds' logged pass@1
    per_run = pd.read_csv(report / "accuracy.csv")
    per_run = per_run[per_run["policy"] == "trained"].groupby(["method", "benchmark"])["pass1"].mean()
    for row in trained.itertuples():
        assert row.pass1 == pytest.approx(per_run[row.method, row.benchmark]), row
    claims = json.loads((report / "claims.json").read_text())
    ids = {c["id"] for c in claims}
    assert ids == {
        "a_qerl_entropy_gt_lora",
        "a_qerl_noaqn_entropy_gt_lora",
        "a_qlora_entropy_gt_lora",
        "b_qerl_ge_qerl_noaqn",
        "b_qerl_noaqn_ge_lora",
        "c_lora_aqn_ge_lora",
    }
    for c in claims:  # every claim measured on both seeds, its sentence on the page
        assert c["seeds"] == SEEDS and c["difference"]["n"] == len(SEEDS), c
        num = r"-?\d+\.\d+(?:e[-+]\d+)?"
        assert re.fullmatch(
            rf"(supported|contradicted|cannot tell): difference {num}, 95% interval \[{num}, {num}\], 2 seeds",
            c["text"],
        ), c["text"]
        assert c["text"] in page
        assert c["verdict"] == c["text"].split(":")[0]
    assert "first AQN stage" in page
    parent = compared["client"].get_run(compared["parent"].info.run_id)
    for cid in ids:
        assert parent.data.metrics[f"claims/{cid}/n_seeds"] == len(SEEDS)
        assert parent.data.tags[f"claims.{cid}"] == next(c["text"] for c in claims if c["id"] == cid)


def test_notebook_draws_the_smoke_runs(compared, monkeypatch):
    import nbclient
    import nbformat

    monkeypatch.setenv("MLFLOW_TRACKING_URI", compared["uri"])
    monkeypatch.setenv("QERL_COMPARE_GROUP", compared["parent"].info.run_id)
    nb = nbformat.read(PROJECT / "notebooks" / "compare_runs.ipynb", as_version=4)
    nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(PROJECT / "notebooks")}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 4
    text = json.dumps([o.get("data", {}).get("text/html", "") for o in outputs])
    for m in METHODS:
        assert m in text


def test_the_report_node_alone_rebuilds_the_report_without_training(compared):
    """The one report path, run again: ``--nodes=build_comparison_report`` reads the branches' persisted summaries."""
    root = compared["root"]
    out = root / "report2"
    proc = run_kedro(
        root,
        "run",
        "--pipelines=compare",
        "--env=smoke",
        "--nodes=build_comparison_report",
        f"{EVAL_PARAMS},compare.report_dir={out}",
        timeout=600,
    )
    assert re.findall(r"Running node: ([\w.]+)", proc.stdout) == ["build_comparison_report"]  # nothing trained
    page = (out / "report.html").read_text()
    for run in compared["children"]:
        assert run.info.run_id in page  # the same runs, by id


def test_one_branch_alone_reuses_its_training_and_evaluation(compared):
    """``--namespaces=compare.qlora``: Kedro's own selection runs one branch; finished, it redoes nothing."""
    root = compared["root"]
    proc = run_kedro(root, *ARGS, "--namespaces=compare.qlora", timeout=600)
    ran = re.findall(r"Running node: ([\w.]+)", proc.stdout)
    branch = {  # Kedro's log names a namespaced node by its own name
        "training_config",
        "train_policy",
        "evaluation_config",
        "evaluate_policies",
        "export_config",
        "evaluation_outputs",
        "export_policy",
        "evaluate_export",
        "report_export",
    }
    assert ran and all(n.startswith("compare.qlora.") or n in branch for n in ran), ran
    assert "compare.qlora: export.in_compare is off, not exported" in proc.stdout  # the export nodes did nothing
    assert len(re.findall(rf"qlora: already trained to step {SMOKE_STEPS} in .* reusing it", proc.stdout)) == len(
        SEEDS
    )
    assert len(re.findall(r"evaluate qlora seed \d+: run \w+ already holds this evaluation", proc.stdout)) == len(
        SEEDS
    )
    assert "shared engine started" not in proc.stdout  # nothing needed an engine


def test_a_method_left_out_of_compare_methods_is_neither_trained_nor_evaluated(compared):
    """``compare.methods`` chooses what trains: a compare of mxfp4 alone (QeRL's recipe on an MXFP4 base, a format
    of the sweep) on a seed no run has used trains, evaluates and reports that branch through the same code as the
    others (its own base, quantized by its codec and served as its dense decoded copy on CPU), and leaves every
    other branch's nodes saying so, with no run folder, no MLflow run and no engine start for their methods.

    The last test of the module: it rewrites the skipped branches' datasets (their ``train_summary`` says
    ``skipped``), which the tests above read. ``compare.methods`` is given as the space-separated string form."""
    root, client = compared["root"], compared["client"]
    seed, report = 7, root / "report_methods"
    proc = run_kedro(
        root,
        "run",
        "--pipelines=compare",
        "--env=smoke",
        f"{EVAL_PARAMS},compare.methods=mxfp4,compare.seeds=[{seed}],compare.report_dir={report}",
        timeout=900,
    )
    out = proc.stdout
    from qerl_pipeline.config import COMPARE_METHODS

    left_out = [m for m in COMPARE_METHODS if m != "mxfp4"]
    assert set(METHODS) <= set(left_out) | {"mxfp4"} and "fp8" in left_out
    for m in left_out:  # its train, evaluate and export nodes ran, and each said so (the export once for its three)
        assert out.count(f"compare.{m}: not in compare.methods, skipped") == 3, m
    assert _branches(out) == ["mxfp4"]
    assert re.findall(r"evaluate (\w+) seed (\d+) on ", out) == [("mxfp4", str(seed))]
    started = re.findall(r"shared engine started for (\S+)", out)
    assert started and all("base_mxfp4" in path for path in started), started  # mxfp4's base alone
    assert sorted(p.name for p in (root / "data/06_models/train_smoke/compare" / f"seed-{seed}").iterdir()) == [
        "mxfp4"
    ]
    exp = client.get_experiment_by_name("qerl_pipeline")
    seeded = client.search_runs([exp.experiment_id], filter_string=f"tags.seed = '{seed}'")
    assert [r.data.tags["method"] for r in seeded] == ["mxfp4"]
    parent = next(
        r
        for r in client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
        if r.data.tags.get("qerl.role") == "compare"
    )
    assert list(_child_runs(client, parent.info.run_id)) == [("mxfp4", seed)]
    # the report's runs
    assert list(json.loads((root / "data/08_reporting/smoke/compare/runs.json").read_text())) == ["mxfp4"]
    assert "mxfp4" in (report / "report.html").read_text()
    assert json.loads((report / "claims.json").read_text()) == []  # every claim names a method left out
    summary = json.loads((compared["report"] / "qlora" / "train_summary.json").read_text())
    assert summary["skipped"] == "compare.qlora: not in compare.methods, skipped" and summary["runs"] == []
