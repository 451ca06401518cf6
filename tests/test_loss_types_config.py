"""grpo.loss_type (TRL 1.16's names) in the config: the registered loss types (rl/losses.py), TRL's refusal
(vespo with a sequence IS mode) and TRL's warnings, every refusal naming its fields; the removed older keys
(loss_aggregation, tis_cap) get the unknown-key error."""

from __future__ import annotations

import logging

import pytest
import yaml

from qerl_pipeline.config import ConfigError, validate
from qerl_pipeline.rl import losses
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
    assert g.loss_type == "dapo"
    assert losses.loss_spec(g.loss_type).aggregation == "token"
    assert g.entropy_coef == 0.0


@pytest.mark.parametrize("loss_type", losses.loss_names())
def test_each_loss_type_validates_by_its_trl_name(loss_type):
    level = "sequence" if loss_type == "luspo" else "token"
    assert validate(_params(loss_type=loss_type, importance_sampling_level=level)).grpo.loss_type == loss_type


def test_the_eight_are_trls_and_each_is_described():
    from qerl_pipeline.config import GRPOConfig

    assert losses.loss_names() == ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
    assert all(losses.loss_spec(n).trl_name == n for n in losses.loss_names())
    description = GRPOConfig.model_fields["loss_type"].description
    assert all(f"{n} (reads " in description for n in losses.loss_names()), description


@pytest.mark.parametrize("key, value", [("loss_aggregation", "token"), ("loss_aggregation", None), ("tis_cap", 3.0)])
def test_removed_keys_get_the_unknown_key_error(key, value):
    """An older config's loss_aggregation / tis_cap is refused as any unknown key (loss_type / is_cap name them)."""
    assert f"  grpo.{key}: Extra inputs are not permitted" in _refusal(**{key: value})


@pytest.mark.parametrize("value", ["ppo", None, 3])
def test_an_unregistered_loss_type_is_refused_naming_the_registered(value):
    msg = _refusal(loss_type=value)
    assert "  grpo.loss_type: " in msg and "registered: " + ", ".join(losses.loss_names()) in msg, msg


@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_truncate"])
def test_vespo_refuses_sequence_is_modes_as_trl(mode):
    msg = _refusal(loss_type="vespo", is_mode=mode)
    assert "grpo.loss_type vespo" in msg and "grpo.is_mode" in msg and mode in msg, msg


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "none"])
def test_vespo_takes_token_is_modes_and_none(mode):
    assert validate(_params(loss_type="vespo", is_mode=mode)).grpo.is_mode == mode


@pytest.mark.parametrize(
    "over, field",
    [
        ({"loss_type": "ppo"}, "grpo.loss_type"),
        ({"loss_type": "cispo", "cispo_clip_max": 0.0}, "grpo.cispo_clip_max"),
        ({"loss_type": "sapo", "sapo_temperature_neg": -1.0}, "grpo.sapo_temperature_neg"),
        ({"loss_type": "vespo", "vespo_lambda_pos": 0.0}, "grpo.vespo_lambda_pos"),
        ({"entropy_coef": "much"}, "grpo.entropy_coef"),
    ],
)
def test_bad_values_name_the_field(over, field):
    assert f"  {field}: " in _refusal(**over)


@pytest.mark.parametrize(
    "over, warned",
    [
        ({"loss_type": "luspo"}, "luspo is meant for importance_sampling_level 'sequence'"),
        (
            {"loss_type": "vespo", "importance_sampling_level": "sequence"},
            "importance_sampling_level should be 'token'",
        ),
        ({"loss_type": "cispo", "importance_sampling_level": "sequence"}, "each sequence weighs by its length"),
        ({"importance_sampling_level": "sequence"}, "each sequence weighs by its length"),  # the default dapo
        ({"loss_type": "grpo", "importance_sampling_level": "sequence"}, None),  # GSPO: no warning
        ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, None),
    ],
)
def test_trl_warnings(caplog, over, warned):
    with caplog.at_level(logging.WARNING, logger="qerl_pipeline.config"):
        validate(_params(**over))
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "qerl_pipeline.config")
    if warned is None:
        assert "loss_type" not in text and "importance_sampling_level" not in text, text
    else:
        assert warned in text, text
