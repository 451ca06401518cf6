"""A right answer always scores: every gold of the five benchmark sets, written as a model
would write it, scores 1 against itself; near misses and wrong numbers score 0.

The golds come from the offline copies in ../shared/data (skipped when absent), read
through ``data.sources.normalise_row``, so they are exactly the golds training and
evaluation score against. Scoring is ``score_accuracy`` in-process (the same function the
scorer's workers run, cheap checks included), about 20 s for the ~1,900 golds x 3 forms.
"""

from __future__ import annotations

import pytest

from qerl_pipeline.rewards.extraction import KNOWN_PLAIN_MISSES, MATH500_PLAIN_FLOOR, score_accuracy
from qerl_pipeline.rewards.tex import normalise_tex_shorthand
from tests.helpers.golds import all_golds

FORMS = {
    "boxed": "\\boxed{{{}}}",
    "plain": "The answer is {}.",
    "tagged": "<think>I work it out.</think><answer>{}</answer>",
}


@pytest.fixture(scope="module")
def golds() -> dict[str, list[str]]:
    return all_golds()


def _misses(golds: list[str], form: str) -> list[str]:
    """Golds whose ``form`` does not score 1; the cheap checks must pass every one of them."""
    misses = []
    for gold in golds:
        row = score_accuracy(FORMS[form].format(gold), gold)
        assert row["rejected"] is None, (gold, form, row["rejected"])  # the bounds never reject a gold
        if row["accuracy"] != 1.0:
            misses.append(gold)
    return misses


def test_set_sizes(golds):
    assert {k: len(v) for k, v in golds.items()} == {
        "gsm8k": 1319,
        "math500": 500,
        "aime24": 30,
        "aime25": 30,
        "amc23": 40,
    }


@pytest.mark.parametrize("form", ["boxed", "tagged"])
def test_every_gold_scores_itself(golds, form):
    for name, gs in golds.items():
        assert _misses(gs, form) == [], (name, form)


def test_plain_answer_form(golds):
    for name in ("gsm8k", "aime24", "aime25", "amc23"):
        assert _misses(golds[name], "plain") == [], name
    misses = _misses(golds["math500"], "plain")
    # the floor measured 2026-12-01 after the fix: 500 of 500 (391 before); every miss that
    # remains must be one the module docstring lists and explains
    assert len(golds["math500"]) - len(misses) >= MATH500_PLAIN_FLOOR
    assert misses == list(KNOWN_PLAIN_MISSES)


# ----------------------------------------------------------------------- wrong answers stay wrong
WRONG = [
    ("The answer is 17.", "18", "a wrong number after the anchor"),
    ("The answer is 11\\sqrt3.", "11\\sqrt2", "near-miss surd"),
    ("\\boxed{11\\sqrt3}", "11\\sqrt2", "near-miss surd, boxed"),
    ("The answer is 11\\sqrt2.", "11", "a surd is not its coefficient (plain-number extraction took 11)"),
    ("\\boxed{\\frac34}", "\\frac43", "shorthand fraction inverted"),
    ("The answer is \\frac65.", "\\frac56", "shorthand fraction inverted, plain"),
    ("The answer is \\frac432.", "\\frac{4}{3}", "TeX reads \\frac432 as \\frac{4}{3}2"),
    ("The answer is \\frac{270}7.", "\\frac{270}{17}", "near-miss denominator"),
    ("The answer is 2. Then I keep talking about 18.", "18", "the sentence after the answer is not the answer"),
    ("The answer is eighteen.", "18", "words are not numbers"),
    ("The answer is x = 4.", "5", "a wrong equation"),
    ("The answer is (1,2).", "(2,1)", "an ordered pair in the wrong order"),
    ("The answer is 1,-3.", "1,-2", "a wrong list"),
    ("The answer is \\text{west}.", "\\text{east}", "a wrong word answer"),
    ("The answer is \\$32,\\!349.", "\\$32,\\!348", "a wrong amount"),
]
RIGHT = [
    ("The answer is \\frac{4}{3}.", "\\frac43", "explicit vs shorthand fraction"),
    ("\\boxed{\\frac43}", "\\frac{4}{3}", "shorthand prediction vs explicit gold (scored 0 before)"),
    ("<answer>\\frac 59</answer>", "\\frac{5}{9}", "shorthand with a space, in answer tags"),
    ("\\boxed{\\frac{270}{7}}", "\\frac{270}7\\text{ degrees}", "the unit is stripped on both sides"),
    ("The answer is \\frac{270}{7}^\\circ.", "\\frac{270}7\\text{ degrees}", "degrees as \\circ"),
    ("The answer is 270/7 degrees.", "\\frac{270}7\\text{ degrees}", "plain fraction and unit word"),
    ("The answer is 18 apples.", "18", "a number and a word: math-verify's own anchored reading"),
    ("The answer is: $1,234$", "1234", "thousands separator in math mode"),
    ("The final answer is\n$$\n\\frac{1}{2}\n$$", "0.5", "display math after the anchor"),
    ("Answer: **42**", "42", "markdown bold"),
    ("Therefore, the answer is 42!", "42", "an exclamation mark after a plain number is punctuation"),
    ("The answer is 1 000 000.", "1000000", "space thousands separators (math-verify's number reading)"),
    ("Answer: 3, 4, 5", "3, 5, 4", "an unordered list of solutions"),
    ("The answer is $11\\sqrt{2}$.", "11\\sqrt2", "explicit vs shorthand surd"),
    ("So the answer is \\(3\\pi\\).", "3\\pi", "inline \\( \\) delimiters"),
    ("The answer is 7. I hope this answer helps.", "7", "a later mention of 'answer' with no answer after it"),
    ("The answer is 7.\nIs this the answer? Answer: yes", "7", "a later strict anchor with prose after it"),
]


@pytest.mark.parametrize("completion,gold,why", WRONG)
def test_wrong_answers_score_zero(completion, gold, why):
    assert score_accuracy(completion, gold)["accuracy"] == 0.0, why


@pytest.mark.parametrize("completion,gold,why", RIGHT)
def test_right_answers_score_one(completion, gold, why):
    assert score_accuracy(completion, gold)["accuracy"] == 1.0, why


def test_tex_shorthand_normalisation():
    cases = {
        "\\frac43": "\\frac{4}{3}",
        "\\frac 59": "\\frac {5}{9}",
        "\\frac9{19}": "\\frac{9}{19}",
        "\\frac{270}7\\text{ degrees}": "\\frac{270}{7}\\text{ degrees}",
        "\\dfrac\\pi2": "\\dfrac{\\pi}{2}",
        "11\\sqrt2": "11\\sqrt{2}",
        "\\sqrt[3]2": "\\sqrt[3]{2}",
        "\\frac432": "\\frac{4}{3}2",
        "\\frac{\\frac12}3": "\\frac{\\frac{1}{2}}{3}",
        "\\frac{1}{2}": "\\frac{1}{2}",
        "\\fraction 12": "\\fraction 12",
        "\\frac": "\\frac",
        "x^2": "x^2",
    }
    for text, want in cases.items():
        assert normalise_tex_shorthand(text) == want, text
