"""The benchmark report: the table as files, and every figure as an MLflow metric.

Files (``write_report_files``), under ``benchmark.report_dir``, each written with
``atomic.write_atomic`` so a reader never sees half a file:

* ``benchmark.csv``: every row, columns ``table.COLUMNS``;
* ``benchmark.md``: a per-method headline table (``table.headline``), then every row;
* ``benchmark.html``: the same two tables as one page;
* ``benchmark_raw.json``: the measurements behind the table (everything but its rows).

Markdown and HTML are rendered here without a table library; numbers show four
significant digits, missing values (None, NaN) an empty cell.

MLflow (``log_report``): every finite ``value``, ``limit`` and ``fraction_of_limit`` of a row
as a metric named by ``table.metric_name`` (``report_metrics``), tags ``benchmark.device``,
``benchmark.trl`` (the TRL version, or ``skipped``) and the served format / dtype of each
engine (``served_run_tags``), and the four files as artifacts under ``benchmark/``.
"""

from __future__ import annotations

import html
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from qerl_pipeline.atomic import write_atomic
from qerl_pipeline.benchmarking.table import COLUMNS, headline, metric_name
from qerl_pipeline.tracking import MlflowLogger

log = logging.getLogger(__name__)

#: File kind -> name under ``benchmark.report_dir``.
FILES = {"csv": "benchmark.csv", "markdown": "benchmark.md", "html": "benchmark.html", "raw": "benchmark_raw.json"}


def format_value(value: Any) -> str:
    """A table cell: floats to four significant digits, None and NaN empty."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def to_markdown(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A markdown table (no tabulate dependency)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(format_value(r.get(c)).replace("|", "/") for c in columns) + " |")
    return "\n".join(lines)


def to_html(rows: list[dict[str, Any]], columns: list[str], title: str) -> str:
    """A standalone HTML page holding one table."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(format_value(r.get(c)))}</td>" for c in columns) + "</tr>" for r in rows
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
        "padding:2px 6px;text-align:right}td:first-child,td:nth-child(2),td:nth-child(3){text-align:left}</style>"
        f"</head><body><h1>{html.escape(title)}</h1><table><tr>{head}</tr>{body}</table></body></html>"
    )


def title(table: dict[str, Any]) -> str:
    """The report's title: the machine the figures were measured on."""
    hw = table["hardware"]
    return f"qerl-pipeline benchmark ({hw['device']}: {hw.get('gpu') or hw['cpu']}, {hw['cpu_cores']} cores)"


def write_report_files(table: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """CSV, markdown, HTML and raw JSON of ``table`` under ``out_dir`` (atomic); ``{kind: path}``."""
    import pandas as pd

    out = Path(out_dir)
    rows = table["rows"]
    paths = {kind: out / name for kind, name in FILES.items()}
    name = title(table)
    write_atomic(paths["csv"], pd.DataFrame(rows, columns=COLUMNS).to_csv(index=False))
    head = headline(table)
    head_cols = list(head[0]) if head else []
    when = time.strftime("%Y-%m-%d %H:%M")
    write_atomic(
        paths["markdown"],
        f"# {name}\n\n{when}\n\n## Per method\n\n{to_markdown(head, head_cols)}\n\n"
        f"## Every figure\n\n{to_markdown(rows, COLUMNS)}\n",
    )
    write_atomic(
        paths["html"],
        to_html(head, head_cols, name).replace("</body></html>", "")
        + to_html(rows, COLUMNS, "Every figure").split("<body>", 1)[1],
    )
    write_atomic(paths["raw"], json.dumps({k: v for k, v in table.items() if k != "rows"}, indent=1, default=str))
    return paths


def report_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """``{metric_name: value}`` of every finite value, limit and fraction of limit in ``rows``."""
    metrics = {}
    for r in rows:
        for field in ("value", "limit", "fraction_of_limit"):
            v = r.get(field)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                metrics[metric_name(r, field)] = float(v)
    return metrics


def served_run_tags(served: dict[str, dict[str, Any]]) -> dict[str, str]:
    """``rollout.served_format`` / ``rollout.served_dtype`` of a run that served several bases.

    One format per base as ``<format>=<tag>`` (comma-separated), plus one tag per base
    (``rollout.served_format.<format>``); the dtype as one value when all engines agree.
    """
    if not served:
        return {}
    tags = {"rollout.served_format": ",".join(f"{fmt}={s['served_format']}" for fmt, s in served.items())}
    dtypes = list(dict.fromkeys(str(s.get("dtype", "")) for s in served.values()))
    tags["rollout.served_dtype"] = (
        dtypes[0] if len(dtypes) == 1 else ",".join(f"{f}={s.get('dtype')}" for f, s in served.items())
    )
    for fmt, s in served.items():
        tags[f"rollout.served_format.{fmt}"] = s["served_format"]
        tags[f"rollout.served_dtype.{fmt}"] = str(s.get("dtype", ""))
    return tags


def log_report(table: dict[str, Any], paths: dict[str, Path], metrics: dict[str, float], logger=None) -> str | None:
    """Metrics, tags and the report files into the MLflow run (the active one by default); its run id."""
    if logger is None:
        logger = MlflowLogger()
    trl = table["trl"]
    logger.log_metrics(metrics)
    logger.set_tags(
        {
            "benchmark.device": table["hardware"]["device"],
            "benchmark.trl": "skipped" if trl.get("skipped") else trl.get("trl_version", ""),
            **served_run_tags(table["rollout"].get("served", {})),
        }
    )
    for p in paths.values():
        logger.log_artifact(p, artifact_path="benchmark")
    return logger.run_id
