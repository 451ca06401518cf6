"""Accuracy: which text of a completion math-verify parses, and whether it matches the gold.

Faithful to the paper's reward, with these deviations:

* Gold: ``math_verify.parse(gold, extraction_mode="first_match")`` with math-verify's
  default extraction targets, as the paper does. Deviation: a gold given as bare LaTeX
  (``\\frac{14}{3}``, ``p - q``, ``\\text{Evelyn}``) carries no delimiter, and math-verify
  extracts nothing from such golds; so a gold with no ``$``/``\\boxed`` is wrapped as
  ``\\boxed{gold}``. No string fallback is kept (``fallback_mode="no_fallback"``): a gold
  that does not parse to a math object gives accuracy 0 and is reported, never a string
  match, so an unparseable gold can never yield reward 1.0.
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

1. the last ``\\boxed{...}`` (balanced braces): parsed as ``\\boxed{content}``, what
   math-verify's first-match boxed priority picks; one difference: several boxes joined
   by "and" in one ``$...$`` are not read as a set, the last box counts;
2. ``anchored_plain_answers`` only: the text after the last strict anchor
   (``ANSWER_ANCHOR``: "answer is", "answer:", "answer =", case-insensitive) up to the end
   of its line and its first sentence-ending period (a display ``$$...$$``/``\\[...\\]``
   whole), ``$``/``\\(\\)`` delimiters, markdown ``**`` and the final period removed, is
   parsed as ``\\boxed{span}``, unless it reads as prose (a word of 3+ letters outside
   ``\\text{}``/commands, a number followed by a word: "18 apples", a ``%``, or ``$``
   inside; then step 3 reads it). A plain number ("1 000 000", "42!", "**18**") is handed
   as ``answer: <number>`` to math-verify's plain-number reading. So "The answer is
   \\frac{3\\sqrt{3}}{4}." scores like its boxed form, and "The answer is 11\\sqrt2." does
   not score as 11;
3. a window of ``ANCHOR_WINDOW_CHARS`` from that anchor (or the last "answer" in any
   form) to math-verify's own anchored patterns (LaTeX, and plain numbers with
   ``anchored_plain_answers``): prose spans and the paper's extraction. math-verify reaches
   at most 100 characters past the anchor, so the window loses only answers longer than
   ``MAX_ANSWER_CHARS``. Windows from the last ``ANCHOR_TRIES`` strict anchors are tried,
   last first; with no strict anchor, one window from the last "answer". Deviation: an
   anchored answer further back is not seen (math-verify scans the whole text);
4. ``answer_tag_as_boxed``: the whole tag content as ``\\boxed{content}``.

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


#: A strict answer anchor: "The answer is", "the final answer is:", "Answer:", "answer =".
ANSWER_ANCHOR = re.compile(r"\banswer\b[ \t]*(?:is\b[ \t]*:?|:|=)\s*", re.IGNORECASE)
#: Windows tried from the last strict anchors, last first ("The answer is 7. ... Answer: yes").
ANCHOR_TRIES = 3
_SENTENCE_END = re.compile(r"\.(?=\s|$)")
_TEXT_ARG = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname|begin|end)\s*\{[^{}]*\}")
_CONTROL_WORD = re.compile(r"\\[a-zA-Z]+")
_PROSE_WORD = re.compile(r"[A-Za-z]{3,}")
#: A plain number ("1 000 000", "1,234.5", "$18", "42" of "42!"): math-verify's own anchored reading keeps it.
_PLAIN_NUMBER = re.compile(r"[-+]?\$?(?:\d{1,3}(?:[ ,]\d{3})+|\d+)(?:\.\d+)?")
_NUMBER_THEN_WORD = re.compile(r"^[-+]?\$?\d[\d,]*(?:\.\d+)?\s+[A-Za-z]")


def _boxed_content(region: str, at: int) -> str | None:
    r"""The content of the ``\boxed{...}`` starting at ``region[at]``, or None when malformed."""
    j = at + len("\\boxed")
    while j < len(region) and region[j].isspace():
        j += 1
    if j >= len(region) or region[j] != "{":
        return None
    end = match_close(region, j)
    return None if end < 0 else region[j + 1 : end - 1]


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
        _PROSE_WORD.search(bare) or _NUMBER_THEN_WORD.match(bare) or "$" in span.replace("\\$", "")
        or re.search(r"(?<!\\)%", span)
    )


def _prediction_inputs(completion: str, answer_tag_as_boxed: bool, anchored_plain: bool):
    """Yield, lazily and in order, what math-verify may be given: ``("boxed", answer)``
    (parsed as ``\\boxed{answer}``) or ``("window", text)`` (math-verify's anchored patterns)."""
    region, tagged = answer_region(completion)
    region = _CONTROL_CHARS.sub(" ", region)
    at = region.rfind("\\boxed")
    if at >= 0:
        content = _boxed_content(region, at)
        if content is not None:
            yield "boxed", content
            return
    anchors = deque(ANSWER_ANCHOR.finditer(region), maxlen=ANCHOR_TRIES)
    if anchors and anchored_plain:
        span = anchor_span(region, anchors[-1].end())
        if _PLAIN_NUMBER.fullmatch(span.rstrip("!")):
            yield "window", f"answer: {span.rstrip('!')}"  # math-verify's plain-number reading
        elif span and not _is_prose(span):
            yield "boxed", span
    starts = [m.start() for m in reversed(anchors)] or [region.lower().rfind("answer")]
    for start in starts:
        if start >= 0:
            yield "window", region[start : start + ANCHOR_WINDOW_CHARS]
    if tagged and answer_tag_as_boxed:
        inner = region.strip().strip("$").strip().rstrip(".").strip()
        if inner and "\\boxed" not in inner:
            yield "boxed", inner


def prediction_trace(completion: str, answer_tag_as_boxed: bool = True, anchored_plain: bool = True) -> dict:
    """Extraction with its record: ``{parsed, rejected, inputs}``. ``inputs`` lists what was
    handed to math-verify, in order, as ``(kind, text)``: kind ``boxed`` is parsed as
    ``\\boxed{text}``, kind ``window`` as is. ``rejected`` names the check the next input
    failed (a rejected input never reaches math-verify), else None."""
    mv = _math_verify()
    cfg = _prediction_config(anchored_plain)
    inputs: list[tuple[str, str]] = []
    for kind, text in _prediction_inputs(completion, answer_tag_as_boxed, anchored_plain):
        text = normalise_tex_shorthand(text)
        reason = bounds_violation(text, MAX_ANSWER_CHARS if kind == "boxed" else ANCHOR_WINDOW_CHARS)
        if reason:
            return {"parsed": [], "rejected": reason, "inputs": inputs}
        inputs.append((kind, text))
        parsed = mv.parse(f"\\boxed{{{text}}}" if kind == "boxed" else text, extraction_config=cfg,
                          extraction_mode="first_match", fallback_mode="no_fallback", parsing_timeout=None)
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
    trace = prediction_trace(completion, answer_tag_as_boxed, anchored_plain)
    pred = trace["parsed"]
    extracted = str(pred[0])[:EXTRACTED_MAX_CHARS] if pred else None
    accuracy = 0.0
    if gold_parsed and pred:
        accuracy = 1.0 if _math_verify().verify(list(gold_parsed), pred, timeout_seconds=None) else 0.0
    return {
        "accuracy": accuracy, "extracted": extracted, "gold_parsed": bool(gold_parsed), "rejected": trace["rejected"],
    }
