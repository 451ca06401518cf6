"""Rewards for verifiable math: the format bonus (format.py), math-verify accuracy
(extraction.py, with the cheap bounds of bounds.py and TeX scanning of tex.py), and the
time-limited scorer that combines them (scorer.py)."""

from qerl_pipeline.rewards.extraction import gold_is_parseable, parse_gold, score_accuracy
from qerl_pipeline.rewards.format import format_reward
from qerl_pipeline.rewards.scorer import RewardScorer, accuracy_reward

__all__ = ["RewardScorer", "accuracy_reward", "format_reward", "gold_is_parseable", "parse_gold", "score_accuracy"]
