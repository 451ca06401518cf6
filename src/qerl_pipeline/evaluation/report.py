"""The comparison report: QeRL vs QLoRA vs BF16 LoRA side by side, as the artefacts a user reads.

``report_artifacts(runs)`` turns the runs of a compare (``report_runs``: one ``RunData`` per
method and seed, read from MLflow) into every file of the report, by file name: the figures
(``plots``), the tables (``report_tables``), the claims (``report_claims``) and one
self-contained HTML page with the figures inlined as base64 and the tables as HTML. Nothing is
written here: the compare pipelines return these objects and the Kedro catalog
(``conf/base/catalog_compare.yml``) writes each file, atomically, into the report folder and
logs it to the compare run under ``report/``. ``notebooks/compare_runs.ipynb`` draws the same
figures and tables from the same functions.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import math
from collections.abc import Sequence
from typing import Any

import pandas as pd

from qerl_pipeline.evaluation import stats
from qerl_pipeline.evaluation.plots import figure_png, figures, method_label
from qerl_pipeline.evaluation.report_claims import claims, claims_frame
from qerl_pipeline.evaluation.report_runs import DEPLOYED_4BIT, RunData, by_method
from qerl_pipeline.evaluation.report_tables import (
    accuracy_frame,
    accuracy_summary,
    accuracy_table,
    curve_bands,
    paired_frame,
    runs_table,
    system_table,
)

#: Every file of the report (the keys of ``report_artifacts``), named as in the report folder and in MLflow.
REPORT_FILES = (
    "reward_curves.png",
    "entropy_curves.png",
    "accuracy.png",
    "system.png",
    "accuracy.csv",
    "accuracy_summary.csv",
    "curves.csv",
    "system.csv",
    "claims.csv",
    "claims.json",
    "report.html",
)

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1200px;color:#222}
h1{font-size:1.6em} h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.9em;margin:.6em 0}
th,td{border:1px solid #ccc;padding:.3em .6em;text-align:right}
th{background:#f4f4f4} td:first-child,th:first-child{text-align:left} img{max-width:100%}
.note{color:#666;font-size:.85em}
"""


def render_html(
    runs: Sequence[RunData],
    pngs: dict[str, bytes],
    title: str = "QeRL comparison",
    found: Sequence[stats.Claim] | None = None,
) -> str:
    """One self-contained page: provenance, the claims, accuracy tables, system table, inlined figures."""

    def img(stem: str) -> str:
        data = base64.b64encode(pngs[stem]).decode("ascii")
        return f'<img alt="{html.escape(stem)}" src="data:image/png;base64,{data}">'

    def tbl(frame: pd.DataFrame) -> str:
        return (
            frame.to_html(escape=True, na_rep="n/a", float_format=lambda v: f"{v:.4g}")
            if not frame.empty
            else "<p>none</p>"
        )

    groups = by_method(runs)
    seeds = sorted({len(m) for m in groups.values()})
    found = claims(runs) if found is None else found
    claim_rows = "".join(
        f"<tr><td>{html.escape(c.id)}</td><td>{html.escape(c.statement)}</td><td>{html.escape(c.statistic)}</td>"
        f"<td>{html.escape(c.text)}</td><td>{html.escape(c.seeds_note)}</td></tr>"
        for c in found
    )
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p class='note'>Methods: {html.escape(', '.join(method_label(m) for m in groups))}; seeds per method: "
        f"{html.escape(', '.join(map(str, seeds)))}. "
        f"Generated {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} from MLflow runs.</p>",
        "<h2>The paper's claims, measured</h2>",
        "<table><tr><th>claim</th><th>statement</th><th>statistic (per seed)</th><th>measured: verdict, A - B</th>"
        "<th>seeds to tell it from 0</th></tr>"
        f"{claim_rows}</table>",
        "<p class='note'>Each claim compares the two methods seed by seed (the same seed trains both on the same "
        "prompts); the interval is the 95% Student-t interval of the per-seed differences. 'cannot tell' when it "
        "contains 0 or there is one seed (see qerl_pipeline/evaluation/stats.py). Seeds to tell it from 0: for a "
        "'cannot tell' claim, the smallest n with t(0.975, n-1) &middot; s_d / &radic;n &lt; |d|, d and s_d the mean "
        "and standard deviation of the measured per-seed differences, assuming the differences are independent and "
        "normal across seeds and d and s_d are the true ones: a plug-in estimate (at that n an interval clears 0 "
        "about half the time), not a power calculation. One seed has no spread to estimate it from.</p>",
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
    deployed = accuracy_table(runs, DEPLOYED_4BIT, "pass1")
    if not deployed.empty:  # methods exported with their evaluation (export/accuracy.py)
        parts += [
            "<h2>Deployed in 4 bits: the exported merged policy quantized again to NVFP4 (merged_nvfp4), pass@1</h2>",
            tbl(deployed),
            "<h3>What deploying in 4 bits costs: merged_nvfp4 minus the trained policy, paired by seed and "
            "problem</h3>",
            tbl(paired_frame(runs, DEPLOYED_4BIT)),
            "<p class='note'>Exported methods only ('-' where a method was not exported). The difference is paired: "
            "the same seed's policy on the same problem, as trained (base + adapter) and merged then quantized to "
            "NVFP4; its interval is the crossed two-way estimate over seeds and problems (one seed: Student's t over "
            "the problems), see stats.paired_difference.</p>",
        ]
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


def report_artifacts(
    runs: Sequence[RunData], title: str = "QeRL comparison", found: Sequence[stats.Claim] | None = None
) -> dict[str, Any]:
    """Every file of the report by name (``REPORT_FILES``): the figures as matplotlib ``Figure``s, the
    accuracy (per run and over seeds), curve-band, system and claims tables as ``DataFrame``s, the
    claims as a JSON-able list (NaN as null) and ``report.html`` as text. ``found``: the claims to state
    (None: the claims about the methods of ``runs``, ``claims(runs)``)."""
    if not runs:
        raise ValueError("no runs to report on")
    found = claims(runs) if found is None else found
    figs = figures(runs)
    page = render_html(runs, {stem: figure_png(fig) for stem, fig in figs.items()}, title, found)
    out = {f"{stem}.png": fig for stem, fig in figs.items()}
    out.update(
        {
            "accuracy.csv": accuracy_frame(runs),
            "accuracy_summary.csv": accuracy_summary(runs),
            "curves.csv": curve_bands(runs),
            "system.csv": system_table(runs).reset_index(),  # the method column first, as the index was
            "claims.csv": claims_frame(found),
            "claims.json": _no_nan([c.as_dict() for c in found]),
            "report.html": page,
        }
    )
    return out


def _no_nan(x):
    """NaN as null (strict JSON), recursively."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_no_nan(v) for v in x]
    return x
