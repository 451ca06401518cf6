"""Rewards for verifiable math: math-verify accuracy and the format bonus (see math.py)."""

from qerl_pipeline.rewards.math import (
    RewardScorer,
    accuracy_reward,
    format_reward,
    gold_is_parseable,
    parse_gold,
    score_accuracy,
)

__all__ = ["RewardScorer", "accuracy_reward", "format_reward", "gold_is_parseable", "parse_gold", "score_accuracy"]
