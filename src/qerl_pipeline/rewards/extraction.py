"""Accuracy: which text of a completion math-verify parses, and whether it matches the gold.

Faithful to the paper's reward, with these deviations:

* Gold: ``math_verify.parse(gold, extraction_mode="first_match")`` with math-verify's
  default extraction targets, as the paper does. Deviation: a gold given as bare LaTeX
  (``\\frac{14}{3}``, ``p - q``, ``\\text{Evelyn}``) carries no delimiter, and math-verify
  extracts nothing from such golds; so a gold with no ``$``/``\\boxed`` is wrapped as
  ``\\boxed{gold}``. No string fallback is kept (``fallback_mode="no_fallback"``): a gold
  that does not parse to a math object gives accuracy 0 and is reported, never a string
  match, so an unparseable gold can never yield reward 1.0. So a bare gold with a comma
  between two numbers (``-2,1``, ``1,22``) is a list, where the paper's parse reads a
  decimal: MATH-500's gold ``-2,1`` is two roots, and reading it as -2.1 would let the wrong
  answer -2.1 score 1.
* Prediction: LaTeX extraction with ``boxed_match_priority=0`` (``\\boxed{}`` first) and
  ``try_extract_without_anchor=False`` (no anchorless fallback), the paper's
  normalisation (basic LaTeX, units, ``boxed="all"``; no nits/malformed-operator fixes),
  ``extraction_mode="first_match"``. Golds and predictions alike first go through
  ``rewards.tex.normalise_tex_shorthand`` (deviation; see there).
* ``RewardConfig.anchored_plain_answers`` (default True, deviation) adds math-verify's
  ``ExprExtractionConfig(try_extract_without_anchor=False)``: a plain number after an
  anchor ("The answer is 2.", "Final answer: 1,234") counts; a bare number with no anchor
  still does not. Small instruct models answer in plain text, never in LaTeX or
  ``<answer>`` tags, so the paper's extraction gives them no learning signal. With it, the
  answer after a strict anchor is also read as LaTeX (below). False = the paper's extraction.
* Where it looks: the content of the last complete ``<answer>...</answer>`` pair when
  the completion has one, else the whole completion. The system prompt (paper App. E)
  asks for the answer inside ``<answer>`` tags, so reasoning numbers inside ``<think>``
  must not be picked up when an answer block exists.
* ``RewardConfig.answer_tag_as_boxed`` (default True, deviation): when the answer block
  holds no ``\\boxed``/anchored LaTeX (e.g. ``<answer> 18 </answer>``), its content is
  scored as if it were ``\\boxed{content}``. The tags are an explicit anchor, as strong as
  ``\\boxed``; the paper's prompt never asks for ``\\boxed``, and without this a model that
  follows the prompt exactly would get accuracy 0. False = the paper's extraction only.

What reaches math-verify (deviation: we pick the answer text, math-verify parses it)
-----------------------------------------------------------------------------------------
math-verify run on a whole completion scans all of it and may parse huge candidates, so
we choose the answer text first (all steps linear in the completion length) and hand
math-verify only that, after the cheap checks of ``rewards.bounds``. In the answer region
(control characters ``\\x00-\\x08 \\x0b-\\x1f \\x7f-\\x9f`` blanked to spaces first, so a
stray NUL neither crashes the parser nor glues two numbers together), in order, the first
that parses wins:

1. the boxes (``box_group``), read as math-verify reads several boxes: the last
   ``\\boxed{...}`` (balanced braces) and, going back from it, each earlier box that is
   fewer than ``BOX_GAP_CHARS`` (10) characters before the box after it, or fewer than
   ``BOX_SEPARATOR_GAP_CHARS`` (70) with "and", "or", "," or ";" between and another
   content, or inside the math environment (``$$...$$``, ``\\[...\\]``, ``\\(...\\)``,
   one-line ``$...$``) that holds the last box; a repeated content counts once. The
   contents, joined by ",", are parsed as ``\\boxed{a,b}``, a set: ``\\boxed{1}, \\boxed{2}``
   and ``$\\boxed{-2} \\quad\\text{and}\\quad \\boxed{1}$`` read {1, 2} and {-2, 1}, so a
   hedge over several boxes does not match one of them. When the last box is malformed,
   there is no box reading (steps 2-4 follow); boxes that do not parse give no answer.
   With ``anchored_plain_answers``, a "final answer ... is" after the last box
   (``FINAL_ANSWER``, math-verify's pattern: "is" within 100 characters; looked for at the
   last ``ANCHOR_TRIES`` mentions of "final answer") is read first: the span after it as
   in step 2 when it is a strict anchor ("The final answer is 7"), then its window as in
   step 3; the boxes only when neither parses.
   math-verify's default priorities rank that pattern with the box and take the later
   one; a later "Answer: 7" ranks below the box there and here. With
   ``anchored_plain_answers`` False (the paper's extraction, whose
   ``boxed_match_priority=0`` ranks the box first) the box still wins;
2. ``anchored_plain_answers`` only: the text after the last strict anchor
   (``ANSWER_ANCHOR``: "answer is", "answer:", "answer =", case-insensitive) up to the end
   of its line and its first sentence-ending period (a display ``$$...$$``/``\\[...\\]``
   whole), ``$``/``\\(\\)`` delimiters, markdown ``**`` and the final period removed, is
   parsed as ``\\boxed{span}``, unless it reads as prose (a word of 3+ letters outside
   ``\\text{}``/commands, a number followed by a word: "18 apples", a ``%``, or ``$``
   inside; then step 3 reads it). A plain number ("1 000 000", "42!", "**18**") is handed
   as ``answer: <number>`` to math-verify's plain-number reading. So "The answer is
   \\frac{3\\sqrt{3}}{4}." scores like its boxed form, and "The answer is 11\\sqrt2." does
   not score as 11. A decimal comma (``1,22``, ``-0,5``: a comma not followed by 3-digit
   groups; ``1,234`` is a thousands separator, as in math-verify) is handed the same way,
   and so read as a decimal as math-verify reads it, when the gold is a number that is not
   an integer (``gold_is_decimal``: ``1.22``, ``18.0``, ``\\frac12``); a set never equals
   such a gold, so this only turns into 1 what math-verify scores 1. Otherwise the span
   stays a list, parsed as ``\\boxed{1,22}`` (deviation: math-verify reads 1.22 whatever the
   gold), so "The answer is -2,1." keeps matching the list gold ``-2,1``, and an integer
   gold is never compared with a decimal reading ("18,00" does not score against 18);
3. a window of ``ANCHOR_WINDOW_CHARS`` from that anchor (or the last "answer" in any
   form; from "final answer" when "final " precedes it, so math-verify's "final answer ...
   is" pattern, which reaches 100 characters, keeps working, not only its "answer"
   pattern, which reaches 50) to math-verify's own anchored patterns (LaTeX, and plain
   numbers with ``anchored_plain_answers``): prose spans and the paper's extraction (so
   "Final Answer: after giving 3 apples ... Jenny keeps is 42" reads 42, not 3).
   math-verify reaches at most 100 characters past the anchor (its "final answer ... is"
   pattern 100 past "final answer"), so the window loses only answers longer than
   ``MAX_ANSWER_CHARS``. Windows from the last ``ANCHOR_TRIES`` strict anchors are tried,
   last first; with no strict anchor, one window from the last "answer". Deviation: an
   anchored answer further back is not seen (math-verify scans the whole text);
4. ``answer_tag_as_boxed``: the whole tag content as ``\\boxed{content}``.

The default (CPU) run's answers are not touched by the boxes, final-answer and
decimal-comma rules: its golds are integers and its completions end with "The answer is
N" without a box, so the first input is ``answer: N`` from the last strict anchor and
step 3 is never reached (tests/test_answer_reading.py checks the inputs of such
completions). tests/test_answer_reading.py compares each rule with math-verify's own
reading of the whole completion and asserts every deviation above.

Self-scoring (tests/test_gold_self_scoring.py, every gold of GSM8K test, MATH-500,
AIME24, AMC23 in ../shared/data, in-process): as ``\\boxed{gold}``, as ``<answer>gold</answer>``
and as "The answer is gold." all score 1. ``KNOWN_PLAIN_MISSES`` lists the MATH-500 golds
that miss in the plain form, each to be explained here: none.
"""

from __future__ import annotations

import logging
import re
from collections import deque
from functools import lru_cache
from typing import Any

from qerl_pipeline.rewards.bounds import ANCHOR_WINDOW_CHARS, MAX_ANSWER_CHARS, bounds_violation
from qerl_pipeline.rewards.format import ANSWER_CLOSE, ANSWER_OPEN
from qerl_pipeline.rewards.tex import match_close, normalise_tex_shorthand

#: Longest parsed answer kept, as text, in a scorer row's ``extracted``.
EXTRACTED_MAX_CHARS = 200
#: MATH-500 golds that still miss as "The answer is {gold}." (each explained in the module
#: docstring); tests/test_gold_self_scoring.py checks the misses are exactly these.
KNOWN_PLAIN_MISSES: tuple[str, ...] = ()
#: MATH-500 golds that score themselves as "The answer is {gold}.".
MATH500_PLAIN_FLOOR = 500 - len(KNOWN_PLAIN_MISSES)

_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def answer_region(completion: str) -> tuple[str, bool]:
    """The content of the last complete <answer>...</answer> pair, or the whole text.

    Returns ``(text, tagged)``; ``tagged`` says whether an answer block was found.
    """
    end = completion.rfind(ANSWER_CLOSE)
    if end >= 0:
        start = completion.rfind(ANSWER_OPEN, 0, end)
        if start >= 0:
            return completion[start + len(ANSWER_OPEN) : end], True
    return completion, False


@lru_cache(maxsize=2)
def _prediction_config(anchored_plain: bool = False) -> tuple:
    from latex2sympy2_extended import NormalizationConfig  # sympy; see _math_verify
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    latex = LatexExtractionConfig(
        normalization_config=NormalizationConfig(
            basic_latex=True, units=True, malformed_operators=False, nits=False, boxed="all", equations=False
        ),
        boxed_match_priority=0,
        try_extract_without_anchor=False,
    )
    return (latex, ExprExtractionConfig(try_extract_without_anchor=False)) if anchored_plain else (latex,)


def _math_verify():
    """The ``math_verify`` module, its loggers quieted (its signal timeout is disabled on
    purpose, and its warning about that is noise)."""
    import math_verify  # pulls in sympy; imported on first use, the scorer's parent never needs it

    for name in ("math_verify", "math_verify.parser", "math_verify.grader", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return math_verify


@lru_cache(maxsize=4096)
def parse_gold(gold: str) -> tuple:
    """Parse a gold answer (first match, math objects only); empty tuple = unparseable."""
    mv = _math_verify()
    text = normalise_tex_shorthand(str(gold).strip())
    if not text:
        return ()
    attempts = [text] if ("\\boxed" in text or "$" in text) else []
    attempts.append(f"\\boxed{{{text}}}")
    for attempt in attempts:
        parsed = mv.parse(attempt, extraction_mode="first_match", fallback_mode="no_fallback", parsing_timeout=None)
        parsed = [p for p in parsed if not isinstance(p, str)]
        if parsed:
            return tuple(parsed)
    return ()


def gold_is_parseable(gold: Any) -> bool:
    """Whether math-verify can parse ``gold`` into a math object (used to validate data rows)."""
    return gold is not None and bool(parse_gold(str(gold)))


@lru_cache(maxsize=4096)
def gold_is_decimal(gold: str) -> bool:
    """Whether ``gold`` parses to a number that is not an integer (``1.22``, ``18.0``,
    ``\\frac12``): then a decimal comma after an anchor is read as a decimal (module docstring)."""
    from sympy import Expr  # sympy is loaded with math-verify by parse_gold

    return any(isinstance(g, Expr) and g.is_number and g.is_integer is not True for g in parse_gold(gold))


#: A strict answer anchor: "The answer is", "the final answer is:", "Answer:", "answer =".
ANSWER_ANCHOR = re.compile(r"\banswer\b[ \t]*(?:is\b[ \t]*:?|:|=)\s*", re.IGNORECASE)
#: math-verify's "final answer ... is" anchor (the "is" within 100 characters of "final answer").
FINAL_ANSWER = re.compile(r"final answer.{0,100}?\sis", re.IGNORECASE | re.DOTALL)
_FINAL = "final "
_FINAL_MENTION = re.compile("final answer", re.IGNORECASE)
#: Two boxes are one answer when fewer than ``BOX_GAP_CHARS`` characters separate them, or fewer
#: than ``BOX_SEPARATOR_GAP_CHARS`` holding a separator (math-verify's reading of several boxes).
BOX_GAP_CHARS, BOX_SEPARATOR_GAP_CHARS = 10, 70
_BOX_SEPARATOR = re.compile(r"\b(?:and|or)\b|[,;]")
_SINGLE_DOLLAR = re.compile(r"(?<![\\$])\$(?!\$)")
#: A decimal comma ("1,22", "-0,5"); a comma before 3-digit groups ("1,234") is a thousands
#: separator and matches ``_PLAIN_NUMBER`` first.
_DECIMAL_COMMA = re.compile(r"-?\d+,\d+")
#: Windows tried from the last strict anchors, last first ("The answer is 7. ... Answer: yes").
ANCHOR_TRIES = 3
_SENTENCE_END = re.compile(r"\.(?=\s|$)")
_TEXT_ARG = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname|begin|end)\s*\{[^{}]*\}")
_CONTROL_WORD = re.compile(r"\\[a-zA-Z]+")
_PROSE_WORD = re.compile(r"[A-Za-z]{3,}")
#: A plain number ("1 000 000", "1,234.5", "$18", "42" of "42!"): math-verify's own anchored reading keeps it.
_PLAIN_NUMBER = re.compile(r"[-+]?\$?(?:\d{1,3}(?:[ ,]\d{3})+|\d+)(?:\.\d+)?")
_NUMBER_THEN_WORD = re.compile(r"^[-+]?\$?\d[\d,]*(?:\.\d+)?\s+[A-Za-z]")


def _boxed_content(region: str, at: int, limit: int | None = None) -> tuple[str, int] | None:
    r"""The content of the ``\boxed{...}`` starting at ``region[at]`` and the index past its
    closing brace, or None when it is malformed or not closed before ``limit``."""
    stop = len(region) if limit is None else limit
    j = at + len("\\boxed")
    while j < stop and region[j].isspace():
        j += 1
    if j >= stop or region[j] != "{":
        return None
    end = match_close(region, j, stop)
    return None if end < 0 else (region[j + 1 : end - 1], end)


def _math_env_start(region: str, at: int, end: int) -> int:
    r"""Start of the math environment holding ``region[at:end]`` (``$$...$$``, ``\[...\]``,
    ``\(...\)``, or ``$...$`` within one line), or -1 when it is in none."""
    if region.count("$$", 0, at) % 2 and region.find("$$", end) >= 0:
        return region.rfind("$$", 0, at)
    for left, right in (("\\[", "\\]"), ("\\(", "\\)")):
        opener = region.rfind(left, 0, at)
        if opener >= 0 and region.find(right, opener, at) < 0 and region.find(right, end) >= 0:
            return opener
    line_start = region.rfind("\n", 0, at) + 1
    line_end = region.find("\n", end)
    before = [m.start() for m in _SINGLE_DOLLAR.finditer(region, line_start, at)]
    if len(before) % 2 and _SINGLE_DOLLAR.search(region, end, len(region) if line_end < 0 else line_end):
        return before[-1]
    return -1


def box_group(region: str) -> tuple[str, int] | None:
    r"""The boxed answer of ``region`` as math-verify reads several boxes, and the index past
    its last box; None when there is no box or the last one is malformed.

    From the last ``\boxed{}`` back, an earlier box joins while the text between it and the
    box after it is shorter than ``BOX_GAP_CHARS``, or shorter than ``BOX_SEPARATOR_GAP_CHARS``
    with "and"/"or"/","/";" in it and a different content, or while it lies in the math
    environment that holds the last box; a content equal to the next one counts once. The
    contents are joined with "," (math-verify's own join), so ``\boxed{1}, \boxed{2}`` is
    read as the set {1, 2}. Linear: each box is scanned once, only up to the box after it,
    and collecting stops once the joined text is longer than ``MAX_ANSWER_CHARS`` (the
    length check then rejects it).
    """
    at = region.rfind("\\boxed")
    last = _boxed_content(region, at) if at >= 0 else None
    if last is None:
        return None
    content, end = last
    env_start = _math_env_start(region, at, end)
    contents, later_at, later = [content], at, content.strip()
    size = len(content)
    while size <= MAX_ANSWER_CHARS:
        prev = region.rfind("\\boxed", 0, later_at)
        got = _boxed_content(region, prev, later_at) if prev >= 0 else None
        if got is None:
            break
        text, close = got
        gap = region[close:later_at]
        same = text.strip() == later
        if not (
            0 <= env_start <= prev
            or len(gap) < BOX_GAP_CHARS
            or (not same and len(gap) < BOX_SEPARATOR_GAP_CHARS and _BOX_SEPARATOR.search(gap))
        ):
            break
        if not same:
            contents.append(text)
            size += len(text) + 1
        later_at, later = prev, text.strip()
    return ",".join(reversed(contents)), end


def _strip_delimiters(span: str) -> str:
    span = span.strip().strip("*").strip()
    for left, right in (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$")):
        if span.startswith(left) and span.endswith(right) and len(span) >= len(left) + len(right):
            return span[len(left) : len(span) - len(right)].strip().rstrip(".").strip()
    if span.startswith("$") and "$" not in span[1:]:
        span = span[1:]  # a currency sign
    return span.strip().rstrip(".").strip()


def anchor_span(region: str, start: int) -> str:
    """The answer written after an anchor ending at ``region[start]``: up to the end of its
    line and its first sentence-ending period (a display ``$$...$$``/``\\[...\\]`` whole),
    without ``$`` delimiters, markdown ``**`` or the final period."""
    rest = region[start : start + MAX_ANSWER_CHARS + 40].lstrip()
    for left, right in (("$$", "$$"), ("\\[", "\\]")):
        if rest.startswith(left):
            end = rest.find(right, len(left))
            return _strip_delimiters(rest if end < 0 else rest[: end + len(right)])
    line = rest.split("\n", 1)[0]
    stop = _SENTENCE_END.search(line)
    return _strip_delimiters(line[: stop.start()] if stop else line)


def _is_prose(span: str) -> bool:
    """True when an anchored span is words, not one math expression ("18 apples", "eighteen",
    "$x$ = $5$", "5%"): then math-verify's own anchored patterns read it (step 3 of the module docstring)."""
    bare = _CONTROL_WORD.sub(" ", _TEXT_ARG.sub(" ", span))
    return bool(
        _PROSE_WORD.search(bare)
        or _NUMBER_THEN_WORD.match(bare)
        or "$" in span.replace("\\$", "")
        or re.search(r"(?<!\\)%", span)
    )


def _span_inputs(region: str, at: int, decimal_gold: bool):
    """Step 2 of the module docstring for the anchor ending at ``region[at]``."""
    span = anchor_span(region, at)
    number = span.rstrip("!")
    if _PLAIN_NUMBER.fullmatch(number) or (decimal_gold and _DECIMAL_COMMA.fullmatch(number)):
        yield "window", f"answer: {number}"  # math-verify's plain-number reading
    elif span and not _is_prose(span):
        yield "boxed", span


def _window(region: str, start: int) -> str:
    """The anchor window from ``region[start]`` (an "answer"), from "final answer" when the
    anchor is one, so math-verify's "final answer ... is" pattern stays in reach."""
    if region[max(0, start - len(_FINAL)) : start].lower() == _FINAL:
        start -= len(_FINAL)
    return region[start : start + ANCHOR_WINDOW_CHARS]


def _final_answer_after(region: str, end: int) -> re.Match | None:
    """The last "final answer ... is" (``FINAL_ANSWER``) after ``region[end]``, looked for at the
    last ``ANCHOR_TRIES`` mentions of "final answer" (one literal scan, then at most
    ``ANCHOR_TRIES`` bounded matches), or None."""
    mentions = deque((m.start() for m in _FINAL_MENTION.finditer(region, end)), maxlen=ANCHOR_TRIES)
    for at in reversed(mentions):
        found = FINAL_ANSWER.match(region, at)
        if found:
            return found
    return None


def _prediction_inputs(completion: str, answer_tag_as_boxed: bool, anchored_plain: bool, decimal_gold: bool = False):
    """Yield, lazily and in order, what math-verify may be given: ``("boxed", answer)``
    (parsed as ``\\boxed{answer}``) or ``("window", text)`` (math-verify's anchored patterns)."""
    region, tagged = answer_region(completion)
    region = _CONTROL_CHARS.sub(" ", region)
    boxes = box_group(region)
    if boxes is not None:
        content, end = boxes
        final = _final_answer_after(region, end) if anchored_plain else None
        if final is not None:  # a later "final answer ... is" is read before the boxes
            anchor = ANSWER_ANCHOR.match(region, final.start() + len(_FINAL))
            if anchor:
                yield from _span_inputs(region, anchor.end(), decimal_gold)
            yield "window", region[final.start() : final.start() + ANCHOR_WINDOW_CHARS]
        yield "boxed", content
        return
    anchors = deque(ANSWER_ANCHOR.finditer(region), maxlen=ANCHOR_TRIES)
    if anchors and anchored_plain:
        yield from _span_inputs(region, anchors[-1].end(), decimal_gold)
    starts = [m.start() for m in reversed(anchors)] or [region.lower().rfind("answer")]
    for start in starts:
        if start >= 0:
            yield "window", _window(region, start)
    if tagged and answer_tag_as_boxed:
        inner = region.strip().strip("$").strip().rstrip(".").strip()
        if inner and "\\boxed" not in inner:
            yield "boxed", inner


def prediction_trace(
    completion: str, answer_tag_as_boxed: bool = True, anchored_plain: bool = True, decimal_gold: bool = False
) -> dict:
    """Extraction with its record: ``{parsed, rejected, inputs}``. ``inputs`` lists what was
    handed to math-verify, in order, as ``(kind, text)``: kind ``boxed`` is parsed as
    ``\\boxed{text}``, kind ``window`` as is. ``rejected`` names the check the next input
    failed (a rejected input never reaches math-verify), else None. ``decimal_gold``
    (``gold_is_decimal``) reads a decimal comma after an anchor as a decimal."""
    mv = _math_verify()
    cfg = _prediction_config(anchored_plain)
    inputs: list[tuple[str, str]] = []
    for kind, text in _prediction_inputs(completion, answer_tag_as_boxed, anchored_plain, decimal_gold):
        text = normalise_tex_shorthand(text)
        reason = bounds_violation(text, MAX_ANSWER_CHARS if kind == "boxed" else ANCHOR_WINDOW_CHARS)
        if reason:
            return {"parsed": [], "rejected": reason, "inputs": inputs}
        inputs.append((kind, text))
        parsed = mv.parse(
            f"\\boxed{{{text}}}" if kind == "boxed" else text,
            extraction_config=cfg,
            extraction_mode="first_match",
            fallback_mode="no_fallback",
            parsing_timeout=None,
        )
        parsed = [p for p in parsed if not isinstance(p, str)]
        if parsed:
            return {"parsed": parsed, "rejected": None, "inputs": inputs}
    return {"parsed": [], "rejected": None, "inputs": inputs}


def extract_prediction(completion: str, answer_tag_as_boxed: bool = True, anchored_plain: bool = True) -> list:
    """Parse a completion's answer (boxed first, anchored only), per the module docstring."""
    return prediction_trace(completion, answer_tag_as_boxed, anchored_plain)["parsed"]


def score_accuracy(completion: str, gold: str, answer_tag_as_boxed: bool = True, anchored_plain: bool = True) -> dict:
    """In-process accuracy (no time limit): ``{accuracy, extracted, gold_parsed, rejected}``.

    This is what each worker runs. The cheap checks bound what reaches math-verify, but
    only the worker's time limit bounds the time: call it directly on trusted inputs.
    """
    gold_parsed = parse_gold(str(gold))
    decimal_gold = bool(gold_parsed) and anchored_plain and gold_is_decimal(str(gold))
    trace = prediction_trace(completion, answer_tag_as_boxed, anchored_plain, decimal_gold)
    pred = trace["parsed"]
    extracted = str(pred[0])[:EXTRACTED_MAX_CHARS] if pred else None
    accuracy = 0.0
    if gold_parsed and pred:
        accuracy = 1.0 if _math_verify().verify(list(gold_parsed), pred, timeout_seconds=None) else 0.0
    return {
        "accuracy": accuracy,
        "extracted": extracted,
        "gold_parsed": bool(gold_parsed),
        "rejected": trace["rejected"],
    }
