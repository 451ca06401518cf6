"""The compare report's figures, and one training run's curves (``plot_training``, drawn by the trainer).

Matplotlib ``Figure`` objects on the Agg canvas, built without pyplot: no display and no global
backend switch, so importing this module in a notebook leaves its inline backend alone. Every
curve is the mean over a method's seeds with the 95% interval over seeds as a band where there
are two or more (``stats.step_bands``); the bars carry the intervals of ``report_tables``.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from qerl_pipeline.config import METHOD_SPECS
from qerl_pipeline.evaluation import stats
from qerl_pipeline.evaluation.report_runs import CURVES, SYSTEM, RunData, by_method
from qerl_pipeline.evaluation.report_tables import accuracy_summary, system_table


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def method_label(method: str) -> str:
    """The method's name as the figures and the report page show it."""
    spec = METHOD_SPECS.get(method)
    return spec.label if spec else method


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
        bands = stats.step_bands({j: r.curve(key) for j, r in enumerate(mine) if r.curve(key)})
        if bands:
            steps = [b["step"] for b in bands]
            n = max(b["n_seeds"] for b in bands)
            label = method_label(method) + (f" (mean of {n} seeds)" if n > 1 else "")
            ax.plot(
                steps,
                [b["mean"] for b in bands],
                color=f"C{i}",
                marker="o" if len(bands) < 30 else None,
                ms=3,
                label=label,
            )
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
                lo_b = (
                    float(sub.at[b, f"{metric}_ci_low"])
                    if b in sub.index and pd.notna(sub.at[b, f"{metric}_ci_low"])
                    else v
                )
                hi_b = (
                    float(sub.at[b, f"{metric}_ci_high"])
                    if b in sub.index and pd.notna(sub.at[b, f"{metric}_ci_high"])
                    else v
                )
                vals.append(0.0 if math.isnan(v) else v)
                lo.append(0.0 if math.isnan(v) else max(0.0, v - lo_b))
                hi.append(0.0 if math.isnan(v) else max(0.0, hi_b - v))
            xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(benchmarks))]
            ax.bar(xs, vals, width, yerr=[lo, hi], capsize=3, label=method_label(method))
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
            ax.text(
                i,
                0 if math.isnan(v) else v,
                "n/a" if math.isnan(v) else f"{v:.3g}",
                ha="center",
                va="bottom",
                fontsize=8,
            )
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
    fig.suptitle(f"Training: {method_label(method)}")
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


def figure_png(fig) -> bytes:
    """A figure as PNG bytes (for files, the HTML page, and ``IPython.display.Image``)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()
