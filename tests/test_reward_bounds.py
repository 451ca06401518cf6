"""Cheap bounds before math-verify: degenerate completions are rejected by a named check, or
what reaches math-verify is within the documented bounds (rewards/bounds.py docstring).

No timed assertion: the facts asserted are machine-independent (which check fires, what
reaches math-verify, that no completion hits the scorer's time limit). The cost of a
degenerate batch against an ordinary one is measured by hand, with this module run as a
script (numbers in docs/performance.md):

    .venv/bin/python -m tests.test_reward_bounds [N]     # N = 1000 completions per batch
"""

from __future__ import annotations

import json
import random
import sys
import time

import pytest

from qerl_pipeline.config import RewardConfig
from qerl_pipeline.rewards import RewardScorer, bounds
from qerl_pipeline.rewards.bounds import bounds_violation
from qerl_pipeline.rewards.extraction import _CONTROL_CHARS, prediction_trace, score_accuracy
from qerl_pipeline.rewards.tex import normalise_tex_shorthand
from tests.helpers.golds import all_golds

TH = "<think>I work it out.</think>"


def degenerate_completions() -> dict[str, str]:
    """One or more completions per degenerate family (name -> completion)."""
    sum3000 = "+".join(["1"] * 3000)
    out = {
        # nested braces / brackets
        "boxed_braces_500": "\\boxed{" + "{" * 500 + "1" + "}" * 500 + "}",
        "tag_braces_2000": f"{TH}<answer>" + "{" * 2000 + "7" + "}" * 2000 + "</answer>",
        "parens_1000": "\\boxed{" + "(" * 1000 + "1" + ")" * 1000 + "}",
        "left_right_200": "The answer is " + "\\left(" * 200 + "x" + "\\right)" * 200 + ".",
        "braces_9": "\\boxed{" + "{" * 9 + "1" + "}" * 9 + "}",
        "unbalanced_open_5000": "\\boxed{" + "{" * 5000,
        "brackets_mixed": "<answer>" + "[({" * 300 + "</answer>",
        # huge numbers
        "digits_5000_boxed": "\\boxed{" + "7" * 5000 + "}",
        "digits_5000_plain": "The answer is " + "9" * 5000 + ".",
        "digits_5000_tag": f"{TH}<answer>" + "3" * 5000 + "</answer>",
        "digits_grouped": "\\boxed{" + "1" + ",000" * 1500 + "}",
        "digits_150": "\\boxed{" + "8" * 150 + "}",
        "decimal_5000": "The answer is 0." + "3" * 5000,
        # exponent towers
        "chain_300": "\\boxed{" + "^".join(["2"] * 300) + "}",
        "braced_tower_50": "\\boxed{" + "2^{" * 50 + "2" + "}" * 50 + "}",
        "tower_9_9_9": "\\boxed{9^{9^{9}}}",
        "tower_10_10_10": "The answer is $10^{10^{10}}$.",
        "big_exponent": "\\boxed{7^{123456789}}",
        "tower_2_5": "\\boxed{2^{2^{2^{2^{2}}}}}",
        "exp_tower_e": "\\boxed{e^{e^{e^{e^{10}}}}}",
        # long sums
        "sum_3000_boxed": "\\boxed{" + sum3000 + "}",
        "sum_3000_plain": "The answer is " + sum3000 + ".",
        "sum_3000_dollar": "Final answer: $" + sum3000 + "$",
        "sum_3000_tag": f"{TH}<answer>{sum3000}</answer>",
        "poly_200": "\\boxed{" + "+".join(f"x^{{{i}}}" for i in range(200)) + "}",
        "sum_400000": "The final answer: $" + "1+" * 400_000 + "1$",
        # control characters
        "control_boxed": "\\boxed{1\x00\x01\x02" + "\x07" * 1000 + "}",
        "control_everywhere": "".join(chr(c) for c in range(32)) * 300 + "<answer>5\x00</answer>",
        "control_formfeed": "<think>\x0c\x0c</think><answer>\x0crac{1}{2}</answer>",
        "control_c1": "\\boxed{\x85\x9f" * 2000 + "}",
        # thousands of tags
        "answer_tags_3000": "<answer>1</answer>" * 3000,
        "think_tags_5000": "<think>" * 5000 + "<answer>5</answer>",
        "open_answer_5000": "<answer>" * 5000,
        "close_answer_5000": "</answer>" * 5000,
        "think_answer_pairs": "<think>a</think><answer>" * 3000 + "</answer>" * 3000,
        "nested_answer_tags": "<answer>" * 2000 + "9" + "</answer>" * 2000,
        # huge \frac nesting
        "frac_denominator_200": "\\boxed{" + "\\frac{1}{" * 200 + "2" + "}" * 200 + "}",
        "frac_numerator_200": "\\boxed{" + "\\frac{" * 200 + "1" + "}{2}" * 200 + "}",
        "frac_short_chain": "\\boxed{" + "\\frac" * 3000 + "12}",
        "frac_nest_20": "The answer is $" + "\\frac{1}{" * 20 + "2" + "}" * 20 + "$.",
        "sqrt_nest_100": "\\boxed{" + "\\sqrt{" * 100 + "2" + "}" * 100 + "}",
        # powers, factorials, binomials, big operators
        "factorial_1e6": "\\boxed{(10^6)!}",
        "factorial_digits": "\\boxed{100000!}",
        "factorial_plain": "The answer is (10^{6})!.",
        "binomial_big": "\\boxed{\\binom{10^6}{5\\cdot 10^5}}",
        "multinomial_7_8": "\\boxed{(a+b+c+d+e+f+g)^{8}}",
        "binomial_power_1000": "\\boxed{(x+1)^{1000}}",
        "surd_power": "\\boxed{(1+\\sqrt{2}+\\sqrt{3})^{200}}",
        "function_power": "\\boxed{\\sin^{200}(x)}",
        "integral": "\\boxed{\\int_0^{100} x^{x} dx}",
        "series": "\\boxed{\\sum_{k=1}^{10^9} k^k}",
        # long text of other kinds
        "letters_400": "\\boxed{" + "a" * 5000 + "}",
        "matrix_30": "\\boxed{\\begin{pmatrix}"
        + "\\\\".join("&".join(["1"] * 30) for _ in range(30))
        + "\\end{pmatrix}}",
        "dollars_5000": "answer: " + "$1$ " * 5000,
        "answer_word_5000": "answer " * 5000 + "5",
        "anchors_5000": "The answer is 1. " * 5000,
        "long_prose": "word " * 50_000 + "The answer is 5.",
        "unclosed_boxed_5000": "\\boxed{" * 5000 + "1",
        "boxed_text_huge": "\\boxed{\\text{" + "z" * 20_000 + "}}",
        "display_unclosed": "The answer is $$" + "1+" * 2000,
        "mixed_soup": ("{(^_\\frac" * 500) + "The answer is " + "}" * 2000,
        # many boxes read as one answer, "final answer" mentions after a box
        "boxes_chain_5000": "\\boxed{1}, \\boxed{2}, " * 2500,
        "boxes_repeat_5000": "\\boxed{7} " * 5000,
        "boxes_display_env_2000": "$$" + "\\boxed{1}\\qquad\\qquad \\boxed{2}" * 1000 + "$$",
        "boxes_unclosed_chain": "\\boxed{1" * 3000 + "\\boxed{2}",
        "final_answer_after_box": "\\boxed{3}" + " final answer" * 50_000,
        "final_answer_spaces": "\\boxed{3} final answer" + " " * 200_000 + "is 4",
    }
    return out


def _within_bounds(kind: str, text: str) -> None:
    limit = bounds.MAX_ANSWER_CHARS if kind == "boxed" else bounds.ANCHOR_WINDOW_CHARS
    assert len(text) <= limit
    assert bounds.nesting_depth(text) <= bounds.MAX_NESTING_DEPTH
    assert bounds.max_number_digits(text) <= bounds.MAX_NUMBER_DIGITS
    assert bounds.operator_count(text) <= bounds.MAX_OPERATORS
    assert bounds.exponent_depth(text) <= bounds.MAX_EXPONENT_DEPTH
    assert not _CONTROL_CHARS.search(text)
    assert bounds_violation(text, limit) is None


def test_every_family_is_present():
    names = degenerate_completions()
    for family in (
        "braces",
        "digits",
        "chain",
        "tower",
        "sum_3000",
        "control",
        "tags",
        "frac",
        "factorial",
        "binomial",
    ):
        assert any(family in n for n in names), family


def test_degenerate_completions_are_rejected_or_bounded():
    rejected = {}
    for name, completion in degenerate_completions().items():
        for tag, plain in ((True, True), (False, False)):
            trace = prediction_trace(completion, tag, plain)
            assert trace["rejected"] is None or trace["rejected"] in bounds.REJECTION_REASONS, name
            for kind, text in trace["inputs"]:  # what math-verify was handed
                _within_bounds(kind, text)
            if tag:
                rejected[name] = trace["rejected"]
    # the families that math-verify cannot handle cheaply are stopped by the named check
    expect = {
        "boxed_braces_500": "length",
        "parens_1000": "length",
        "braces_9": "nesting_depth",
        "left_right_200": "length",
        "digits_5000_boxed": "length",
        "digits_150": "number_digits",
        "chain_300": "length",
        "braced_tower_50": "nesting_depth",
        "tower_9_9_9": "exponent_value",
        "tower_10_10_10": "exponent_value",
        "big_exponent": "exponent_value",
        "tower_2_5": "exponent_depth",
        "exp_tower_e": "exponent_depth",
        "sum_3000_boxed": "length",
        "sum_3000_plain": "length",
        "sum_3000_dollar": "length",
        "sum_3000_tag": "length",
        "sum_400000": "length",
        "poly_200": "length",
        "frac_denominator_200": "length",
        "frac_nest_20": "nesting_depth",
        "control_boxed": "length",
        "factorial_1e6": "combinatorial_arg",
        "factorial_digits": "combinatorial_arg",
        "factorial_plain": "combinatorial_arg",
        "binomial_big": "combinatorial_arg",
        "multinomial_7_8": "power_expansion",
        "binomial_power_1000": "power_expansion",
        "surd_power": "power_expansion",
        "function_power": "power_expansion",
        "integral": "big_operator",
        "series": "big_operator",
        "letters_400": "length",
        "matrix_30": "length",
        "boxed_text_huge": "length",
        "display_unclosed": "operators",
        "boxes_chain_5000": "length",
        "boxes_display_env_2000": "length",
    }
    for name, reason in expect.items():
        assert rejected[name] == reason, (name, rejected[name])


@pytest.mark.integration
def test_degenerate_batch_through_the_scorer_never_times_out():
    comps = degenerate_completions()
    names = list(comps)
    with RewardScorer(RewardConfig(max_workers=2)) as scorer:
        rows = scorer.score([comps[n] for n in names], ["5"] * len(names))
        assert scorer.timeouts == 0
        assert sum(scorer.rejections.values()) == sum(1 for r in rows if r["rejected"])
    for name, row in zip(names, rows, strict=True):
        assert row["timed_out"] is False, name
        if row["rejected"]:
            assert row["accuracy"] == 0.0 and row["rejected"] in bounds.REJECTION_REASONS, name
    assert sum(1 for r in rows if r["rejected"]) >= 30


def test_rejected_answer_keeps_its_format_reward():
    evil = f"{TH}<answer>\\boxed{{{'(' * 50}5{')' * 50}}}</answer>"
    with RewardScorer(RewardConfig(max_workers=1)) as scorer:
        (row,) = scorer.score([evil], ["5"])
        assert scorer.rejections == {"nesting_depth": 1}
    assert row["rejected"] == "nesting_depth" and row["accuracy"] == 0.0 and row["format"] == 0.2
    assert row["reward"] == pytest.approx(0.2) and row["timed_out"] is False


def test_control_characters_are_blanked_not_scored():
    assert score_accuracy(f"{TH}<answer>18\x00\x0c</answer>", "18")["accuracy"] == 1.0
    assert score_accuracy("So \x07\\boxed{1\x002}", "12")["accuracy"] == 0.0  # "1 2", not "12"
    trace = prediction_trace("\x01\x02The answer is 7.\x03")
    assert trace["parsed"] and all(not _CONTROL_CHARS.search(t) for _, t in trace["inputs"])


# ------------------------------------------------------------------ each check at its threshold
def _at(reason: str, ok: str, bad: str) -> None:
    assert bounds_violation(ok) is None, (reason, ok)
    assert bounds_violation(bad) == reason, (reason, bad, bounds_violation(bad))


def test_length_threshold():
    ok = "\\text{" + "a" * (bounds.MAX_ANSWER_CHARS - 7) + "}"
    assert len(ok) == bounds.MAX_ANSWER_CHARS
    _at("length", ok, ok + " ")
    window = "answer " + "x" * (bounds.ANCHOR_WINDOW_CHARS - 7)
    assert bounds_violation(window, bounds.ANCHOR_WINDOW_CHARS) is None
    assert bounds_violation(window + "x", bounds.ANCHOR_WINDOW_CHARS) == "length"


def test_nesting_threshold():
    d = bounds.MAX_NESTING_DEPTH
    _at("nesting_depth", "{" * d + "1" + "}" * d, "{" * (d + 1) + "1" + "}" * (d + 1))
    _at("nesting_depth", "(" * (d - 1) + "[1]" + ")" * (d - 1), "\\left(" * d + "[1]" + "\\right)" * d)
    assert bounds.nesting_depth("(3,4]") == 1 and bounds.nesting_depth("))((") == 2


def test_digits_threshold():
    d = bounds.MAX_NUMBER_DIGITS
    _at("number_digits", "9" * d, "9" * (d + 1))
    _at("number_digits", "0." + "3" * d, "0." + "3" * (d + 1))
    grouped = "1" + ",000" * 33  # 100 digits once the separators are joined
    _at("number_digits", grouped, grouped + ",000")
    assert bounds.max_number_digits("10,\\!080") == 5 and bounds.max_number_digits("1,-2") == 1


def test_operators_threshold():
    n = bounds.MAX_OPERATORS
    _at("operators", "+".join(["1"] * (n + 1)), "+".join(["1"] * (n + 2)))
    assert bounds.operator_count("a \\cdot b \\times c \\pm d \\\\ e") == 4


def test_big_operator_check():
    _at("big_operator", "\\text{summary}", "\\sum_{k=1}^{3} k")
    for op in ("\\int_0^1 x dx", "\\lim_{x \\to 0} x", "\\prod_{k=1}^{3} k", "\\oint f"):
        assert bounds_violation(op) == "big_operator", op


def test_exponent_depth_threshold():
    _at("exponent_depth", "2^{2^{2^{x}}}", "2^{2^{2^{2^{x}}}}")
    _at("exponent_depth", "a^b^c^d", "a^b^c^d^e")
    assert bounds.exponent_depth("x^2 + y^2") == 1 and bounds.exponent_depth("e^{-x^2}") == 2
    assert bounds.exponent_depth("{x^2}^3") == 1  # a power of a power is not a tower
    assert bounds.exponent_depth("2^\\frac{2^{2^{2}}}{3}") == 3  # superscripts inside a command operand count


def test_exponent_value_threshold():
    v = bounds.MAX_EXPONENT_VALUE
    _at("exponent_value", f"7^{{{v}}}", f"7^{{{v + 1}}}")
    _at("exponent_value", "9^{9^{5}}", "9^{9^{6}}")  # 59049 vs 531441
    _at("exponent_value", "x^{10^{5}}", "x^{10^{5}+1}")
    assert bounds_violation("2^{n \\cdot 10^{4}}") is None  # symbolic exponent: no evaluation


def test_power_expansion_threshold():
    t = bounds.MAX_EXPANSION_TERMS  # (x+1)^n expands to n+1 terms
    _at("power_expansion", f"(x+1)^{{{t - 1}}}", f"(x+1)^{{{t}}}")
    _at("power_expansion", "(a+b+c)^{12}", "(a+b+c)^{13}")  # C(14,2)=91, C(15,2)=105
    _at("power_expansion", f"\\sin^{{{t - 1}}}(x)", f"\\sin^{{{t}}}(x)")
    for fine in ("\\left(\\frac{1}{2}\\right)^{2023}", "\\omega^{1995}", "(-2)^{5000}", "x^{2023}", "(x+1)^n"):
        assert bounds_violation(fine) is None, fine


def test_combinatorial_threshold():
    m = bounds.MAX_COMBINATORIAL_ARG
    _at("combinatorial_arg", f"{m}!", f"{m + 1}!")
    _at("combinatorial_arg", "(10^4)!", "(10^{5})!")
    _at("combinatorial_arg", f"\\binom{{{m}}}{{2}}", f"\\dbinom{{{m + 1}}}{{2}}")
    assert bounds_violation("10,\\!080") is None  # \! is a thin space, not a factorial


def test_numeric_magnitude():
    assert bounds.numeric_log10("1000") == pytest.approx(3)
    assert bounds.numeric_log10("9^{9}") == pytest.approx(9 * 0.9542, rel=1e-3)
    assert bounds.numeric_log10("2 \\cdot 10^{3}") == pytest.approx(3.30103)
    assert bounds.numeric_log10("\\frac{10^{6}}{3}") == pytest.approx(6)
    assert bounds.numeric_log10("9^{9^{9}}") > 1e8
    assert (
        bounds.numeric_log10("x+1") is None and bounds.numeric_log10("") is None and bounds.numeric_log10("(1") is None
    )


def test_thresholds_are_above_every_gold():
    """The checks never reject a gold of the four benchmark sets (the floor each threshold
    must clear); tests/test_gold_self_scoring.py scores those golds through the same path."""
    golds = [g for gs in all_golds().values() for g in gs]
    assert len(golds) > 1500
    worst = {"len": 0, "nest": 0, "digits": 0, "ops": 0, "exp": 0}
    for gold in golds:
        text = normalise_tex_shorthand(gold)
        assert bounds_violation(text) is None, gold
        worst = {
            "len": max(worst["len"], len(text)),
            "nest": max(worst["nest"], bounds.nesting_depth(text)),
            "digits": max(worst["digits"], bounds.max_number_digits(text)),
            "ops": max(worst["ops"], bounds.operator_count(text)),
            "exp": max(worst["exp"], bounds.exponent_depth(text)),
        }
    # comfortably above: at least twice the largest gold value of each measure
    assert 2 * worst["len"] <= bounds.MAX_ANSWER_CHARS and 2 * worst["nest"] <= bounds.MAX_NESTING_DEPTH
    assert 2 * worst["digits"] <= bounds.MAX_NUMBER_DIGITS and 2 * worst["ops"] <= bounds.MAX_OPERATORS
    assert 2 * worst["exp"] <= bounds.MAX_EXPONENT_DEPTH


# ----------------------------------------------------------------- measurement (run by hand)
def ordinary_completions(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """``n`` ordinary completions (half right) in the three answer forms, and their golds."""
    rng = random.Random(seed)
    g = all_golds()
    pool = [(x, "gsm8k") for x in g["gsm8k"]] + [(x, "math500") for x in g["math500"]]
    completions, golds = [], []
    for i in range(n):
        gold, src = pool[rng.randrange(len(pool))]
        if i % 2 == 0:
            answer = gold
        elif src == "gsm8k" and gold.lstrip("-").isdigit():
            answer = str(int(gold) + 1)
        else:
            answer = pool[rng.randrange(len(pool))][0]
        steps = " ".join(
            f"Step {k}: we compute {rng.randint(2, 99)} + {rng.randint(2, 99)} and simplify." for k in range(8)
        )
        form = i % 3
        if form == 0:
            completions.append(f"<think>{steps}</think>\n<answer>{answer}</answer>")
        elif form == 1:
            completions.append(f"{steps}\nThe answer is {answer}.")
        else:
            completions.append(f"{steps} So the result is $\\boxed{{{answer}}}$.")
        golds.append(gold)
    return completions, golds


def measure_batches(n: int = 1000) -> dict:
    """Wall time of ``n`` ordinary and ``n`` degenerate completions through a default RewardScorer."""
    families = list(degenerate_completions().values())
    degenerate = [f"<think>attempt {i}</think>" + families[i % len(families)] for i in range(n)]
    ordinary, golds = ordinary_completions(n)
    with RewardScorer(RewardConfig()) as scorer:
        scorer.score(["\\boxed{1}"] * 4, ["1"] * 4)  # workers ready
        t0 = time.monotonic()
        rows = scorer.score(ordinary, golds)
        t_ordinary = time.monotonic() - t0
        t0 = time.monotonic()
        scorer.score(degenerate, [str(i % 97) for i in range(n)])
        t_degenerate = time.monotonic() - t0
        return {
            "n": n,
            "ordinary_s": round(t_ordinary, 2),
            "degenerate_s": round(t_degenerate, 2),
            "ratio": round(t_degenerate / t_ordinary, 2),
            "ordinary_accuracy": sum(r["accuracy"] for r in rows) / n,
            "timeouts": scorer.timeouts,
            "rejections": dict(scorer.rejections),
            "max_workers": scorer.cfg.max_workers,
            "timeout_s": scorer.cfg.timeout_s,
        }


if __name__ == "__main__":
    print(json.dumps(measure_batches(int(sys.argv[1]) if len(sys.argv) > 1 else 1000), indent=1))
