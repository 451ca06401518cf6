"""The compare report's tables: accuracy per run and over seeds, curve bands, system numbers, provenance.

Seeds and intervals (``evaluation/stats.py`` holds the statistics): accuracy is the mean over
seeds and problems with a 95% interval over both (``accuracy_summary``, from each run's
per-problem records; one seed: that evaluation's Wilson interval over problems), curves are the
mean over seeds per step with a 95% band (``curve_bands``), system numbers the mean over seeds.
"""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Sequence
from typing import Any

import pandas as pd

from qerl_pipeline.evaluation import stats
from qerl_pipeline.evaluation.report_runs import SYSTEM, RunData, by_method


def _fmt_ci(mean: float | None, low: float | None, high: float | None) -> str:
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "-"
    if low is None or high is None or math.isnan(low) or math.isnan(high):
        return f"{mean:.3f}"
    return f"{mean:.3f} [{low:.3f}, {high:.3f}]"


def accuracy_frame(runs: Sequence[RunData]) -> pd.DataFrame:
    """Long table: one row per (method, seed, policy, benchmark) with every evaluation number of that run."""
    rows = []
    for run in runs:
        for row in run.eval_rows():
            rows.append({"method": run.method, "seed": run.seed, **row})
    cols = [
        "method",
        "seed",
        "policy",
        "benchmark",
        "n_problems",
        "k",
        "pass1",
        "pass1_ci_low",
        "pass1_ci_high",
        "greedy",
        "greedy_ci_low",
        "greedy_ci_high",
    ]
    frame = pd.DataFrame(rows)
    for c in cols:
        if c not in frame:
            frame[c] = math.nan
    return frame[cols + [c for c in frame.columns if c not in cols]]


def problem_scores(records: list[dict] | None, policy: str, benchmark: str, metric: str) -> dict[str, float] | None:
    """``{problem id: score}`` of one evaluation's records (pass1: fraction of samples correct; greedy: 0/1)."""
    if not records:
        return None
    out = {}
    for r in records:
        if r.get("policy") != policy or r.get("source", r.get("benchmark")) != benchmark:
            continue
        if metric == "pass1":
            correct = r.get("correct") or []
            if not correct:
                continue
            out[str(r["id"])] = sum(bool(c) for c in correct) / len(correct)
        elif r.get("greedy_correct") is not None:
            out[str(r["id"])] = 1.0 if r["greedy_correct"] else 0.0
    return out or None


def _summary_interval(runs: Sequence[RunData], policy: str, benchmark: str, metric: str) -> stats.Interval:
    """Mean and 95% interval of ``metric`` over the runs (seeds) and problems (``stats`` module docstring)."""
    logged = []
    for run in runs:
        row = next((x for x in run.eval_rows() if x["policy"] == policy and x["benchmark"] == benchmark), None)
        if row is not None and row.get(metric) is not None and not math.isnan(row[metric]):
            logged.append((run, row))
    if not logged:
        return stats.Interval(math.nan, math.nan, math.nan, 0, "")
    if len(logged) == 1:  # one seed: that evaluation's Wilson interval over problems (metrics.py)
        _, row = logged[0]
        return stats.Interval(
            row[metric],
            row.get(f"{metric}_ci_low", math.nan),
            row.get(f"{metric}_ci_high", math.nan),
            int(row.get("n_problems", 0) or 0),
            "problems",
        )
    scores = [problem_scores(run.records, policy, benchmark, metric) for run, _ in logged]
    if all(scores):
        common = sorted(set.intersection(*(set(x) for x in scores)))
        if common:
            return stats.crossed_interval([[x[pid] for pid in common] for x in scores])
    return stats.seed_interval([row[metric] for _, row in logged])  # no per-problem records: over seeds only


def _seed_scores(records: list[dict[str, Any]], policy: str, bench: str, metric: str) -> dict[Any, dict[str, float]]:
    by_seed: dict[Any, list[dict[str, Any]]] = {}
    for r in records:
        by_seed.setdefault(r.get("seed"), []).append(r)
    out = {}
    for seed, mine in by_seed.items():
        scores = problem_scores(mine, policy, bench, metric)
        if scores:
            out[seed] = scores
    return out


def paired_rows(records: list[dict[str, Any]], policy: str, reference: str) -> list[dict[str, Any]]:
    """Per benchmark and metric (pass1, greedy): ``reference`` and ``policy`` with their 95% intervals over seeds
    and problems (``stats.crossed_interval``; one seed: Wilson over problems) and ``policy - reference`` paired by
    seed and problem (``stats.paired_difference``), from records of both policies carrying ``seed``. Only the
    seeds and problems both policies have count. The export's 4-bit cost (``merged_nvfp4`` against ``trained``)."""
    rows = []
    benches = list(dict.fromkeys(r.get("source") for r in records if r.get("policy") == policy))
    for bench in benches:
        for metric in ("pass1", "greedy"):
            ref, got = _seed_scores(records, reference, bench, metric), _seed_scores(records, policy, bench, metric)
            seeds = [s for s in ref if s in got]
            if not seeds:
                continue
            common = sorted(set.intersection(*(set(ref[s]) & set(got[s]) for s in seeds)))
            if not common:
                continue
            a = [[got[s][p] for p in common] for s in seeds]
            b = [[ref[s][p] for p in common] for s in seeds]
            row: dict[str, Any] = {
                "benchmark": bench,
                "metric": metric,
                "n_seeds": len(seeds),
                "n_problems": len(common),
            }
            for name, table in ((reference, b), (policy, a)):
                iv = stats.crossed_interval(table)
                row.update({name: iv.mean, f"{name}_ci_low": iv.low, f"{name}_ci_high": iv.high})
            diff = stats.paired_difference(a, b)
            row.update(
                difference=diff.mean, difference_ci_low=diff.low, difference_ci_high=diff.high, interval_over=diff.over
            )
            rows.append(row)
    return rows


def accuracy_summary(runs: Sequence[RunData]) -> pd.DataFrame:
    """One row per (method, policy, benchmark): pass@1 and greedy accuracy, mean over seeds and problems
    with the 95% interval over both (``stats.crossed_interval``; one seed: the Wilson interval over
    problems). ``base`` rows use one seed's evaluation: the base is the same for every seed."""
    frame = accuracy_frame(runs)
    out = []
    for method, mine in by_method(runs).items():
        sub = frame[frame["method"] == method]
        for policy in dict.fromkeys(sub["policy"]):
            for bench in dict.fromkeys(sub[sub["policy"] == policy]["benchmark"]):
                use = mine[:1] if policy == "base" else mine
                row = {"method": method, "policy": policy, "benchmark": bench, "n_seeds": len(use)}
                for metric in ("pass1", "greedy"):
                    iv = _summary_interval(use, policy, bench, metric)
                    row.update({metric: iv.mean, f"{metric}_ci_low": iv.low, f"{metric}_ci_high": iv.high})
                    if metric == "pass1":
                        row["interval_over"] = iv.over
                n = sub[(sub["policy"] == policy) & (sub["benchmark"] == bench)]["n_problems"]
                row["n_problems"] = int(n.max()) if n.notna().any() else 0
                out.append(row)
    cols = [
        "method",
        "policy",
        "benchmark",
        "n_seeds",
        "n_problems",
        "pass1",
        "pass1_ci_low",
        "pass1_ci_high",
        "greedy",
        "greedy_ci_low",
        "greedy_ci_high",
        "interval_over",
    ]
    return pd.DataFrame(out, columns=cols)


def accuracy_table(runs: Sequence[RunData], policy: str = "trained", metric: str = "pass1") -> pd.DataFrame:
    """Wide table for reading: benchmarks as rows, methods as columns,
    ``mean [95% CI]`` cells (over seeds and problems)."""
    frame = accuracy_summary(runs)
    frame = frame[frame["policy"] == policy]
    benchmarks = list(dict.fromkeys(frame["benchmark"]))
    table = {}
    for method in by_method(runs):
        col = {}
        sub = frame[frame["method"] == method]
        for bench in benchmarks:
            hit = sub[sub["benchmark"] == bench]
            if hit.empty:
                col[bench] = "-"
            else:
                r = hit.iloc[0]
                col[bench] = _fmt_ci(r.get(metric), r.get(f"{metric}_ci_low"), r.get(f"{metric}_ci_high"))
        table[method] = col
    return pd.DataFrame(table, index=pd.Index(benchmarks, name="benchmark"))


def system_table(runs: Sequence[RunData]) -> pd.DataFrame:
    """Methods as rows, the ``SYSTEM`` numbers (mean over the method's seeds) as columns (nan where runs lack one)."""
    groups = by_method(runs)
    data = {}
    for k in SYSTEM:
        col = []
        for mine in groups.values():
            vals = [v for v in (r.system(k) for r in mine) if not math.isnan(v)]
            col.append(sum(vals) / len(vals) if vals else math.nan)
        data[SYSTEM[k][0]] = col
    return pd.DataFrame(data, index=pd.Index(list(groups), name="method"))


def runs_table(runs: Sequence[RunData]) -> pd.DataFrame:
    """Which MLflow run stands for each method and seed, with its provenance tags."""
    rows = []
    for r in runs:
        start = (
            _dt.datetime.fromtimestamp(r.start_time / 1000, tz=_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            if r.start_time
            else ""
        )
        rows.append(
            {
                "method": r.method,
                "seed": "" if r.seed is None else r.seed,
                "run_id": r.run_id,
                "eval_run_id": r.eval_run_id or "",
                "run_name": r.run_name,
                "status": r.status,
                "started": start,
                "model": r.tags.get("model", r.params.get("model.name", ""))
                + (" (random init)" if r.params.get("model.source") == "random" else ""),
                "dataset": r.tags.get("dataset", r.params.get("data.train_source", "")),
                "git_commit": r.tags.get("git_commit", r.tags.get("mlflow.source.git.commit", ""))[:12],
            }
        )
    return pd.DataFrame(rows).set_index("method") if rows else pd.DataFrame()


def paired_frame(runs: Sequence[RunData], policy: str, reference: str = "trained") -> pd.DataFrame:
    """``paired_rows`` per method, over its runs' (seeds') records: e.g. an export's ``merged_nvfp4`` against
    ``trained``; empty when no run has records of ``policy``."""
    rows = []
    for method, mine in by_method(runs).items():
        records = [{**r, "seed": run.seed} for run in mine for r in (run.records or [])]
        rows += [{"method": method, **row} for row in paired_rows(records, policy, reference)]
    return pd.DataFrame(rows)


def curve_bands(runs: Sequence[RunData], keys: Sequence[str] = ("reward", "entropy")) -> pd.DataFrame:
    """Per (curve, method, step): mean over the method's seeds and the 95% t interval (``stats.step_bands``)."""
    rows = []
    for key in keys:
        for method, mine in by_method(runs).items():
            curves = {i: r.curve(key) for i, r in enumerate(mine) if r.curve(key)}
            for band in stats.step_bands(curves):
                rows.append({"curve": key, "method": method, **band})
    return pd.DataFrame(rows, columns=["curve", "method", "step", "mean", "ci_low", "ci_high", "n_seeds"])
