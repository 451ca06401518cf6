"""grpo.loss_type (TRL 1.16's names) in the config: how it reads beside loss_aggregation, TRL's refusal
(vespo with a sequence IS mode) and TRL's warnings, every refusal naming its fields."""

from __future__ import annotations

import logging

import pytest
import yaml

from qerl_pipeline.config import ConfigError, validate
from qerl_pipeline.rl import grpo

from tests.helpers.project import PROJECT


def _params(**grpo_over) -> dict:
    p = yaml.safe_load((PROJECT / "conf/base/parameters.yml").read_text())
    p["grpo"].update(grpo_over)
    return p


def _refusal(**grpo_over) -> str:
    with pytest.raises(ConfigError) as err:
        validate(_params(**grpo_over))
    return str(err.value)


def test_default_run_is_dapo_the_token_mean_it_always_was():
    g = validate(_params()).grpo
    assert (g.loss_type, g.loss_aggregation) == ("dapo", None)
    assert grpo.LOSS_AGGREGATION[g.loss_type] == "token"
    assert g.entropy_coef == 0.0


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_each_loss_type_validates_by_its_trl_name(loss_type):
    level = "sequence" if loss_type == "luspo" else "token"
    assert validate(_params(loss_type=loss_type, importance_sampling_level=level)).grpo.loss_type == loss_type


def test_config_and_loss_functions_know_the_same_eight():
    from typing import get_args

    from qerl_pipeline.config import GRPOConfig

    literal = get_args(GRPOConfig.model_fields["loss_type"].annotation)[0]
    assert set(get_args(literal)) == set(grpo.LOSS_TYPES) == set(grpo.LOSS_AGGREGATION)


@pytest.mark.parametrize("agg, loss_type", [("sequence", "grpo"), ("token", "dapo"), ("dr_grpo", "dr_grpo")])
def test_loss_aggregation_alone_still_reads(agg, loss_type):
    assert validate(_params(loss_aggregation=agg)).grpo.loss_type == loss_type


@pytest.mark.parametrize("loss_type, agg", [("cispo", "token"), ("vespo", "token"), ("sapo", "sequence"), ("grpo", "sequence")])
def test_both_set_and_agreeing_validate(loss_type, agg):
    assert validate(_params(loss_type=loss_type, loss_aggregation=agg)).grpo.loss_type == loss_type


@pytest.mark.parametrize("loss_type, agg", [("bnpo", "token"), ("grpo", "token"), ("luspo", "sequence"), ("dapo", "dr_grpo")])
def test_both_set_and_disagreeing_are_refused_naming_both(loss_type, agg):
    msg = _refusal(loss_type=loss_type, loss_aggregation=agg)
    assert "  grpo: " in msg and f"grpo.loss_type '{loss_type}'" in msg and f"grpo.loss_aggregation '{agg}'" in msg, msg


@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_truncate"])
def test_vespo_refuses_sequence_is_modes_as_trl(mode):
    msg = _refusal(loss_type="vespo", is_mode=mode)
    assert "grpo.loss_type vespo" in msg and "grpo.is_mode" in msg and mode in msg, msg


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "none"])
def test_vespo_takes_token_is_modes_and_none(mode):
    assert validate(_params(loss_type="vespo", is_mode=mode)).grpo.is_mode == mode


@pytest.mark.parametrize("over, field", [
    ({"loss_type": "ppo"}, "grpo.loss_type"),
    ({"loss_type": "cispo", "cispo_clip_max": 0.0}, "grpo.cispo_clip_max"),
    ({"loss_type": "sapo", "sapo_temperature_neg": -1.0}, "grpo.sapo_temperature_neg"),
    ({"loss_type": "vespo", "vespo_lambda_pos": 0.0}, "grpo.vespo_lambda_pos"),
    ({"entropy_coef": "much"}, "grpo.entropy_coef"),
])
def test_bad_values_name_the_field(over, field):
    assert f"  {field}: " in _refusal(**over)


@pytest.mark.parametrize("over, warned", [
    ({"loss_type": "luspo"}, "luspo is meant for importance_sampling_level 'sequence'"),
    ({"loss_type": "vespo", "importance_sampling_level": "sequence"}, "importance_sampling_level should be 'token'"),
    ({"loss_type": "cispo", "importance_sampling_level": "sequence"}, "each sequence weighs by its length"),
    ({"importance_sampling_level": "sequence"}, "each sequence weighs by its length"),  # the default dapo
    ({"loss_type": "grpo", "importance_sampling_level": "sequence"}, None),  # GSPO: no warning
    ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, None),
])
def test_trl_warnings(caplog, over, warned):
    with caplog.at_level(logging.WARNING, logger="qerl_pipeline.config"):
        validate(_params(**over))
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "qerl_pipeline.config")
    if warned is None:
        assert "loss_type" not in text and "importance_sampling_level" not in text, text
    else:
        assert warned in text, text
