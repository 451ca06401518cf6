"""``train.reward_fn`` the TRL way: one import path or a weighted list (``train.reward_weights``),
checked at validation, combined by ``rewards.functions.WeightedScorer``, logged per entry.

Fast tier: the math entry is the real ``RewardScorer`` (worker processes, math-verify).
"""

from __future__ import annotations

import pytest

from qerl_pipeline import metric_names
from qerl_pipeline.config import ConfigError, QerlConfig, TrainConfig, validate
from qerl_pipeline.rewards.functions import FunctionScorer, WeightedScorer, make_scorer, reward_component_metrics
from qerl_pipeline.rewards.scorer import RewardScorer
from tests.helpers.rewards import brevity, letter_fraction

LETTERS = "tests.helpers.rewards:letter_fraction"
BREVITY = "tests.helpers.rewards:brevity"


def takes_two(completions, golds):
    """A reward with the wrong signature (no samples)."""
    return [0.0] * len(completions)


def as_dicts_with_accuracy(completions, golds, samples):
    return [{"reward": 0.5, "accuracy": 1.0, "note": "mine"} for _ in completions]


NOT_A_FUNCTION = 3


@pytest.mark.parametrize(
    "train, field, expected",
    [
        (
            {"reward_fn": "no_such_module_xyz:f"},
            "train.reward_fn",
            "'no_such_module_xyz:f' cannot be imported: ModuleNotFoundError",
        ),
        (
            {"reward_fn": ["math", "tests.helpers.rewards:nothing_here"]},
            "train.reward_fn",
            "module 'tests.helpers.rewards' has no attribute 'nothing_here'",
        ),
        ({"reward_fn": f"{__name__}:NOT_A_FUNCTION"}, "train.reward_fn", "is not callable: it is int 3"),
        (
            {"reward_fn": [f"{__name__}:takes_two"]},
            "train.reward_fn",
            "cannot be called as f(completions, golds, samples)",
        ),
        ({"reward_fn": "justaname"}, "train.reward_fn", "expected an import path 'package.module:function'"),
        ({"reward_fn": []}, "train.reward_fn", "an empty list"),
        (
            {"reward_fn": [LETTERS, "tests.helpers.rewards.letter_fraction"]},
            "train.reward_fn",
            "are both named 'letter_fraction'",
        ),
        (
            {"reward_fn": ["math", LETTERS], "reward_weights": [1.0]},
            "train",
            "reward_weights: 1 weight(s) for 2 reward function(s)",
        ),
        ({"reward_fn": ["math", LETTERS], "reward_weights": [1.0, float("nan")]}, "train", "finite number"),
        ({"reward_fn": LETTERS, "reward_weights": [2.0]}, "train", "goes with a reward_fn list"),
        ({"reward_weights": [2.0]}, "train", "goes with a reward_fn list"),
    ],
)
def test_reward_list_refused_at_validation_naming_the_field(train, field, expected):
    with pytest.raises(ConfigError) as err:
        validate({"train": train}, QerlConfig)
    assert f"  {field}: " in str(err.value) and expected in str(err.value), str(err.value)


def test_reward_components_names_paths_and_weights():
    assert TrainConfig().reward_components() == [("math", "math", 1.0)]
    assert TrainConfig(reward_fn=LETTERS).reward_components() == [("letter_fraction", LETTERS, 1.0)]
    cfg = TrainConfig(reward_fn=["math", LETTERS, BREVITY], reward_weights=[1.0, 0.5, -2])
    assert cfg.reward_components() == [
        ("math", "math", 1.0),
        ("letter_fraction", LETTERS, 0.5),
        ("brevity", BREVITY, -2.0),
    ]
    # TRL: 1.0 each
    assert TrainConfig(reward_fn=[LETTERS, BREVITY]).reward_components()[1] == ("brevity", BREVITY, 1.0)


def test_default_and_single_reward_keep_their_scorers():
    """None: the math RewardScorer as it always was; one path: that function alone (FunctionScorer)."""
    default = make_scorer(QerlConfig())
    try:
        assert type(default) is RewardScorer
    finally:
        default.close()
    single = make_scorer(QerlConfig(train={"reward_fn": LETTERS}))
    assert type(single) is FunctionScorer and single.fn is letter_fraction
    rows = single.score(["ab1", ""], ["1", "1"], [])
    assert rows == [{"reward": 2 / 3, "accuracy": 0.0, "format": 0.0}, {"reward": 0.0, "accuracy": 0.0, "format": 0.0}]
    assert reward_component_metrics(rows) == {}  # one reward: no components, reward/mean is it


def test_weighted_sum_of_math_and_user_rewards():
    cfg = QerlConfig(
        train={"reward_fn": ["math", LETTERS, BREVITY], "reward_weights": [1.0, 0.5, -2.0]},
        reward={"format_style": "answer_line"},
        data={"system_prompt": "Say: The answer is N."},
    )
    scorer = make_scorer(cfg)
    completions = ["So 6 * 7 = 42. The answer is 42", "The answer is 41", "zzz"]
    golds = ["42", "42", "42"]
    try:
        assert type(scorer) is WeightedScorer
        rows = scorer.score(completions, golds, [])
        with RewardScorer(cfg.reward) as alone:
            math_rows = alone.score(completions, golds)
    finally:
        scorer.close()
    letters, short = letter_fraction(completions, golds, []), brevity(completions, golds, [])
    for row, m, letter, b in zip(rows, math_rows, letters, short, strict=True):
        assert row["rewards"] == {"math": m["reward"], "letter_fraction": letter["reward"], "brevity": b}
        assert row["reward"] == pytest.approx(m["reward"] + 0.5 * letter["reward"] - 2.0 * b, abs=1e-12)
        # accuracy, format and the extracted answer are the math entry's
        assert (row["accuracy"], row["format"], row["extracted"]) == (m["accuracy"], m["format"], m["extracted"])
    assert [r["accuracy"] for r in rows] == [1.0, 0.0, 0.0]
    metrics = reward_component_metrics(rows)
    assert set(metrics) == {
        f"rewards/{n}/{s}" for n in ("math", "letter_fraction", "brevity") for s in ("mean", "std")
    }
    assert metrics[metric_names.reward_component("brevity")] == pytest.approx(sum(short) / 3)
    assert metrics["rewards/math/mean"] == pytest.approx(sum(m["reward"] for m in math_rows) / 3)


def test_without_math_entry_accuracy_comes_from_the_first_entry_that_gives_it():
    scorer = make_scorer(
        QerlConfig(train={"reward_fn": [BREVITY, f"{__name__}:as_dicts_with_accuracy"], "reward_weights": [0.0, 2.0]})
    )
    rows = scorer.score(["a", "bb"], ["1", "2"], [])
    assert [r["reward"] for r in rows] == [1.0, 1.0]
    assert all(r["accuracy"] == 1.0 and r["format"] == 0.0 and r["note"] == "mine" for r in rows)
    assert rows[0]["rewards"] == {"brevity": 0.5, "as_dicts_with_accuracy": 0.5}


def test_a_reward_that_returns_the_wrong_count_is_named():
    def broken(completions, golds, samples):
        return [1.0]

    with pytest.raises(ValueError, match="reward function 'broken' returned 1 rewards for 2 completions"):
        WeightedScorer([("broken", 1.0, FunctionScorer(broken))]).score(["a", "b"], ["1", "1"], [])
