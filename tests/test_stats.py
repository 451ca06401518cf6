"""evaluation/stats.py against values computed by hand (the arithmetic is written out beside each)."""

from __future__ import annotations

import math

import pytest

from qerl_pipeline.evaluation import metrics, stats

T1 = 12.706204736174698  # t(0.975, 1), from tables
T2 = 4.302652729749464  # t(0.975, 2)


def test_t_quantile_matches_the_tables():
    assert stats.t_quantile(1) == pytest.approx(T1)
    assert stats.t_quantile(2) == pytest.approx(T2)
    assert stats.t_quantile(30) == pytest.approx(2.042272456, rel=1e-6)
    with pytest.raises(ValueError, match="df must be >= 1"):
        stats.t_quantile(0)


def test_seed_interval_is_students_t():
    # mean 2, sd 1, se 1/sqrt(3); half = t(2) / sqrt(3)
    iv = stats.seed_interval([1.0, 2.0, 3.0])
    assert (iv.mean, iv.n, iv.over) == (2.0, 3, "seeds")
    assert iv.low == pytest.approx(2 - T2 / math.sqrt(3)) and iv.high == pytest.approx(2 + T2 / math.sqrt(3))
    # two seeds: sd = 0.01/sqrt(2), se = 0.005, half = t(1) * 0.005
    iv = stats.seed_interval([0.15, 0.16])
    assert iv.mean == pytest.approx(0.155)
    assert (iv.low, iv.high) == (pytest.approx(0.155 - T1 * 0.005), pytest.approx(0.155 + T1 * 0.005))
    one = stats.seed_interval([5.0])
    assert one.mean == 5.0 and one.n == 1 and not one.has_interval
    assert stats.seed_interval([]).n == 0 and math.isnan(stats.seed_interval([]).mean)
    assert stats.seed_interval([1.0, float("nan"), 3.0]).n == 2  # a seed without the value is left out


def test_crossed_interval_by_hand():
    table = [[1, 1, 0.5, 0], [1, 0.5, 0.5, 0], [1, 1, 1, 0.5]]  # 3 seeds x 4 problems
    # grand mean 8/12; seed means .625 .5 .875 (variance 0.0364583, /3 = 0.0121528);
    # problem means 1 .8333 .6667 .1667 (variance 0.1296296, /4 = 0.0324074);
    # residual sum of squares 0.2083333 over (2*3) df: MSE 0.0347222, /12 = 0.0028935;
    # V = 0.0121528 + 0.0324074 - 0.0028935 = 1/24
    v_rows, v_cols, v_cell = 0.0364583 / 3, 0.1296296 / 4, 0.0347222 / 12
    var = v_rows + v_cols - v_cell
    assert var == pytest.approx(1 / 24, rel=1e-5)
    df = var**2 / (v_rows**2 / 2 + v_cols**2 / 3 + v_cell**2 / 6)  # Satterthwaite: about 4.08
    assert df == pytest.approx(4.082, abs=1e-3)
    iv = stats.crossed_interval(table)
    assert iv.mean == pytest.approx(2 / 3) and iv.over == "seeds+problems" and iv.n == 12
    assert iv.low == pytest.approx(2 / 3 - stats.t_quantile(df) * math.sqrt(var), rel=1e-4)
    assert iv.high == 1.0  # 2/3 + 0.56 clipped to the score range


def test_paired_difference_by_hand():
    # one seed: d = [0, -1, 1, 1] (a - b per problem), mean 0.25, sd sqrt(0.91667), half t(3) * sd / 2
    iv = stats.paired_difference([[1, 0, 1, 1]], [[1, 1, 0, 0]])
    assert (iv.mean, iv.n, iv.over) == (0.25, 4, "problems")
    half = stats.t_quantile(3) * math.sqrt((0.0625 + 1.5625 + 0.5625 + 0.5625) / 3) / 2
    assert (iv.low, iv.high) == (pytest.approx(0.25 - half), pytest.approx(0.25 + half))
    # two seeds: the crossed estimate of the table of differences, not clipped to [0, 1] (a negative difference)
    a, b = [[0, 0, 0.5, 0], [0, 1, 0, 0]], [[1, 0, 1, 0], [1, 1, 0, 0.5]]
    d = [[-1, 0, -0.5, 0], [-1, 0, 0, -0.5]]
    var, df = stats._crossed_variance(d)
    iv = stats.paired_difference(a, b)
    assert iv.mean == pytest.approx(-0.375) and iv.over == "seeds+problems" and iv.n == 8
    assert (iv.low, iv.high) == (
        pytest.approx(-0.375 - stats.t_quantile(df) * math.sqrt(var)),
        pytest.approx(-0.375 + stats.t_quantile(df) * math.sqrt(var)),
    )
    assert iv.low < -0.375 < iv.high < 0.5
    # the same policy twice: a difference of exactly 0 with no width
    same = stats.paired_difference(a, a)
    assert (same.mean, same.low, same.high) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="different shapes"):
        stats.paired_difference([[1, 0]], [[1, 0], [0, 0]])


def test_crossed_interval_keeps_the_problems_uncertainty():
    # every seed right on every problem: zero observed variance, but 4 problems are 4 problems
    iv = stats.crossed_interval([[1, 1, 1, 1], [1, 1, 1, 1]])
    assert (iv.low, iv.high) == pytest.approx(metrics.wilson_interval(1.0, 4))
    # seeds that agree: only the problems vary; V = var(problem means)/N = 0.25/4, df = N - 1 = 3
    iv = stats.crossed_interval([[1, 0, 0, 0], [1, 0, 0, 0]])
    assert iv.mean == 0.25
    assert iv.low == 0.0 and iv.high == pytest.approx(min(1.0, 0.25 + stats.t_quantile(3) * 0.25))
    # one seed: the Wilson interval over its problems, as a single evaluation reports it
    one = stats.crossed_interval([[1, 0, 1, 1]])
    assert one.over == "problems" and (one.low, one.high) == pytest.approx(metrics.wilson_interval(0.75, 4))
    with pytest.raises(ValueError, match="same problems"):
        stats.crossed_interval([[1, 0], [1]])


def test_curve_auc_and_window_mean():
    pts = [(1, 0.0), (2, 1.0), (3, 1.0)]
    assert stats.curve_auc(pts) == pytest.approx((0.5 + 1.0) / 2)  # trapezoids 0.5 + 1.0 over a span of 2 steps
    assert stats.curve_auc(pts, steps=[2, 3]) == 1.0
    assert stats.curve_auc([(4, 0.3)]) == 0.3 and math.isnan(stats.curve_auc([]))
    assert (
        stats.window_mean(pts, [2, 3]) == 1.0
        and stats.window_mean(pts, [1]) == 0.0
        and math.isnan(stats.window_mean(pts, [9]))
    )


def test_step_bands_over_seeds():
    bands = stats.step_bands({0: [(1, 1.0), (2, 2.0)], 1: [(1, 3.0), (2, 2.0)], 2: [(1, 2.0)]})
    assert [b["step"] for b in bands] == [1, 2]
    # step 1: 1, 3, 2 -> mean 2, sd 1; step 2: 2, 2 -> sd 0
    assert (
        bands[0]["mean"] == 2.0
        and bands[0]["ci_high"] == pytest.approx(2 + T2 / math.sqrt(3))
        and bands[0]["n_seeds"] == 3
    )
    assert (bands[1]["mean"], bands[1]["ci_low"], bands[1]["ci_high"], bands[1]["n_seeds"]) == (2.0, 2.0, 2.0, 2)


def test_verdict_wording():
    assert stats.verdict(stats.Interval(0.01, -0.03, 0.05, 2, "seeds")) == (
        "cannot tell",
        "cannot tell: difference 0.010, 95% interval [-0.030, 0.050], 2 seeds",
    )
    assert stats.verdict(stats.Interval(0.01, math.nan, math.nan, 1, "")) == (
        "cannot tell",
        "cannot tell: difference 0.010, 1 seed (no interval from one seed)",
    )
    assert stats.verdict(stats.Interval(0.2, 0.1, 0.3, 3, "seeds"))[0] == "supported"
    assert stats.verdict(stats.Interval(-0.2, -0.3, -0.1, 3, "seeds")) == (
        "contradicted",
        "contradicted: difference -0.200, 95% interval [-0.300, -0.100], 3 seeds",
    )
    # no difference at all is no support
    assert stats.verdict(stats.Interval(0.0, 0.0, 0.0, 2, "seeds"))[0] == "cannot tell"
    # differences below 0.001 keep 3 significant digits instead of reading 0.000
    assert stats.verdict(stats.Interval(-7.77e-05, -1.44e-04, -1.11e-05, 2, "seeds"))[1] == (
        "contradicted: difference -7.77e-05, 95% interval [-1.44e-04, -1.11e-05], 2 seeds"
    )
    # a round small value keeps its decimal point (":.3g" wrote "2e-05", which the report's readers did not parse)
    assert stats.verdict(stats.Interval(2e-05, -6.48e-05, 1.05e-04, 2, "seeds"))[1] == (
        "cannot tell: difference 2.00e-05, 95% interval [-6.48e-05, 1.05e-04], 2 seeds"
    )


def test_claim_pairs_seeds():
    # per-seed differences 0.2 and 0.22: mean 0.21, se 0.01, half t(1) * 0.01 = 0.127
    c = stats.claim("a_x", "x above y", "x", "y", "entropy", {0: 1.2, 1: 1.22, 7: 3.0}, {0: 1.0, 1: 1.0})
    assert c.seeds == (0, 1)  # seed 7 has no partner
    assert c.difference.mean == pytest.approx(0.21)
    assert c.verdict == "supported"
    assert c.text == "supported: difference 0.210, 95% interval [0.083, 0.337], 2 seeds"
    missing = stats.claim("c", "z >= y", "z", "y", "auc", {}, {0: 1.0})
    assert missing.verdict == "cannot tell" and missing.text == "cannot tell: no data for z"
    assert (
        stats.claim("c", "z >= y", "z", "y", "auc", {0: float("nan")}, {0: 1.0}).text == "cannot tell: no data for z"
    )
    d = c.as_dict()
    assert d["seeds"] == [0, 1] and d["difference"]["mean"] == pytest.approx(0.21)


def test_seeds_needed_by_hand():
    """Smallest n with t(0.975, n-1) * s_d / sqrt(n) < |d|, the t values from tables."""
    # d = 0.005, s_d = 0.01/sqrt(2) (differences 0 and 0.01): need t(n-1)/sqrt(n) < 0.70711;
    # n = 10: t(9) = 2.26216, / sqrt(10) = 0.71535 (no); n = 11: t(10) = 2.22814, / sqrt(11) = 0.67181 (yes)
    assert stats.seeds_needed(0.005, 0.01 / math.sqrt(2)) == 11
    assert stats.seeds_needed(-0.005, 0.01 / math.sqrt(2)) == 11  # the sign does not matter
    # differences 0.1, -0.05, 0.25: d = 0.1, s_d = 0.15 (squares 0, 0.0225, 0.0225 over 2), need t/sqrt(n) < 2/3:
    # n = 11: 0.67181 (no); n = 12: t(11) = 2.20099, / sqrt(12) = 0.63537 (yes)
    c = stats.claim("b_x", "x >= y", "x", "y", "auc", {0: 0.1, 1: -0.05, 2: 0.25}, {0: 0.0, 1: 0.0, 2: 0.0})
    assert c.verdict == "cannot tell" and c.difference.n == 3
    assert (c.seeds_needed, c.seeds_note) == (12, "12 seeds")
    assert c.as_dict()["seeds_needed"] == 12
    # no spread to estimate from, no difference, no data, a verdict already: no number
    one = stats.claim("b_x", "x >= y", "x", "y", "auc", {0: 0.1}, {0: 0.0})
    assert (one.seeds_needed, one.seeds_note) == (None, "needs ≥2 seeds to estimate")
    zero = stats.claim("b_x", "x >= y", "x", "y", "auc", {0: 0.1, 1: -0.1}, {0: 0.0, 1: 0.0})
    assert zero.verdict == "cannot tell" and (zero.seeds_needed, zero.seeds_note) == (
        None,
        "none: the measured difference is 0",
    )
    assert stats.claim("c", "z >= y", "z", "y", "auc", {}, {0: 1.0}).seeds_note == "n/a: no paired data"
    told = stats.claim("a_x", "x above y", "x", "y", "entropy", {0: 1.2, 1: 1.22}, {0: 1.0, 1: 1.0})
    assert told.verdict == "supported" and (told.seeds_needed, told.seeds_note) == (None, "")
    assert stats.seeds_needed(0.0, 1.0) is None and stats.seeds_needed(1.0, 0.0) == 2
    assert stats.seeds_needed(1e-9, 1.0) is None  # beyond max_n (about 3.8e18 seeds)
