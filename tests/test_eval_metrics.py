"""Accuracy and confidence intervals on fixed records, against hand-computed values."""

from __future__ import annotations

import math

import pytest

from qerl_pipeline.evaluation import metrics


def _rec(pid, correct, greedy=None, source="gsm8k", policy="trained", finish=None):
    r = {"id": pid, "source": source, "policy": policy, "correct": correct, "greedy_correct": greedy}
    if finish is not None:
        r["finish_reasons"] = finish
    return r


# Four problems, k = 2: per-problem scores 0.5, 1, 0, 0.5 -> pass@1 = 0.5; pass@2 = 3/4.
RECORDS = [
    _rec("a", [True, False], True, finish=["stop", "length"]),
    _rec("b", [True, True], True, finish=["stop", "stop"]),
    _rec("c", [False, False], False, finish=["length", "length"]),
    _rec("d", [False, True], False, finish=["stop", "stop"]),
]


def test_wilson_hand_computed():
    # p = 0.5, n = 4, z = 1.96: centre 0.5, half = 1.96*sqrt(0.0625 + 3.8416/64)/1.9604 = 0.34997
    low, high = metrics.wilson_interval(0.5, 4, z=1.96)
    assert low == pytest.approx(0.15003, abs=1e-4)
    assert high == pytest.approx(0.84997, abs=1e-4)
    # all wrong: the interval is [0, z^2 / (n + z^2)], not the zero-width Wald interval
    low, high = metrics.wilson_interval(0.0, 4, z=1.96)
    assert low == 0.0
    assert high == pytest.approx(3.8416 / 7.8416, abs=1e-9)
    # all right: mirror image
    low, high = metrics.wilson_interval(1.0, 4, z=1.96)
    assert low == pytest.approx(4 / 7.8416, abs=1e-9) and high == 1.0
    assert all(math.isnan(x) for x in metrics.wilson_interval(0.5, 0))
    with pytest.raises(ValueError):
        metrics.wilson_interval(1.5, 3)


def test_interval_narrows_with_more_problems():
    w10 = metrics.wilson_interval(0.3, 10)
    w1000 = metrics.wilson_interval(0.3, 1000)
    assert (w1000[1] - w1000[0]) < (w10[1] - w10[0])
    assert w1000[0] < 0.3 < w1000[1]


def test_benchmark_metrics_hand_computed():
    m = metrics.benchmark_metrics(RECORDS)
    assert m["n_problems"] == 4 and m["k"] == 2
    assert m["pass1"] == pytest.approx(0.5)
    assert m["pass_at_k"] == pytest.approx(0.75)
    # intervals use n = problems (4), not samples (8)
    assert (m["pass1_ci_low"], m["pass1_ci_high"]) == pytest.approx(metrics.wilson_interval(0.5, 4))
    # per-problem scores 0.5, 1, 0, 0.5: sample var = 0.5/3, stderr = sqrt(0.5/3/4) = 0.20412
    assert m["pass1_stderr"] == pytest.approx(math.sqrt(0.5 / 3 / 4))
    assert m["greedy"] == pytest.approx(0.5)
    # greedy 1,1,0,0: var = 1/3, stderr = sqrt(1/12)
    assert m["greedy_stderr"] == pytest.approx(math.sqrt(1 / 12))
    # 3 of 8 sampled completions hit the length cap
    assert m["truncated_frac"] == pytest.approx(3 / 8)


def test_pass1_weighs_problems_equally_when_k_differs():
    recs = [_rec("a", [True]), _rec("b", [False, False, False, True])]
    m = metrics.benchmark_metrics(recs)
    # (1 + 0.25) / 2, not 2 correct of 5 samples
    assert m["pass1"] == pytest.approx(0.625)
    assert m["k"] == 1
    assert "greedy" not in m  # no greedy scores in these records


def test_aggregate_per_policy_and_benchmark():
    recs = RECORDS + [
        _rec("m1", [True, True], True, source="math500"),
        _rec("m2", [False, False], True, source="math500"),
        _rec("a", [False, False], False, policy="base"),
    ]
    rows = metrics.aggregate(recs)
    assert [(r["policy"], r["benchmark"]) for r in rows] == [
        ("trained", "gsm8k"),
        ("trained", "math500"),
        ("base", "gsm8k"),
    ]
    assert rows[1]["pass1"] == pytest.approx(0.5) and rows[1]["greedy"] == pytest.approx(1.0)
    assert rows[2]["pass1"] == 0.0 and rows[2]["n_problems"] == 1
    flat = metrics.metric_dict(rows)
    assert flat["eval/trained/gsm8k/pass1"] == pytest.approx(0.5)
    assert flat["eval/trained/math500/greedy"] == pytest.approx(1.0)
    assert flat["eval/base/gsm8k/n_problems"] == 1.0
    # one sample per problem -> stderr undefined (nan) -> not logged
    assert "eval/base/gsm8k/pass1_stderr" not in flat


def test_bad_records_named():
    with pytest.raises(ValueError, match="no scored samples"):
        metrics.benchmark_metrics([_rec("x", [])])
    with pytest.raises(ValueError, match="id='y'.*correct"):
        metrics.benchmark_metrics([{"id": "y", "source": "s"}])
    with pytest.raises(ValueError, match="lacks policy"):
        metrics.aggregate([{"id": "z", "source": "s", "correct": [True]}])


def test_limit_subset_is_deterministic_and_order_free():
    from qerl_pipeline.evaluation.evaluator import subset

    recs = [{"id": f"p{i}", "source": "s"} for i in range(50)]
    a = subset(recs, 7)
    b = subset(list(reversed(recs)), 7)
    assert len(a) == 7 and {r["id"] for r in a} == {r["id"] for r in b}  # same problems whatever the file order
    assert [r["id"] for r in a] == [r["id"] for r in recs if r in a]  # original order kept
    assert [r["id"] for r in a] != [f"p{i}" for i in range(7)]  # not a prefix of the file
    assert subset(recs, None) == recs and subset(recs, 500) == recs
