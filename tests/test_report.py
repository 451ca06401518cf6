"""The comparison report on fixed MLflow runs in a temporary SQLite store; the notebook runs headless."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from qerl_pipeline.evaluation import metrics as M
from qerl_pipeline.evaluation import report as R

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["qerl", "qerl_noaqn", "qlora", "lora"]
EXPERIMENT = "report_test"


def _log_method_run(client, exp_id, method, i, group="g1"):
    """A run as train + evaluate leave it: tagged, per-step curves, eval/... metrics."""
    run = client.create_run(exp_id, tags={"method": method, "model": "tiny", "dataset": "generator", R.GROUP_TAG: group}, run_name=f"{method}-run")
    rid = run.info.run_id
    client.log_param(rid, "method", method)
    for step in range(5):
        client.log_metric(rid, R.CURVES["reward"][1][0], 0.1 * step + 0.05 * i, step=step)
        client.log_metric(rid, R.CURVES["entropy"][1][0], 1.0 - 0.1 * step + 0.01 * i, step=step)
        client.log_metric(rid, R.SYSTEM["rollout_tokens_per_s"][1][0], 100.0 * (i + 1) + step, step=step)
        client.log_metric(rid, R.SYSTEM["step_time_s"][1][0], 2.0 + i, step=step)
        client.log_metric(rid, R.SYSTEM["peak_memory_gib"][1][0], 1.0 + step * 0.1, step=step)
    client.log_metric(rid, R.SYSTEM["weight_mib"][1][0], [10.0, 10.0, 12.0, 40.0][i])
    # evaluation: 4 problems on two benchmarks, method i gets i+1 of 4 right on 'gsm8k'
    records = []
    for bench in ("gsm8k", "math500"):
        for p in range(4):
            ok = p <= i if bench == "gsm8k" else p == 0
            records.append({"id": f"{bench}-{p}", "source": bench, "policy": "trained", "correct": [ok, ok], "greedy_correct": ok})
            records.append({"id": f"{bench}-{p}", "source": bench, "policy": "base", "correct": [False, p == 0], "greedy_correct": False})
    for key, value in M.metric_dict(M.aggregate(records)).items():
        client.log_metric(rid, key, value)
    client.set_terminated(rid)
    return rid


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp_id = client.create_experiment(EXPERIMENT, artifact_location=str(tmp / "artifacts"))
    # an older run of qerl in another group, and the compare parent run: neither may be picked
    old = client.create_run(exp_id, tags={"method": "qerl", R.GROUP_TAG: "old"})
    client.log_metric(old.info.run_id, "eval/trained/gsm8k/pass1", 0.99)
    parent = client.create_run(exp_id, tags={R.ROLE_TAG: "compare", "method": "qerl"})
    ids = {m: _log_method_run(client, exp_id, m, i) for i, m in enumerate(METHODS)}
    return {"uri": uri, "client": client, "ids": ids, "old": old.info.run_id, "parent": parent.info.run_id}


def test_load_runs_picks_group_and_newest(store):
    runs = R.load_runs(EXPERIMENT, METHODS, client=store["client"], group="g1")
    assert [r.method for r in runs] == METHODS
    assert [r.run_id for r in runs] == [store["ids"][m] for m in METHODS]
    # without group: newest per method, still never the compare parent run
    runs = R.load_runs(EXPERIMENT, ["qerl"], client=store["client"])
    assert runs[0].run_id == store["ids"]["qerl"]
    assert runs[0].curve("reward")[:2] == [(0, pytest.approx(0.0)), (1, pytest.approx(0.1))]
    with pytest.raises(ValueError, match="no MLflow run for method.*lora.*group 'old'"):
        R.load_runs(EXPERIMENT, ["qerl", "lora"], client=store["client"], group="old")
    assert [r.method for r in R.load_runs(EXPERIMENT, ["qerl", "lora"], client=store["client"], group="old", require_all=False)] == ["qerl"]


def test_tables(store):
    runs = R.load_runs(EXPERIMENT, METHODS, client=store["client"], group="g1")
    table = R.accuracy_table(runs)
    assert list(table.columns) == METHODS and list(table.index) == ["gsm8k", "math500"]
    # lora (i=3) gets all 4 gsm8k problems right: 1.000 with Wilson interval [z^2... , 1]
    lo, hi = M.wilson_interval(1.0, 4)
    assert table.at["gsm8k", "lora"] == f"1.000 [{lo:.3f}, {hi:.3f}]"
    assert table.at["gsm8k", "qerl"].startswith("0.250 [")
    base = R.accuracy_table(runs, policy="base")
    assert base.at["math500", "qlora"].startswith("0.125 [")  # 1 of 8 samples, 1/2 on one of 4 problems
    sys = R.system_table(runs)
    assert sys.loc["qlora", "Rollout tokens/s"] == pytest.approx(302.0)  # mean of 300..304
    assert sys.loc["qerl", "Peak memory (GiB)"] == pytest.approx(1.4)  # max over steps
    assert sys.loc["lora", "Base weight size (MiB)"] == pytest.approx(40.0)


def test_build_report_writes_pngs_and_self_contained_html(store, tmp_path):
    runs = R.load_runs(EXPERIMENT, METHODS, client=store["client"], group="g1")
    paths = R.build_report(runs, tmp_path / "report")
    for stem in ("reward_curves", "entropy_curves", "accuracy", "system"):
        data = paths[stem].read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    page = paths["html"].read_text()
    for m in METHODS:
        assert m in page and R.METHOD_LABEL[m] in page
    imgs = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(imgs) == 4
    assert all(base64.b64decode(i)[:4] == b"\x89PNG" for i in imgs)
    assert "http" not in page.split("<body>")[1]  # nothing fetched from elsewhere
    assert not list((tmp_path / "report").glob(".*tmp"))  # atomic writes left no temp files
    csv = paths["accuracy_csv"].read_text().splitlines()
    assert csv[0].startswith("method,policy,benchmark") and len(csv) == 1 + 4 * 2 * 2


def test_log_report_to_mlflow(store, tmp_path):
    from qerl_pipeline.evaluation.report import log_report

    runs = R.load_runs(EXPERIMENT, METHODS, client=store["client"], group="g1")
    paths = R.build_report(runs, tmp_path / "r2")

    class ClientLogger:  # the MetricsLogger method the report needs, on an explicit run
        def log_artifact(self, path, artifact_path=None):
            store["client"].log_artifact(store["parent"], path, artifact_path)

    log_report(paths, ClientLogger())
    names = {Path(f.path).name for f in store["client"].list_artifacts(store["parent"], "report")}
    assert {"report.html", "accuracy.png", "reward_curves.png"} <= names


def test_notebook_executes_headless(store, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store["uri"])
    monkeypatch.setenv("QERL_EXPERIMENT", EXPERIMENT)
    monkeypatch.setenv("QERL_COMPARE_GROUP", "g1")
    nb = nbformat.read(ROOT / "notebooks" / "compare_runs.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    pngs = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(pngs) == 4  # accuracy, reward, entropy, system
    text = " ".join(str(o.get("data", {}).get("text/html", "")) + str(o.get("text", "")) for o in outputs)
    for m in METHODS:
        assert m in text
    assert "no run for" not in text


def test_separate_train_and_evaluate_runs_are_paired(tmp_path):
    """`kedro run --pipeline=train` then `--pipeline=evaluate`: two runs, one report row."""
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'm.db'}")
    exp = client.create_experiment("sep", artifact_location=str(tmp_path / "a"))
    old_eval = client.create_run(exp, tags={"method": "qlora"}).info.run_id
    client.log_metric(old_eval, "eval/trained/gsm8k/pass1", 0.9)
    train = client.create_run(exp, tags={"method": "qlora"}).info.run_id
    for step in (1, 2):
        client.log_metric(train, "reward/mean", 0.1 * step, step=step)
    evaluate = client.create_run(exp).info.run_id  # evaluate runs carry the method as a param
    client.log_param(evaluate, "method", "qlora")
    client.log_metric(evaluate, "eval/trained/gsm8k/pass1", 0.25)
    client.log_metric(evaluate, "base/weight_mib", 3.0)
    (run,) = R.load_runs("sep", ["qlora"], client=client)
    assert run.run_id == train and run.eval_run_id == evaluate
    assert run.curve("reward") == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2))]
    assert run.metrics["eval/trained/gsm8k/pass1"] == 0.25 and run.system("weight_mib") == 3.0
    assert R.runs_table([run]).loc["qlora", "eval_run_id"] == evaluate
    again = R.load_selected(R.selection([run]), client=client)[0]
    assert again.metrics == run.metrics and again.eval_run_id == evaluate


def test_training_figure_draws_every_curve_from_the_history():
    history = [
        {"step": s, "reward/mean": 0.1 * s, "reward/accuracy": 0.05 * s, "reward/format": 0.02 * s, "policy/entropy": 1.0 - 0.1 * s,
         "completion/length": 90.0 - s, "aqn/sigma": 0.01 / s}
        for s in range(1, 6)
    ]
    fig = R.plot_training(history, "qerl")
    axes = fig.get_axes()
    assert [ax.get_title() for ax in axes] == [R.CURVES[k][0] for k in ("reward", "accuracy", "format", "entropy", "length", "sigma")]
    for ax in axes:
        (line,) = ax.get_lines()
        assert list(line.get_xdata()) == [1, 2, 3, 4, 5]
    assert list(axes[0].get_lines()[0].get_ydata()) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert R.figure_png(fig)[:8] == b"\x89PNG\r\n\x1a\n"
    # a curve the history lacks says so instead of drawing nothing silently
    empty = R.plot_training([{"step": 1, "reward/mean": 0.5}], "lora").get_axes()[1]
    assert not empty.get_lines() and "no runs log this metric" in empty.texts[0].get_text()
