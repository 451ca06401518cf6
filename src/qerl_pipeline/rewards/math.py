"""Math rewards: math-verify accuracy plus the format bonus, time-limited and thread-safe.

Accuracy (faithful to the paper's reward, with documented extensions)
------------------------------------------------------------------------
* Gold: ``math_verify.parse(gold, extraction_mode="first_match")`` with math-verify's
  default extraction targets, as the paper does. Deviation: a gold given as bare LaTeX
  (``\\frac{14}{3}``, ``p - q``, ``\\text{Evelyn}``) carries no delimiter, and math-verify
  extracts nothing from 51 of the 500 MATH-500 answers that way; so a gold with no
  ``$``/``\\boxed`` is wrapped as ``\\boxed{gold}`` (then every MATH-500 answer parses).
  No string fallback is kept (``fallback_mode="no_fallback"``): a gold that does not
  parse to a math object gives accuracy 0 and is reported, never a string match, so an
  unparseable gold can never yield reward 1.0.
* Prediction: LaTeX extraction with ``boxed_match_priority=0`` (``\\boxed{}`` first) and
  ``try_extract_without_anchor=False`` (no anchorless fallback), the paper's
  normalisation (basic LaTeX, units, ``boxed="all"``; no nits/malformed-operator fixes),
  ``extraction_mode="first_match"``.
* ``RewardConfig.anchored_plain_answers`` (default True) adds math-verify's
  ``ExprExtractionConfig(try_extract_without_anchor=False)``: a plain number after an
  anchor ("The answer is 2.", "Final answer: 1,234") counts; a bare number with no anchor
  still does not. Measured on 16 generator level-1 problems with the paper prompt:
  SmolLM2-135M-Instruct answers in plain text ("... The answer is 2."), never in LaTeX
  or <answer> tags; the paper's extraction scored 0 of 96 completions (greedy and T=1.0),
  with this option 3/16 greedy and 1/64 sampled at T=1.0 are right: a learning signal.
  With it, the answer after a strict anchor is also read as LaTeX (below). False = the
  paper's extraction.
* Where it looks: the content of the last complete ``<answer>...</answer>`` pair when
  the completion has one, else the whole completion. The system prompt (paper App. E)
  asks for the answer inside ``<answer>`` tags, so reasoning numbers inside ``<think>``
  must not be picked up when an answer block exists.
* ``RewardConfig.answer_tag_as_boxed`` (default True): when the answer block holds no
  ``\\boxed``/anchored LaTeX (e.g. ``<answer> 18 </answer>``), its content is scored as
  if it were ``\\boxed{content}``. The tags are an explicit anchor, as strong as
  ``\\boxed``; the paper's prompt never asks for ``\\boxed``, and without this a model
  that follows the prompt exactly would get accuracy 0. False = the paper's extraction only.

What reaches math-verify (deviation: we pick the answer text, math-verify parses it)
-----------------------------------------------------------------------------------------
math-verify run on a whole completion scans all of it and may parse huge candidates, so
we choose the answer text first (all steps linear in the completion length) and hand
math-verify only that, after the cheap checks below. In the answer region (control
characters ``\\x00-\\x08 \\x0b-\\x1f \\x7f-\\x9f`` blanked to spaces first, so a stray NUL
neither crashes the parser nor glues two numbers together), in order, the first that
parses wins:

1. the last ``\\boxed{...}`` (balanced braces): parsed as ``\\boxed{content}``. This is
   what math-verify's first-match boxed priority picked before; one difference: several
   boxes joined by "and" in one ``$...$`` are no longer read as a set, the last box counts;
2. ``anchored_plain_answers`` only: the text after the last strict anchor
   (``ANSWER_ANCHOR``: "answer is", "answer:", "answer =", case-insensitive) up to the end
   of its line and its first sentence-ending period (a display ``$$...$$``/``\\[...\\]``
   whole), ``$``/``\\(\\)`` delimiters, markdown ``**`` and the final period removed, is
   parsed as ``\\boxed{span}``, unless it reads as prose (a word of 3+ letters outside
   ``\\text{}``/commands, a number followed by a word: "18 apples", a ``%``, or ``$``
   inside; then step 3 reads it). A plain number ("1 000 000", "42!", "**18**") is handed
   as ``answer: <number>`` to math-verify's plain-number reading, as before. This makes
   "The answer is \\frac{3\\sqrt{3}}{4}." score like its boxed form, where before only a
   plain number after the anchor was read (391/500 MATH-500 golds scored themselves in
   that form; now 500/500). It also stops "The answer is 11\\sqrt2." scoring as 11;
3. a window of ``ANCHOR_WINDOW_CHARS`` from that anchor (or the last "answer" in any
   form) to math-verify's own anchored patterns (LaTeX, and plain numbers with
   ``anchored_plain_answers``): prose spans and the paper's extraction. math-verify reaches
   at most 100 characters past the anchor, so the window loses only answers longer than
   ``MAX_ANSWER_CHARS``. Windows from the last ``ANCHOR_TRIES`` strict anchors are tried,
   last first; with no strict anchor, one window from the last "answer". Deviation: an
   anchored answer further back is not seen (math-verify scanned the whole text);
4. ``answer_tag_as_boxed``: the whole tag content as ``\\boxed{content}``.

Before parsing, golds and predictions alike get TeX's one-token arguments made explicit
(``normalise_tex_shorthand``: ``\\frac43`` -> ``\\frac{4}{3}``, ``\\frac9{19}``,
``\\frac{270}7``, ``\\sqrt2`` -> ``\\sqrt{2}``; ``\\frac432`` is ``\\frac{4}{3}2`` as in
TeX). math-verify parses the gold with its malformed-operator fixes and the prediction
without them (the paper's setting), so a gold like ``\\frac43`` did not match its own
boxed form, and a model writing ``\\frac43`` for the gold ``\\frac{4}{3}`` scored 0:
8 MATH-500 golds (``11\\sqrt2``, ``\\frac43``, ``\\frac65``, ``\\frac 59``, ``\\frac9{19}``,
``\\frac14``, ``\\frac 34``, ``\\frac{270}7\\text{ degrees}``) failed to score themselves
boxed; now 500/500. We do not switch math-verify's own malformed-operator fixes on: their
regexes read ``\\frac123`` as ``\\frac{1}{23}``. Units (``\\text{ degrees}``) are stripped
by math-verify's ``units`` normalisation on both sides once the fraction is well-formed.

Self-scoring (tests/test_gold_self_scoring.py, every gold of GSM8K test, MATH-500,
AIME24, AMC23 in ../shared/data, in-process): as ``\\boxed{gold}``, as ``<answer>gold</answer>``
and as "The answer is gold." all score 1 (MATH-500 before this change: 492/500 boxed,
391/500 plain). ``KNOWN_PLAIN_MISSES`` lists the MATH-500 golds that still miss in the
plain form, each to be explained here: none remain.

Cheap bounds before math-verify
-------------------------------
A degenerate completion (nested braces, 5,000-digit numbers, exponent towers, 3,000-term
sums, control characters, thousands of tags) used to cost up to the time limit in
math-verify/sympy (measured: a batch of 1,000 took 605 s on the CPU, the 5 s cap hit
several times). ``bounds_violation`` checks the text chosen above (boxed content, anchored
span, tag content or window) before it reaches math-verify; the first check it fails gives
accuracy 0 (format reward as usual), the scorer row's ``rejected`` names it and
``RewardScorer.rejections`` counts it. The floor each threshold must clear is the largest
value among the 9,362 golds of GSM8K train+test, MATH-500, AIME24, AMC23 (normalised; the
boxed answers of the 500 MATH-500 human solutions give no larger values); a threshold
rejects nothing a real final answer needs:

======================  ==========  ===================  ===============================================================
check (``rejected=``)   threshold   largest gold         why no real answer comes near it; cost above it
======================  ==========  ===================  ===============================================================
``length``              400 chars   53                   7x the longest gold (a 3-vector); windows 520
``nesting_depth``       8           2                    4x; ``\\left(\\frac{\\sqrt{3}}{2}\\right)`` is 3; depth 12: 4 s
``number_digits``       100         9                    11x; over 4,300 digits break int parsing
``operators``           60          15                   4x (``x^8 + ... + 1``); 60 terms of x^i: 0.8 s
``big_operator``        0 allowed   0                    ``\\int \\sum \\prod \\lim`` are not answers; integral: 2.4 s
``exponent_depth``      3           1                    3x; ``e^{-x^2}`` is 2; braced 2^2^2^2^2 (4): 1.7 s
``exponent_value``      100,000     8                    ``2^{2023}`` passes; ``9^{9^{9}}``: past 20 s
``power_expansion``     100 terms   1 (no powered sums)  ``(x+1)^{99}`` passes; ``(a+...+g)^{8}``: past 20 s
``combinatorial_arg``   10,000      none                 ``(10^6)!``: 16 s; ``\\binom{10^6}{5 \\cdot 10^5}``: 94 s
======================  ==========  ===================  ===============================================================

Numeric exponents and factorial/binomial arguments are bounded with ``numeric_log10``, a
rough upper bound of log10 |value| of a purely numeric TeX expression (numbers, ``+ - * /
^ !``, ``\\cdot \\times \\frac \\sqrt \\binom \\pi``); a symbolic exponent (``2^{n}``) is not
evaluated by sympy and is not bounded. Run over the 4,208 ``$...$`` snippets of the
MATH-500 human solutions (working, not only answers), the checks fire on 3, none an
answer: two multi-line ``aligned`` derivations (length) and a double ``\\sum``. The checks
are linear, or quadratic in at most 520 characters (length goes first), so a rejected
completion costs microseconds. What passes can still cost up to ~1.5 s in sympy
(``e^{e^{e^{10}}}``, depth 3: 1.5 s; depth-8 braces: 0.7 s), and the worker time limit
stays the backstop.

Measured 2026-12-01 on this 2-core CPU, default ``RewardConfig`` (2 workers, 5 s limit),
``.venv/bin/python -m tests.test_reward_bounds 1000``: 1,000 degenerate completions (the 61
of ``degenerate_completions()`` in tests/test_reward_bounds.py, cycled) took 2.3 s, 1,000
ordinary ones (reasoning + a right or wrong answer boxed, tagged or after "The answer is")
2.8 s: ratio 0.83, no timeout, 791 rejected (three other runs, two under load from other
jobs: 0.39 to 0.82). The goal was at most 20x. The code before these checks took 290 s on
200 of the same degenerate completions (71 timeouts) against 1.7 s for 200 ordinary ones.

Format: ``format_reward`` (0.2 by default) when the completion has the format its
prompt asks for; ``reward.format_style`` says which:

* ``think_answer`` (the paper): a non-empty ``<think>...</think>`` followed (whitespace
  only between) by a non-empty ``<answer>...</answer>`` (the paper's soft format check;
  empty blocks do not count). Found with ``str.find`` scans, linear in the completion
  length, so an adversarial completion cannot make the format check slow.
* ``answer_line`` (deviation, the CPU default's plain prompt "... end with: The answer is
  <number>."): the completion's last non-empty line ends with "the answer is <number>"
  (case-insensitive, optional ``:``/``$``/final ``.``). It is the same kind of signal as
  the paper's: the instruction was followed, whatever the number. Only the last 200
  characters are matched, so it is constant-time in the completion length. Without it
  the 135M default model gets no format reward at all (it never writes the tags).

Time limit and threads
----------------------
math-verify's own timeout uses ``signal.alarm``, which raises off the main thread.
We disable it (``parsing_timeout=None``, ``timeout_seconds=None``) and enforce our own:
``RewardScorer`` keeps ``reward.max_workers`` worker *subprocesses* (plain
``subprocess.Popen`` of this interpreter, so they start from threads, from daemonic
worker processes and inside ``kedro run`` alike, with no fork of the caller), sends
each completion to an idle worker and kills the worker if the answer is not back within
``reward.timeout_s``: that completion scores accuracy 0 with ``timed_out=True`` and a
fresh worker replaces the killed one. A pathological completion costs at most
``timeout_s`` of one worker; the others keep going. Golds are parsed once per worker
(LRU cache).
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import re
import selectors
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from functools import lru_cache
from pathlib import Path
from typing import Any

from qerl_pipeline.config import RewardConfig

log = logging.getLogger(__name__)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
EXTRACTED_MAX_CHARS = 200
#: MATH-500 golds that still miss as "The answer is {gold}." (each explained in the module
#: docstring); tests/test_gold_self_scoring.py checks the misses are exactly these.
KNOWN_PLAIN_MISSES: tuple[str, ...] = ()
#: MATH-500 golds that score themselves as "The answer is {gold}." (measured 2026-12-01: 500).
MATH500_PLAIN_FLOOR = 500 - len(KNOWN_PLAIN_MISSES)
_WORKER_START_TIMEOUT_S = 120.0


# ----------------------------------------------------------------------------- format
def has_answer_format(completion: str) -> bool:
    """True when a non-empty <think> block is followed by a non-empty <answer> block."""
    start = completion.find(THINK_OPEN)
    while start >= 0:
        close = completion.find(THINK_CLOSE, start + len(THINK_OPEN))
        if close < 0:
            return False
        if completion[start + len(THINK_OPEN) : close].strip():
            rest = close + len(THINK_CLOSE)
            while rest < len(completion) and completion[rest].isspace():
                rest += 1
            if completion.startswith(ANSWER_OPEN, rest):
                end = completion.find(ANSWER_CLOSE, rest + len(ANSWER_OPEN))
                if end >= 0 and completion[rest + len(ANSWER_OPEN) : end].strip():
                    return True
        start = completion.find(THINK_OPEN, close + len(THINK_CLOSE))
    return False


_ANSWER_LINE = re.compile(r"the (?:final )?answer is\s*:?\s*\$?\s*-?\d[\d,]*(?:\.\d+)?\s*\$?\s*\.?\Z", re.IGNORECASE)
#: The format checks ``reward.format_style`` selects.
FORMAT_STYLES = ("think_answer", "answer_line")


def has_answer_line(completion: str) -> bool:
    """True when the last non-empty line ends with 'the answer is <number>' (see the module docstring)."""
    tail = completion.rstrip()[-200:]
    return bool(_ANSWER_LINE.search(tail.rsplit("\n", 1)[-1]))


def format_reward(completion: str, value: float = 0.2, style: str = "think_answer") -> float:
    """``value`` when ``completion`` has the ``style`` format (``think_answer``: the paper's
    ``<think>...</think><answer>...</answer>``; ``answer_line``: ends with 'The answer is N'), else 0."""
    if style == "think_answer":
        ok = has_answer_format(completion)
    elif style == "answer_line":
        ok = has_answer_line(completion)
    else:
        raise ValueError(f"reward.format_style {style!r} unknown; allowed: {', '.join(FORMAT_STYLES)}")
    return float(value) if ok else 0.0


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


# ------------------------------------------------------------ cheap bounds (before math-verify)
#: Longest answer text (boxed content, text after an anchor, <answer> content) handed to math-verify.
MAX_ANSWER_CHARS = 400
#: Deepest nesting of ``{`` ``(`` ``[`` (any mix, ``\\left(`` and ``\\{`` included).
MAX_NESTING_DEPTH = 8
#: Most digits in one number (thousands separators ``,`` ``{,}`` ``\\!`` ``\\,`` between 3-digit groups joined).
MAX_NUMBER_DIGITS = 100
#: Most operators and separators (``+ - * / = < > , ; & ^ _ ! |``, ``\\\\``, ``\\cdot`` ``\\times`` ``\\pm`` ...).
MAX_OPERATORS = 60
#: Deepest tower of superscripts (``x^2``: 1, ``e^{-x^2}``: 2; a bare chain ``2^2^2`` counts as a tower).
MAX_EXPONENT_DEPTH = 3
#: Largest numeric value of one exponent (``7^{123456789}`` and ``9^{9^{9}}`` go over it).
MAX_EXPONENT_VALUE = 100_000
#: Most terms the multinomial expansion of a powered sum may have: C(n+k-1, k-1) for a bracketed
#: base of k top-level terms (a function base like ``\\sin^{n}`` counts as k=2) raised to a numeric n.
MAX_EXPANSION_TERMS = 100
#: Largest numeric argument of ``!`` and of ``\\binom``/``\\dbinom``/``\\tbinom``.
MAX_COMBINATORIAL_ARG = 10_000
#: Unevaluated big operators: an answer that still holds one is rejected (none allowed).
BIG_OPERATORS = ("\\int", "\\iint", "\\iiint", "\\oint", "\\sum", "\\prod", "\\lim")
#: Text handed to math-verify's own anchored patterns (after an "answer" with no strict anchor or
#: prose after it): the anchor word, math-verify's own reach after it (<= 100 characters), one answer.
ANCHOR_WINDOW_CHARS = 100 + MAX_ANSWER_CHARS + 20
#: The names a rejected completion's ``rejected`` field can take (one per check, in check order).
REJECTION_REASONS = (
    "length", "nesting_depth", "number_digits", "operators", "big_operator",
    "exponent_depth", "exponent_value", "power_expansion", "combinatorial_arg",
)

_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_DIGITS = re.compile(r"\d+")
_THOUSANDS_SEP = re.compile(r"(?<=\d)(?:\{,\}|,|\\!|\\,)+(?=\d{3}(?!\d))")
_OPERATOR_CMDS = re.compile(
    r"\\\\|\\(?:cdot|times|div|pm|mp|cup|cap|setminus|le|ge|leq|geq|ne|neq|lt|gt|wedge|vee)(?![a-zA-Z])"
)
_OPERATOR_CHARS = frozenset("+-*/=<>,;&^_!|")
_BIG_OPERATOR = re.compile(r"\\(?:i{1,3}nt|oint|sum|prod|lim)(?![a-zA-Z])")
_OPEN, _CLOSE = "{([", "})]"
_FUNCTIONS = frozenset(
    "sin cos tan cot sec csc sinh cosh tanh coth arcsin arccos arctan log ln lg exp".split()
)
_LOG10_EXPONENT_MAX = math.log10(MAX_EXPONENT_VALUE) + 1e-9  # the tolerance absorbs float rounding


def _match_close(text: str, i: int) -> int:
    """Index just past the bracket group opening at ``text[i]`` (same family), or -1 if unclosed."""
    opener = text[i]
    closer = _CLOSE[_OPEN.index(opener)]
    depth = 0
    for j in range(i, len(text)):
        c = text[j]
        if c == opener:
            depth += 1
        elif c == closer:
            depth -= 1
            if depth == 0:
                return j + 1
    return -1


def _match_open(text: str, j: int) -> int:
    """Index of the opener of the bracket group closing at ``text[j]``, or -1."""
    closer = text[j]
    opener = _OPEN[_CLOSE.index(closer)]
    depth = 0
    for i in range(j, -1, -1):
        c = text[i]
        if c == closer:
            depth += 1
        elif c == opener:
            depth -= 1
            if depth == 0:
                return i
    return -1


def _operand_after(text: str, i: int) -> tuple[str, int]:
    """The TeX operand starting at ``text[i]`` (a bracket group's content, a digit run, a
    control word with its brace arguments, or one character) and the index after it."""
    n = len(text)
    while i < n and text[i].isspace():
        i += 1
    if i >= n:
        return "", n
    c = text[i]
    if c in _OPEN:
        end = _match_close(text, i)
        end = n if end < 0 else end
        return text[i + 1 : end - 1], end
    if c.isdigit():
        j = i
        while j < n and (text[j].isdigit() or text[j] == "."):
            j += 1
        return text[i:j], j
    if c == "\\":
        j = i + 1
        while j < n and text[j].isalpha():
            j += 1
        j = max(j, i + 2)
        k = j
        while k < n and text[k] == "{":  # \frac{..}{..}: the arguments belong to the operand
            end = _match_close(text, k)
            if end < 0:
                break
            k = end
        return text[i:k], k
    return c, i + 1


# A rough magnitude evaluator for purely numeric TeX (numbers, + - * / ^ ! \cdot \times \frac
# \sqrt \binom \pi, brackets): log10 of an upper bound of |value| (0 for |value| <= 1), or None
# when the text is not purely numeric. Only used to bound exponents and factorial arguments.
_NUM_TOKEN = re.compile(r"\\[a-zA-Z]+|\\.|\d+(?:\.\d*)?|\.\d+|\S")
_IMPLICIT_PRODUCT = frozenset({"{", "(", "[", "\\frac", "\\dfrac", "\\tfrac", "\\sqrt", "\\pi", "\\binom"})
_NUM_SKIP = frozenset({"\\left", "\\right", "\\,", "\\!", "\\;", "\\:", "\\ ", "\\displaystyle"})


class _NotNumeric(Exception):
    pass


class _Magnitude:
    def __init__(self, text: str) -> None:
        self.toks = [t for t in _NUM_TOKEN.findall(text) if t not in _NUM_SKIP]
        self.pos = 0

    def peek(self) -> str | None:
        return self.toks[self.pos] if self.pos < len(self.toks) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise _NotNumeric
        self.pos += 1
        return tok

    def run(self) -> float:
        value = self.expr()
        if self.peek() is not None:
            raise _NotNumeric
        return value

    def expr(self) -> float:
        value = self.term()
        while self.peek() in ("+", "-"):
            self.take()
            value = max(value, self.term()) + 0.30103
        return value

    def term(self) -> float:
        value = self.factor()
        while True:
            tok = self.peek()
            if tok in ("*", "\\cdot", "\\times"):
                self.take()
                value += self.factor()
            elif tok in ("/", "\\div"):
                self.take()
                self.factor()  # |a / b| is bounded by |a| for |b| >= 1 (rough)
            elif tok is not None and (tok[0].isdigit() or tok[0] == "." or tok in _IMPLICIT_PRODUCT):
                value += self.factor()  # implicit product
            else:
                return value

    def factor(self) -> float:
        if self.peek() in ("-", "+"):
            self.take()
            return self.factor()
        base = self.atom()
        while self.peek() == "!":
            self.take()
            count = 10.0 ** min(base, 300.0)
            base = count * math.log10(count) if count > 1 else 0.0
        if self.peek() == "^":
            self.take()
            exponent = self.factor()
            return 0.0 if base <= 0 else (math.inf if exponent > 300 else base * 10.0 ** exponent)
        return base

    def group(self) -> float:
        tok = self.take()
        if tok not in _OPEN:
            raise _NotNumeric
        value = self.expr()
        if self.take() not in _CLOSE:
            raise _NotNumeric
        return value

    def atom(self) -> float:
        tok = self.peek()
        if tok is None:
            raise _NotNumeric
        if tok in _OPEN:
            return self.group()
        self.take()
        if tok[0].isdigit() or tok[0] == ".":
            whole = tok.split(".")[0].lstrip("0")
            return float(len(whole)) if len(whole) > 15 else math.log10(max(float(tok), 1.0))
        if tok == "\\pi":
            return 0.5
        if tok in ("\\frac", "\\dfrac", "\\tfrac"):
            num = self.group()
            self.group()
            return num
        if tok == "\\sqrt":
            if self.peek() == "[":
                self.group()
            return self.group() / 2
        if tok == "\\binom":
            top = self.group()
            self.group()
            return 0.30103 * 10.0 ** min(top, 300.0)
        raise _NotNumeric


def numeric_log10(text: str) -> float | None:
    """log10 of a rough upper bound of the value of a purely numeric TeX expression, else None."""
    if not text.strip():
        return None
    try:
        return _Magnitude(text).run()
    except (_NotNumeric, OverflowError, ValueError, RecursionError):
        return None


def _too_big(text: str, limit: float) -> bool:
    bound = numeric_log10(text)
    return bound is not None and bound > math.log10(limit) + 1e-9


def nesting_depth(text: str) -> int:
    """Deepest nesting of ``{ ( [`` in ``text`` (one counter for all three; stray closers ignored)."""
    depth = best = 0
    for c in text:
        if c in _OPEN:
            depth += 1
            best = max(best, depth)
        elif c in _CLOSE and depth:
            depth -= 1
    return best


def max_number_digits(text: str) -> int:
    """Digits of the longest number (thousands separators between 3-digit groups joined)."""
    return max((len(m) for m in _DIGITS.findall(_THOUSANDS_SEP.sub("", text))), default=0)


def operator_count(text: str) -> int:
    """Operators and separators in ``text`` (see ``MAX_OPERATORS``)."""
    return sum(1 for c in text if c in _OPERATOR_CHARS) + len(_OPERATOR_CMDS.findall(text))


def exponent_depth(text: str) -> int:
    """Deepest tower of superscripts; ``a^b^c`` (bare tokens) counts as nested, like ``a^{b^{c}}``."""
    stack: list[int] = []  # superscript level inside each open bracket
    level = best = 0
    chain = 0  # level of a bare-token exponent that a following '^' would stack on
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "^":
            j = i + 1
            while j < n and text[j].isspace():
                j += 1
            inner = max(level, chain) + 1
            best = max(best, inner)
            if j < n and text[j] in _OPEN:
                stack.append(level)
                level = inner
                chain = 0
                i = j + 1
                continue
            operand, i = _operand_after(text, j)
            if operand.startswith("\\"):  # ^\frac{..}{..}: superscripts inside count one level up
                best = max(best, inner + exponent_depth(operand))
            chain = inner
            continue
        if c in _OPEN:
            stack.append(level)
        elif c in _CLOSE and stack:
            level = stack.pop()
        if not c.isspace():
            chain = 0
        i += 1
    return best


def _top_level_terms(group: str) -> int:
    """Additive terms at the top level of ``group`` (a leading sign does not start a term)."""
    depth, terms, prev = 0, 1, ""
    for c in group:
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth = max(0, depth - 1)
        elif c in "+-" and depth == 0 and prev.strip() not in ("", "+", "-", "(", "{", "[", "^", "_", "=", ","):
            terms += 1
        if not c.isspace():
            prev = c
    return terms


def _power_violation(text: str) -> str | None:
    """``exponent_value`` / ``power_expansion`` for the superscripts of ``text``, else None."""
    i = text.find("^")
    while i >= 0:
        exponent, _ = _operand_after(text, i + 1)
        bound = numeric_log10(exponent)
        if bound is not None:
            if bound > _LOG10_EXPONENT_MAX:
                return "exponent_value"
            n = int(round(10.0 ** bound))
            j = i - 1
            while j >= 0 and text[j].isspace():
                j -= 1
            k = 1
            if j >= 0 and text[j] in _CLOSE:
                start = _match_open(text, j)
                if start >= 0:
                    k = _top_level_terms(text[start + 1 : j])
            elif j >= 0 and text[j].isalpha():
                w = j
                while w >= 0 and text[w].isalpha():
                    w -= 1
                if w >= 0 and text[w] == "\\" and text[w + 1 : j + 1] in _FUNCTIONS:  # \sin^{n}(x): a function power
                    k = 2
            if k > 1 and math.comb(n + k - 1, k - 1) > MAX_EXPANSION_TERMS:
                return "power_expansion"
        i = text.find("^", i + 1)
    return None


def _combinatorial_violation(text: str) -> bool:
    i = text.find("!")
    while i >= 0:
        if i > 0 and text[i - 1] != "\\":  # \! is a thin space
            j = i - 1
            while j >= 0 and text[j].isspace():
                j -= 1
            arg = ""
            if j >= 0 and text[j] in _CLOSE:
                start = _match_open(text, j)
                arg = text[start + 1 : j] if start >= 0 else ""
            elif j >= 0 and text[j].isdigit():
                k = j
                while k >= 0 and text[k].isdigit():
                    k -= 1
                arg = text[k + 1 : j + 1]
            if arg and _too_big(arg, MAX_COMBINATORIAL_ARG):
                return True
        i = text.find("!", i + 1)
    for m in re.finditer(r"\\[dt]?binom(?![a-zA-Z])", text):
        top, end = _operand_after(text, m.end())
        bottom, _ = _operand_after(text, end)
        if _too_big(top, MAX_COMBINATORIAL_ARG) or _too_big(bottom, MAX_COMBINATORIAL_ARG):
            return True
    return False


def bounds_violation(text: str, max_chars: int = MAX_ANSWER_CHARS) -> str | None:
    """The first cheap check ``text`` fails (a name from ``REJECTION_REASONS``), or None.

    ``text`` is what would reach math-verify (see the module docstring); ``max_chars`` is
    ``ANCHOR_WINDOW_CHARS`` for an anchor window. Every check is linear, or quadratic in at
    most ``max_chars`` characters, since the length check goes first.
    """
    if len(text) > max_chars:
        return "length"
    if nesting_depth(text) > MAX_NESTING_DEPTH:
        return "nesting_depth"
    if max_number_digits(text) > MAX_NUMBER_DIGITS:
        return "number_digits"
    if operator_count(text) > MAX_OPERATORS:
        return "operators"
    if _BIG_OPERATOR.search(text):
        return "big_operator"
    if exponent_depth(text) > MAX_EXPONENT_DEPTH:
        return "exponent_depth"
    power = _power_violation(text)
    if power:
        return power
    if _combinatorial_violation(text):
        return "combinatorial_arg"
    return None


# --------------------------------------------------------------------- math-verify
_SHORTHAND = re.compile(r"\\(?:[dt]?frac|sqrt)(?![a-zA-Z])")


def normalise_tex_shorthand(text: str) -> str:
    r"""TeX's one-token arguments made explicit, as TeX reads them: ``\frac43`` -> ``\frac{4}{3}``,
    ``\frac 59``, ``\frac9{19}``, ``\frac{270}7``, ``\frac\pi2`` -> ``\frac{\pi}{2}``, ``\sqrt2`` ->
    ``\sqrt{2}`` (``\frac432`` is ``\frac{4}{3}2``, as in TeX). Applied to golds and predictions alike."""
    if "frac" not in text and "sqrt" not in text:
        return text
    inserts: list[tuple[int, str]] = []
    n = len(text)
    for m in _SHORTHAND.finditer(text):
        i = m.end()
        nargs = 2
        if m.group().endswith("sqrt"):
            nargs = 1
            k = i
            while k < n and text[k].isspace():
                k += 1
            if k < n and text[k] == "[":
                end = _match_close(text, k)
                if end < 0:
                    continue
                i = end
        for _ in range(nargs):
            while i < n and text[i].isspace():
                i += 1
            if i >= n:
                break
            c = text[i]
            if c == "{":
                end = _match_close(text, i)
                if end < 0:
                    break
                i = end
                continue
            if c == "\\":
                j = i + 1
                while j < n and text[j].isalpha():
                    j += 1
                j = max(j, i + 2)
                if _SHORTHAND.match(text, i):
                    break
            elif c.isalnum():
                j = i + 1
            else:
                break
            inserts += [(i, "{"), (j, "}")]
            i = j
    if not inserts:
        return text
    out, pos = [], 0
    for at, piece in sorted(inserts, key=lambda x: x[0]):
        out.append(text[pos:at])
        out.append(piece)
        pos = at
    out.append(text[pos:])
    return "".join(out)


@lru_cache(maxsize=2)
def _prediction_config(anchored_plain: bool = False) -> tuple:
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    latex = LatexExtractionConfig(
        normalization_config=NormalizationConfig(
            basic_latex=True, units=True, malformed_operators=False, nits=False, boxed="all", equations=False
        ),
        boxed_match_priority=0,
        try_extract_without_anchor=False,
    )
    return (latex, ExprExtractionConfig(try_extract_without_anchor=False)) if anchored_plain else (latex,)


def _quiet_math_verify() -> None:
    # We disable math-verify's signal timeout on purpose; its warning about that is noise.
    for name in ("math_verify", "math_verify.parser", "math_verify.grader", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.ERROR)


@lru_cache(maxsize=4096)
def parse_gold(gold: str) -> tuple:
    """Parse a gold answer (first match, math objects only); empty tuple = unparseable."""
    from math_verify import parse

    _quiet_math_verify()
    text = normalise_tex_shorthand(str(gold).strip())
    if not text:
        return ()
    attempts = [text] if ("\\boxed" in text or "$" in text) else []
    attempts.append(f"\\boxed{{{text}}}")
    for attempt in attempts:
        parsed = parse(attempt, extraction_mode="first_match", fallback_mode="no_fallback", parsing_timeout=None)
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
    end = _match_close(region, j)
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
    "$x$ = $5$", "5%"): then math-verify's own anchored patterns read it, as before."""
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
    from math_verify import parse

    _quiet_math_verify()
    cfg = _prediction_config(anchored_plain)
    inputs: list[tuple[str, str]] = []
    for kind, text in _prediction_inputs(completion, answer_tag_as_boxed, anchored_plain):
        text = normalise_tex_shorthand(text)
        reason = bounds_violation(text, MAX_ANSWER_CHARS if kind == "boxed" else ANCHOR_WINDOW_CHARS)
        if reason:
            return {"parsed": [], "rejected": reason, "inputs": inputs}
        inputs.append((kind, text))
        parsed = parse(f"\\boxed{{{text}}}" if kind == "boxed" else text, extraction_config=cfg,
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
    from math_verify import verify

    gold_parsed = parse_gold(str(gold))
    trace = prediction_trace(completion, answer_tag_as_boxed, anchored_plain)
    pred = trace["parsed"]
    extracted = str(pred[0])[:EXTRACTED_MAX_CHARS] if pred else None
    accuracy = 0.0
    if gold_parsed and pred:
        accuracy = 1.0 if verify(list(gold_parsed), pred, timeout_seconds=None) else 0.0
    return {
        "accuracy": accuracy, "extracted": extracted, "gold_parsed": bool(gold_parsed), "rejected": trace["rejected"],
    }


# -------------------------------------------------------------------------- worker
def _worker_main() -> None:
    """Subprocess loop: one JSON request per stdin line, one JSON answer per line.

    Ends when stdin closes or the parent stops reading (parent gone: an orphaned worker
    exits by itself instead of lingering).
    """
    try:
        _worker_loop()
    except (BrokenPipeError, KeyboardInterrupt):
        pass


def _worker_loop() -> None:
    proto = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # stray prints from libraries must not corrupt the protocol
    sys.stdout = sys.stderr
    _quiet_math_verify()
    score_accuracy("<answer>1</answer>", "1")  # warm imports and regex caches
    proto.write(b'{"ready": true}\n')
    for line in sys.stdin.buffer:
        req = json.loads(line)
        try:
            out = score_accuracy(req["c"], req["g"], req["tag"], req["plain"])
        except Exception as err:  # noqa: BLE001 - a scoring error is accuracy 0, reported
            out = {"accuracy": 0.0, "extracted": None, "gold_parsed": False, "rejected": None, "error": repr(err)[:200]}
        proto.write((json.dumps(out) + "\n").encode())


class _Worker:
    """One scoring subprocess and its line buffer."""

    def __init__(self) -> None:
        src = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from qerl_pipeline.rewards.math import _worker_main; _worker_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True,
        )
        self.fd = self.proc.stdout.fileno()
        self.buf = b""
        self.ready = False
        self.started = time.monotonic()
        self.item: int | None = None
        self.deadline = 0.0

    def read_lines(self) -> list[bytes] | None:
        """Lines now available; None when the worker closed its output (died)."""
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            return None
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        return lines

    def send(self, item: int, completion: str, gold: str, cfg: RewardConfig) -> None:
        self.item = item
        self.deadline = time.monotonic() + cfg.timeout_s
        req = {"c": completion, "g": gold, "tag": cfg.answer_tag_as_boxed, "plain": cfg.anchored_plain_answers}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class RewardScorer:
    """Scores completions against golds in worker subprocesses with a per-item time limit.

    ``score(completions, golds)`` returns one dict per completion with keys ``reward``,
    ``accuracy``, ``format``, ``extracted`` (parsed answer as str, or None),
    ``timed_out``, ``gold_parsed`` (False flags a gold math-verify cannot parse;
    None when unknown because the item timed out or its worker died) and ``rejected``
    (the name of the cheap check that rejected the answer before math-verify, else None;
    ``self.rejections`` counts them by name, ``self.timeouts`` the timeouts).
    Thread-safe (calls are serialised); use as a context manager or call ``close()``.
    """

    def __init__(self, cfg: RewardConfig | dict | None = None) -> None:
        from qerl_pipeline.config import parse as parse_section

        self.cfg: RewardConfig = parse_section(RewardConfig, cfg, "reward")
        self._lock = threading.Lock()
        self._workers: list[_Worker] = [_Worker() for _ in range(self.cfg.max_workers)]
        self._closed = False
        self.timeouts = 0  # completions that hit the time limit since creation
        self.rejections: Counter[str] = Counter()  # completions a cheap check rejected, by check name

    # -- lifecycle
    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        with self._lock:
            for w in self._workers:
                w.kill()
            self._workers = []
            self._closed = True

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; close() is the contract
        try:
            if not self._closed:
                self.close()
        except Exception:  # noqa: BLE001
            pass

    # -- scoring
    def score(self, completions: list[str], golds: list[str]) -> list[dict]:
        """Rewards for ``completions[i]`` against ``golds[i]`` (same length)."""
        if len(completions) != len(golds):
            raise ValueError(f"score: {len(completions)} completions but {len(golds)} golds")
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardScorer is closed")
            acc = self._run([str(c) for c in completions], [str(g) for g in golds])
            self.rejections.update(a["rejected"] for a in acc if a.get("rejected"))
        out = []
        for completion, a in zip(completions, acc):
            fmt = format_reward(str(completion), self.cfg.format_reward, self.cfg.format_style)
            out.append({
                "reward": self.cfg.accuracy_weight * a["accuracy"] + self.cfg.format_weight * fmt,
                "accuracy": a["accuracy"],
                "format": fmt,
                "extracted": a["extracted"],
                "timed_out": a["timed_out"],
                "gold_parsed": a["gold_parsed"],
                "rejected": a.get("rejected"),
            })

        return out

    def _run(self, completions: list[str], golds: list[str]) -> list[dict]:
        n = len(completions)
        results: list[dict | None] = [None] * n
        pending = list(range(n - 1, -1, -1))  # pop() takes the lowest index first
        sel = selectors.DefaultSelector()
        for w in self._workers:
            sel.register(w.fd, selectors.EVENT_READ, w)
        try:
            while pending or any(w.item is not None for w in self._workers):
                for w in self._workers:
                    if w.ready and w.item is None and pending:
                        i = pending.pop()
                        try:
                            w.send(i, completions[i], golds[i], self.cfg)
                        except (BrokenPipeError, OSError):
                            pending.append(i)
                            w.item = None
                            self._replace(w, sel, "its input pipe broke")
                now = time.monotonic()
                waits = [w.deadline - now for w in self._workers if w.item is not None]
                waits += [w.started + _WORKER_START_TIMEOUT_S - now for w in self._workers if not w.ready]
                events = sel.select(timeout=max(0.0, min(waits)) if waits else None)
                for key, _ in events:
                    w: _Worker = key.data
                    lines = w.read_lines()
                    if lines is None:
                        if w.item is not None:  # died while scoring: accuracy 0, not a timeout
                            results[w.item] = {"accuracy": 0.0, "extracted": None, "gold_parsed": None, "timed_out": False}
                            log.warning("reward worker died while scoring completion %d", w.item)
                        elif not w.ready:
                            raise RuntimeError("reward worker exited during start-up (see its stderr above)")
                        self._replace(w, sel, "it exited")
                        continue
                    for line in lines:
                        msg = json.loads(line)
                        if msg.get("ready"):
                            w.ready = True
                        elif w.item is not None:
                            if "error" in msg:
                                log.warning("reward scoring error on completion %d: %s", w.item, msg["error"])
                            msg["timed_out"] = False
                            results[w.item] = msg
                            w.item = None
                now = time.monotonic()
                for w in list(self._workers):
                    if w.item is not None and now >= w.deadline:
                        results[w.item] = {"accuracy": 0.0, "extracted": None, "gold_parsed": None, "timed_out": True}
                        self.timeouts += 1
                        log.warning("reward: completion %d exceeded %.1f s; worker restarted", w.item, self.cfg.timeout_s)
                        w.item = None
                        self._replace(w, sel, "timeout")
                    elif not w.ready and now - w.started > _WORKER_START_TIMEOUT_S:
                        raise RuntimeError(f"reward worker not ready after {_WORKER_START_TIMEOUT_S:.0f} s")
        finally:
            sel.close()
        return results  # type: ignore[return-value]

    def _replace(self, worker: _Worker, sel: selectors.BaseSelector, why: str) -> None:
        try:
            sel.unregister(worker.fd)
        except (KeyError, ValueError):
            pass
        worker.kill()
        fresh = _Worker()
        self._workers[self._workers.index(worker)] = fresh
        sel.register(fresh.fd, selectors.EVENT_READ, fresh)
        log.debug("reward worker replaced (%s)", why)


# ------------------------------------------------------------- convenience function
_default: RewardScorer | None = None
_default_lock = threading.Lock()


def _default_scorer() -> RewardScorer:
    global _default
    with _default_lock:
        if _default is None:
            _default = RewardScorer(RewardConfig())
            atexit.register(_default.close)
        return _default


def accuracy_reward(completion: str, gold: str) -> float:
    """1.0 if the completion's answer matches ``gold`` per math-verify, else 0.0.

    Runs in a shared default ``RewardScorer`` (started on first use), so the time limit
    (RewardConfig().timeout_s) holds and it is safe from any thread.
    """
    return _default_scorer().score([completion], [gold])[0]["accuracy"]
