"""The comparison report: QeRL vs QLoRA vs BF16 LoRA side by side, from MLflow runs.

Inputs are MLflow runs only (read with ``MlflowClient``), so the same report can be
rebuilt at any time from the tracking store: by the compare pipeline right after it
trained and evaluated the methods, by the ``compare_report`` pipeline, or by
``notebooks/compare_runs.ipynb``, which imports the functions below and draws the same
figures.

What a run must carry
---------------------
- the method: tag ``method`` (the train pipeline sets it), else the param ``method``
  (kedro-mlflow logs every parameter);
- training curves, per step: one of the names listed for each entry of ``CURVES``
  (the first name present wins, so a renamed metric needs one edit here);
- system numbers: the entries of ``SYSTEM``, each reduced over its steps (mean
  tokens/s, mean step time, max peak memory, last weight bytes);
- evaluation metrics as written by ``metrics.metric_dict``:
  ``eval/<policy>/<benchmark>/<name>`` with policy ``trained`` or ``base``.

Runs are selected per method and seed: in a compare group (``GROUP_TAG``) the newest run of
each (method, seed), where the seed is the run's tag ``seed`` (compare sets it), else its
param ``train.seed``; outside a group the newest run per method. A missing method is
reported, never silently dropped.

Seeds and intervals (``evaluation/stats.py`` holds the statistics): with several seeds per
method the curves are drawn as the mean over seeds with a 95% band (``curve_bands``, also
``curves.csv``), accuracy is the mean over seeds and problems with a 95% interval over both
(``accuracy_summary``, from each run's per-problem ``eval/records.json``; ``accuracy_summary.csv``),
and the paper's claims are stated with the measured seed-paired difference and its interval
(``claims``; ``claims.csv``, ``claims.json``, the report page, and the compare run's
``claims/<id>/...`` metrics and ``claims.<id>`` tags):

* (a) the policy entropy of each quantized method (qerl, qerl_noaqn, qlora) is above BF16
  LoRA's in the first AQN stage (``first_aqn_stage_steps``: the steps of the first stage with
  sigma > 0, read from the runs' ``aqn/stage`` and ``aqn/sigma`` curves);
* (b) reward growth, the area under the reward curve (``stats.curve_auc``), is ordered
  qerl >= qerl_noaqn >= lora;
* (c) the same for AQN without quantization: lora_aqn >= lora.

Where the interval contains 0, or there is one seed, the claim reads "cannot tell" with the
numbers (``stats.verdict``).

Output: PNG figures (matplotlib ``Figure`` objects on the Agg canvas, built without pyplot:
no display, no global backend switch, so importing this module in a notebook leaves its
inline backend alone) and one self-contained
HTML page with the figures inlined as base64 and the tables as HTML, each file written
atomically (temp file + ``os.replace``) so a reader never sees half a report.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from mlflow.tracking import MlflowClient

from qerl_pipeline.atomic import write_atomic  # the one home (re-exported: report.write_atomic)
from qerl_pipeline.evaluation import stats as S

#: GROUP_TAG groups the runs of one compare invocation (value: the compare run's id); runs with
#: ROLE_TAG = compare (the compare pipeline's own run) are never method rows. Homes: tracking.py.
from qerl_pipeline.tracking import GROUP_TAG, ROLE_TAG  # noqa: E402

#: Per-step training curves: key -> (title, candidate metric names, first present wins).
CURVES: dict[str, tuple[str, tuple[str, ...]]] = {
    "reward": ("Reward (mean over rollouts)", ("reward/mean", "train/reward_mean", "reward_mean", "reward")),
    "entropy": ("Policy entropy (nats/token)", ("policy/entropy", "entropy", "train/entropy")),
    "accuracy": ("Training accuracy", ("reward/accuracy", "accuracy", "train/accuracy")),
    "sigma": ("AQN sigma", ("aqn/sigma", "sigma", "train/sigma")),
    "format": ("Format reward", ("reward/format",)),
    "length": ("Completion length (tokens)", ("completion/length",)),
    "stage": ("AQN stage", ("aqn/stage",)),
}

#: System numbers: key -> (title, candidate metric names, reduction over steps).
SYSTEM: dict[str, tuple[str, tuple[str, ...], str]] = {
    "rollout_tokens_per_s": ("Rollout tokens/s", ("rollout/tokens_per_s", "rollout_tokens_per_s", "tokens_per_s"), "mean"),
    "step_time_s": ("Step time (s)", ("time/step_s", "step_time_s", "time/step"), "mean"),
    "peak_memory_gib": ("Peak memory (GiB)", ("memory/peak_gb", "memory/peak_gib", "peak_memory_gib"), "max"),
    "weight_mib": ("Base weight size (MiB)", ("base/weight_mib", "weight_mib"), "last"),
    "linear_bytes_ratio": ("Linear weight bytes / BF16", ("quantize/linear_bytes_ratio",), "last"),
}

EVAL_METRIC = re.compile(r"^eval/(?P<policy>[^/]+)/(?P<benchmark>[^/]+)/(?P<name>[^/]+)$")
METHOD_ORDER = ("qerl", "qerl_noaqn", "qlora", "lora", "lora_aqn")
METHOD_LABEL = {"qerl": "QeRL (NVFP4+LoRA+AQN)", "qerl_noaqn": "NVFP4+LoRA (no AQN)", "qlora": "QLoRA (NF4)", "lora": "BF16 LoRA",
                "lora_aqn": "BF16 LoRA+AQN (ablation)"}


@dataclass
class RunData:
    """What the report needs of one method's run."""

    method: str
    run_id: str
    run_name: str = ""
    status: str = ""
    start_time: int = 0
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # latest value of every metric
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # curve/system metrics per step
    eval_run_id: str | None = None  # a separate evaluate run whose eval/ and base/ metrics were merged in
    seed: int | None = None  # tag ``seed`` (compare's), else param ``train.seed``
    records: list[dict[str, Any]] | None = None  # per-problem evaluation records (``eval/records.json``), if logged

    def curve(self, key: str) -> list[tuple[int, float]]:
        """Steps and values of a curve (``CURVES`` or ``SYSTEM`` key); empty if the run lacks it."""
        names = CURVES[key][1] if key in CURVES else SYSTEM[key][1]
        for name in names:
            if self.history.get(name):
                return sorted(self.history[name])
        return []

    def system(self, key: str) -> float:
        """A ``SYSTEM`` number reduced over its steps; nan if the run lacks it."""
        _, names, how = SYSTEM[key]
        values = [v for _, v in self.curve(key)]
        if not values:
            values = [self.metrics[n] for n in names if n in self.metrics][:1]
        if not values:
            return math.nan
        if how == "mean":
            return sum(values) / len(values)
        if how == "max":
            return max(values)
        return values[-1]

    def eval_rows(self) -> list[dict[str, Any]]:
        """Evaluation metrics as rows {policy, benchmark, <name>: value}."""
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        for key, value in self.metrics.items():
            m = EVAL_METRIC.match(key)
            if m:
                row = rows.setdefault((m["policy"], m["benchmark"]), {"policy": m["policy"], "benchmark": m["benchmark"]})
                row[m["name"]] = value
        return list(rows.values())


# ----------------------------------------------------------------------------- loading
def _method_of(run) -> str | None:
    return run.data.tags.get("method") or run.data.params.get("method")


def _seed_of(run) -> int | None:
    for value in (run.data.tags.get("seed"), run.data.params.get("train.seed")):
        try:
            return int(value)
        except (TypeError, ValueError):
            continue
    return None


RECORDS_ARTIFACT = "eval/records.json"
RESULT_ARTIFACT = "eval/result.json"  # evaluator.RESULT_ARTIFACT: the whole result, records with their lists intact


def _cell(value: Any) -> Any:
    """A ``log_table`` cell: lists were written as their Python repr (``tracking._jsonable``); read them back."""
    if isinstance(value, str) and value.startswith("[") and value.endswith("]"):
        import ast

        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return value
    return value


def eval_records(client: MlflowClient, run_id: str) -> list[dict[str, Any]] | None:
    """The per-problem evaluation records logged into a run, or None.

    ``eval/result.json`` (compare branches: ``evaluator.log_evaluation`` with a key) when present,
    else the ``eval/records.json`` table (``tracking.MlflowLogger.log_table``: list cells as text,
    parsed back by ``_cell``).
    """
    import tempfile

    for artifact in (RESULT_ARTIFACT, RECORDS_ARTIFACT):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                path = client.download_artifacts(run_id, artifact, tmp)
                data = json.loads(Path(path).read_text())
            except Exception:  # noqa: BLE001 - not logged (e.g. an older or a metrics-only run): the next one
                continue
        if isinstance(data, dict) and isinstance(data.get("records"), list):
            return data["records"]
        if isinstance(data, dict) and "columns" in data:
            return [{c: _cell(v) for c, v in zip(data["columns"], row, strict=True)} for row in data["data"]]
        if isinstance(data, list):
            return data
    return None


def _history_names() -> list[str]:
    names = [n for _, cands in CURVES.values() for n in cands]
    names += [n for _, cands, _ in SYSTEM.values() for n in cands]
    return names


def run_data(client: MlflowClient, run) -> RunData:
    """Fetch what the report needs of one MLflow run (histories only of the known curves)."""
    history = {}
    for name in _history_names():
        if name in run.data.metrics:
            history[name] = [(int(m.step), float(m.value)) for m in client.get_metric_history(run.info.run_id, name)]
    return RunData(
        seed=_seed_of(run),
        records=eval_records(client, run.info.run_id) if _has_eval(run) else None,
        method=_method_of(run) or "?",
        run_id=run.info.run_id,
        run_name=run.info.run_name or "",
        status=run.info.status,
        start_time=int(run.info.start_time or 0),
        tags=dict(run.data.tags),
        params=dict(run.data.params),
        metrics=dict(run.data.metrics),
        history=history,
    )


def load_runs(
    experiment: str,
    methods: Sequence[str] = METHOD_ORDER,
    *,
    tracking_uri: str | None = None,
    group: str | None = None,
    run_ids: Sequence[str] | None = None,
    require_all: bool = True,
    require_eval: bool = False,
    finished_only: bool = False,
    client: MlflowClient | None = None,
) -> list[RunData]:
    """One row per method from the runs of ``experiment`` (by name), in ``methods`` order.

    ``group``: the newest run tagged ``GROUP_TAG = group`` (one compare invocation) per
    method and seed (rows in ``methods`` order, seeds ascending); ``run_ids``: exactly those runs. Neither: runs of separate ``kedro run``s, where
    training and evaluation are different MLflow runs: the newest run with training curves
    is paired with the newest run with ``eval/trained/...`` metrics (one run when it has
    both, as compare's runs do); the evaluation run's ``eval/`` and ``base/`` metrics are
    merged in and its id kept in ``RunData.eval_run_id``.

    Runs tagged ``ROLE_TAG = compare`` (the compare pipeline's own run) are never method
    rows. ``require_eval`` skips methods without evaluation metrics, ``finished_only`` runs
    whose status is not FINISHED. With ``require_all`` a method without a run raises an
    error naming it and what the experiment holds.
    """
    client = client or MlflowClient(tracking_uri=tracking_uri)
    if run_ids:
        runs = [client.get_run(r) for r in run_ids]
    else:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            raise ValueError(f"MLflow experiment {experiment!r} not found at {client.tracking_uri}")
        filt = f"tags.`{GROUP_TAG}` = '{group}'" if group else ""
        runs = client.search_runs([exp.experiment_id], filter_string=filt, order_by=["attributes.start_time DESC"], max_results=5000)
    runs = [r for r in runs if r.data.tags.get(ROLE_TAG) != "compare"]
    if finished_only:
        runs = [r for r in runs if r.info.status == "FINISHED"]
    chosen: dict[str, RunData] = {}
    if group or run_ids:
        per_seed: dict[str, dict] = {}
        for run in runs:
            method, seed = _method_of(run), _seed_of(run)
            mine = per_seed.setdefault(method, {})
            if method in methods and seed not in mine and (_has_eval(run) or not require_eval):
                mine[seed] = run_data(client, run)
        for method, by_seed in per_seed.items():
            if by_seed:
                chosen[method] = [by_seed[k] for k in sorted(by_seed, key=lambda x: (x is None, x or 0))]
    else:  # separate `kedro run`s: pair the newest training run with the newest evaluation run
        for method in methods:
            mine = [r for r in runs if _method_of(r) == method]
            trained = next((r for r in mine if _has_curves(r)), None)
            evaluated = next((r for r in mine if _has_eval(r)), None)
            if (trained or evaluated) is None or (require_eval and evaluated is None):
                continue
            data = run_data(client, trained or evaluated)
            if trained is not None and evaluated is not None and evaluated.info.run_id != trained.info.run_id:
                _merge_eval(data, evaluated, client)
            chosen[method] = data
    missing = [m for m in methods if m not in chosen]
    if missing and require_all:
        seen = sorted({_method_of(r) or "?" for r in runs})
        raise ValueError(
            f"no MLflow run for method(s) {', '.join(missing)} in experiment {experiment!r}"
            + (f" group {group!r}" if group else "")
            + f"; runs found for: {', '.join(seen) or 'none'}"
        )
    return [r for m in methods if m in chosen for r in (chosen[m] if isinstance(chosen[m], list) else [chosen[m]])]


def _merge_eval(data: RunData, evaluated, client: MlflowClient | None = None) -> RunData:
    """Take the ``eval/`` and ``base/`` metrics (and, with ``client``, the records) of a separate evaluation run into ``data``."""
    data.metrics.update({k: v for k, v in evaluated.data.metrics.items() if k.startswith(("eval/", "base/"))})
    data.eval_run_id = evaluated.info.run_id
    if client is not None:
        data.records = eval_records(client, evaluated.info.run_id)
    return data


def load_selected(selection: dict[str, Any], *, client: MlflowClient | None = None, tracking_uri: str | None = None) -> list[RunData]:
    """Rows for ``{method: [{"run_id", "eval_run_id" or None, "seed"}, ...]}`` (what compare records; one
    dict instead of the list: one run), in that order."""
    client = client or MlflowClient(tracking_uri=tracking_uri)
    out = []
    for method, entries in selection.items():
        for ids in [entries] if isinstance(entries, dict) else entries:
            data = run_data(client, client.get_run(ids["run_id"]))
            data.method = method
            if ids.get("seed") is not None:
                data.seed = int(ids["seed"])
            if ids.get("eval_run_id"):
                _merge_eval(data, client.get_run(ids["eval_run_id"]), client)
            out.append(data)
    return out


def selection(runs: Sequence[RunData]) -> dict[str, list[dict[str, Any]]]:
    """The inverse of ``load_selected``: which runs (one per seed) stand for which method."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        out.setdefault(r.method, []).append({"run_id": r.run_id, "eval_run_id": r.eval_run_id, "seed": r.seed})
    return out


def by_method(runs: Sequence[RunData]) -> dict[str, list[RunData]]:
    """The runs of each method (one per seed), methods in first-seen order."""
    out: dict[str, list[RunData]] = {}
    for r in runs:
        out.setdefault(r.method, []).append(r)
    return out


def _has_eval(run) -> bool:
    return any(k.startswith("eval/trained/") for k in run.data.metrics)


def _has_curves(run) -> bool:
    return any(n in run.data.metrics for n in CURVES["reward"][1])


# ------------------------------------------------------------------------------ tables
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
    cols = ["method", "seed", "policy", "benchmark", "n_problems", "k", "pass1", "pass1_ci_low", "pass1_ci_high", "greedy",
            "greedy_ci_low", "greedy_ci_high"]
    frame = pd.DataFrame(rows)
    for c in cols:
        if c not in frame:
            frame[c] = math.nan
    return frame[cols + [c for c in frame.columns if c not in cols]]


def _problem_scores(run: RunData, policy: str, benchmark: str, metric: str) -> dict[str, float] | None:
    """``{problem id: score}`` of one run's records (pass1: fraction of samples correct; greedy: 0/1)."""
    if not run.records:
        return None
    out = {}
    for r in run.records:
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


def _summary_interval(runs: Sequence[RunData], policy: str, benchmark: str, metric: str) -> S.Interval:
    """Mean and 95% interval of ``metric`` over the runs (seeds) and problems (``stats`` module docstring)."""
    logged = []
    for run in runs:
        row = next((x for x in run.eval_rows() if x["policy"] == policy and x["benchmark"] == benchmark), None)
        if row is not None and row.get(metric) is not None and not math.isnan(row[metric]):
            logged.append((run, row))
    if not logged:
        return S.Interval(math.nan, math.nan, math.nan, 0, "")
    if len(logged) == 1:  # one seed: that evaluation's Wilson interval over problems (metrics.py)
        _, row = logged[0]
        return S.Interval(row[metric], row.get(f"{metric}_ci_low", math.nan), row.get(f"{metric}_ci_high", math.nan),
                          int(row.get("n_problems", 0) or 0), "problems")
    scores = [_problem_scores(run, policy, benchmark, metric) for run, _ in logged]
    if all(scores):
        common = sorted(set.intersection(*(set(x) for x in scores)))
        if common:
            return S.crossed_interval([[x[pid] for pid in common] for x in scores])
    return S.seed_interval([row[metric] for _, row in logged])  # no per-problem records: over seeds only


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
    cols = ["method", "policy", "benchmark", "n_seeds", "n_problems", "pass1", "pass1_ci_low", "pass1_ci_high", "greedy",
            "greedy_ci_low", "greedy_ci_high", "interval_over"]
    return pd.DataFrame(out, columns=cols)


def accuracy_table(runs: Sequence[RunData], policy: str = "trained", metric: str = "pass1") -> pd.DataFrame:
    """Wide table for reading: benchmarks as rows, methods as columns, ``mean [95% CI]`` cells (over seeds and problems)."""
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
        start = _dt.datetime.fromtimestamp(r.start_time / 1000, tz=_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC") if r.start_time else ""
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


def curve_bands(runs: Sequence[RunData], keys: Sequence[str] = ("reward", "entropy")) -> pd.DataFrame:
    """Per (curve, method, step): mean over the method's seeds and the 95% t interval (``stats.step_bands``)."""
    rows = []
    for key in keys:
        for method, mine in by_method(runs).items():
            curves = {i: r.curve(key) for i, r in enumerate(mine) if r.curve(key)}
            for band in S.step_bands(curves):
                rows.append({"curve": key, "method": method, **band})
    return pd.DataFrame(rows, columns=["curve", "method", "step", "mean", "ci_low", "ci_high", "n_seeds"])


# ------------------------------------------------------------------------------ claims
#: Claim (a): the quantized methods whose entropy the paper finds above BF16 LoRA's early in training.
QUANTIZED = ("qerl", "qerl_noaqn", "qlora")
#: Claims (b) and (c): (id, higher, lower) of "reward growth of higher >= lower".
REWARD_ORDER = (("b_qerl_ge_qerl_noaqn", "qerl", "qerl_noaqn"), ("b_qerl_noaqn_ge_lora", "qerl_noaqn", "lora"),
                ("c_lora_aqn_ge_lora", "lora_aqn", "lora"))


def first_aqn_stage_steps(runs: Sequence[RunData]) -> list[int]:
    """The logged steps of the first AQN stage with sigma > 0.

    Read from the runs that logged ``aqn/sigma > 0`` (qerl, lora_aqn) with their ``aqn/stage``:
    the steps whose stage is the smallest stage seen with sigma > 0 (the same for every run of
    one compare: one config). No such run: computed from a run's ``train.steps`` and
    ``aqn.num_stages`` params with ``rl.aqn.stage_of`` (stage 1 is the first noisy stage).
    """
    steps: set[int] = set()
    for run in runs:
        sigma, stage = dict(run.curve("sigma")), dict(run.curve("stage"))
        noisy = {s: int(stage[s]) for s, v in sigma.items() if v > 0 and s in stage}
        if noisy:
            first = min(noisy.values())
            steps |= {s for s, k in noisy.items() if k == first}
    if steps:
        return sorted(steps)
    for run in runs:
        try:
            total, stages = int(run.params["train.steps"]), int(run.params["aqn.num_stages"])
        except (KeyError, ValueError):
            continue
        from qerl_pipeline.rl.aqn import stage_of

        return [s + 1 for s in range(total) if stage_of(s, total, stages) == 1]  # logged steps are 1-based
    return []


def _per_seed(runs: Sequence[RunData], fn) -> dict[int, float]:
    """``{seed: fn(run)}`` of one method's runs (runs without a seed count as seed 0)."""
    return {(r.seed if r.seed is not None else 0): fn(r) for r in runs}


def claims(runs: Sequence[RunData]) -> list[S.Claim]:
    """The paper's claims (a), (b), (c) measured on ``runs`` (see the module docstring); every claim is
    returned, one whose methods are missing reads "cannot tell: no data for ..."."""
    groups = by_method(runs)
    window = first_aqn_stage_steps(runs)
    out = []
    lora = groups.get("lora", [])
    for m in QUANTIZED:
        stat = (f"mean policy entropy over steps {window[0]}-{window[-1]} (first AQN stage)" if window
                else "mean policy entropy in the first AQN stage (no step found)")
        out.append(S.claim(
            f"a_{m}_entropy_gt_lora", f"policy entropy of {m} above lora in the first AQN stage", m, "lora", stat,
            _per_seed(groups.get(m, []), lambda r: S.window_mean(r.curve("entropy"), window)),
            _per_seed(lora, lambda r: S.window_mean(r.curve("entropy"), window)),
        ))
    for cid, hi, lo in REWARD_ORDER:
        a_runs = {(r.seed if r.seed is not None else 0): r for r in groups.get(hi, [])}
        b_runs = {(r.seed if r.seed is not None else 0): r for r in groups.get(lo, [])}
        a_auc, b_auc = {}, {}
        for seed in a_runs:
            if seed in b_runs:  # the same steps for both: the area over their common steps
                common = sorted({s for s, _ in a_runs[seed].curve("reward")} & {s for s, _ in b_runs[seed].curve("reward")})
                a_auc[seed] = S.curve_auc(a_runs[seed].curve("reward"), common)
                b_auc[seed] = S.curve_auc(b_runs[seed].curve("reward"), common)
            else:
                a_auc[seed] = S.curve_auc(a_runs[seed].curve("reward"))
        for seed in b_runs:
            b_auc.setdefault(seed, S.curve_auc(b_runs[seed].curve("reward")))
        out.append(S.claim(cid, f"reward growth of {hi} >= {lo}", hi, lo,
                           "area under the reward curve / step span (mean reward over training)", a_auc, b_auc))
    return out


def claims_frame(found: Sequence[S.Claim]) -> pd.DataFrame:
    """One row per claim: id, statement, verdict, difference with its interval, seeds, the sentence."""
    rows = [{"claim": c.id, "statement": c.statement, "verdict": c.verdict, "difference": c.difference.mean,
             "ci_low": c.difference.low, "ci_high": c.difference.high, "n_seeds": c.difference.n,
             "seeds": " ".join(map(str, c.seeds)), "statistic": c.statistic, "text": c.text} for c in found]
    return pd.DataFrame(rows, columns=["claim", "statement", "verdict", "difference", "ci_low", "ci_high", "n_seeds", "seeds",
                                       "statistic", "text"])


def claim_metrics(found: Sequence[S.Claim]) -> tuple[dict[str, float], dict[str, str]]:
    """``(metrics, tags)`` of the claims for the compare run: ``claims/<id>/{difference,ci_low,ci_high,n_seeds}``
    (NaN left out) and ``claims.<id>`` = the sentence."""
    metrics, tags = {}, {}
    for c in found:
        for name, value in (("difference", c.difference.mean), ("ci_low", c.difference.low), ("ci_high", c.difference.high),
                            ("n_seeds", float(c.difference.n))):
            if not math.isnan(value):
                metrics[f"claims/{c.id}/{name}"] = float(value)
        tags[f"claims.{c.id}"] = c.text
    return metrics, tags


# ------------------------------------------------------------------------------- plots
def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def _label(method: str) -> str:
    return METHOD_LABEL.get(method, method)


def plot_curves(runs: Sequence[RunData], key: str, ax=None):
    """One line per method of a ``CURVES`` (or per-step ``SYSTEM``) metric against the step: the mean
    over the method's seeds, with the 95% interval over seeds as a band where there are two or more."""
    title = CURVES[key][0] if key in CURVES else SYSTEM[key][0]
    fig = None
    if ax is None:
        fig = _figure(6.4, 3.8)
        ax = fig.add_subplot()
    drawn, banded = 0, False
    for i, (method, mine) in enumerate(by_method(runs).items()):
        bands = S.step_bands({j: r.curve(key) for j, r in enumerate(mine) if r.curve(key)})
        if bands:
            steps = [b["step"] for b in bands]
            n = max(b["n_seeds"] for b in bands)
            label = _label(method) + (f" (mean of {n} seeds)" if n > 1 else "")
            ax.plot(steps, [b["mean"] for b in bands], color=f"C{i}", marker="o" if len(bands) < 30 else None, ms=3, label=label)
            lo, hi = [b["ci_low"] for b in bands], [b["ci_high"] for b in bands]
            if any(not math.isnan(x) for x in lo):
                ax.fill_between(steps, lo, hi, color=f"C{i}", alpha=0.2, linewidth=0)
                banded = True
            drawn += 1
    if banded:
        title += ", 95% interval over seeds"
    if not drawn:
        ax.text(0.5, 0.5, "no runs log this metric", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)
    return fig or ax.figure


def plot_accuracy(runs: Sequence[RunData], policy: str = "trained"):
    """Grouped bars per benchmark, one bar per method (mean over seeds and problems), 95% interval
    over seeds and problems as error bars (``accuracy_summary``); pass@1 and greedy."""
    frame = accuracy_summary(runs)
    frame = frame[frame["policy"] == policy]
    benchmarks = list(dict.fromkeys(frame["benchmark"]))
    metrics = [m for m in ("pass1", "greedy") if frame[m].notna().any()] or ["pass1"]
    methods = list(by_method(runs))
    fig = _figure(6.4 * len(metrics), 3.8)
    axes = fig.subplots(1, len(metrics), squeeze=False)
    width = 0.8 / max(1, len(methods))
    for ax, metric in zip(axes[0], metrics, strict=True):
        for i, method in enumerate(methods):
            sub = frame[frame["method"] == method].set_index("benchmark")
            vals, lo, hi = [], [], []
            for b in benchmarks:
                v = float(sub.at[b, metric]) if b in sub.index and pd.notna(sub.at[b, metric]) else math.nan
                lo_b = float(sub.at[b, f"{metric}_ci_low"]) if b in sub.index and pd.notna(sub.at[b, f"{metric}_ci_low"]) else v
                hi_b = float(sub.at[b, f"{metric}_ci_high"]) if b in sub.index and pd.notna(sub.at[b, f"{metric}_ci_high"]) else v
                vals.append(0.0 if math.isnan(v) else v)
                lo.append(0.0 if math.isnan(v) else max(0.0, v - lo_b))
                hi.append(0.0 if math.isnan(v) else max(0.0, hi_b - v))
            xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(benchmarks))]
            ax.bar(xs, vals, width, yerr=[lo, hi], capsize=3, label=_label(method))
        ax.set_xticks(range(len(benchmarks)), benchmarks)
        ax.set_ylim(0, 1)
        ax.set_title(f"{'pass@1 (mean over k samples)' if metric == 'pass1' else 'greedy accuracy'}, 95% CI")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_system(runs: Sequence[RunData]):
    """Bars per method (mean over its seeds): rollout tokens/s, step time, peak memory, base weight size."""
    fig = _figure(3.6 * len(SYSTEM), 3.6)
    axes = fig.subplots(1, len(SYSTEM), squeeze=False)
    table = system_table(runs)
    names = list(table.index)
    colors = [f"C{i}" for i in range(len(names))]
    for ax, key in zip(axes[0], SYSTEM, strict=True):
        vals = [float(v) for v in table[SYSTEM[key][0]]]
        ax.bar(range(len(names)), [0.0 if math.isnan(v) else v for v in vals], color=colors)
        for i, v in enumerate(vals):
            ax.text(i, 0 if math.isnan(v) else v, "n/a" if math.isnan(v) else f"{v:.3g}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_title(SYSTEM[key][0], fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_training(history: Sequence[dict[str, float]], method: str):
    """One run's training curves (reward, accuracy, format, entropy, length, sigma) from the trainer's history."""
    run = RunData(method=method, run_id="")
    for row in history:
        for name, value in row.items():
            if name != "step" and isinstance(value, (int, float)):
                run.history.setdefault(name, []).append((int(row["step"]), float(value)))
    keys = ("reward", "accuracy", "format", "entropy", "length", "sigma")
    fig = _figure(13.0, 6.4)
    for ax, key in zip(fig.subplots(2, 3).flat, keys, strict=True):
        plot_curves([run], key, ax=ax)
    fig.suptitle(f"Training: {_label(method)}")
    fig.tight_layout()
    return fig


def figures(runs: Sequence[RunData]) -> dict[str, Any]:
    """Every figure of the report by file stem (the notebook draws the same ones)."""
    return {
        "reward_curves": plot_curves(runs, "reward"),
        "entropy_curves": plot_curves(runs, "entropy"),
        "accuracy": plot_accuracy(runs),
        "system": plot_system(runs),
    }


# ------------------------------------------------------------------------------ output
def figure_png(fig) -> bytes:
    """A figure as PNG bytes (for files, the HTML page, and ``IPython.display.Image``)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1200px;color:#222}
h1{font-size:1.6em} h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.9em;margin:.6em 0} th,td{border:1px solid #ccc;padding:.3em .6em;text-align:right}
th{background:#f4f4f4} td:first-child,th:first-child{text-align:left} img{max-width:100%} .note{color:#666;font-size:.85em}
"""


def render_html(runs: Sequence[RunData], pngs: dict[str, bytes], title: str = "QeRL comparison",
                found: Sequence[S.Claim] | None = None) -> str:
    """One self-contained page: provenance, the claims, accuracy tables, system table, inlined figures."""

    def img(stem: str) -> str:
        data = base64.b64encode(pngs[stem]).decode("ascii")
        return f'<img alt="{html.escape(stem)}" src="data:image/png;base64,{data}">'

    def tbl(frame: pd.DataFrame) -> str:
        return frame.to_html(escape=True, na_rep="n/a", float_format=lambda v: f"{v:.4g}") if not frame.empty else "<p>none</p>"

    groups = by_method(runs)
    seeds = sorted({len(m) for m in groups.values()})
    found = claims(runs) if found is None else found
    claim_rows = "".join(
        f"<tr><td>{html.escape(c.id)}</td><td>{html.escape(c.statement)}</td><td>{html.escape(c.statistic)}</td>"
        f"<td>{html.escape(c.text)}</td></tr>" for c in found)
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p class='note'>Methods: {html.escape(', '.join(_label(m) for m in groups))}; seeds per method: "
        f"{html.escape(', '.join(map(str, seeds)))}. "
        f"Generated {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} from MLflow runs.</p>",
        "<h2>The paper's claims, measured</h2>",
        "<table><tr><th>claim</th><th>statement</th><th>statistic (per seed)</th><th>measured: verdict, A - B</th></tr>"
        f"{claim_rows}</table>",
        "<p class='note'>Each claim compares the two methods seed by seed (the same seed trains both on the same "
        "prompts); the interval is the 95% Student-t interval of the per-seed differences. 'cannot tell' when it "
        "contains 0 or there is one seed (see qerl_pipeline/evaluation/stats.py).</p>",
        "<h2>Runs</h2>",
        tbl(runs_table(runs)),
        "<h2>Accuracy per benchmark (trained policy): pass@1 averaged over k samples</h2>",
        tbl(accuracy_table(runs, "trained", "pass1")),
        "<h2>Greedy accuracy (trained policy)</h2>",
        tbl(accuracy_table(runs, "trained", "greedy")),
    ]
    base = accuracy_table(runs, "base", "pass1")
    if not base.empty:
        parts += ["<h2>Reference: each method's base without adapter, pass@1</h2>", tbl(base)]
    parts += [
        "<p class='note'>Cells: mean over seeds and problems [95% interval over seeds and problems (crossed two-way "
        "estimate); one seed: the Wilson interval over problems]; see qerl_pipeline/evaluation/stats.py and "
        "metrics.py for the definitions. The base rows are one evaluation (the base is the same for every seed).</p>",
        "<h2>Accuracy over seeds and problems (every method, policy and benchmark)</h2>",
        tbl(accuracy_summary(runs)),
        "<h2>Accuracy</h2>",
        img("accuracy"),
        "<h2>Training reward</h2>",
        img("reward_curves"),
        "<h2>Policy entropy</h2>",
        img("entropy_curves"),
        "<h2>Speed and memory</h2>",
        tbl(system_table(runs)),
        img("system"),
        "</body></html>",
    ]
    return "\n".join(parts)


def build_report(runs: Sequence[RunData], out_dir: str | Path, title: str = "QeRL comparison") -> dict[str, Path]:
    """Write every figure as PNG, the accuracy (per run and over seeds), curve-band, system and claims
    tables as CSV, the claims as JSON and ``report.html``.

    Returns the written paths by name. Each file is replaced atomically.
    """
    if not runs:
        raise ValueError("no runs to report on")
    out_dir = Path(out_dir)
    found = claims(runs)
    pngs = {stem: figure_png(fig) for stem, fig in figures(runs).items()}
    paths: dict[str, Path] = {}
    for stem, data in pngs.items():
        paths[stem] = out_dir / f"{stem}.png"
        write_atomic(paths[stem], data)
    paths["accuracy_csv"] = out_dir / "accuracy.csv"
    write_atomic(paths["accuracy_csv"], accuracy_frame(runs).to_csv(index=False).encode())
    paths["accuracy_summary_csv"] = out_dir / "accuracy_summary.csv"
    write_atomic(paths["accuracy_summary_csv"], accuracy_summary(runs).to_csv(index=False).encode())
    paths["curves_csv"] = out_dir / "curves.csv"
    write_atomic(paths["curves_csv"], curve_bands(runs).to_csv(index=False).encode())
    paths["system_csv"] = out_dir / "system.csv"
    write_atomic(paths["system_csv"], system_table(runs).to_csv().encode())
    paths["claims_csv"] = out_dir / "claims.csv"
    write_atomic(paths["claims_csv"], claims_frame(found).to_csv(index=False).encode())
    paths["claims_json"] = out_dir / "claims.json"
    write_atomic(paths["claims_json"], json.dumps(_no_nan([c.as_dict() for c in found]), indent=1).encode())
    paths["html"] = out_dir / "report.html"
    write_atomic(paths["html"], render_html(runs, pngs, title, found).encode("utf-8"))
    return paths


def _no_nan(x):
    """NaN as null (strict JSON), recursively."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_no_nan(v) for v in x]
    return x


def log_report(paths: dict[str, Path] | Iterable[Path], logger, artifact_path: str = "report") -> None:
    """Log the report files to MLflow through a ``tracking.MetricsLogger``."""
    for p in paths.values() if isinstance(paths, dict) else paths:
        logger.log_artifact(str(p), artifact_path)


def report_for(selection: dict[str, Any], compare_cfg, compare_run_id: str) -> tuple[dict, pd.DataFrame, dict]:
    """Build the report of ``selection`` (``{method: [{"run_id", "eval_run_id", "seed"}, ...]}``) into
    ``compare_cfg.report_dir``, log it and the claims (metrics ``claims/<id>/...``, tags
    ``claims.<id>``) to the compare run; return ``(selection, long accuracy table, summary)``
    (summary: run ids, written files, the system numbers per method, the claims' sentences)."""
    from qerl_pipeline.tracking import MlflowLogger

    client = MlflowClient()
    runs = load_selected(selection, client=client)
    methods = list(by_method(runs))
    paths = build_report(runs, compare_cfg.report_dir, title=f"QeRL comparison: {', '.join(methods)}")
    logger = MlflowLogger(run_id=compare_run_id)
    log_report(paths, logger)
    found = claims(runs)
    metrics, tags = claim_metrics(found)
    logger.log_metrics(metrics, step=0)
    logger.set_tags(tags)
    system = system_table(runs).reset_index().to_dict(orient="records")
    summary = {"compare_run_id": compare_run_id, "runs": selection, "files": {k: str(p) for k, p in paths.items()},
               "system": system, "claims": {c.id: c.text for c in found}}
    return selection, accuracy_frame(runs), summary
