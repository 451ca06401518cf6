r"""TeX scanning shared by the answer extraction and the cheap bounds: bracket groups,
operands, and TeX's one-token arguments made explicit.

``normalise_tex_shorthand`` runs on golds and predictions alike before math-verify sees
them (``\frac43`` -> ``\frac{4}{3}``, ``\frac9{19}``, ``\frac{270}7``, ``\sqrt2`` ->
``\sqrt{2}``; ``\frac432`` is ``\frac{4}{3}2`` as in TeX). Deviation from the paper's
extraction: math-verify parses the gold with its malformed-operator fixes and the
prediction without them (the paper's setting), so without this step a gold like
``\frac43`` does not match its own boxed form, and a model writing ``\frac43`` for the
gold ``\frac{4}{3}`` scores 0. math-verify's own malformed-operator fixes stay off for
predictions: their regexes read ``\frac123`` as ``\frac{1}{23}``. Units
(``\text{ degrees}``) are stripped by math-verify's ``units`` normalisation on both sides
once the fraction is well-formed.
"""

from __future__ import annotations

import re

#: Bracket families, opener and closer at the same index.
OPEN_BRACKETS, CLOSE_BRACKETS = "{([", "})]"

_SHORTHAND = re.compile(r"\\(?:[dt]?frac|sqrt)(?![a-zA-Z])")


def _partner(text: str, i: int, limit: int | None = None) -> int:
    """Index of the bracket matching ``text[i]`` (forward from an opener, before ``limit``;
    backward from a closer; same family), or -1 when there is none."""
    mine = text[i]
    if mine in OPEN_BRACKETS:
        end = len(text) if limit is None else min(limit, len(text))
        other, step, stop = CLOSE_BRACKETS[OPEN_BRACKETS.index(mine)], 1, end
    else:
        other, step, stop = OPEN_BRACKETS[CLOSE_BRACKETS.index(mine)], -1, -1
    depth = 0
    for j in range(i, stop, step):
        c = text[j]
        if c == mine:
            depth += 1
        elif c == other:
            depth -= 1
            if depth == 0:
                return j
    return -1


def match_close(text: str, i: int, limit: int | None = None) -> int:
    """Index just past the bracket group opening at ``text[i]``, or -1 if it is not closed
    before ``limit`` (default: the end of ``text``)."""
    j = _partner(text, i, limit)
    return j + 1 if j >= 0 else -1


def match_open(text: str, j: int) -> int:
    """Index of the opener of the bracket group closing at ``text[j]``, or -1."""
    return _partner(text, j)


def operand_after(text: str, i: int) -> tuple[str, int]:
    """The TeX operand starting at ``text[i]`` (a bracket group's content, a digit run, a
    control word with its brace arguments, or one character) and the index after it."""
    n = len(text)
    while i < n and text[i].isspace():
        i += 1
    if i >= n:
        return "", n
    c = text[i]
    if c in OPEN_BRACKETS:
        end = match_close(text, i)
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
            end = match_close(text, k)
            if end < 0:
                break
            k = end
        return text[i:k], k
    return c, i + 1


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
                end = match_close(text, k)
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
                end = match_close(text, i)
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
