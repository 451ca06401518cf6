"""Cheap bounds on what reaches math-verify: a degenerate answer is rejected by a named check
before math-verify/sympy can spend the worker's time limit on it.

A degenerate completion (nested braces, 5,000-digit numbers, exponent towers, 3,000-term
sums, control characters, thousands of tags) can cost math-verify/sympy up to the time
limit. ``bounds_violation`` checks the text the extraction chose (boxed content, anchored
span, tag content or window; see ``rewards.extraction``) before it reaches math-verify; the
first check it fails gives accuracy 0 (format reward as usual), the scorer row's
``rejected`` names it and ``RewardScorer.rejections`` counts it. The floor each threshold
must clear is the largest value among the 9,362 golds of GSM8K train+test, MATH-500,
AIME24, AMC23 (normalised; the boxed answers of the 500 MATH-500 human solutions give no
larger values; tests/test_reward_bounds.py asserts a 2x margin); a threshold rejects
nothing a real final answer needs:

======================  ==========  ===================  =================================================
check (``rejected=``)   threshold   largest gold         why no real answer comes near it
======================  ==========  ===================  =================================================
``length``              400 chars   53                   7x the longest gold (a 3-vector); windows 520
``nesting_depth``       8           2                    4x; ``\\left(\\frac{\\sqrt{3}}{2}\\right)`` is 3
``number_digits``       100         9                    11x; over 4,300 digits break int parsing
``operators``           60          15                   4x (``x^8 + ... + 1``)
``big_operator``        0 allowed   0                    ``\\int \\sum \\prod \\lim`` are not answers
``exponent_depth``      3           1                    3x; ``e^{-x^2}`` is 2
``exponent_value``      100,000     8                    ``2^{2023}`` passes; ``9^{9^{9}}`` does not
``power_expansion``     100 terms   1 (no powered sums)  ``(x+1)^{99}`` passes; ``(a+...+g)^{8}`` does not
``combinatorial_arg``   10,000      none                 ``(10^6)!`` and ``\\binom{10^6}{5 \\cdot 10^5}`` do not
======================  ==========  ===================  =================================================

The sympy cost of an answer just above each threshold is in docs/performance.md.

Numeric exponents and factorial/binomial arguments are bounded with ``numeric_log10``, a
rough upper bound of log10 |value| of a purely numeric TeX expression (numbers, ``+ - * /
^ !``, ``\\cdot \\times \\frac \\sqrt \\binom \\pi``); a symbolic exponent (``2^{n}``) is not
evaluated by sympy and is not bounded. Over the ``$...$`` snippets of the MATH-500 human
solutions (working, not only answers) the checks fire only on non-answers (multi-line
``aligned`` derivations, a double ``\\sum``). The checks are linear, or quadratic in at
most ``ANCHOR_WINDOW_CHARS`` characters (length goes first), so a rejected completion
costs microseconds. What passes can still cost sympy a noticeable fraction of a second
(``e^{e^{e^{10}}}``), and the worker time limit stays the backstop.
"""

from __future__ import annotations

import math
import re

from qerl_pipeline.rewards.tex import CLOSE_BRACKETS, OPEN_BRACKETS, match_open, operand_after

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
    "length",
    "nesting_depth",
    "number_digits",
    "operators",
    "big_operator",
    "exponent_depth",
    "exponent_value",
    "power_expansion",
    "combinatorial_arg",
)

_DIGITS = re.compile(r"\d+")
_THOUSANDS_SEP = re.compile(r"(?<=\d)(?:\{,\}|,|\\!|\\,)+(?=\d{3}(?!\d))")
_OPERATOR_CMDS = re.compile(
    r"\\\\|\\(?:cdot|times|div|pm|mp|cup|cap|setminus|le|ge|leq|geq|ne|neq|lt|gt|wedge|vee)(?![a-zA-Z])"
)
_OPERATOR_CHARS = frozenset("+-*/=<>,;&^_!|")
_BIG_OPERATOR = re.compile(r"\\(?:i{1,3}nt|oint|sum|prod|lim)(?![a-zA-Z])")
_FUNCTIONS = frozenset("sin cos tan cot sec csc sinh cosh tanh coth arcsin arccos arctan log ln lg exp".split())
_LOG10_EXPONENT_MAX = math.log10(MAX_EXPONENT_VALUE) + 1e-9  # the tolerance absorbs float rounding


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
            return 0.0 if base <= 0 else (math.inf if exponent > 300 else base * 10.0**exponent)
        return base

    def expect(self, allowed: str) -> None:
        if self.take() not in allowed:
            raise _NotNumeric

    def group(self) -> float:
        self.expect(OPEN_BRACKETS)
        value = self.expr()
        self.expect(CLOSE_BRACKETS)
        return value

    def atom(self) -> float:
        tok = self.peek()
        if tok is None:
            raise _NotNumeric
        if tok in OPEN_BRACKETS:
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
        if c in OPEN_BRACKETS:
            depth += 1
            best = max(best, depth)
        elif c in CLOSE_BRACKETS and depth:
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
            if j < n and text[j] in OPEN_BRACKETS:
                stack.append(level)
                level = inner
                chain = 0
                i = j + 1
                continue
            operand, i = operand_after(text, j)
            if operand.startswith("\\"):  # ^\frac{..}{..}: superscripts inside count one level up
                best = max(best, inner + exponent_depth(operand))
            chain = inner
            continue
        if c in OPEN_BRACKETS:
            stack.append(level)
        elif c in CLOSE_BRACKETS and stack:
            level = stack.pop()
        if not c.isspace():
            chain = 0
        i += 1
    return best


def _top_level_terms(group: str) -> int:
    """Additive terms at the top level of ``group`` (a leading sign does not start a term)."""
    depth, terms, prev = 0, 1, ""
    for c in group:
        if c in OPEN_BRACKETS:
            depth += 1
        elif c in CLOSE_BRACKETS:
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
        exponent, _ = operand_after(text, i + 1)
        bound = numeric_log10(exponent)
        if bound is not None:
            if bound > _LOG10_EXPONENT_MAX:
                return "exponent_value"
            n = int(round(10.0**bound))
            j = i - 1
            while j >= 0 and text[j].isspace():
                j -= 1
            k = 1
            if j >= 0 and text[j] in CLOSE_BRACKETS:
                start = match_open(text, j)
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
            if j >= 0 and text[j] in CLOSE_BRACKETS:
                start = match_open(text, j)
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
        top, end = operand_after(text, m.end())
        bottom, _ = operand_after(text, end)
        if _too_big(top, MAX_COMBINATORIAL_ARG) or _too_big(bottom, MAX_COMBINATORIAL_ARG):
            return True
    return False


def bounds_violation(text: str, max_chars: int = MAX_ANSWER_CHARS) -> str | None:
    """The first cheap check ``text`` fails (a name from ``REJECTION_REASONS``), or None.

    ``text`` is what would reach math-verify (see ``rewards.extraction``); ``max_chars`` is
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
