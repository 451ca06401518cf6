"""The comparison report on fixed MLflow runs in a temporary SQLite store; the notebook runs headless.

The store holds a compare group of 5 methods x 2 seeds whose curves and evaluations are
built so that every claim's verdict and numbers can be worked out by hand (see ``_curves``).
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from qerl_pipeline.evaluation import plots, report_claims, report_runs, report_tables, stats
from qerl_pipeline.evaluation.metrics import aggregate, metric_dict, wilson_interval
from qerl_pipeline.evaluation.report import REPORT_FILES, report_artifacts
from qerl_pipeline.tracking import GROUP_TAG, ROLE_TAG

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["qerl", "qerl_noaqn", "qlora", "lora", "lora_aqn"]
SEEDS = [0, 1]
EXPERIMENT = "report_test"
STEPS = range(1, 6)
#: AQN methods' stage and sigma per step: the first noisy stage (1) is steps 2 and 3
STAGE = {1: 0, 2: 1, 3: 1, 4: 2, 5: 2}
SIGMA = {0: 0.0, 1: 0.01, 2: 0.005}


def _curves(method, seed, step):
    """reward and entropy of (method, seed) at a step.

    reward = slope * step + seed term: its area per step span over steps 1..5 is 3 * slope + term.
    qerl (slope 0.1, term 0.02 seed) vs qerl_noaqn (0.05, 0.01 seed): per-seed differences 0.15, 0.16;
    qerl_noaqn vs lora (0.05, 0): 0.00, 0.01; lora_aqn equals lora: 0, 0.
    entropy = 1 outside the first AQN stage; inside it 1 + A + J * seed: differences to lora
    qerl 0.2, 0.22 (supported), qerl_noaqn -0.3, -0.28 (contradicted), qlora 0, 0.02 (cannot tell).
    """
    slope = {"qerl": 0.1}.get(method, 0.05)
    term = {"qerl": 0.02, "qerl_noaqn": 0.01}.get(method, 0.0) * seed
    a = {"qerl": 0.2, "qerl_noaqn": -0.3, "lora_aqn": 0.1}.get(method, 0.0)
    j = 0.02 if method in ("qerl", "qerl_noaqn", "qlora") else 0.0
    entropy = 1.0 + a + j * seed if STAGE[step] == 1 else 1.0
    return slope * step + term, entropy


def _log_records(client, rid, records):
    """``eval/records.json`` written by ``MlflowLogger.log_table`` itself (its list cells become text)."""
    from qerl_pipeline.tracking import MlflowLogger

    logger = MlflowLogger(run_id=rid)
    logger.client = client
    logger.log_table(records, "eval/records.json")


def _log_method_run(client, exp_id, method, i, seed=0, group="g1"):
    """A run as a compare branch leaves it: tagged (method, seed), per-step curves, eval/... metrics and records."""
    tags = {"method": method, "model": "tiny", "dataset": "generator", GROUP_TAG: group, "seed": str(seed)}
    run = client.create_run(exp_id, tags=tags, run_name=f"{method}-run-{seed}")
    rid = run.info.run_id
    client.log_param(rid, "method", method)
    client.log_param(rid, "train.seed", seed)
    aqn = method in ("qerl", "lora_aqn")
    for step in STEPS:
        reward, entropy = _curves(method, seed, step)
        client.log_metric(rid, report_runs.CURVES["reward"][1], reward, step=step)
        client.log_metric(rid, report_runs.CURVES["entropy"][1], entropy, step=step)
        client.log_metric(rid, "aqn/stage", STAGE[step] if aqn else 0, step=step)
        client.log_metric(rid, "aqn/sigma", SIGMA[STAGE[step]] if aqn else 0.0, step=step)
        client.log_metric(rid, report_runs.SYSTEM["rollout_tokens_per_s"][1], 100.0 * (i + 1) + step, step=step)
        client.log_metric(rid, report_runs.SYSTEM["step_time_s"][1], 2.0 + i, step=step)
        client.log_metric(rid, report_runs.SYSTEM["peak_memory_gib"][1], 1.0 + step * 0.1, step=step)
    client.log_metric(rid, report_runs.SYSTEM["weight_mib"][1], [10.0, 10.0, 12.0, 40.0, 40.0][i])
    # evaluation: 4 problems on two benchmarks, method i gets i+1 of 4 right on 'gsm8k'; qerl's seed 1 one more
    records = []
    for bench in ("gsm8k", "math500"):
        for p in range(4):
            ok = (p <= i or (method == "qerl" and seed == 1 and p == 1)) if bench == "gsm8k" else p == 0
            records.append(
                {"id": f"{bench}-{p}", "source": bench, "policy": "trained", "correct": [ok, ok], "greedy_correct": ok}
            )
            records.append(
                {
                    "id": f"{bench}-{p}",
                    "source": bench,
                    "policy": "base",
                    "correct": [False, p == 0],
                    "greedy_correct": False,
                }
            )
    for key, value in metric_dict(aggregate(records)).items():
        client.log_metric(rid, key, value)
    _log_records(client, rid, records)
    client.set_terminated(rid)
    return rid


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp_id = client.create_experiment(EXPERIMENT, artifact_location=str(tmp / "artifacts"))
    # an older run of qerl in another group, and the compare parent run: neither may be picked
    old = client.create_run(exp_id, tags={"method": "qerl", GROUP_TAG: "old"})
    client.log_metric(old.info.run_id, "eval/trained/gsm8k/pass1", 0.99)
    parent = client.create_run(exp_id, tags={ROLE_TAG: "compare", "method": "qerl"})
    ids = {(m, k): _log_method_run(client, exp_id, m, i, k) for i, m in enumerate(METHODS) for k in SEEDS}
    return {"uri": uri, "client": client, "ids": ids, "old": old.info.run_id, "parent": parent.info.run_id}


def test_load_runs_picks_group_and_newest(store):
    runs = report_runs.load_runs(EXPERIMENT, METHODS, client=store["client"], group="g1")
    # one run per method and seed
    assert [(r.method, r.seed) for r in runs] == [(m, k) for m in METHODS for k in SEEDS]
    assert [r.run_id for r in runs] == [store["ids"][m, k] for m in METHODS for k in SEEDS]
    assert runs[0].records and {"id", "source", "policy", "correct"} <= set(runs[0].records[0])
    # without group: newest per method, still never the compare parent run
    runs = report_runs.load_runs(EXPERIMENT, ["qerl"], client=store["client"])
    assert runs[0].run_id == store["ids"]["qerl", 1]
    assert runs[0].curve("reward")[:2] == [(1, pytest.approx(0.12)), (2, pytest.approx(0.22))]
    with pytest.raises(ValueError, match="no MLflow run for method.*lora.*group 'old'"):
        report_runs.load_runs(EXPERIMENT, ["qerl", "lora"], client=store["client"], group="old")
    assert [
        r.method
        for r in report_runs.load_runs(
            EXPERIMENT, ["qerl", "lora"], client=store["client"], group="old", require_all=False
        )
    ] == ["qerl"]


def test_tables(store):
    runs = report_runs.load_runs(EXPERIMENT, METHODS, client=store["client"], group="g1")
    table = report_tables.accuracy_table(runs)
    assert list(table.columns) == METHODS and list(table.index) == ["gsm8k", "math500"]
    # lora (i=3) gets all 4 gsm8k problems right: 1.000 with Wilson interval [z^2... , 1]
    lo, hi = wilson_interval(1.0, 4)
    assert table.at["gsm8k", "lora"] == f"1.000 [{lo:.3f}, {hi:.3f}]"
    assert table.at["gsm8k", "qerl"].startswith("0.375 [")  # seed 0: 1 of 4, seed 1: 2 of 4
    base = report_tables.accuracy_table(runs, policy="base")
    assert base.at["math500", "qlora"].startswith("0.125 [")  # 1 of 8 samples, 1/2 on one of 4 problems
    sys = report_tables.system_table(runs)
    assert sys.loc["qlora", "Rollout tokens/s"] == pytest.approx(303.0)  # mean of 301..305, both seeds
    assert sys.loc["qerl", "Peak memory (GiB)"] == pytest.approx(1.5)  # max over steps
    assert sys.loc["lora", "Base weight size (MiB)"] == pytest.approx(40.0)


def test_accuracy_over_seeds_and_problems(store):
    runs = report_runs.load_runs(EXPERIMENT, METHODS, client=store["client"], group="g1")
    summary = report_tables.accuracy_summary(runs).set_index(["method", "policy", "benchmark"])
    row = summary.loc[("qerl", "trained", "gsm8k")]
    expected = stats.crossed_interval([[1, 0, 0, 0], [1, 1, 0, 0]])  # seeds x problems, aligned by problem id
    assert (row["n_seeds"], row["n_problems"], row["interval_over"]) == (2, 4, "seeds+problems")
    assert (row["pass1"], row["pass1_ci_low"], row["pass1_ci_high"]) == pytest.approx(
        (expected.mean, expected.low, expected.high)
    )
    assert row["greedy"] == pytest.approx(0.375)
    # the base is one evaluation for every seed: its interval is over problems only
    base = summary.loc[("qlora", "base", "math500")]
    assert base["n_seeds"] == 1 and base["interval_over"] == "problems"


def test_curve_bands_over_seeds(store):
    runs = report_runs.load_runs(EXPERIMENT, METHODS, client=store["client"], group="g1")
    bands = report_tables.curve_bands(runs)
    qerl = bands[(bands["curve"] == "reward") & (bands["method"] == "qerl")].set_index("step")
    # step 1: rewards 0.10 and 0.12: mean 0.11, half t(1) * 0.01
    assert qerl.loc[1, "mean"] == pytest.approx(0.11) and qerl.loc[1, "n_seeds"] == 2
    assert qerl.loc[1, "ci_high"] - qerl.loc[1, "mean"] == pytest.approx(stats.t_quantile(1) * 0.01)
    lora = bands[(bands["curve"] == "entropy") & (bands["method"] == "lora")]
    assert (lora["ci_low"] == lora["mean"]).all()  # seeds that agree: a zero-width band


def test_claims_by_hand(store):
    runs = report_runs.load_runs(EXPERIMENT, METHODS, client=store["client"], group="g1")
    assert report_claims.first_aqn_stage_steps(runs) == [2, 3]
    found = {c.id: c for c in report_claims.claims(runs)}
    assert set(found) == {
        "a_qerl_entropy_gt_lora",
        "a_qerl_noaqn_entropy_gt_lora",
        "a_qlora_entropy_gt_lora",
        "b_qerl_ge_qerl_noaqn",
        "b_qerl_noaqn_ge_lora",
        "c_lora_aqn_ge_lora",
    }
    # (a) per-seed entropy differences over steps 2-3: 0.2, 0.22 / -0.3, -0.28 / 0, 0.02; half t(1) * 0.01 = 0.127
    assert found["a_qerl_entropy_gt_lora"].text == "supported: difference 0.210, 95% interval [0.083, 0.337], 2 seeds"
    assert (
        found["a_qerl_noaqn_entropy_gt_lora"].text
        == "contradicted: difference -0.290, 95% interval [-0.417, -0.163], 2 seeds"
    )
    assert (
        found["a_qlora_entropy_gt_lora"].text == "cannot tell: difference 0.010, 95% interval [-0.117, 0.137], 2 seeds"
    )
    # (b) areas 3 * slope + seed term: differences 0.15, 0.16 (half t(1) * 0.005 = 0.064) / 0.00, 0.01 / (c) 0, 0
    assert found["b_qerl_ge_qerl_noaqn"].text == "supported: difference 0.155, 95% interval [0.091, 0.219], 2 seeds"
    assert found["b_qerl_noaqn_ge_lora"].text == "cannot tell: difference 0.005, 95% interval [-0.059, 0.069], 2 seeds"
    assert found["c_lora_aqn_ge_lora"].text == "cannot tell: difference 0.000, 95% interval [0.000, 0.000], 2 seeds"
    # one seed: every claim says the data cannot tell
    one = {c.id: c for c in report_claims.claims([r for r in runs if r.seed == 0])}
    assert all(c.verdict == "cannot tell" and "1 seed (no interval" in c.text for c in one.values())
    # a method chosen but not run: the claim says which (without a choice, the claims of the methods that ran)
    no_aqn = {c.id: c for c in report_claims.claims([r for r in runs if r.method != "lora_aqn"], METHODS)}
    assert no_aqn["c_lora_aqn_ge_lora"].text == "cannot tell: no data for lora_aqn"
    # compare.methods without qlora and lora_aqn: their claims are not stated at all (nothing was meant to run),
    # the others' are the same; a chosen method without runs still reads "no data"
    chosen = {c.id: c for c in report_claims.claims(runs, ["qerl", "qerl_noaqn", "lora"])}
    assert set(chosen) == {
        "a_qerl_entropy_gt_lora",
        "a_qerl_noaqn_entropy_gt_lora",
        "b_qerl_ge_qerl_noaqn",
        "b_qerl_noaqn_ge_lora",
    }
    assert all(chosen[k].text == found[k].text for k in chosen)
    assert report_claims.claims([r for r in runs if r.method != "lora_aqn"], ["lora", "lora_aqn"])[0].text == (
        "cannot tell: no data for lora_aqn"
    )
    # seeds that would tell a "cannot tell" difference from 0 at its measured spread (stats.seeds_needed):
    # differences 0, 0.01 and 0, 0.02 both have s_d / |d| = sqrt(2): t(n-1)/sqrt(n) < 0.70711 first at n = 11
    # (t(9)/sqrt(10) = 0.71535, t(10)/sqrt(11) = 0.67181); differences 0, 0 have no difference to tell
    assert [
        (found[c].seeds_needed, found[c].seeds_note) for c in ("b_qerl_noaqn_ge_lora", "a_qlora_entropy_gt_lora")
    ] == [(11, "11 seeds"), (11, "11 seeds")]
    assert found["c_lora_aqn_ge_lora"].seeds_note == "none: the measured difference is 0"
    assert found["b_qerl_ge_qerl_noaqn"].seeds_note == ""  # supported: nothing to estimate
    assert {c.seeds_note for c in one.values()} == {"needs ≥2 seeds to estimate"}
    metrics, tags = report_claims.claim_metrics(found.values())
    assert metrics["claims/b_qerl_ge_qerl_noaqn/difference"] == pytest.approx(0.155)
    assert metrics["claims/b_qerl_ge_qerl_noaqn/n_seeds"] == 2
    assert (
        metrics["claims/b_qerl_noaqn_ge_lora/seeds_needed"] == 11
        and "claims/b_qerl_ge_qerl_noaqn/seeds_needed" not in metrics
    )
    assert tags["claims.a_qlora_entropy_gt_lora"].startswith("cannot tell")


@pytest.mark.filterwarnings("ignore:register_new_resolver")  # omegaconf 2.4 on Kedro's loader (settings.py)
def test_report_files_through_the_catalog(store, tmp_path):
    """The report node's files, saved by the catalog's compare_report_* entries: into the folder a
    ``--params`` value of ``compare.report_dir`` names, atomically, and into the compare run's ``report/``."""
    import mlflow
    from kedro.config import OmegaConfigLoader
    from kedro.io import DataCatalog

    from qerl_pipeline.pipelines.compare.pipeline import OUTPUTS

    runs = report_runs.load_runs(EXPERIMENT, METHODS, client=store["client"], group="g1")
    files = report_artifacts(runs)
    assert tuple(files) == REPORT_FILES
    out = tmp_path / "report"
    loader = OmegaConfigLoader(
        str(ROOT / "conf"),
        base_env="base",
        default_run_env="local",
        runtime_params={"compare": {"report_dir": str(out)}},
    )
    catalog = DataCatalog.from_config(loader["catalog"])
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(store["uri"])
    try:
        with mlflow.start_run(run_id=store["parent"]):  # the compare run: kedro-mlflow's active run
            for name, data in files.items():
                catalog.save(OUTPUTS[name], data)
    finally:
        mlflow.set_tracking_uri(before)
    paths = {name: out / name for name in REPORT_FILES}
    for stem in ("reward_curves", "entropy_curves", "accuracy", "system"):
        data = paths[f"{stem}.png"].read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    page = paths["report.html"].read_text()
    for m in METHODS:
        assert m in page and plots.method_label(m) in page
    imgs = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(imgs) == 4
    assert all(base64.b64decode(i)[:4] == b"\x89PNG" for i in imgs)
    assert "http" not in page.split("<body>")[1]  # nothing fetched from elsewhere
    assert not [p for p in out.iterdir() if p.name not in REPORT_FILES]  # atomic writes left no temp files
    csv = paths["accuracy.csv"].read_text().splitlines()
    # methods x seeds x policies x benchmarks
    assert csv[0].startswith("method,seed,policy,benchmark") and len(csv) == 1 + 5 * 2 * 2 * 2
    claims = json.loads(paths["claims.json"].read_text())
    assert len(claims) == 6 and all(c["text"] in page for c in claims)
    assert "supported: difference 0.210, 95% interval [0.083, 0.337], 2 seeds" in paths["claims.csv"].read_text()
    import pandas as pd

    table = pd.read_csv(paths["claims.csv"]).set_index("claim")
    assert (
        table.at["b_qerl_noaqn_ge_lora", "seeds_needed"] == 11
        and table.at["b_qerl_noaqn_ge_lora", "seeds_needed_note"] == "11 seeds"
    )
    assert pd.isna(table.at["b_qerl_ge_qerl_noaqn", "seeds_needed"])
    assert "<th>seeds to tell it from 0</th>" in page and "<td>11 seeds</td>" in page and "t(0.975, n-1)" in page
    assert next(c for c in claims if c["id"] == "b_qerl_noaqn_ge_lora")["seeds_needed"] == 11
    curves = paths["curves.csv"].read_text().splitlines()
    assert curves[0] == "curve,method,step,mean,ci_low,ci_high,n_seeds" and len(curves) == 1 + 2 * 5 * 5
    assert paths["accuracy_summary.csv"].read_text().startswith("method,policy,benchmark,n_seeds")
    # the method index as first column
    assert paths["system.csv"].read_text() == report_tables.system_table(runs).to_csv()
    names = {Path(f.path).name for f in store["client"].list_artifacts(store["parent"], "report")}
    assert set(REPORT_FILES) <= names


def test_notebook_executes_headless(store, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store["uri"])
    monkeypatch.setenv("QERL_EXPERIMENT", EXPERIMENT)
    monkeypatch.setenv("QERL_COMPARE_GROUP", "g1")
    nb = nbformat.read(ROOT / "notebooks" / "compare_runs.ipynb", as_version=4)
    nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}
    ).execute()
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
    (run,) = report_runs.load_runs("sep", ["qlora"], client=client)
    assert run.run_id == train and run.eval_run_id == evaluate
    assert run.curve("reward") == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2))]
    assert run.metrics["eval/trained/gsm8k/pass1"] == 0.25 and run.system("weight_mib") == 3.0
    assert report_tables.runs_table([run]).loc["qlora", "eval_run_id"] == evaluate
    again = report_runs.load_selected(report_runs.selection([run]), client=client)[0]
    assert again.metrics == run.metrics and again.eval_run_id == evaluate


def test_training_figure_draws_every_curve_from_the_history():
    history = [
        {
            "step": s,
            "reward/mean": 0.1 * s,
            "reward/accuracy": 0.05 * s,
            "reward/format": 0.02 * s,
            "policy/entropy": 1.0 - 0.1 * s,
            "completion/length": 90.0 - s,
            "aqn/sigma": 0.01 / s,
        }
        for s in range(1, 6)
    ]
    fig = plots.plot_training(history, "qerl")
    axes = fig.get_axes()
    assert [ax.get_title() for ax in axes] == [
        report_runs.CURVES[k][0] for k in ("reward", "accuracy", "format", "entropy", "length", "sigma")
    ]
    for ax in axes:
        (line,) = ax.get_lines()
        assert list(line.get_xdata()) == [1, 2, 3, 4, 5]
    assert list(axes[0].get_lines()[0].get_ydata()) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert plots.figure_png(fig)[:8] == b"\x89PNG\r\n\x1a\n"
    # a curve the history lacks says so instead of drawing nothing silently
    empty = plots.plot_training([{"step": 1, "reward/mean": 0.5}], "lora").get_axes()[1]
    assert not empty.get_lines() and "no runs log this metric" in empty.texts[0].get_text()


def test_the_report_gains_the_4bit_policy_where_exports_exist(sqlite_store):
    """An export's evaluation (``export.accuracy.log_cost``) in a training run: the report reads ``merged_nvfp4`` as
    one more policy, with its intervals over seeds and problems, and its cost paired with ``trained``."""
    from qerl_pipeline.evaluation.report import render_html
    from qerl_pipeline.export.accuracy import log_cost

    client = MlflowClient()
    exp_id = client.create_experiment("exported")
    for seed in SEEDS:
        # trained: gsm8k seed 0 1 of 4, seed 1 2 of 4
        rid = _log_method_run(client, exp_id, "qerl", 0, seed, group="gx")
        # seed 1 loses gsm8k-1
        quantized = [
            {
                "id": f"{b}-{p}",
                "source": b,
                "policy": "merged_nvfp4",
                "seed": seed,
                "correct": [p == 0, p == 0],
                "greedy_correct": p == 0,
            }
            for b in ("gsm8k", "math500")
            for p in range(4)
        ]
        log_cost(rid, quantized, seed)
        _log_method_run(client, exp_id, "lora", 3, seed, group="gx")  # not exported
    runs = report_runs.load_runs("exported", ["qerl", "lora"], client=client, group="gx")
    summary = report_tables.accuracy_summary(runs).set_index(["method", "policy", "benchmark"])
    row = summary.loc[("qerl", "merged_nvfp4", "gsm8k")]
    expected = stats.crossed_interval([[1, 0, 0, 0], [1, 0, 0, 0]])
    assert (row["pass1"], row["pass1_ci_low"], row["pass1_ci_high"]) == pytest.approx(
        (expected.mean, expected.low, expected.high)
    )
    assert row["interval_over"] == "seeds+problems" and ("lora", "merged_nvfp4", "gsm8k") not in summary.index
    cost = report_tables.paired_frame(runs, "merged_nvfp4").set_index(["method", "benchmark", "metric"])
    assert set(cost.index.get_level_values("method")) == {"qerl"}
    diff = stats.paired_difference([[1, 0, 0, 0], [1, 0, 0, 0]], [[1, 0, 0, 0], [1, 1, 0, 0]])
    got = cost.loc[("qerl", "gsm8k", "pass1")]
    assert (got["difference"], got["difference_ci_low"], got["difference_ci_high"]) == pytest.approx(
        (-0.125, diff.low, diff.high)
    )
    assert got["trained"] == pytest.approx(0.375) and got["merged_nvfp4"] == pytest.approx(0.25)
    assert cost.loc[("qerl", "math500", "pass1"), "difference"] == 0.0
    page = render_html(runs, {s: b"\x89PNG" for s in ("accuracy", "reward_curves", "entropy_curves", "system")})
    assert "Deployed in 4 bits" in page and "What deploying in 4 bits costs" in page
    plain = render_html(runs[2:], {s: b"\x89PNG" for s in ("accuracy", "reward_curves", "entropy_curves", "system")})
    assert [r.method for r in runs[2:]] == ["lora", "lora"] and "Deployed in 4 bits" not in plain
