"""The loss registry (rl/losses.py) as the one place a loss type is added: a toy loss registered from this file
alone is accepted by config.py's validation, obeys its own rule, and trains one ``update.policy_update`` (the
trainer's update: micro-batches, optimiser step) on a tiny packed base; no source file names it. Also what the
registry refuses, and the benchmark's TRL arguments read from it. Fast tier: no vLLM, no Kedro."""

from __future__ import annotations

import pytest
import torch

from qerl_pipeline.benchmarking import peer_trl
from qerl_pipeline.config import BenchmarkConfig, ConfigError, QerlConfig, validate
from qerl_pipeline.rl import grpo, losses, update
from qerl_pipeline.rl.records import Batch
from tests.helpers.policy_update import update_batch, update_policy

TOY = "toy_capped_reinforce"


@pytest.fixture
def toy(monkeypatch):
    """``TOY`` registered for one test: REINFORCE with the advantage capped at ``clip_eps_high``, token mean."""
    monkeypatch.setattr(losses, "LOSSES", dict(losses.LOSSES))  # the registration ends with the test

    @losses.register_loss(
        TOY,
        aggregation="token",
        fields={"clip_eps_high": None},
        rules=(
            losses.Rule(
                lambda g: g.importance_sampling_level != "token",
                "grpo.loss_type toy_capped_reinforce needs token ratios, got {g.importance_sampling_level!r}",
                refuse=True,
            ),
        ),
    )
    def toy_capped_reinforce(t: losses.LossTerms, options) -> losses.TokenLoss:
        """-min(A, clip_eps_high) logp over the tokens."""
        return losses.TokenLoss(-t.advantages.clamp(max=options["clip_eps_high"]) * t.logp)

    return toy_capped_reinforce


def _cfg(**grpo_over) -> QerlConfig:
    return validate(
        {
            "method": "qerl",
            "lora": {"rank": 4, "alpha": 8, "train_norms": True},
            "optim": {"lr": {"qerl": 1e-2}, "warmup_steps": 0, "schedule": "constant", "max_grad_norm": 1e9},
            "grpo": {
                "num_generations": 2,
                "kl_beta": 0.0,
                "log_kl_to_base": False,
                "is_mode": "none",
                "clip_eps_high": 0.5,
                **grpo_over,
            },
            "rollout": {"temperature": 0.7, "max_new_tokens": 6},
            "train": {"micro_batch_size": 3, "prompts_per_step": 4},
        }
    )


def test_a_toy_loss_from_this_file_trains_one_update(base_dir, toy):
    """The update's loss is the toy's formula on the policy's log-probs (ratio 1 at the first update, so no other
    loss type gives it), over micro-batches of 3 rows with the whole batch's token count; the adapter moves."""
    cfg = _cfg(loss_type=TOY)
    assert cfg.grpo.loss_type == TOY
    policy, opt, ref_norms = update_policy(base_dir, cfg)
    ids, p_lens, roll, mask, adv = update_batch()
    with torch.no_grad():
        logp = update.completion_logprobs(policy, ids, p_lens, mask.shape[1], cfg.rollout.temperature)[0]
    want = float(-(adv.clamp(max=0.5).unsqueeze(1) * logp * mask).sum() / mask.sum())
    before = [p.detach().clone() for p in opt.params]
    out = update.policy_update(policy, opt, Batch(ids, p_lens, roll, mask, adv), cfg, 0, ref_norms=ref_norms)
    assert out["loss"] == pytest.approx(want, rel=1e-5)
    dapo = float(-(adv.unsqueeze(1) * mask).sum() / mask.sum())  # what the default loss would give here
    assert out["loss"] != pytest.approx(dapo, rel=1e-3)
    assert out["optim/grad_norm"] > 0 and out["policy/clip_fraction"] == 0.0  # the toy declares no clip
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, opt.params, strict=True))


def test_config_reads_the_registry_at_validation(toy):
    grpo_section = {"loss_type": TOY, "importance_sampling_level": "sequence"}
    msg = str(pytest.raises(ConfigError, validate, {"grpo": grpo_section}).value)
    assert "  grpo: " in msg and "toy_capped_reinforce needs token ratios, got 'sequence'" in msg, msg
    msg = str(pytest.raises(ConfigError, validate, {"grpo": {"loss_type": "toy"}}).value)
    assert f"registered: {', '.join(losses.loss_names())}" in msg and msg.rstrip().endswith(f"{TOY} (got 'toy')"), msg
    params = grpo.LossParams.of(_cfg(loss_type=TOY).grpo)
    assert (params.loss_type, dict(params.options)) == (TOY, {"clip_eps_high": 0.5})


def test_a_loss_reading_a_field_grpo_lacks_is_refused(monkeypatch):
    monkeypatch.setattr(losses, "LOSSES", dict(losses.LOSSES))
    losses.register_loss("needs_temperature", aggregation="token", fields={"toy_temperature": None})(
        lambda t, options: losses.TokenLoss(-t.logp)
    )
    msg = str(pytest.raises(ConfigError, validate, {"grpo": {"loss_type": "needs_temperature"}}).value)
    assert "grpo.loss_type 'needs_temperature' reads toy_temperature, which grpo does not have" in msg, msg


def test_the_registry_refuses_a_taken_name_and_an_unknown_reduction(monkeypatch):
    monkeypatch.setattr(losses, "LOSSES", dict(losses.LOSSES))
    with pytest.raises(ValueError, match="'dapo' is already registered"):
        losses.register_loss("dapo", aggregation="token")
    with pytest.raises(ValueError, match="unknown aggregation 'mean'"):
        losses.register_loss("new", aggregation="mean")
    with pytest.raises(ValueError, match="grpo.loss_type: unknown loss type 'new'"):
        grpo.LossParams("new")
    with pytest.raises(ValueError, match="'cispo' reads cispo_clip_max: missing"):
        grpo.LossParams("cispo", {"clip_eps_low": 0.2})


def test_a_loss_whose_term_is_not_per_token_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(losses, "LOSSES", dict(losses.LOSSES))
    losses.register_loss("summed", aggregation="token")(lambda t, options: losses.TokenLoss(-t.logp.sum(dim=1)))
    zeros, ones = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"'summed': per-token loss of shape \(2,\), expected the mask's \(2, 3\)"):
        grpo.policy_loss(zeros, zeros, torch.ones(2), ones, grpo.LossParams("summed"))


def test_the_trl_peer_takes_each_loss_types_trl_arguments(toy):
    cispo = validate({"grpo": {"loss_type": "cispo", "cispo_clip_max": 3.0}}).grpo
    assert peer_trl.trl_loss_args(cispo) == {"loss_type": "cispo", "epsilon": 0.2, "epsilon_high": 3.0}
    sapo = validate({"grpo": {"loss_type": "sapo", "sapo_temperature_neg": 1.3}}).grpo
    assert peer_trl.trl_loss_args(sapo) == {
        "loss_type": "sapo",
        "epsilon": 0.2,
        "epsilon_high": 0.28,
        "sapo_temperature_pos": 1.0,
        "sapo_temperature_neg": 1.3,
    }
    cfg = _cfg(loss_type=TOY)
    out = peer_trl.measure_peer({"bf16": "/nonexistent"}, cfg, BenchmarkConfig())
    assert out == {"skipped": True, "reason": f"grpo.loss_type {TOY!r} has no TRL counterpart"}


@pytest.mark.parametrize("loss_type", losses.loss_names())
def test_trl_accepts_the_arguments_of_every_built_in_loss_type(tmp_path, loss_type):
    trl = pytest.importorskip("trl", reason="TRL (the bench extra)")
    g = validate({"grpo": {"loss_type": loss_type, "importance_sampling_level": "token"}}).grpo
    args = trl.GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **peer_trl.trl_loss_args(g))
    assert args.loss_type == loss_type
    assert args.epsilon_high == (g.cispo_clip_max if loss_type == "cispo" else g.clip_eps_high)
