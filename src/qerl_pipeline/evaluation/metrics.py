"""Benchmark accuracy from per-problem records: pass@1 over k samples, greedy, 95% intervals.

A per-problem record (evaluator.py writes them) carries, for one problem and one policy,
``correct``: one bool per sampled completion (k of them) and, when greedy decoding was
scored, ``greedy_correct``: one bool. Everything here is a pure function of those records.

Definitions
-----------
- **pass@1 averaged over k** (the paper's metric, as in DeepSeek-R1 / DAPO evaluations):
  for each problem the fraction of its k samples that are correct, then the mean over
  problems. Every problem weighs the same whatever its k.
- **pass@k**: the fraction of problems with at least one correct sample among their k
  (reported for information; with n = k samples the unbiased estimator reduces to this).
- **greedy accuracy**: the fraction of problems whose greedy completion is correct.

Confidence intervals (95%, z = 1.96)
------------------------------------
The problems are the sampling unit: a benchmark is a sample of problems, and the k
completions of one problem are not independent draws of the benchmark. So intervals
are computed over problems, with n = number of problems, never n = problems x k.

- ``ci_low`` / ``ci_high``: the **Wilson score interval** over problems, applied to the
  mean per-problem score p. For greedy (0/1 per problem) this is the textbook Wilson
  interval. For pass@1 over k it is conservative: a per-problem mean in [0, 1] with mean
  p has variance at most p(1 - p), the binomial variance Wilson assumes. Wilson was chosen
  over the normal (Wald) interval because benchmarks here are small (AIME: 30 problems)
  and accuracies are often near 0, where Wald collapses to a zero-width interval.
- ``stderr``: the standard error of the per-problem scores (sample std with ddof=1 over
  sqrt(n)); the normal interval is ``mean +- 1.96 * stderr`` for whoever prefers it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson_interval(p_hat: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a proportion ``p_hat`` observed over ``n`` units.

    ``n == 0`` gives ``(nan, nan)``: no problems, no estimate.
    """
    if n <= 0:
        return (math.nan, math.nan)
    if not 0.0 <= p_hat <= 1.0:
        raise ValueError(f"p_hat must be in [0, 1], got {p_hat}")
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p_hat + z2 / (2 * n)) / denom
    half = z * math.sqrt(p_hat * (1 - p_hat) / n + z2 / (4 * n * n)) / denom
    low = 0.0 if p_hat == 0.0 else max(0.0, centre - half)  # exact ends: no 1e-17 rounding dust
    high = 1.0 if p_hat == 1.0 else min(1.0, centre + half)
    return (low, high)


def standard_error(values: Sequence[float]) -> float:
    """Sample standard deviation (ddof=1) over sqrt(n); nan for fewer than two values."""
    n = len(values)
    if n < 2:
        return math.nan
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return math.sqrt(var / n)


def problem_score(correct: Sequence[bool]) -> float:
    """Fraction of one problem's samples that are correct (its pass@1 estimate)."""
    if len(correct) == 0:
        raise ValueError("a problem has no scored samples (empty `correct`)")
    return sum(bool(c) for c in correct) / len(correct)


def accuracy_summary(scores: Sequence[float], z: float = Z95) -> dict[str, float]:
    """Mean of per-problem scores with its Wilson interval and standard error."""
    n = len(scores)
    mean = sum(scores) / n if n else math.nan
    low, high = wilson_interval(mean, n, z) if n else (math.nan, math.nan)
    return {"mean": mean, "ci_low": low, "ci_high": high, "stderr": standard_error(scores), "n": n}


def benchmark_metrics(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """All accuracy numbers of one benchmark (one policy) from its per-problem records.

    Returns ``n_problems``, ``k`` (samples per problem; the smallest if they differ),
    ``pass1`` with ``pass1_ci_low/high`` and ``pass1_stderr``, ``pass_at_k``, and, when
    every record has ``greedy_correct``, ``greedy`` with ``greedy_ci_low/high`` and
    ``greedy_stderr``; ``truncated_frac`` (sampled completions cut at the length cap)
    when records carry ``finish_reasons``.
    """
    records = list(records)
    if not records:
        raise ValueError("no records to summarise")
    for i, r in enumerate(records):
        if "correct" not in r:
            raise ValueError(f"record {i} (id={r.get('id')!r}) has no 'correct' field")
    scores = [problem_score(r["correct"]) for r in records]
    s = accuracy_summary(scores)
    out: dict[str, Any] = {
        "n_problems": len(records),
        "k": min(len(r["correct"]) for r in records),
        "pass1": s["mean"],
        "pass1_ci_low": s["ci_low"],
        "pass1_ci_high": s["ci_high"],
        "pass1_stderr": s["stderr"],
        "pass_at_k": sum(any(r["correct"]) for r in records) / len(records),
    }
    if all(r.get("greedy_correct") is not None for r in records):
        g = accuracy_summary([1.0 if r["greedy_correct"] else 0.0 for r in records])
        out.update(greedy=g["mean"], greedy_ci_low=g["ci_low"], greedy_ci_high=g["ci_high"], greedy_stderr=g["stderr"])
    if all(r.get("finish_reasons") for r in records):
        reasons = [f for r in records for f in r["finish_reasons"]]
        out["truncated_frac"] = sum(f == "length" for f in reasons) / len(reasons)
    return out


def aggregate(records: Iterable[dict[str, Any]], keys: Sequence[str] = ("policy", "source")) -> list[dict[str, Any]]:
    """One row per distinct ``keys`` (default: policy and benchmark source), in first-seen order.

    Each row holds the key fields (``source`` is also copied to ``benchmark``) and the
    numbers of :func:`benchmark_metrics`.
    """
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for i, r in enumerate(records):
        missing = [k for k in keys if k not in r]
        if missing:
            raise ValueError(f"record {i} (id={r.get('id')!r}) lacks {', '.join(missing)}")
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    rows = []
    for key, group in groups.items():
        row: dict[str, Any] = dict(zip(keys, key, strict=True))
        if "source" in row:
            row["benchmark"] = row["source"]
        row.update(benchmark_metrics(group))
        rows.append(row)
    return rows


def metric_dict(rows: Iterable[dict[str, Any]], prefix: str = "eval") -> dict[str, float]:
    """Flatten accuracy rows to MLflow metric names ``<prefix>/<policy>/<benchmark>/<name>``.

    NaNs are dropped (MLflow stores them, but plots and tables are cleaner without).
    The report parses these names back (``evaluation/report_runs.EVAL_METRIC``).
    """
    out: dict[str, float] = {}
    for row in rows:
        policy, bench = row.get("policy", "policy"), row["benchmark"]
        for name, value in row.items():
            if name in ("policy", "source", "benchmark") or not isinstance(value, (int, float)):
                continue
            if isinstance(value, float) and math.isnan(value):
                continue
            out[f"{prefix}/{policy}/{bench}/{name}"] = float(value)
    return out
