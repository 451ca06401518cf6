"""compare.seeds without running anything: the config, what a seed sets, and a pipeline shape that ignores the list.

The runs themselves (10 trainings of 5 methods x 2 seeds, killed and resumed) are
tests/test_compare_pipeline.py's; the statistics are tests/test_stats.py's.
"""

from __future__ import annotations

import pytest

from qerl_pipeline.config import METHODS, ConfigError, QerlConfig, validate


def test_seeds_default_and_duplicates_refused():
    assert validate({}, QerlConfig).compare.seeds == [0]
    assert validate({"compare": {"seeds": [3, 1]}}, QerlConfig).compare.seeds == [3, 1]
    with pytest.raises(ConfigError, match="seeds"):
        validate({"compare": {"seeds": [0, 0]}}, QerlConfig)
    with pytest.raises(ConfigError, match="seeds"):
        validate({"compare": {"seeds": []}}, QerlConfig)


def test_a_seed_sets_the_three_random_streams_of_a_training_and_nothing_else():
    from qerl_pipeline.pipelines.train.nodes import seeded_sections, train_config

    sections = {"train": {"seed": 0, "steps": 3}, "rollout": {"seed": 0}, "aqn": {"seed": 0}, "data": {"seed": 42},
                "model": {"source": "random"}, "lora": None}
    out = seeded_sections(sections, 7)
    assert out["train"] == {"seed": 7, "steps": 3} and out["rollout"] == {"seed": 7} and out["aqn"] == {"seed": 7}
    assert out["data"] == {"seed": 42} and out["model"] == {"source": "random"}  # same prompts, same base
    assert sections["train"]["seed"] == 0  # the shared parameters are not changed in place
    cfg = train_config("qerl", out)
    assert (cfg.train.seed, cfg.rollout.seed, cfg.aqn.seed, cfg.data.seed, cfg.model.random_init.seed) == (7, 7, 7, 42, 0)


def test_the_pipeline_reads_the_seeds_as_a_parameter_of_every_branch():
    """The shape is fixed before parameters are known: each branch's nodes loop over ``compare.seeds``."""
    from qerl_pipeline.pipelines.compare.pipeline import create_pipeline

    pipe = create_pipeline()
    for m in METHODS:
        train, evaluate = (next(n for n in pipe.nodes if n.name == f"compare.{m}.{x}") for x in ("train_policy", "evaluate_policies"))
        assert "params:compare.seeds" in train.inputs and "params:compare.seeds" in evaluate.inputs
