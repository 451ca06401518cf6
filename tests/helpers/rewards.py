"""Reward functions for the trainer tests (``train.reward_fn: tests.helpers.rewards:<name>``).

A random tiny model never earns the math reward (it writes no answer), so every group
would have equal rewards, zero advantages and an adapter that never moves. These rewards
depend only on the completion text, so they differ between samples of a group and the
policy gradient is real.
"""

from __future__ import annotations


def letter_fraction(completions: list[str], golds: list[str], samples) -> list[dict]:
    """Reward = the fraction of the completion's characters that are ASCII letters (0 when empty)."""
    out = []
    for text in completions:
        letters = sum(c.isascii() and c.isalpha() for c in text)
        out.append({"reward": letters / len(text) if text else 0.0})
    return out


def brevity(completions: list[str], golds: list[str], samples) -> list[float]:
    """Reward = 1 / (1 + the completion's length in characters): a plain float per completion."""
    return [1.0 / (1.0 + len(text)) for text in completions]
