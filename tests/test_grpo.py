"""GRPO/DAPO loss pieces against hand-computed values on small tensors."""

import math

import pytest
import torch

from qerl_pipeline.rl import grpo


def test_group_advantages_group_scale_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    a = grpo.group_advantages(r, 4, "group", eps=1e-4)
    # group 1: mean 0.25, population std sqrt(3)/4
    std = math.sqrt(3) / 4
    expected = [0.75 / (std + 1e-4)] + [-0.25 / (std + 1e-4)] * 3 + [0.0] * 4
    assert a.tolist() == pytest.approx(expected, rel=1e-6)


def test_group_advantages_batch_and_none():
    r = torch.tensor([1.0, 3.0, 0.0, 0.0])
    none = grpo.group_advantages(r, 2, "none")
    assert none.tolist() == [-1.0, 1.0, 0.0, 0.0]
    batch = grpo.group_advantages(r, 2, "batch", eps=0.0)
    # batch population std of [1,3,0,0]: mean 1, var (0+4+1+1)/4 = 1.5
    assert batch.tolist() == pytest.approx([-1 / math.sqrt(1.5), 1 / math.sqrt(1.5), 0.0, 0.0])
    with pytest.raises(ValueError):
        grpo.group_advantages(torch.ones(3), 2)


def _toy():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.5], [0.5, 0.5, 0.1]]))
    old = torch.log(torch.tensor([[0.25, 0.25, 0.5], [0.5, 1.0, 0.1]]))
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    return logp, old, adv, mask


def test_policy_loss_clipping_and_aggregations():
    logp, old, adv, mask = _toy()
    # ratios: row0 [2, 1, 1(masked)], row1 [1, 0.5, 1]
    # row0 A=+1: token0 ratio 2 > 1.28 -> clipped to 1.28 -> -1.28; token1 -> -1
    # row1 A=-2: token0 -> 2; token1 ratio 0.5 < 0.8: min(0.5*-2, 0.8*-2) = -1.6 -> loss 1.6; token2 -> 2
    per_tok = torch.tensor([[-1.28, -1.0, 0.0], [2.0, 1.6, 2.0]])
    seq = ((-1.28 - 1.0) / 2 + (2 + 1.6 + 2) / 3) / 2
    tok = (-1.28 - 1.0 + 2 + 1.6 + 2) / 5
    dr = (-1.28 - 1.0 + 2 + 1.6 + 2) / (2 * 8)
    for how, want in (("sequence", seq), ("token", tok), ("dr_grpo", dr)):
        loss, stats = grpo.policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, aggregation=how, max_len=8)
        assert float(loss) == pytest.approx(want, rel=1e-6), how
    assert float(grpo.aggregate(per_tok, mask, "token")) == pytest.approx(tok)
    # clipped tokens: row0 token0 (high, A>0) and row1 token1 (low, A<0): 2 of 5
    assert stats.clip_fraction == pytest.approx(2 / 5)
    assert stats.clip_high_fraction == pytest.approx(1 / 5)
    assert stats.clip_low_fraction == pytest.approx(1 / 5)


def test_clipped_tokens_get_no_gradient():
    logp, old, adv, mask = _toy()
    logp = logp.clone().requires_grad_(True)
    loss, _ = grpo.policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, aggregation="token")
    loss.backward()
    g = logp.grad
    assert g[0, 0] == 0 and g[1, 1] == 0  # clip active
    assert g[0, 2] == 0  # masked
    # unclipped token: d/dlogp of -ratio*A/5 = -ratio*A/5
    assert float(g[0, 1]) == pytest.approx(-1.0 / 5)
    assert float(g[1, 0]) == pytest.approx(2.0 / 5)


def test_microbatches_sum_to_full_batch():
    torch.manual_seed(0)
    logp, old = torch.randn(6, 5) * 0.1 - 1, torch.randn(6, 5) * 0.1 - 1
    adv = torch.randn(6)
    mask = grpo.completion_mask(torch.tensor([5, 3, 1, 4, 2, 5]), 5)
    for how in ("sequence", "token", "dr_grpo"):
        full, _ = grpo.policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, aggregation=how)
        parts = sum(
            grpo.policy_loss(
                logp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], eps_low=0.2, eps_high=0.28,
                aggregation=how, num_sequences=6, num_tokens=float(mask.sum()), max_len=5,
            )[0]
            for i in (0, 2, 4)
        )
        assert float(parts) == pytest.approx(float(full), rel=1e-6), how


def test_tis_weights_and_mismatch_kl():
    old = torch.log(torch.tensor([[0.5, 0.9, 0.1]]))
    roll = torch.log(torch.tensor([[0.25, 0.9, 0.4]]))
    w = grpo.tis_weights(old, roll, cap=1.5)
    assert w.tolist()[0] == pytest.approx([1.5, 1.0, 0.25])  # 2.0 capped at 1.5
    assert grpo.tis_weights(old, roll, None) is None
    mask = torch.ones(1, 3)
    # k3 of KL(roll||train) per token: exp(d) - d - 1, d = old - roll
    d = [math.log(2), 0.0, math.log(0.25)]
    want = sum(math.exp(x) - x - 1 for x in d) / 3
    assert grpo.mismatch_kl(roll, old, mask) == pytest.approx(want, rel=1e-6)
    # weights multiply the per-token loss
    adv = torch.tensor([1.0])
    lw, _ = grpo.policy_loss(old, old, adv, mask, eps_low=0.2, eps_high=0.28, is_weights=w, aggregation="token")
    assert float(lw) == pytest.approx(-(1.5 + 1.0 + 0.25) / 3)


def test_kl_to_reference_k3():
    logp = torch.log(torch.tensor([[0.5, 0.5]]))
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    adv = torch.zeros(1)
    mask = torch.ones(1, 2)
    loss, stats = grpo.policy_loss(logp, logp, adv, mask, eps_low=0.2, eps_high=0.2, ref_logp=ref, kl_beta=0.1)
    kl0 = 0.5 - math.log(0.5) - 1  # exp(ref-logp) - (ref-logp) - 1 with ratio 0.5
    assert stats.kl_to_ref == pytest.approx(kl0 / 2)
    assert float(loss) == pytest.approx(0.1 * kl0 / 2)
    loss0, stats0 = grpo.policy_loss(logp, logp, adv, mask, eps_low=0.2, eps_high=0.2, ref_logp=ref, kl_beta=0.0)
    assert float(loss0) == 0.0 and stats0.kl_to_ref == pytest.approx(kl0 / 2)


def test_dynamic_sampling_and_zero_std():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.2, 0.2, 0.0, 1.2])
    keep = grpo.dynamic_sampling_keep(r, 2)
    assert keep.tolist() == [False, True, False, True]
    assert grpo.zero_std_fraction(r, 2) == 0.5
    assert grpo.zero_std_fraction(r, 4) == 0.0


def test_overlong_penalty_ramp():
    lengths = torch.tensor([10, 96, 100, 112, 128, 140])
    p = grpo.overlong_penalty(lengths, max_new_tokens=128, buffer_tokens=32, penalty=0.5)
    assert p.tolist() == pytest.approx([0.0, 0.0, -0.125 * 0.5, -0.5 * 0.5, -0.5, -0.5])


def test_completion_mask_truncated():
    m = grpo.completion_mask(torch.tensor([2, 3]), 4, truncated=torch.tensor([False, True]))
    assert m.tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]
