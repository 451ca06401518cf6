"""Means and 95% intervals over seeds and problems, and the paper's claims put to the data.

One home for the statistics of the compare report (``evaluation/report.py``); the
per-problem Wilson interval of one evaluation stays in ``evaluation/metrics.py``.

Intervals (all two-sided 95%):

* over seeds (``seed_interval``): Student's t interval of the per-seed values,
  ``mean +- t(0.975, S-1) * sd / sqrt(S)`` with the sample sd (ddof 1). One seed: no interval
  (low/high NaN): one training says nothing about the spread between trainings. Used for
  the per-step reward and entropy bands and for every claim.
* over seeds and problems (``crossed_interval``): the pass@1 of S seeds on the same N
  problems is an S x N table ``y[s][j]`` (each cell: the fraction of the k samples of problem
  j correct for seed s). Seeds and problems are crossed random factors, so the variance of the
  grand mean is ``sigma_seed^2/S + sigma_problem^2/N + sigma_cell^2/(S N)``; its unbiased
  moment estimate (two-way ANOVA without replication) is
  ``V = s_rows^2/S + s_cols^2/N - MSE/(S N)``, with ``s_rows^2`` the variance of the seed
  means, ``s_cols^2`` the variance of the problem means and ``MSE`` the residual mean square
  ``sum (y - row mean - col mean + grand mean)^2 / ((S-1)(N-1))``. When V falls below either
  one-factor term it is raised to the larger of ``s_rows^2/S`` and ``s_cols^2/N`` (each
  estimates a part of the true variance). Critical value ``t(0.975, df)`` with
  Satterthwaite's degrees of freedom for a sum of mean squares,
  ``df = V^2 / sum_i (c_i MS_i)^2 / df_i`` over the three terms (df S-1, N-1, (S-1)(N-1);
  the kept term's df when V was raised), at least 1: with 2 seeds that differ, df is near 1
  and the interval wide; with seeds that agree it tends to N-1. The interval is then widened
  to contain the Wilson interval of the grand mean over the N problems
  (``metrics.wilson_interval``): the seeds share the same problems, so more seeds cannot
  shrink the problem-sampling part below what one seed's N problems give, and an all-correct
  or all-wrong table does not get a zero-width interval. It is clipped to [0, 1]. S = 1: the
  Wilson interval over problems alone, as the single-seed report always did.

Claims (``claim``): a one-sided statement "A >= B" (or "A > B") about a per-seed statistic
(mean entropy over the steps of the first AQN stage; the area under the reward curve),
tested on the seed-paired differences ``A_s - B_s`` (seed s trains every method on the same
prompts in the same order, so pairing removes the seeds' shared part). The verdict:

* ``supported`` when the whole interval of the difference lies above 0,
* ``contradicted`` when it lies below 0,
* ``cannot tell`` otherwise: the interval contains 0, or there is only one common seed (no
  interval), or a method lacks the data. The sentence always carries the measured difference,
  its interval and the number of seeds, e.g. ``cannot tell: difference 0.010, 95% interval
  [-0.030, 0.050], 2 seeds``.

Seeds a "cannot tell" claim would need (``seeds_needed``): with the measured mean ``d`` and
sample sd ``s_d`` (ddof 1) of the seed-paired differences, the smallest number of seeds ``n``
(in total, not more) whose interval would exclude 0,
``t(0.975, n-1) * s_d / sqrt(n) < |d|``, found by trying n = 2, 3, ... (from
``(z(0.975) s_d / |d|)^2``, below which no n passes since t > z). The assumptions: the
per-seed differences are independent and normally distributed across seeds (what the t
interval itself assumes) and the measured ``d`` and ``s_d`` are the true ones. It is a
plug-in estimate, not a power calculation: ``d`` and ``s_d`` from a few seeds are themselves
uncertain, and at that n an experiment whose true difference and spread are these would
exclude 0 only about half the time (the expected interval just clears 0). One seed has no
spread: "needs ≥2 seeds to estimate"; a measured difference of exactly 0 needs no finite n.

Area under the reward curve (``curve_auc``): the trapezoid area over the logged steps divided
by their span (last - first step), i.e. the curve's mean height in reward units, so runs of
different lengths compare; a single step's AUC is its value. Both methods of a claim use the
same steps (the common steps of their curves), or the comparison would be of different
things.

scipy (``stats.t``) comes with mlflow, a pinned dependency.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from qerl_pipeline.evaluation.metrics import wilson_interval

LEVEL = 0.95


def t_quantile(df: float, level: float = LEVEL) -> float:
    """Two-sided Student-t critical value (``t(1 - (1 - level)/2, df)``); ``df`` (may be fractional) must be >= 1."""
    from scipy.stats import t

    if df < 1:
        raise ValueError(f"t_quantile: df must be >= 1, got {df}")
    return float(t.ppf(1 - (1 - level) / 2, df))


@dataclass(frozen=True)
class Interval:
    """A mean with its 95% interval (``low``/``high`` NaN when there is none) and what it is over."""

    mean: float
    low: float
    high: float
    n: int  # seeds (seed_interval, claims) or seeds x problems (crossed_interval)
    over: str  # "seeds", "seeds+problems", "problems" or "" (no interval)

    @property
    def has_interval(self) -> bool:
        return not (math.isnan(self.low) or math.isnan(self.high))

    def as_dict(self) -> dict:
        return asdict(self)


NAN = math.nan


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _var(xs: Sequence[float]) -> float:
    """Sample variance (ddof 1)."""
    m = _mean(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def seed_interval(values: Sequence[float]) -> Interval:
    """Mean of per-seed values with Student's t 95% interval; one value: no interval; none: NaN."""
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not xs:
        return Interval(NAN, NAN, NAN, 0, "")
    m = _mean(xs)
    if len(xs) == 1:
        return Interval(m, NAN, NAN, 1, "")
    half = t_quantile(len(xs) - 1) * math.sqrt(_var(xs) / len(xs))
    return Interval(m, m - half, m + half, len(xs), "seeds")


def _rows(table: Sequence[Sequence[float]], what: str) -> list[list[float]]:
    rows = [[float(v) for v in r] for r in table]
    if rows and any(len(r) != len(rows[0]) for r in rows):
        raise ValueError(f"{what}: every seed needs the same problems, got row lengths {[len(r) for r in rows]}")
    return rows


def _crossed_variance(rows: list[list[float]]) -> tuple[float, float]:
    """``(V, df)`` of the grand mean of an S x N table, S, N >= 2 (the crossed estimate of the module docstring)."""
    s, n = len(rows), len(rows[0])
    grand = sum(map(sum, rows)) / (s * n)
    row_means = [_mean(r) for r in rows]
    col_means = [_mean([r[j] for r in rows]) for j in range(n)]
    resid = sum((rows[i][j] - row_means[i] - col_means[j] + grand) ** 2 for i in range(s) for j in range(n))
    mse = resid / ((s - 1) * (n - 1))
    terms = [(_var(row_means) / s, s - 1), (_var(col_means) / n, n - 1), (mse / (s * n), (s - 1) * (n - 1))]
    var = terms[0][0] + terms[1][0] - terms[2][0]
    if var < max(terms[0][0], terms[1][0]):
        return max(terms[:2])
    denom = sum(c * c / d for c, d in terms)
    return var, (var * var / denom if denom > 0 else float(n - 1))


def crossed_interval(table: Sequence[Sequence[float]]) -> Interval:
    """Grand mean of an S (seeds) x N (problems) table of scores in [0, 1] with the crossed two-way
    95% interval (module docstring).

    Every row must have the same N problems in the same order (the caller aligns them by
    problem id). One row: the Wilson interval of its mean over N problems.
    """
    rows = _rows(table, "crossed_interval")
    if not rows or not rows[0]:
        return Interval(NAN, NAN, NAN, 0, "")
    s, n = len(rows), len(rows[0])
    grand = sum(map(sum, rows)) / (s * n)
    if s == 1:
        lo, hi = wilson_interval(min(1.0, max(0.0, grand)), n)
        return Interval(grand, lo, hi, n, "problems")
    if n == 1:
        iv = seed_interval([r[0] for r in rows])
        return Interval(iv.mean, iv.low, iv.high, s, iv.over)
    var, df = _crossed_variance(rows)
    half = t_quantile(max(1.0, df)) * math.sqrt(var) if var > 0 else 0.0
    w_lo, w_hi = wilson_interval(min(1.0, max(0.0, grand)), n)
    low, high = max(0.0, min(grand - half, w_lo)), min(1.0, max(grand + half, w_hi))
    return Interval(grand, low, high, s * n, "seeds+problems")


def paired_difference(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> Interval:
    """Mean of ``a - b`` over two S (seeds) x N (problems) score tables aligned cell by cell (the same
    seed's policy, the same problem: e.g. a policy quantized again vs as trained), with its 95% interval.

    The differences ``d = a - b`` are a table of the same shape; pairing removes what the two share
    (the problem's difficulty, the seed's training). S = 1: Student's t interval over the N problems'
    differences (``t(0.975, N-1) sd / sqrt(N)``); S, N >= 2: the crossed two-way estimate of the
    module docstring on ``d`` (Satterthwaite's df), neither clipped nor widened: a difference may be
    negative, and two equal policies give an interval of width 0 at 0. N = 1: over seeds alone.
    """
    ra, rb = _rows(a, "paired_difference"), _rows(b, "paired_difference")
    if len(ra) != len(rb) or (ra and len(ra[0]) != len(rb[0])):
        raise ValueError(f"paired_difference: tables of different shapes, {len(ra)} and {len(rb)} seeds")
    d = [[x - y for x, y in zip(r, q, strict=True)] for r, q in zip(ra, rb, strict=True)]
    if not d or not d[0]:
        return Interval(NAN, NAN, NAN, 0, "")
    s, n = len(d), len(d[0])
    if n == 1:
        return seed_interval([r[0] for r in d])
    grand = sum(map(sum, d)) / (s * n)
    if s == 1:
        var, df, over = _var(d[0]) / n, n - 1, "problems"
    else:
        (var, df), over = _crossed_variance(d), "seeds+problems"
    half = t_quantile(max(1.0, df)) * math.sqrt(var) if var > 0 else 0.0
    return Interval(grand, grand - half, grand + half, s * n, over)


def seeds_needed(d: float, s_d: float, level: float = LEVEL, max_n: int = 10**9) -> int | None:
    """The smallest n >= 2 with ``t(1 - (1 - level)/2, n-1) * s_d / sqrt(n) < |d|`` (module docstring: the
    formula, its assumptions and why it is a plug-in estimate); None when no n up to ``max_n`` does (``d``
    is 0 or NaN, or the spread is too large for it)."""
    from statistics import NormalDist

    if math.isnan(d) or math.isnan(s_d) or d == 0:
        return None
    if s_d == 0:
        return 2
    z = NormalDist().inv_cdf(1 - (1 - level) / 2)
    n = max(2, math.floor((z * s_d / abs(d)) ** 2))  # t(df) > z for every df: no smaller n passes
    while n <= max_n:
        if t_quantile(n - 1, level) * s_d / math.sqrt(n) < abs(d):
            return n
        n += 1
    return None


def curve_auc(points: Sequence[tuple[int, float]], steps: Sequence[int] | None = None) -> float:
    """Trapezoid area under ``(step, value)`` points divided by the step span (the mean height).

    ``steps``: use only these steps (a claim's common steps). No point: NaN; one: its value.
    """
    pts = sorted((int(s), float(v)) for s, v in points if steps is None or int(s) in set(steps))
    if not pts:
        return NAN
    if len(pts) == 1:
        return pts[0][1]
    area = sum((s1 - s0) * (v0 + v1) / 2 for (s0, v0), (s1, v1) in zip(pts, pts[1:], strict=False))
    return area / (pts[-1][0] - pts[0][0])


def window_mean(points: Sequence[tuple[int, float]], steps: Sequence[int]) -> float:
    """Mean of the values at ``steps`` (NaN when none of them was logged)."""
    keep = set(steps)
    vals = [float(v) for s, v in points if int(s) in keep]
    return _mean(vals) if vals else NAN


def step_bands(curves: Mapping[int, Sequence[tuple[int, float]]]) -> list[dict]:
    """Per step: mean and 95% interval over the seeds that logged it (``{seed: [(step, value)]}``)."""
    by_step: dict[int, list[float]] = {}
    for pts in curves.values():
        for step, value in pts:
            by_step.setdefault(int(step), []).append(float(value))
    out = []
    for step in sorted(by_step):
        iv = seed_interval(by_step[step])
        out.append({"step": step, "mean": iv.mean, "ci_low": iv.low, "ci_high": iv.high, "n_seeds": iv.n})
    return out


@dataclass(frozen=True)
class Claim:
    """One of the paper's claims, measured: ``a`` vs ``b`` on ``statistic``."""

    id: str
    statement: str  # e.g. "policy entropy of qerl above lora in the first AQN stage"
    a: str
    b: str
    statistic: str
    difference: Interval  # of the per-seed differences a - b
    seeds: tuple[int, ...]
    verdict: str  # supported | contradicted | cannot tell
    text: str  # the sentence the report prints
    #: "cannot tell" only: the seeds that would tell the measured difference from 0 at its measured spread
    #: (``seeds_needed``); None when there is no such number or the verdict is not "cannot tell"
    seeds_needed: int | None = None
    #: what the report prints for it: "11 seeds", "needs ≥2 seeds to estimate", ...; "" unless "cannot tell"
    seeds_note: str = ""

    def as_dict(self) -> dict:
        d = asdict(self)
        d["seeds"] = list(self.seeds)
        return d


def _num(x: float) -> str:
    """3 decimals; 3 significant digits in e-notation below 0.001 (smoke runs' entropy differences are ~1e-4) and
    from 1000, always with a decimal point ("2.00e-05", never "2e-05": ``:.3g`` drops it for round values)."""
    if math.isnan(x):
        return "nan"
    return f"{x:.3f}" if x == 0 or 0.001 <= abs(x) < 1000 else f"{x:.2e}"


def _seeds_text(n: int) -> str:
    return f"{n} seed" if n == 1 else f"{n} seeds"


def verdict(diff: Interval, missing: str = "") -> tuple[str, str]:
    """``(verdict, sentence)`` for the paired difference ``diff`` of a claim "A >= B"."""
    if missing:
        return "cannot tell", f"cannot tell: {missing}"
    if diff.n == 0 or math.isnan(diff.mean):
        return "cannot tell", "cannot tell: no seed has both methods' data"
    if not diff.has_interval:
        return (
            "cannot tell",
            f"cannot tell: difference {_num(diff.mean)}, {_seeds_text(diff.n)} (no interval from one seed)",
        )
    where = f"difference {_num(diff.mean)}, 95% interval [{_num(diff.low)}, {_num(diff.high)}], {_seeds_text(diff.n)}"
    if diff.low > 0:
        return "supported", f"supported: {where}"
    if diff.high < 0:
        return "contradicted", f"contradicted: {where}"
    return "cannot tell", f"cannot tell: {where}"


def claim(
    claim_id: str,
    statement: str,
    a: str,
    b: str,
    statistic: str,
    per_seed_a: Mapping[int, float],
    per_seed_b: Mapping[int, float],
) -> Claim:
    """Claim "``a`` >= ``b``" on a per-seed statistic, from the seed-paired differences."""

    def ok(x) -> bool:
        return x is not None and not math.isnan(float(x))

    missing = [m for m, d in ((a, per_seed_a), (b, per_seed_b)) if not any(ok(v) for v in d.values())]
    seeds = tuple(sorted(s for s in per_seed_a if s in per_seed_b and ok(per_seed_a[s]) and ok(per_seed_b[s])))
    diffs = [float(per_seed_a[s]) - float(per_seed_b[s]) for s in seeds]
    diff = seed_interval(diffs)
    why = f"no data for {', '.join(missing)}" if missing else ""
    v, text = verdict(diff, why)
    needed, note = None, ""
    if v == "cannot tell":
        needed, note = _seeds_note(diffs, diff, bool(missing))
    return Claim(claim_id, statement, a, b, statistic, diff, seeds, v, text, needed, note)


def _seeds_note(diffs: Sequence[float], diff: Interval, missing: bool) -> tuple[int | None, str]:
    """``(seeds_needed, note)`` of a "cannot tell" claim with the paired differences ``diffs``."""
    if missing or diff.n == 0:
        return None, "n/a: no paired data"
    if diff.n == 1:
        return None, "needs ≥2 seeds to estimate"
    if diff.mean == 0:
        return None, "none: the measured difference is 0"
    n = seeds_needed(diff.mean, math.sqrt(_var(diffs)))
    return (n, f"{n} seeds") if n is not None else (None, "over 10^9 seeds")
