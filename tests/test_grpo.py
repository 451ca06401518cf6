"""GRPO/DAPO loss pieces against hand-computed values on small tensors."""

import math

import pytest
import torch

from qerl_pipeline.rl import grpo, losses

#: the clip range of the hand computations
CLIP = {"clip_eps_low": 0.2, "clip_eps_high": 0.28}
CLIP_02 = {"clip_eps_low": 0.2, "clip_eps_high": 0.2}
#: every built-in loss type's options: the clip range and TRL 1.16's defaults of the others
OPTIONS = {
    **CLIP,
    "cispo_clip_max": 5.0,
    "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05,
    "vespo_k_pos": 2.0,
    "vespo_lambda_pos": 3.0,
    "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0,
}


def _p(loss_type: str = "dapo", options: dict | None = None, **scalars) -> grpo.LossParams:
    """``grpo.LossParams`` of ``loss_type`` with the clip range ``CLIP`` (or ``options``)."""
    return grpo.LossParams(loss_type, CLIP if options is None else options, **scalars)


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
    for how, want in (("grpo", seq), ("dapo", tok), ("dr_grpo", dr)):
        loss, stats = grpo.policy_loss(logp, old, adv, mask, _p(how, max_len=8))
        assert float(loss) == pytest.approx(want, rel=1e-6), how
    assert float(grpo.aggregate(per_tok, mask, "token")) == pytest.approx(tok)
    # clipped tokens: row0 token0 (high, A>0) and row1 token1 (low, A<0): 2 of 5
    assert stats.clip_fraction == pytest.approx(2 / 5)
    assert stats.clip_high_fraction == pytest.approx(1 / 5)
    assert stats.clip_low_fraction == pytest.approx(1 / 5)


def test_new_loss_types_hand_computed():
    """cispo, sapo, luspo, vespo and bnpo on the toy batch (ratios row0 [2, 1], row1 [1, 0.5, 1]; A = [1, -2])."""
    logp, old, adv, mask = _toy()
    lp0 = logp.tolist()
    prm = {**OPTIONS, "cispo_clip_max": 1.5}

    def run(loss_type, **kw):
        lp = logp.clone().requires_grad_(True)
        loss, st = grpo.policy_loss(lp, old, adv, mask, _p(loss_type, prm), **kw)
        loss.backward()
        return float(loss.detach()), lp.grad, st

    # cispo: -sg(min(r, 1.5)) A logp / 5 tokens; the clipped token (r = 2 > 1.5, A > 0) keeps a gradient
    w = [[1.5, 1.0], [1.0, 0.5, 1.0]]
    want = -sum(w[0][t] * 1.0 * lp0[0][t] for t in range(2)) - sum(w[1][t] * -2.0 * lp0[1][t] for t in range(3))
    val, g, st = run("cispo")
    assert val == pytest.approx(want / 5, rel=1e-6)
    assert float(g[0, 0]) == pytest.approx(-1.5 / 5) and float(g[1, 1]) == pytest.approx(0.5 * 2 / 5)
    assert st.clip_high_fraction == pytest.approx(1 / 5) and st.clip_low_fraction == 0.0

    # sapo: -(4/tau) sigmoid(tau (r - 1)) A, tau 1 (A > 0) / 1.05 (A <= 0), sequence mean; at r = 1 the gradient is -A
    def gate(r, tau):
        return 4.0 / tau / (1.0 + math.exp(-tau * (r - 1.0)))

    seq0 = -(gate(2.0, 1.0) + gate(1.0, 1.0)) / 2
    seq1 = 2.0 * (gate(1.0, 1.05) + gate(0.5, 1.05) + gate(1.0, 1.05)) / 3
    val, g, st = run("sapo")
    assert val == pytest.approx((seq0 + seq1) / 2, rel=1e-6)
    assert float(g[1, 0]) == pytest.approx(2.0 / (3 * 2), rel=1e-6) and st.clip_fraction == 0.0
    # luspo: the clipped surrogate summed over each sequence, mean over sequences
    val, g, _ = run("luspo")
    assert val == pytest.approx(((-1.28 - 1.0) + (2.0 + 1.6 + 2.0)) / 2, rel=1e-6)
    # vespo: phi(w) = exp(lambda + k ln w - lambda w), w0 = 2 (k 2, lambda 3), w1 = 0.5 (A < 0: k 3, lambda 2)
    phi0, phi1 = math.exp(3 + 2 * math.log(2) - 6), math.exp(2 + 3 * math.log(0.5) - 1)
    want = -phi0 * (lp0[0][0] + lp0[0][1]) + 2 * phi1 * sum(lp0[1])
    val, g, _ = run("vespo")
    assert val == pytest.approx(want / 5, rel=1e-6)
    assert float(g[0, 1]) == pytest.approx(-phi0 / 5, rel=1e-6) and float(g[1, 2]) == pytest.approx(
        2 * phi1 / 5, rel=1e-6
    )
    # vespo with token IS weights: folded into w (w0 = 2 * 0.5), not multiplied onto the loss
    isw = torch.tensor([[0.5, 1.0, 1.0], [1.0, 1.0, 1.0]])
    val, _, _ = run("vespo", is_weights=isw)
    assert val == pytest.approx((-math.exp(3 - 3) * (lp0[0][0] + lp0[0][1]) + 2 * phi1 * sum(lp0[1])) / 5, rel=1e-6)
    # bnpo: each micro-batch's token mean over the micro-batches; one micro-batch: dapo
    per_mb = [(-1.28 - 1.0) / 2, (2.0 + 1.6 + 2.0) / 3]
    parts = sum(
        float(
            grpo.policy_loss(
                logp[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], _p("bnpo", num_micro_batches=2)
            )[0]
        )
        for i in (0, 1)
    )
    assert parts == pytest.approx(sum(per_mb) / 2, rel=1e-6)
    assert run("bnpo")[0] == pytest.approx(run("dapo")[0], rel=1e-7)
    with pytest.raises(ValueError, match="grpo.loss_type"):
        run("ppo")


def test_entropy_bonus_is_minus_coef_times_the_selected_mean():
    logp, old, adv, mask = _toy()
    ent = torch.tensor([[1.0, 2.0, 9.0], [3.0, 0.5, 0.5]], requires_grad=True)
    sel = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    for loss_type in losses.loss_names():
        base, _ = grpo.policy_loss(logp, old, adv, mask, _p(loss_type, OPTIONS, num_micro_batches=2), token_select=sel)
        bonus = _p(loss_type, OPTIONS, num_micro_batches=2, entropy_coef=0.1)
        with_bonus, _ = grpo.policy_loss(logp, old, adv, mask, bonus, token_select=sel, entropy=ent)
        # selected real tokens: row0 token0, row1 all three: mean (1 + 3 + 0.5 + 0.5) / 4, halved for 2 micro-batches
        assert float(with_bonus - base) == pytest.approx(-0.1 * 5.0 / 4 / 2, rel=1e-6), loss_type
    ent.grad = None
    with_bonus.backward()
    torch.testing.assert_close(ent.grad, torch.tensor([[-0.1 / 8, 0.0, 0.0], [-0.1 / 8] * 3]))


def test_clipped_tokens_get_no_gradient():
    logp, old, adv, mask = _toy()
    logp = logp.clone().requires_grad_(True)
    loss, _ = grpo.policy_loss(logp, old, adv, mask, _p("dapo"))
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
    for how in ("grpo", "dapo", "dr_grpo"):
        full, _ = grpo.policy_loss(logp, old, adv, mask, _p(how))
        parts = sum(
            grpo.policy_loss(
                logp[i : i + 2],
                old[i : i + 2],
                adv[i : i + 2],
                mask[i : i + 2],
                _p(how, num_sequences=6, num_tokens=float(mask.sum()), max_len=5),
            )[0]
            for i in (0, 2, 4)
        )
        assert float(parts) == pytest.approx(float(full), rel=1e-6), how


def _is_toy():
    # token ratios old/roll: row0 [2, 1, 0.25], row1 [0.5, 2, (padding)]; sequence ratios: 0.5 and 1.0
    old = torch.log(torch.tensor([[0.5, 0.9, 0.1], [0.2, 0.2, 0.3]]))
    roll = torch.log(torch.tensor([[0.25, 0.9, 0.4], [0.4, 0.1, 0.9]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return old, roll, mask


@pytest.mark.parametrize(
    "mode, cap, lower, weights, masked, clipped",
    [
        ("token_truncate", 1.5, None, [[1.5, 1.0, 0.25], [0.5, 1.5]], 0, 2),
        ("token_truncate", 1.5, 0.4, [[1.5, 1.0, 0.4], [0.5, 1.5]], 0, 3),
        ("token_mask", 1.5, None, [[0.0, 1.0, 0.25], [0.5, 0.0]], 2, 0),
        ("token_mask", 1.5, 0.4, [[0.0, 1.0, 0.0], [0.5, 0.0]], 3, 0),
        ("sequence_truncate", 0.8, None, [[0.5] * 3, [0.8] * 2], 0, 1),
        ("sequence_truncate", 0.8, 0.6, [[0.6] * 3, [0.8] * 2], 0, 2),
        ("sequence_mask", 0.8, None, [[0.5] * 3, [0.0] * 2], 1, 0),
        ("sequence_mask", 0.8, 0.6, [[0.0] * 3, [0.0] * 2], 2, 0),
        ("token_truncate", None, 0.4, [[2.0, 1.0, 0.4], [0.5, 2.0]], 0, 1),
    ],
)
def test_is_modes_hand_computed(mode, cap, lower, weights, masked, clipped):
    old, roll, mask = _is_toy()
    w, st = grpo.is_weights(old, roll, mask, mode, cap, lower)
    assert w.shape == mask.shape
    assert w[0].tolist() == pytest.approx(weights[0], rel=1e-6)
    assert w[1, :2].tolist() == pytest.approx(weights[1], rel=1e-6)  # [1, 2] is padding
    n = 5 if mode.startswith("token") else 2  # real tokens, or sequences
    m = st.metrics()
    assert st.masked == masked and st.clipped == clipped
    assert m["mismatch/is_masked_fraction"] == pytest.approx(masked / n)
    assert m["mismatch/is_clipped_fraction"] == pytest.approx(clipped / n)
    if mode.startswith("token"):  # raw ratios of the 5 real tokens, before truncation/masking
        assert (m["mismatch/is_ratio_min"], m["mismatch/is_ratio_max"]) == pytest.approx((0.25, 2.0))
        assert m["mismatch/is_ratio_mean"] == pytest.approx((2 + 1 + 0.25 + 0.5 + 2) / 5)
    else:
        assert (m["mismatch/is_ratio_min"], m["mismatch/is_ratio_mean"], m["mismatch/is_ratio_max"]) == pytest.approx(
            (0.5, 0.75, 1.0)
        )


def test_is_none_and_merge_of_micro_batches():
    old, roll, mask = _is_toy()
    assert grpo.is_weights(old, roll, mask, "none", 2.0) == (None, None)
    with pytest.raises(ValueError, match="is_mode"):
        grpo.is_weights(old, roll, mask, "token_clip", 2.0)
    whole = grpo.is_weights(old, roll, mask, "token_mask", 1.5)[1]
    parts = grpo.ISStats.merge(
        [grpo.is_weights(old[i : i + 1], roll[i : i + 1], mask[i : i + 1], "token_mask", 1.5)[1] for i in (0, 1)]
    )
    assert parts.metrics() == pytest.approx(whole.metrics())
    # a sequence's product of ratios can overflow exp(): clamped, finite, and masked by any cap
    huge_old, huge_roll = torch.zeros(1, 200), torch.full((1, 200), -5.0)
    w, st = grpo.is_weights(huge_old, huge_roll, torch.ones(1, 200), "sequence_mask", 3.0)
    assert torch.isfinite(st.ratios).all() and float(w.max()) == 0.0


def test_mismatch_kl_and_weights_multiply_the_surrogate():
    old = torch.log(torch.tensor([[0.5, 0.9, 0.1]]))
    roll = torch.log(torch.tensor([[0.25, 0.9, 0.4]]))
    mask = torch.ones(1, 3)
    w, _ = grpo.is_weights(old, roll, mask, "token_truncate", 1.5)
    # k3 of KL(roll||train) per token: exp(d) - d - 1, d = old - roll
    d = [math.log(2), 0.0, math.log(0.25)]
    want = sum(math.exp(x) - x - 1 for x in d) / 3
    assert grpo.mismatch_kl(roll, old, mask) == pytest.approx(want, rel=1e-6)
    adv = torch.tensor([1.0])
    lw, _ = grpo.policy_loss(old, old, adv, mask, _p("dapo"), is_weights=w)
    assert float(lw) == pytest.approx(-(1.5 + 1.0 + 0.25) / 3)
    # not the KL term (as TRL): with A = 0 only the KL is left, unweighted
    ref = old - math.log(2)
    lk, _ = grpo.policy_loss(old, old, torch.zeros(1), mask, _p(kl_beta=1.0), is_weights=w, ref_logp=ref)
    assert float(lk) == pytest.approx(0.5 - math.log(0.5) - 1)


def test_gspo_sequence_ratio_hand_computed():
    logp, old, adv, mask = _toy()
    # row0 token log-ratios [ln 2, 0] (third masked): s0 = exp(ln2 / 2) = sqrt(2) > 1.28 with A>0: clipped
    # row1 [0, ln .5, 0]: s1 = 0.5^(1/3) = 0.794 < 0.8 with A<0: min(-2 s1, -1.6) = -1.6, clipped
    for how, want in (("grpo", (-1.28 + 1.6) / 2), ("dapo", (2 * -1.28 + 3 * 1.6) / 5)):
        loss, st = grpo.policy_loss(logp, old, adv, mask, _p(how, level="sequence"))
        assert float(loss) == pytest.approx(want, rel=1e-6), how
        assert st.clip_fraction == pytest.approx(1.0) and st.clip_high_fraction == pytest.approx(2 / 5)
    # unclipped (wide range): loss = (1/2) sum_i -s_i A_i, d/dlogp[i, t] = -A_i s_i / (2 |y_i|)
    lp = logp.clone().requires_grad_(True)
    wide = {"clip_eps_low": 0.9, "clip_eps_high": 9.0}
    loss, _ = grpo.policy_loss(lp, old, adv, mask, _p("grpo", wide, level="sequence"))
    s0, s1 = math.sqrt(2), 0.5 ** (1 / 3)
    assert float(loss) == pytest.approx((-s0 + 2 * s1) / 2, rel=1e-6)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-s0 / 4, -s0 / 4, 0.0], rel=1e-6)
    assert lp.grad[1].tolist() == pytest.approx([s1 / 3] * 3, rel=1e-6)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        grpo.policy_loss(logp, old, adv, mask, _p(level="group"))


def test_kl_bias_correction_hand_computed():
    logp0 = torch.log(torch.tensor([[0.5, 0.5]]))
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    mask, adv = torch.ones(1, 2), torch.zeros(1)
    k3_0 = 0.5 - math.log(0.5) - 1  # token 0; token 1 has k3 = 0
    grads = {}
    for corr in (False, True):
        lp = logp0.clone().requires_grad_(True)
        loss, _ = grpo.policy_loss(
            lp, logp0, adv, mask, _p(options=CLIP_02, kl_beta=0.1, kl_bias_correction=corr), ref_logp=ref
        )
        assert float(loss) == pytest.approx(0.1 * k3_0 / 2)  # ratio 1: same value
        loss.backward()
        grads[corr] = float(lp.grad[0, 0])
    # d k3/d logp = 1 - exp(ref - logp) = 0.5; corrected: d (ratio * k3) = k3 + 0.5 at ratio 1
    assert grads[False] == pytest.approx(0.1 * 0.5 / 2)
    assert grads[True] == pytest.approx(0.1 * (k3_0 + 0.5) / 2)
    # off-policy (pi_theta = 2 pi_old): the corrected term is the ratio times k3
    corrected = _p(options=CLIP_02, kl_beta=0.1, kl_bias_correction=True)
    loss, _ = grpo.policy_loss(logp0, logp0 - math.log(2), adv, mask, corrected, ref_logp=ref)
    assert float(loss) == pytest.approx(2 * 0.1 * k3_0 / 2)


def test_high_entropy_selection_hand_computed():
    ent = torch.tensor([[0.1, 0.9, 0.5], [0.3, 0.7, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # 5.0 is padding: never selected, not in the quantile
    sel, thr = grpo.high_entropy_mask(ent, mask, 0.4)
    # 0.6-quantile of [0.1, 0.3, 0.5, 0.7, 0.9] (linear): position 2.4 -> 0.5 + 0.4 * 0.2 = 0.58
    assert thr == pytest.approx(0.58)
    assert sel.tolist() == [[0, 1, 0], [0, 1, 0]]
    every, _ = grpo.high_entropy_mask(ent, mask, 1.0)
    assert torch.equal(every, mask)
    # only selected tokens carry the surrogate; the normaliser still counts all 5 real tokens
    logp = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -2.0])
    loss, _ = grpo.policy_loss(logp, logp, adv, mask, _p("dapo"), token_select=sel)
    assert float(loss) == pytest.approx((-1.0 + 2.0) / 5)
    lp = logp.clone().requires_grad_(True)
    grpo.policy_loss(lp, logp, adv, mask, _p(), token_select=sel)[0].backward()
    assert (lp.grad != 0).tolist() == [[False, True, False], [False, True, False]]


def test_kl_to_reference_k3():
    logp = torch.log(torch.tensor([[0.5, 0.5]]))
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    adv = torch.zeros(1)
    mask = torch.ones(1, 2)
    loss, stats = grpo.policy_loss(logp, logp, adv, mask, _p(options=CLIP_02, kl_beta=0.1), ref_logp=ref)
    kl0 = 0.5 - math.log(0.5) - 1  # exp(ref-logp) - (ref-logp) - 1 with ratio 0.5
    assert stats.kl_to_ref == pytest.approx(kl0 / 2)
    assert float(loss) == pytest.approx(0.1 * kl0 / 2)
    loss0, stats0 = grpo.policy_loss(logp, logp, adv, mask, _p(options=CLIP_02, kl_beta=0.0), ref_logp=ref)
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
