"""Reward functions for the trainer tests (``train.reward_fn: tests.helpers.rewards:<name>``).

A random tiny model never earns the math reward (it writes no answer), so every group
would have equal rewards, zero advantages and an adapter that never moves. These rewards
depend only on the completion (its text or tokens), so they differ between samples of a group
and the policy gradient is real; ``odd_first_token`` is a coin flip per sample, so it also
leaves groups with equal rewards for DAPO's dynamic sampling to drop.
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


def odd_first_token(completions: list[str], golds: list[str], samples) -> list[float]:
    """Reward = 1 when the completion's first token id is odd, else 0 (0 when empty): a coin flip per sample
    for a random model, so about half the groups of two have equal rewards (DAPO's filter drops them, dynamic
    sampling refills) and the others differ (the update trains)."""
    return [float(s.completion_ids[0] % 2) if s.completion_ids else 0.0 for s in samples]
