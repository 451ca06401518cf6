"""Rewards: math-verify accuracy, format bonus, time limit, threads.

One module-scoped RewardScorer (2 worker processes) serves most tests; scorers with a
short time limit are made where the limit is the point.
"""

from __future__ import annotations

import threading
import time

import pytest

from qerl_pipeline.config import RewardConfig
from qerl_pipeline.rewards import RewardScorer, accuracy_reward, format_reward
from qerl_pipeline.rewards.extraction import answer_region, gold_is_parseable, parse_gold
from qerl_pipeline.rewards.format import has_answer_format

TH = "<think>I add the numbers.</think>"

# (completion, gold, expected accuracy, expected format-ok, why)
CASES = [
    (f"{TH}<answer>18</answer>", "18", 1.0, True, "right, bare number in answer tags"),
    (f"{TH}\n<answer>\\boxed{{18}}</answer>", "18", 1.0, True, "right, boxed in answer tags"),
    ("The total is \\boxed{18}.", "18", 1.0, False, "right, boxed, no tags"),
    (f"{TH}<answer>$\\frac{{1}}{{2}}$</answer>", "0.5", 1.0, True, "right, fraction vs decimal gold"),
    (
        f"{TH}<answer>\\boxed{{\\frac{{14}}{{3}}}}</answer>",
        "\\frac{14}{3}",
        1.0,
        True,
        "right, LaTeX gold (MATH-500 style)",
    ),
    (f"{TH}<answer>1,000</answer>", "1000", 1.0, True, "right, thousands separator"),
    (
        f"{TH}<answer>\\boxed{{(3, \\frac{{\\pi}}{{2}})}}</answer>",
        "\\left( 3, \\frac{\\pi}{2} \\right)",
        1.0,
        True,
        "right, tuple with \\left/\\right gold",
    ),
    (f"{TH}<answer>\\boxed{{x = 5}}</answer>", "5", 1.0, True, "right, equation x = 5"),
    ("<think>9 + 9</think> <answer> 18. </answer>", "18", 1.0, True, "right, trailing period and spaces"),
    ("<think>7 + 5 = 12 so 12</think><answer>\\boxed{12}</answer>", "3", 0.0, True, "wrong, boxed"),
    (f"{TH}<answer>17</answer>", "18", 0.0, True, "wrong, bare number"),
    ("The answer is \\boxed{17}", "18", 0.0, False, "wrong, boxed, no tags"),
    (
        "<think>so it is 18</think><answer>\\boxed{17}</answer> \\boxed{18}",
        "18",
        0.0,
        True,
        "answer block wins over a later boxed",
    ),
    ("I think the answer is 18", "18", 1.0, False, "unboxed, no tags, anchored plain number"),
    ("7 + 11 = 18. The answer is 18.", "18", 1.0, False, "anchored plain number after working"),
    ("So there are 18 apples.", "18", 0.0, False, "unboxed, no anchor: no anchorless fallback"),
    ("18", "18", 0.0, False, "bare number, no tags: no anchorless fallback"),
    ("<think>the sum is 18</think>", "18", 0.0, False, "number only inside think, no answer"),
    (f"{TH}<answer>\\boxed{{18</answer>", "18", 0.0, True, "malformed: unclosed boxed"),
    (f"{TH}<answer></answer>", "18", 0.0, False, "malformed: empty answer block"),
    ("<answer>18", "18", 0.0, False, "malformed: unclosed answer tag, no anchor"),
    ("</answer>18<answer>", "18", 0.0, False, "malformed: tags reversed"),
    ("", "18", 0.0, False, "empty completion"),
    (f"{TH}<answer>the answer is eighteen</answer>", "18", 0.0, True, "words, not a number"),
    (f"{TH}<answer>\\boxed{{18}}</answer>", "not a number ???", 0.0, True, "unparseable gold never scores"),
    (f"{TH}<answer>\\boxed{{}}</answer>", "", 0.0, True, "empty gold never scores"),
]


@pytest.fixture(scope="module")
def scorer():
    with RewardScorer(RewardConfig(timeout_s=5.0, max_workers=2)) as s:
        yield s


def test_case_table_is_large_enough():
    assert len(CASES) >= 20


def test_hand_written_completions(scorer):
    results = scorer.score([c[0] for c in CASES], [c[1] for c in CASES])
    for (completion, gold, acc, fmt_ok, why), r in zip(CASES, results, strict=True):
        assert r["accuracy"] == acc, f"{why}: {completion!r} vs {gold!r} -> {r}"
        assert r["format"] == (0.2 if fmt_ok else 0.0), f"{why}: format {r}"
        assert r["reward"] == pytest.approx(acc + r["format"]), why
        assert r["timed_out"] is False
        assert set(r) >= {"reward", "accuracy", "format", "extracted", "timed_out"}


def test_extracted_answer_reported(scorer):
    right, wrong, none = scorer.score(
        [f"{TH}<answer>\\boxed{{18}}</answer>", f"{TH}<answer>17</answer>", "no answer here"], ["18", "18", "18"]
    )
    assert right["extracted"] == "18" and wrong["extracted"] == "17" and none["extracted"] is None


def test_unparseable_gold_never_full_reward(scorer):
    golds = ["", "   ", "???", "\\boxed{", "$$", "not a number ???"]
    completions = [f"{TH}<answer>{g}</answer>" for g in golds] + [
        f"{TH}<answer>\\boxed{{{g}}}</answer>" for g in golds
    ]
    results = scorer.score(completions, golds + golds)
    for gold, r in zip(golds + golds, results, strict=True):
        assert r["accuracy"] == 0.0 and r["reward"] < 1.0, (gold, r)
        assert r["gold_parsed"] is False
    for gold in golds:
        assert not gold_is_parseable(gold)


def test_every_math500_style_gold_parses():
    for gold in ["p - q", "\\text{Evelyn}", "\\sqrt{51}", "(6,31,-1)", "x^3+3x-6", "90^\\circ", "3, 5, 7", "-2 + 7i"]:
        assert parse_gold(gold), gold


def test_weights_and_format_value():
    cfg = RewardConfig(accuracy_weight=2.0, format_weight=0.5, format_reward=0.4, max_workers=1)
    with RewardScorer(cfg) as s:
        (r,) = s.score([f"{TH}<answer>7</answer>"], ["7"])
    assert r["accuracy"] == 1.0 and r["format"] == 0.4
    assert r["reward"] == pytest.approx(2.0 * 1.0 + 0.5 * 0.4)


def test_paper_extraction_when_both_extensions_off():
    cfg = RewardConfig(answer_tag_as_boxed=False, anchored_plain_answers=False, max_workers=1)
    with RewardScorer(cfg) as s:
        bare, plain, boxed, latex = s.score(
            [f"{TH}<answer>18</answer>", "The answer is 18.", f"{TH}<answer>\\boxed{{18}}</answer>", "answer: $18$"],
            ["18"] * 4,
        )
    assert bare["accuracy"] == 0.0 and plain["accuracy"] == 0.0
    assert boxed["accuracy"] == 1.0 and latex["accuracy"] == 1.0


def test_format_reward_function():
    assert format_reward("<think>a</think><answer>b</answer>") == 0.2
    assert format_reward("<think>a</think>\n\n<answer>b</answer>", value=0.5) == 0.5
    assert format_reward("<think>a</think> text <answer>b</answer>") == 0.0
    assert format_reward("<answer>b</answer><think>a</think>") == 0.0
    assert format_reward("<think></think><answer>b</answer>") == 0.0
    assert format_reward("<think>" * 50_000) == 0.0
    assert has_answer_format("<think>x</think><think>a</think><answer>b</answer>")


def test_answer_line_format_style():
    line = "answer_line"
    assert format_reward("6 + 3 = 9.\n\nThe answer is 9.", style=line) == 0.2
    assert format_reward("So the final answer is: $1,234$", value=0.5, style=line) == 0.5
    assert format_reward("The answer is -3.5  \n\n", style=line) == 0.2
    # the answer line must be the last thing written, and carry a number
    assert format_reward("The answer is 2. Then I keep talking", style=line) == 0.0
    assert format_reward("The answer is two.", style=line) == 0.0
    assert format_reward("answer is 5", style=line) == 0.0
    assert format_reward("The answer is 2\nmore text", style=line) == 0.0
    # the paper's tags do not count as an answer line, and the answer line not as tags
    assert format_reward("<think>a</think><answer>5</answer>", style=line) == 0.0
    assert format_reward("The answer is 5.") == 0.0
    assert format_reward("x" * 1_000_000 + " the answer is 3", style=line) == 0.2
    with pytest.raises(ValueError, match="format_style"):
        format_reward("The answer is 5.", style="boxed")


def test_scorer_uses_the_configured_format_style():
    cfg = RewardConfig(format_style="answer_line", format_reward=0.25, max_workers=1)
    with RewardScorer(cfg) as s:
        right, wrong, rambling = s.score(
            ["The answer is 18.", "The answer is 17.", "The answer is 18. Also 3"], ["18"] * 3
        )
    assert (right["reward"], right["format"]) == (1.25, 0.25)
    assert (wrong["reward"], wrong["accuracy"], wrong["format"]) == (0.25, 0.0, 0.25)
    assert rambling["format"] == 0.0


def test_answer_region():
    assert answer_region("<think>1</think><answer>2</answer><answer>3</answer>") == ("3", True)
    assert answer_region("no tags") == ("no tags", False)


def test_pathological_completion_costs_at_most_the_time_limit():
    # A huge LaTeX sum: math-verify needs seconds on it; the limit is 1 s. The cheap checks
    # reject such a completion before math-verify (tests/test_reward_bounds.py), but golds
    # are not checked, so as a gold it still shows the time limit at work.
    evil = "1+" * 400_000 + "1"
    limit = 1.0
    with RewardScorer(RewardConfig(timeout_s=limit, max_workers=2)) as s:
        s.score(["<answer>1</answer>"], ["1"])  # workers ready
        t0 = time.monotonic()
        results = s.score(["\\boxed{5}", f"{TH}<answer>5</answer>", "\\boxed{6}"], [evil, "5", "6"])
        elapsed = time.monotonic() - t0
        after = s.score(["\\boxed{4}"], ["4"])  # a fresh worker replaced the killed one
    print(f"pathological batch took {elapsed:.2f} s with timeout_s={limit}")
    assert results[0]["timed_out"] is True and results[0]["accuracy"] == 0.0
    assert [r["accuracy"] for r in results[1:]] == [1.0, 1.0]
    assert all(r["timed_out"] is False for r in results[1:])
    assert after[0]["accuracy"] == 1.0
    assert s.timeouts == 1


def test_works_from_threads(scorer):
    out: dict[int, object] = {}

    def work(k: int) -> None:
        try:
            out[k] = (
                accuracy_reward(f"<answer>{k}</answer>", str(k)),
                scorer.score([f"\\boxed{{{k}}}"], [str(k + 1)]),
            )
        except Exception as err:  # surfaced by the assert below
            out[k] = err

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for k in range(4):
        acc, scored = out[k]
        assert acc == 1.0 and scored[0]["accuracy"] == 0.0


def test_length_mismatch_and_closed(scorer):
    with pytest.raises(ValueError, match="2 completions but 1 golds"):
        scorer.score(["a", "b"], ["1"])
    s = RewardScorer(RewardConfig(max_workers=1))
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.score(["a"], ["1"])


def test_throughput_measured(scorer):
    n = 400
    completions = [f"<think>{i} plus 2</think><answer>{i + 2 if i % 3 else i}</answer>" for i in range(n)]
    golds = [str(i + 2) for i in range(n)]
    t0 = time.monotonic()
    results = scorer.score(completions, golds)
    dt = time.monotonic() - t0
    print(f"reward throughput: {n / dt:.0f} completions/s ({scorer.cfg.max_workers} workers)")
    assert sum(r["accuracy"] for r in results) == sum(1 for i in range(n) if i % 3)


def _score_in_child(pair: tuple[str, str]) -> float:
    return accuracy_reward(*pair)


def test_works_inside_daemonic_worker_processes():
    import multiprocessing

    # multiprocessing.Pool workers are daemonic: they may not start multiprocessing children,
    # but the scorer's workers are plain subprocesses, so rewards work there too.
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got = pool.map(_score_in_child, [("<answer>6</answer>", "6"), ("\\boxed{7}", "8")])
    assert got == [1.0, 0.0]
