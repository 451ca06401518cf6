"""``update.policy_update`` on a tiny packed policy: trained norms keep their updates and no
noise, the KL reference is the clean base, a missing rollout log-prob weighs 1; hashed
sampling seeds. Fast tier: no vLLM, no Kedro."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from qerl_pipeline.adapter import trained_norms
from qerl_pipeline.config import QerlConfig
from qerl_pipeline.quantization import aqn
from qerl_pipeline.quantization.policy import build_policy
from qerl_pipeline.rl import grpo, losses, update
from qerl_pipeline.rl.collect import SEED_SPACE, sampling_seeds
from qerl_pipeline.rl.optim import build_optimizer, lr_factor
from qerl_pipeline.rl.records import Batch

LR = 1e-3


def _cfg(**over) -> QerlConfig:
    raw = {
        "method": "qerl",
        "lora": {"rank": 4, "alpha": 8, "train_norms": True},
        "optim": {"lr": {"qerl": LR}, "warmup_steps": 0, "schedule": "constant", "max_grad_norm": 1e9},
        "grpo": {"num_generations": 2, "kl_beta": 0.1, "log_kl_to_base": True, "is_cap": 2.0},
        "rollout": {"temperature": 0.7, "max_new_tokens": 6},
        "train": {"micro_batch_size": 2},
    }
    for key, value in over.items():
        raw.setdefault(key, {}).update(value)
    return QerlConfig.model_validate(raw)


def _batch(n=4, p_len=5, c_len=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (n, p_len + c_len), generator=g)
    p_lens = torch.full((n,), p_len)
    mask = torch.ones(n, c_len)
    roll = -torch.rand(n, c_len, generator=g) * 3
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:n]
    return ids, p_lens, roll, mask, adv


def _setup(base_dir, cfg):
    policy = build_policy(base_dir, "nvfp4", cfg.lora, dtype=torch.float32)
    policy.train()
    base = {n: t.clone() for n, t in trained_norms(policy).items()}
    with torch.no_grad():  # an adapter that has trained, so that the reference differs from the policy
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    params = [p for p in policy.parameters() if p.requires_grad]
    opt, _ = build_optimizer(params, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(i, warmup=0, total=10, schedule="constant"))
    names = aqn.noisy_target_names(base)
    norm_params = aqn.norm_parameters(policy, sorted(base))
    return policy, params, opt, sched, base, names, norm_params


def _noisy(clean: dict, names, sigma=0.3):
    noise = aqn.draw_noise({n: clean[n] for n in names}, sigma, seed=0, step=0)
    return {**{n: t.clone() for n, t in clean.items()}, **aqn.apply_noise({n: clean[n] for n in names}, noise)}


def test_trained_norms_step_from_clean_values_and_keep_the_update(base_dir):
    cfg = _cfg(grpo={"kl_beta": 0.0, "log_kl_to_base": False})
    policy, params, opt, sched, base, names, norm_params = _setup(base_dir, cfg)
    clean = {n: p.detach().clone() for n, p in norm_params.items()}
    noisy = _noisy(clean, names)
    ids, p_lens, roll, mask, adv = _batch()
    update.policy_update(
        policy, update.Optim(opt, sched, params, norm_params), Batch(ids, p_lens, roll, mask, adv, noisy), cfg, 0
    )
    moved = max(float((norm_params[n].detach() - clean[n]).abs().max()) for n in names)
    assert moved > 0.1 * LR, "trained norms did not move (the update was undone)"
    # Adam's first step moves each entry by at most ~lr; the noise (sigma 0.3) must not stay behind
    assert moved <= 1.5 * LR, f"norms moved by {moved}: noise stayed in the weights"
    # the saved adapter carries the clean, updated norms
    saved = trained_norms(policy)
    assert all(torch.equal(saved[n], norm_params[n].detach()) for n in names)


def test_kl_reference_is_the_clean_base(base_dir, monkeypatch):
    cfg = _cfg()
    policy, params, opt, sched, base, names, norm_params = _setup(base_dir, cfg)
    with torch.no_grad():  # trained norms that differ from the base's
        for p in norm_params.values():
            p.add_(0.1)
    clean = {n: p.detach().clone() for n, p in norm_params.items()}
    noisy = _noisy(clean, names)
    ids, p_lens, roll, mask, adv = _batch()
    seen = []
    real = grpo.policy_loss

    def spy(*args, **kwargs):
        seen.append(kwargs["ref_logp"].clone())
        return real(*args, **kwargs)

    monkeypatch.setattr(grpo, "policy_loss", spy)
    ref_norms = {n: base[n] for n in norm_params}
    update.policy_update(
        policy,
        update.Optim(opt, sched, params, norm_params),
        Batch(ids, p_lens, roll, mask, adv, noisy),
        cfg,
        0,
        ref_norms=ref_norms,
    )
    got = torch.cat(seen, 0)
    fresh = build_policy(
        base_dir, "nvfp4", cfg.lora, dtype=torch.float32
    ).eval()  # the base: no adapter effect, base norms
    with torch.no_grad():
        want = torch.cat(
            [update.completion_logprobs(fresh, ids[s], p_lens[s], 6, 0.7)[0] for s in (slice(0, 2), slice(2, 4))], 0
        )
    assert torch.allclose(got, want, atol=1e-6, rtol=0), float((got - want).abs().max())
    # and it is not what the noisy, trained policy computes (the check can fail)
    with torch.no_grad(), policy.disable_adapter(), aqn.noisy_norms(norm_params, noisy):
        noisy_ref = update.completion_logprobs(policy, ids, p_lens, 6, 0.7)[0]
    assert float((noisy_ref - want).abs().max()) > 1e-3


def test_missing_rollout_logprob_gets_pi_old_in_every_update(base_dir, monkeypatch):
    cfg = _cfg(grpo={"updates_per_rollout": 2, "kl_beta": 0.0, "log_kl_to_base": False})
    policy, params, opt, sched, base, names, norm_params = _setup(base_dir, cfg)
    ids, p_lens, roll, mask, adv = _batch()
    roll[0, 2] = roll[3, 5] = float("nan")
    seen = []
    real = grpo.policy_loss

    def spy(*args, **kwargs):
        seen.append(kwargs["is_weights"].clone())
        return real(*args, **kwargs)

    monkeypatch.setattr(grpo, "policy_loss", spy)
    update.policy_update(
        policy, update.Optim(opt, sched, params, norm_params), Batch(ids, p_lens, roll, mask, adv), cfg, 0
    )
    assert len(seen) == 4  # 2 updates x 2 micro-batches
    for u in range(2):
        first, second = seen[2 * u], seen[2 * u + 1]
        assert first[0, 2] == 1.0 and second[1, 5] == 1.0, f"update {u + 1}: weight of a missing log-prob != 1"
    # the other tokens' weights are real ratios (not all 1)
    assert float((seen[0] - 1).abs().max()) > 1e-3


def test_entropy_selection_is_over_the_whole_batch_and_pi_old_unchanged(base_dir, monkeypatch):
    """top_entropy_quantile 0.5: one threshold over all micro-batches' real tokens, half of them trained on;
    pi_old from the no-grad pre-pass equals the first update's forward (ratios exactly 1 at update 1)."""
    cfg = _cfg(grpo={"kl_beta": 0.0, "log_kl_to_base": False, "top_entropy_quantile": 0.5})
    policy, params, opt, sched, base, names, norm_params = _setup(base_dir, cfg)
    ids, p_lens, roll, mask, adv = _batch()
    mask[1, 4:] = 0.0  # padding is never selected nor counted
    seen = []
    real = grpo.policy_loss

    def spy(logp, old_logp, *args, **kwargs):
        seen.append((kwargs["token_select"].clone(), (logp.detach() - old_logp).abs().max()))
        return real(logp, old_logp, *args, **kwargs)

    monkeypatch.setattr(grpo, "policy_loss", spy)
    out = update.policy_update(
        policy, update.Optim(opt, sched, params, norm_params), Batch(ids, p_lens, roll, mask, adv), cfg, 0
    )
    chosen = torch.cat([sel for sel, _ in seen], 0)
    assert chosen.shape == mask.shape and float((chosen * (1 - mask)).sum()) == 0.0
    n_real = int(mask.sum())
    assert int(chosen.sum()) == n_real // 2  # distinct float entropies: exactly half (ties would add)
    assert out["policy/selected_token_fraction"] == pytest.approx(int(chosen.sum()) / n_real)
    with torch.no_grad():
        ent = torch.cat(
            [update.completion_logprobs(policy, ids[s], p_lens[s], 6, 0.7)[1] for s in (slice(0, 2), slice(2, 4))]
        )
    # selected = the real tokens at or above the batch threshold (not per micro-batch)
    assert torch.equal(chosen.bool(), (ent >= out["policy/entropy_threshold"] - 1e-6) & mask.bool())
    assert all(float(d) == 0.0 for _, d in seen)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none"])
def test_each_is_mode_logs_its_ratios_and_fractions(base_dir, mode):
    """A tight two-sided bound around 1 (the rollout log-probs here are random): masks or clips something."""
    cfg = _cfg(grpo={"kl_beta": 0.0, "log_kl_to_base": False, "is_mode": mode, "is_cap": 1.05, "is_lower": 0.95})
    policy, params, opt, sched, base, names, norm_params = _setup(base_dir, cfg)
    ids, p_lens, roll, mask, adv = _batch()
    out = update.policy_update(
        policy, update.Optim(opt, sched, params, norm_params), Batch(ids, p_lens, roll, mask, adv), cfg, 0
    )
    if mode == "none":
        assert not any(k.startswith("mismatch/is_") for k in out)
        return
    assert out["mismatch/is_ratio_min"] <= out["mismatch/is_ratio_mean"] <= out["mismatch/is_ratio_max"]
    if mode.endswith("mask"):
        assert out["mismatch/is_masked_fraction"] > 0 and out["mismatch/is_clipped_fraction"] == 0
    else:
        assert out["mismatch/is_clipped_fraction"] > 0 and out["mismatch/is_masked_fraction"] == 0


def test_is_bounds_are_checked():
    from qerl_pipeline.config import ConfigError, validate

    with pytest.raises(ConfigError, match="is_lower"):
        validate({"grpo": {"is_cap": 1.0, "is_lower": 2.0}})
    with pytest.raises(ConfigError, match="is_mode"):
        validate({"grpo": {"is_cap": None}})


def test_sampling_seeds_are_distinct_and_deterministic():
    n = 8
    seen = {}
    for s in range(60):
        for r in range(4):
            seeds = sampling_seeds(0, s, r, list(range(16)))
            assert seeds == sampling_seeds(0, s, r, list(range(16)))
            for p, x in enumerate(seeds):
                assert 0 <= x < SEED_SPACE
                seen[(s, r, p)] = x
    values = sorted(seen.values())
    # vLLM seeds sample i of a request with seed + i: no two requests' [seed, seed + n) ranges overlap
    assert all(b - a >= n for a, b in pairwise(values))
    # a prompt drawn twice in one step gets two streams; another run seed gives other seeds
    assert len(set(sampling_seeds(0, 3, 0, [5, 5]))) == 2
    assert sampling_seeds(1, 3, 0, [5]) != sampling_seeds(0, 3, 0, [5])


def test_every_loss_type_reaches_the_loss_with_its_batch_counts(base_dir, monkeypatch):
    """grpo.loss_type and its coefficients reach ``grpo.policy_loss`` with the batch's counts (bnpo's divisor: 4 rows
    in micro-batches of 2); each type's update runs and moves the adapter (vespo without IS weights: this batch's
    random rollout log-probs put its sequence weight near 0, as VESPO means them to)."""
    seen = []
    real = grpo.policy_loss

    def spy(logp, old_logp, advantages, mask, params, **kwargs):
        seen.append((params, kwargs))
        return real(logp, old_logp, advantages, mask, params, **kwargs)

    monkeypatch.setattr(grpo, "policy_loss", spy)
    for loss_type in losses.loss_names():
        cfg = _cfg(
            grpo={
                "loss_type": loss_type,
                "kl_beta": 0.0,
                "log_kl_to_base": False,
                "sapo_temperature_neg": 1.3,
                "is_mode": "none" if loss_type == "vespo" else "token_truncate",
            }
        )
        policy, params, opt, sched, *_ = _setup(base_dir, cfg)
        before = [p.detach().clone() for p in params]
        seen.clear()
        out = update.policy_update(policy, update.Optim(opt, sched, params), Batch(*_batch()), cfg, 0)
        want = grpo.LossParams.of(cfg.grpo, num_sequences=4, num_tokens=24.0, max_len=6, num_micro_batches=2)
        assert [p for p, _ in seen] == [want] * 2 and want.loss_type == loss_type
        assert set(want.options) == set(losses.loss_spec(loss_type).fields)
        if loss_type == "sapo":
            assert want.options["sapo_temperature_neg"] == 1.3
        assert all(kw["entropy"] is None for _, kw in seen)  # entropy_coef 0: no entropy gradient is formed
        assert torch.isfinite(torch.tensor(out["loss"])) and out["optim/grad_norm"] > 0, loss_type
        assert any(not torch.equal(a, p.detach()) for a, p in zip(before, params, strict=True)), loss_type


def test_entropy_coef_puts_the_entropy_gradient_into_the_update(base_dir, monkeypatch):
    seen = []
    real = grpo.policy_loss

    def spy(*args, **kwargs):
        seen.append(kwargs["entropy"])
        return real(*args, **kwargs)

    monkeypatch.setattr(grpo, "policy_loss", spy)
    grads = {}
    for coef in (0.0, 0.5):
        cfg = _cfg(grpo={"entropy_coef": coef, "kl_beta": 0.0, "log_kl_to_base": False})
        torch.manual_seed(0)
        policy, params, opt, sched, *_ = _setup(base_dir, cfg)
        out = update.policy_update(policy, update.Optim(opt, sched, params), Batch(*_batch()), cfg, 0)
        grads[coef] = out["optim/grad_norm"]
    assert seen[:2] == [None, None]
    assert all(e is not None and e.requires_grad for e in seen[2:])
    assert grads[0.5] != pytest.approx(grads[0.0], rel=1e-4)
