"""The format reward: ``format_reward`` (0.2 by default) when a completion has the format
its prompt asks for; ``reward.format_style`` says which.

* ``think_answer`` (the paper): a non-empty ``<think>...</think>`` followed (whitespace
  only between) by a non-empty ``<answer>...</answer>`` (the paper's soft format check;
  empty blocks do not count). Found with ``str.find`` scans, linear in the completion
  length, so an adversarial completion cannot make the format check slow.
* ``answer_line`` (deviation, for the CPU default's plain prompt "... end with: The answer
  is <number>."): the completion's last non-empty line ends with "the answer is <number>"
  (case-insensitive, optional ``:``/``$``/final ``.``). It is the same kind of signal as
  the paper's: the instruction was followed, whatever the number. Only the last 200
  characters are matched, so it is constant-time in the completion length. Without it
  the small default model gets no format reward at all (it never writes the tags).
"""

from __future__ import annotations

import re

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
#: The format checks ``reward.format_style`` selects.
FORMAT_STYLES = ("think_answer", "answer_line")

_ANSWER_LINE = re.compile(r"the (?:final )?answer is\s*:?\s*\$?\s*-?\d[\d,]*(?:\.\d+)?\s*\$?\s*\.?\Z", re.IGNORECASE)


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
