r"""Answers read as math-verify reads them: several boxes, "final answer ... is", a later final
answer after a box, decimal commas (rewards/extraction.py, module docstring).

The oracle is math-verify itself on the whole completion (``math_verify_accuracy``): its
anchored extraction (no anchorless fallback) with its own pattern priorities, the box
ranked with "final answer ... is" as math-verify's default ``LatexExtractionConfig`` does
(``boxed_priority=0`` is the paper's setting, where the box ranks first). Each case asserts
our score, and that the oracle agrees, or, where we deviate on purpose, that it disagrees
(so a deviation is written here, not found by accident). In-process ``score_accuracy``,
no scorer workers.
"""

from __future__ import annotations

import math_verify as mv
import pytest
from latex2sympy2_extended import NormalizationConfig
from math_verify import ExprExtractionConfig, LatexExtractionConfig

from qerl_pipeline.rewards.extraction import (
    BOX_GAP_CHARS,
    BOX_SEPARATOR_GAP_CHARS,
    box_group,
    gold_is_decimal,
    parse_gold,
    prediction_trace,
    score_accuracy,
)
from qerl_pipeline.rewards.format import has_answer_line


def math_verify_reading(completion: str, boxed_priority: int = 50) -> list:
    """math-verify's own reading of a whole completion (anchored only, the paper's normalisation)."""
    latex = LatexExtractionConfig(
        normalization_config=NormalizationConfig(
            basic_latex=True, units=True, malformed_operators=False, nits=False, boxed="all", equations=False
        ),
        boxed_match_priority=boxed_priority,
        try_extract_without_anchor=False,
    )
    return mv.parse(
        completion,
        [latex, ExprExtractionConfig(try_extract_without_anchor=False)],
        extraction_mode="first_match",
        fallback_mode="no_fallback",
        parsing_timeout=None,
    )


def math_verify_accuracy(completion: str, gold: str, boxed_priority: int = 50) -> float:
    pred = math_verify_reading(completion, boxed_priority)
    return 1.0 if pred and mv.verify(list(parse_gold(gold)), pred, timeout_seconds=None) else 0.0


def _agree(completion: str, gold: str, want: float, **kw) -> None:
    """Our score is ``want``, and math-verify's own reading scores the same."""
    assert score_accuracy(completion, gold)["accuracy"] == want, (completion, gold)
    assert math_verify_accuracy(completion, gold, **kw) == want, ("oracle", completion, gold)


# ------------------------------------------------------------------------------ several boxes
SEVERAL_BOXES = [
    ("So the roots are \\boxed{1}, \\boxed{2}.", "1, 2", "comma between boxes"),
    ("$\\boxed{-2} \\quad\\text{and}\\quad \\boxed{1}$", "-2, 1", "'and' between boxes in inline math"),
    ("The solutions are\n$$\\boxed{-2} \\quad\\text{and}\\quad \\boxed{1}$$", "-2, 1", "display math"),
    ("\\[\\boxed{3}\\]\nand\n\\[\\boxed{5}\\]", "3, 5", "two display environments joined by 'and'"),
    ("$$\\boxed{1} \\qquad\\qquad \\boxed{2}$$", "1, 2", "one display environment, no separator"),
    ("x = \\boxed{2} or x = \\boxed{3}", "2, 3", "'or' between boxes"),
    ("\\boxed{2}\n\nsome more text\n\n\\boxed{2} and \\boxed{3}", "2, 3", "an earlier repeat too far away"),
]


@pytest.mark.parametrize("completion,gold,why", SEVERAL_BOXES)
def test_several_boxes_are_one_set(completion, gold, why):
    _agree(completion, gold, 1.0)
    last = completion.rsplit("\\boxed{", 1)[1].split("}", 1)[0]
    assert score_accuracy(completion, last)["accuracy"] == 0.0, f"{why}: the last box alone is not the answer"


WRONG_BOXES = [
    ("\\boxed{1}, \\boxed{3}", "1, 2", "one element of the set is wrong"),
    ("\\boxed{1}, \\boxed{2}", "2", "a hedge over two answers is not the answer"),
    ("\\boxed{1}, \\boxed{2}, \\boxed{3}", "1, 2", "one element too many"),
    (
        "First \\boxed{2}. After a long detour of working that goes on and on for quite a while longer, \\boxed{3}",
        "2, 3",
        "boxes far apart are not one answer",
    ),
]


@pytest.mark.parametrize("completion,gold,why", WRONG_BOXES)
def test_wrong_box_sets_score_zero(completion, gold, why):
    _agree(completion, gold, 0.0)


def test_box_group_rules():
    near = "\\boxed{1}" + " " * (BOX_GAP_CHARS - 1) + "\\boxed{2}"
    assert box_group(near)[0] == "1,2"
    assert box_group(near.replace(" \\boxed{2}", "  \\boxed{2}"))[0] == "2"  # a gap of BOX_GAP_CHARS, no separator
    with_and = "\\boxed{1}" + " and" + " " * (BOX_SEPARATOR_GAP_CHARS - 5) + "\\boxed{2}"
    assert box_group(with_and)[0] == "1,2"
    assert box_group(with_and.replace(" and", " and "))[0] == "2"  # the separator's reach ends
    assert box_group("\\boxed{7} and \\boxed{7}")[0] == "7"  # a repeat counts once
    assert box_group("\\boxed{7} and later we see \\boxed{7}")[0] == "7"  # a repeat 10+ away is not joined
    assert box_group("\\boxed{1}, \\boxed{2") is None  # the last box is malformed: no box reading
    assert box_group("\\boxed{\\boxed{2}}")[0] == "2"
    assert box_group("no box") is None


# ------------------------------------------------------------------- "final answer ... is" windows
def test_final_answer_window_keeps_final():
    far = "Final Answer: after giving 3 apples to Tom and 2 to Sue, the number Jenny keeps is 42"
    _agree(far, "42", 1.0)
    _agree(far, "3", 0.0)  # a window from "Answer:" reads the first number within 50 characters
    no_strict_anchor = "The final answer to the question about how many apples Jenny keeps in her basket is 42"
    _agree(no_strict_anchor, "42", 1.0)
    assert prediction_trace(far)["inputs"][-1][1].startswith("Final Answer:")


# ------------------------------------------------------------- a later final answer after a box
def test_later_final_answer_wins_over_an_earlier_box():
    later = "We get \\boxed{5}. Wait, let me recheck the second step.\n\nThe final answer is $7$"
    _agree(later, "7", 1.0)
    _agree(later, "5", 0.0)
    _agree("\\boxed{5}. So the final answer to all of this is 7", "7", 1.0)
    # the span after a strict final-answer anchor is read as LaTeX, as without a box: not as 11
    assert score_accuracy("\\boxed{5}. The final answer is 11\\sqrt2.", "11\\sqrt2")["accuracy"] == 1.0
    assert score_accuracy("\\boxed{5}. The final answer is 11\\sqrt2.", "11")["accuracy"] == 0.0


def test_box_wins_when_the_later_text_is_no_final_answer():
    _agree("\\boxed{5}. Wait. Final Answer: 7", "5", 1.0)  # "answer:" ranks below the box in math-verify
    _agree("\\boxed{5}\n\nI hope this final answer is correct.", "5", 1.0)  # nothing after "is": the box
    _agree("The final answer is $\\boxed{7}$", "7", 1.0)  # the box after the anchor is the answer


def test_paper_mode_keeps_the_box_first():
    later = "We get \\boxed{5}. Wait.\n\nThe final answer is $7$"
    assert math_verify_accuracy(later, "5", boxed_priority=0) == 1.0  # the paper's boxed_match_priority=0
    assert score_accuracy(later, "5", anchored_plain=False)["accuracy"] == 1.0
    assert score_accuracy(later, "7", anchored_plain=False)["accuracy"] == 0.0


# ------------------------------------------------------------------------------ decimal commas
def test_decimal_comma_is_a_decimal_where_the_gold_is_one():
    for completion, gold in [
        ("The answer is 1,22", "1.22"),
        ("Final answer: -0,5.", "-\\frac12"),
        ("The answer is 3,14.", "3.14"),
        ("The answer is 18,00", "18.0"),
    ]:
        _agree(completion, gold, 1.0)
    _agree("The answer is 1,22", "1.2", 0.0)


def test_decimal_comma_never_matches_an_integer_gold():
    _agree("The answer is 1,22", "122", 0.0)
    _agree("The answer is 1,234", "1.234", 0.0)  # a comma before three digits is a thousands separator
    _agree("The answer is 1,234", "1234", 1.0)
    # deviation: math-verify reads "18,00" as 18.0 and scores it against the integer gold 18; an
    # integer gold keeps today's list reading, so no completion of an integer-gold run changes score
    assert score_accuracy("The answer is 18,00", "18")["accuracy"] == 0.0
    assert math_verify_accuracy("The answer is 18,00", "18") == 1.0


def test_comma_lists_stay_lists_where_the_gold_is_a_list():
    """Deviation: math-verify reads "-2,1" after an anchor, and as a bare gold, as -2.1; the
    MATH-500 gold "-2,1" is two roots, so a gold list keeps the list reading both ways."""
    assert score_accuracy("The answer is -2,1.", "-2,1")["accuracy"] == 1.0
    assert score_accuracy("The answer is 1,22", "1, 22")["accuracy"] == 1.0
    assert math_verify_accuracy("The answer is 1,22", "1, 22") == 0.0
    assert score_accuracy("The answer is -2.1", "-2,1")["accuracy"] == 0.0  # a wrong answer stays 0
    paper_gold = mv.parse("-2,1", extraction_mode="first_match", fallback_mode="no_fallback", parsing_timeout=None)
    assert mv.verify(paper_gold, math_verify_reading("The answer is -2.1"), timeout_seconds=None)  # why we deviate


def test_gold_is_decimal():
    for gold, want in [
        ("1.22", True),
        ("18.0", True),
        ("\\frac12", True),
        ("-3.5", True),
        ("18", False),
        ("1,234", False),
        ("1,22", False),
        ("(1,2)", False),
        ("x+1", False),
        ("???", False),
    ]:
        assert gold_is_decimal(gold) is want, gold


# ------------------------------------------------------------------- the default run's answers
def _default_run_completions() -> list[tuple[str, str]]:
    """Completions of the form the default (CPU) run produces and rewards: working in prose with
    numbers, decimals, "final answer" mentions and decimal commas, ending with "The answer is N"."""
    out = []
    for n, gold in [(18, "18"), (7, "18"), (1234, "1234"), (0, "0"), (250, "25")]:
        for working in (
            "6 + 12 = 18.",
            "The final answer to part one is 1,5 and",
            "Half is 0,5; final answer:",
            "**Final Answer**: after 3 steps the total is 9",
            "Answer: 12.5 then 1,22 more",
        ):
            for end in (f"The answer is {n}.", f"the answer is: ${n}$", f"So the final answer is {n}"):
                out.append((f"{working}\n\n{end}", gold))
    return out


def test_default_run_answers_read_only_the_final_number():
    """A completion ending with "The answer is N" (no box, integer gold) is read from that line
    alone, by math-verify's plain-number reading: the box, final-answer and decimal-comma rules
    never apply to it (module docstring)."""
    for completion, gold in _default_run_completions():
        assert has_answer_line(completion), completion
        n = completion.rsplit(" ", 1)[1].strip(".$")
        trace = prediction_trace(completion, decimal_gold=gold_is_decimal(gold))
        assert trace["inputs"] == [("window", f"answer: {n}")], completion
        assert score_accuracy(completion, gold)["accuracy"] == (1.0 if n == gold else 0.0), completion
