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

Runs are selected per method: the newest run (optionally restricted to a compare group
tag, see ``GROUP_TAG``) whose method is the one asked for. A missing method is reported,
never silently dropped.

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
METHOD_ORDER = ("qerl", "qerl_noaqn", "qlora", "lora")
METHOD_LABEL = {"qerl": "QeRL (NVFP4+LoRA+AQN)", "qerl_noaqn": "NVFP4+LoRA (no AQN)", "qlora": "QLoRA (NF4)", "lora": "BF16 LoRA"}


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
    method; ``run_ids``: exactly those runs. Neither: runs of separate ``kedro run``s, where
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
        for run in runs:
            method = _method_of(run)
            if method in methods and method not in chosen and (_has_eval(run) or not require_eval):
                chosen[method] = run_data(client, run)
    else:  # separate `kedro run`s: pair the newest training run with the newest evaluation run
        for method in methods:
            mine = [r for r in runs if _method_of(r) == method]
            trained = next((r for r in mine if _has_curves(r)), None)
            evaluated = next((r for r in mine if _has_eval(r)), None)
            if (trained or evaluated) is None or (require_eval and evaluated is None):
                continue
            data = run_data(client, trained or evaluated)
            if trained is not None and evaluated is not None and evaluated.info.run_id != trained.info.run_id:
                _merge_eval(data, evaluated)
            chosen[method] = data
    missing = [m for m in methods if m not in chosen]
    if missing and require_all:
        seen = sorted({_method_of(r) or "?" for r in runs})
        raise ValueError(
            f"no MLflow run for method(s) {', '.join(missing)} in experiment {experiment!r}"
            + (f" group {group!r}" if group else "")
            + f"; runs found for: {', '.join(seen) or 'none'}"
        )
    return [chosen[m] for m in methods if m in chosen]


def _merge_eval(data: RunData, evaluated) -> RunData:
    """Take the ``eval/`` and ``base/`` metrics of a separate evaluation run into ``data``."""
    data.metrics.update({k: v for k, v in evaluated.data.metrics.items() if k.startswith(("eval/", "base/"))})
    data.eval_run_id = evaluated.info.run_id
    return data


def load_selected(selection: dict[str, dict[str, str | None]], *, client: MlflowClient | None = None, tracking_uri: str | None = None) -> list[RunData]:
    """Rows for ``{method: {"run_id": ..., "eval_run_id": ... or None}}`` (what compare records), in that order."""
    client = client or MlflowClient(tracking_uri=tracking_uri)
    out = []
    for method, ids in selection.items():
        data = run_data(client, client.get_run(ids["run_id"]))
        data.method = method
        if ids.get("eval_run_id"):
            _merge_eval(data, client.get_run(ids["eval_run_id"]))
        out.append(data)
    return out


def selection(runs: Sequence[RunData]) -> dict[str, dict[str, str | None]]:
    """The inverse of ``load_selected``: which runs stand for which method."""
    return {r.method: {"run_id": r.run_id, "eval_run_id": r.eval_run_id} for r in runs}


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
    """Long table: one row per (method, policy, benchmark) with every evaluation number."""
    rows = []
    for run in runs:
        for row in run.eval_rows():
            rows.append({"method": run.method, **row})
    cols = ["method", "policy", "benchmark", "n_problems", "k", "pass1", "pass1_ci_low", "pass1_ci_high", "greedy", "greedy_ci_low", "greedy_ci_high"]
    frame = pd.DataFrame(rows)
    for c in cols:
        if c not in frame:
            frame[c] = math.nan
    return frame[cols + [c for c in frame.columns if c not in cols]]


def accuracy_table(runs: Sequence[RunData], policy: str = "trained", metric: str = "pass1") -> pd.DataFrame:
    """Wide table for reading: benchmarks as rows, methods as columns, ``mean [95% CI]`` cells."""
    frame = accuracy_frame(runs)
    frame = frame[frame["policy"] == policy]
    benchmarks = list(dict.fromkeys(frame["benchmark"]))
    table = {}
    for run in runs:
        col = {}
        sub = frame[frame["method"] == run.method]
        for bench in benchmarks:
            hit = sub[sub["benchmark"] == bench]
            if hit.empty:
                col[bench] = "-"
            else:
                r = hit.iloc[0]
                col[bench] = _fmt_ci(r.get(metric), r.get(f"{metric}_ci_low"), r.get(f"{metric}_ci_high"))
        table[run.method] = col
    return pd.DataFrame(table, index=pd.Index(benchmarks, name="benchmark"))


def system_table(runs: Sequence[RunData]) -> pd.DataFrame:
    """Methods as rows, the ``SYSTEM`` numbers as columns (nan where a run lacks one)."""
    data = {SYSTEM[k][0]: [run.system(k) for run in runs] for k in SYSTEM}
    return pd.DataFrame(data, index=pd.Index([r.method for r in runs], name="method"))


def runs_table(runs: Sequence[RunData]) -> pd.DataFrame:
    """Which MLflow run stands for each method, with its provenance tags."""
    rows = []
    for r in runs:
        start = _dt.datetime.fromtimestamp(r.start_time / 1000, tz=_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC") if r.start_time else ""
        rows.append(
            {
                "method": r.method,
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


# ------------------------------------------------------------------------------- plots
def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def _label(method: str) -> str:
    return METHOD_LABEL.get(method, method)


def plot_curves(runs: Sequence[RunData], key: str, ax=None):
    """One line per method of a ``CURVES`` (or per-step ``SYSTEM``) metric against the step."""
    title = CURVES[key][0] if key in CURVES else SYSTEM[key][0]
    fig = None
    if ax is None:
        fig = _figure(6.4, 3.8)
        ax = fig.add_subplot()
    drawn = 0
    for run in runs:
        pts = run.curve(key)
        if pts:
            steps, values = zip(*pts, strict=True)
            ax.plot(steps, values, marker="o" if len(pts) < 30 else None, ms=3, label=_label(run.method))
            drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, "no runs log this metric", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)
    return fig or ax.figure


def plot_accuracy(runs: Sequence[RunData], policy: str = "trained"):
    """Grouped bars per benchmark, one bar per method, 95% CI as error bars; pass@1 and greedy."""
    frame = accuracy_frame(runs)
    frame = frame[frame["policy"] == policy]
    benchmarks = list(dict.fromkeys(frame["benchmark"]))
    metrics = [m for m in ("pass1", "greedy") if frame[m].notna().any()] or ["pass1"]
    fig = _figure(6.4 * len(metrics), 3.8)
    axes = fig.subplots(1, len(metrics), squeeze=False)
    width = 0.8 / max(1, len(runs))
    for ax, metric in zip(axes[0], metrics, strict=True):
        for i, run in enumerate(runs):
            sub = frame[frame["method"] == run.method].set_index("benchmark")
            vals, lo, hi = [], [], []
            for b in benchmarks:
                v = float(sub.at[b, metric]) if b in sub.index and pd.notna(sub.at[b, metric]) else math.nan
                lo_b = float(sub.at[b, f"{metric}_ci_low"]) if b in sub.index and pd.notna(sub.at[b, f"{metric}_ci_low"]) else v
                hi_b = float(sub.at[b, f"{metric}_ci_high"]) if b in sub.index and pd.notna(sub.at[b, f"{metric}_ci_high"]) else v
                vals.append(0.0 if math.isnan(v) else v)
                lo.append(0.0 if math.isnan(v) else max(0.0, v - lo_b))
                hi.append(0.0 if math.isnan(v) else max(0.0, hi_b - v))
            xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(benchmarks))]
            ax.bar(xs, vals, width, yerr=[lo, hi], capsize=3, label=_label(run.method))
        ax.set_xticks(range(len(benchmarks)), benchmarks)
        ax.set_ylim(0, 1)
        ax.set_title(f"{'pass@1 (mean over k samples)' if metric == 'pass1' else 'greedy accuracy'}, 95% CI")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_system(runs: Sequence[RunData]):
    """Bars per method: rollout tokens/s, step time, peak memory, base weight size."""
    fig = _figure(3.6 * len(SYSTEM), 3.6)
    axes = fig.subplots(1, len(SYSTEM), squeeze=False)
    names = [r.method for r in runs]
    colors = [f"C{i}" for i in range(len(runs))]
    for ax, key in zip(axes[0], SYSTEM, strict=True):
        vals = [r.system(key) for r in runs]
        ax.bar(range(len(runs)), [0.0 if math.isnan(v) else v for v in vals], color=colors)
        for i, v in enumerate(vals):
            ax.text(i, 0 if math.isnan(v) else v, "n/a" if math.isnan(v) else f"{v:.3g}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(runs)), names, rotation=30, ha="right")
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


def render_html(runs: Sequence[RunData], pngs: dict[str, bytes], title: str = "QeRL comparison") -> str:
    """One self-contained page: provenance, accuracy tables, system table, inlined figures."""

    def img(stem: str) -> str:
        data = base64.b64encode(pngs[stem]).decode("ascii")
        return f'<img alt="{html.escape(stem)}" src="data:image/png;base64,{data}">'

    def tbl(frame: pd.DataFrame) -> str:
        return frame.to_html(escape=True, na_rep="n/a", float_format=lambda v: f"{v:.4g}") if not frame.empty else "<p>none</p>"

    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p class='note'>Methods: {html.escape(', '.join(_label(r.method) for r in runs))}. "
        f"Generated {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} from MLflow runs.</p>",
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
        "<p class='note'>Cells: mean [95% Wilson interval over problems]; see "
        "qerl_pipeline/evaluation/metrics.py for the definitions.</p>",
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
    """Write every figure as PNG, the accuracy/system tables as CSV and ``report.html``.

    Returns the written paths by name. Each file is replaced atomically.
    """
    if not runs:
        raise ValueError("no runs to report on")
    out_dir = Path(out_dir)
    pngs = {stem: figure_png(fig) for stem, fig in figures(runs).items()}
    paths: dict[str, Path] = {}
    for stem, data in pngs.items():
        paths[stem] = out_dir / f"{stem}.png"
        write_atomic(paths[stem], data)
    paths["accuracy_csv"] = out_dir / "accuracy.csv"
    write_atomic(paths["accuracy_csv"], accuracy_frame(runs).to_csv(index=False).encode())
    paths["system_csv"] = out_dir / "system.csv"
    write_atomic(paths["system_csv"], system_table(runs).to_csv().encode())
    paths["html"] = out_dir / "report.html"
    write_atomic(paths["html"], render_html(runs, pngs, title).encode("utf-8"))
    return paths


def log_report(paths: dict[str, Path] | Iterable[Path], logger, artifact_path: str = "report") -> None:
    """Log the report files to MLflow through a ``tracking.MetricsLogger``."""
    for p in paths.values() if isinstance(paths, dict) else paths:
        logger.log_artifact(str(p), artifact_path)


def report_for(selection: dict[str, dict[str, str | None]], compare_cfg, compare_run_id: str) -> tuple[dict, pd.DataFrame, dict]:
    """Build the report of ``selection`` (``{method: {"run_id", "eval_run_id"}}``) into
    ``compare_cfg.report_dir``, log it to the compare run; return ``(selection, long accuracy
    table, summary)`` (summary: run ids, written files, the system numbers per method)."""
    from qerl_pipeline.tracking import MlflowLogger

    client = MlflowClient()
    runs = load_selected(selection, client=client)
    methods = [r.method for r in runs]
    paths = build_report(runs, compare_cfg.report_dir, title=f"QeRL comparison: {', '.join(methods)}")
    log_report(paths, MlflowLogger(run_id=compare_run_id))
    system = system_table(runs).reset_index().to_dict(orient="records")
    summary = {"compare_run_id": compare_run_id, "runs": selection, "files": {k: str(p) for k, p in paths.items()},
               "system": system}
    return selection, accuracy_frame(runs), summary
