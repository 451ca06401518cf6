"""Our loss types and options against TRL 1.16's own loss code (the independent oracle), value and gradient.

``GRPOTrainer._compute_loss`` is called unbound on a stand-in for the trainer: its model
forward (``_get_per_token_logps_and_entropies``) returns the log-probs and entropies we
give it, its accelerator is a single process. Everything after the forward is TRL's: the
eight loss types (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo) with their
surrogates and normalisers, the surrogate at token or sequence level (GSPO), the clip, the
KL with and without its bias correction, the entropy selection, the entropy bonus, the vLLM
importance weights multiplying the loss (or, for vespo, folded into its weights). Our
``grpo.policy_loss`` must give the same loss and the same gradient with respect to the
log-probs (and the entropies, for the bonus).

Micro-batches as TRL takes them: a generation batch split into ``GA`` equal micro-batches
(``steps_per_generation = gradient_accumulation_steps = GA``), ``_compute_loss`` called on
each, the losses summed (what its backward accumulates); ours is called on the same slices
with the batch's counts (``num_sequences``, ``num_tokens``, ``num_micro_batches``), as
``rl/update.py`` calls it.

Name map: TRL ``loss_type`` = the registry's ``trl_name`` of our ``grpo.loss_type`` (``rl/losses.py``; the same names);
``importance_sampling_level`` the same; ``use_bias_correction_kl`` = our
``kl_bias_correction``; ``top_entropy_quantile`` the same (TRL takes the quantile over the
micro-batch it is given; the tests give ours the same selection, ``rl/update.py`` takes it over
the whole batch: documented in config.py); ``epsilon_high`` under cispo = our
``cispo_clip_max``; ``sapo_temperature_*``, ``vespo_*``, ``entropy_coef`` the same;
``importance_sampling_ratio`` (the vLLM IS weights) = our ``is_weights`` (the weights
themselves are checked against hand values in test_grpo.py: TRL computes them inside
generation, which needs a live vLLM).
"""

from __future__ import annotations

import itertools
import types
from collections import defaultdict

import pytest
import torch

from qerl_pipeline.rl import grpo, losses

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL (the bench extra) is the oracle")

N, T, MAX_LEN = 6, 5, 7
#: not TRL's defaults, so that a coefficient read from the wrong field shows
PARAMS = types.SimpleNamespace(
    cispo_clip_max=1.1,
    sapo_temperature_pos=0.9,
    sapo_temperature_neg=1.3,
    vespo_k_pos=1.5,
    vespo_lambda_pos=2.5,
    vespo_k_neg=2.5,
    vespo_lambda_neg=1.5,
)
EPS_LOW, EPS_HIGH = 0.2, 0.28
#: every loss type's options (``grpo.LossParams.options``): the clip range and ``PARAMS``
OPTIONS = {"clip_eps_low": EPS_LOW, "clip_eps_high": EPS_HIGH, **vars(PARAMS)}


class _OneProcess:
    num_processes = 1
    sync_gradients = True

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def pad_across_processes(x, dim=0, pad_index=0):
        return x

    @staticmethod
    def reduce(x, reduction="sum"):
        return x


def _trl_loss(
    logp, entropies, inputs, *, loss_type, level, beta, bias_correction, quantile, is_on, ga=1, entropy_coef=0.0
):
    p = PARAMS
    fake = types.SimpleNamespace(
        aux_loss_enabled=False,
        top_entropy_quantile=quantile,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=beta,
        loss_type=losses.loss_spec(loss_type).trl_name,
        epsilon_low=EPS_LOW,
        epsilon_high=p.cispo_clip_max if loss_type == "cispo" else EPS_HIGH,
        use_vllm=True,
        vllm_importance_sampling_correction=is_on,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=ga,
        _entropy_bonus_enabled=entropy_coef != 0.0,
        entropy_coef=entropy_coef,
        use_adaptive_entropy=False,
        _metrics={"train": defaultdict(list)},
        accelerator=_OneProcess(),
        max_completion_length=MAX_LEN,
        args=types.SimpleNamespace(
            use_bias_correction_kl=bias_correction,
            delta=None,
            steps_per_generation=ga,
            sapo_temperature_pos=p.sapo_temperature_pos,
            sapo_temperature_neg=p.sapo_temperature_neg,
            vespo_k_pos=p.vespo_k_pos,
            vespo_lambda_pos=p.vespo_lambda_pos,
            vespo_k_neg=p.vespo_k_neg,
            vespo_lambda_neg=p.vespo_lambda_neg,
        ),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, entropies, None),
    )
    fake.get_high_entropy_mask = types.MethodType(trl_grpo.GRPOTrainer.get_high_entropy_mask, fake)
    fake.get_gamma_weights = trl_grpo.GRPOTrainer.get_gamma_weights
    return trl_grpo.GRPOTrainer._compute_loss(fake, None, inputs)


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 3, 1, 4, 2, 5])
    mask = grpo.completion_mask(lengths, T)
    logp = -torch.rand(N, T, generator=g) * 2 - 0.1
    old = logp + torch.randn(N, T, generator=g) * 0.2  # some token ratios beyond the clip range, some within
    ref = logp + torch.randn(N, T, generator=g) * 0.5
    roll = old + torch.randn(N, T, generator=g) * 0.3
    adv = torch.randn(N, generator=g)
    ent = torch.rand(N, T, generator=g) * 3
    return logp, old, ref, roll, adv, ent, mask


def _is_modes(loss_type: str) -> list[str]:
    """A token and a sequence mode and none; vespo takes token modes only (TRL refuses the others)."""
    return ["token_mask", "token_truncate" if loss_type == "vespo" else "sequence_truncate", "none"]


def _inputs(sl, mask, adv, old, ref, weights):
    out = {
        "prompt_ids": torch.zeros(N, 2, dtype=torch.long)[sl],
        "prompt_mask": torch.ones(N, 2, dtype=torch.long)[sl],
        "completion_ids": torch.zeros(N, T, dtype=torch.long)[sl],
        "completion_mask": mask.long()[sl],
        "advantages": adv[sl],
        "old_per_token_logps": old[sl],
        "ref_per_token_logps": ref[sl],
        "num_items_in_batch": mask.sum(),  # the generation batch's tokens (TRL's dapo/cispo/vespo normaliser)
    }
    if weights is not None:
        out["importance_sampling_ratio"] = weights[sl]
    return out


CASES = [
    (lt, level, kl, quantile, is_mode)
    for lt, level, kl, quantile in itertools.product(
        losses.loss_names(), ["token", "sequence"], [(0.0, False), (0.1, False), (0.1, True)], [1.0, 0.3]
    )
    for is_mode in _is_modes(lt)
]


@pytest.mark.parametrize("loss_type, level, kl, quantile, is_mode", CASES)
def test_loss_and_gradient_equal_trl(loss_type, level, kl, quantile, is_mode):
    beta, bias_correction = kl
    logp, old, ref, roll, adv, ent, mask = _batch(seed=len(loss_type) + 3 * len(level) + int(10 * quantile))
    weights, _ = grpo.is_weights(old, roll, mask, is_mode, cap=1.6, lower=0.6)
    theirs_lp = logp.clone().requires_grad_(True)
    theirs = _trl_loss(
        theirs_lp,
        ent,
        _inputs(slice(None), mask, adv, old, ref, weights),
        loss_type=loss_type,
        level=level,
        beta=beta,
        bias_correction=bias_correction,
        quantile=quantile,
        is_on=weights is not None,
    )
    theirs.backward()

    ours_lp = logp.clone().requires_grad_(True)
    select = grpo.high_entropy_mask(ent, mask, quantile)[0] if quantile < 1.0 else None
    ours, _ = grpo.policy_loss(
        ours_lp,
        old,
        adv,
        mask,
        grpo.LossParams(
            loss_type, OPTIONS, level=level, kl_beta=beta, kl_bias_correction=bias_correction, max_len=MAX_LEN
        ),
        is_weights=weights,
        ref_logp=ref if beta > 0 else None,
        token_select=select,
    )
    ours.backward()
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(ours_lp.grad, theirs_lp.grad, rtol=1e-5, atol=1e-7)
    assert theirs_lp.grad.abs().sum() > 0  # the comparison is not of two zeros


MB_CASES = [
    (lt, level, is_mode)
    for lt, level in itertools.product(losses.loss_names(), ["token", "sequence"])
    for is_mode in _is_modes(lt)
]


@pytest.mark.parametrize("loss_type, level, is_mode", MB_CASES)
def test_micro_batched_loss_and_gradient_equal_trl(loss_type, level, is_mode):
    """Three micro-batches of two sequences (TRL's gradient accumulation), with KL (bias-corrected), entropy
    selection per micro-batch (TRL's) and the entropy bonus: the summed losses and the gradients of the
    log-probs and of the entropies agree. bnpo's per-micro-batch token mean differs from dapo's here."""
    ga, beta, quantile, coef = 3, 0.1, 0.5, 0.05
    logp, old, ref, roll, adv, ent, mask = _batch(seed=100 + len(loss_type) + len(level) + len(is_mode))
    weights, _ = grpo.is_weights(old, roll, mask, is_mode, cap=1.6, lower=0.6)
    slices = [slice(i, i + N // ga) for i in range(0, N, N // ga)]
    theirs_lp, theirs_ent = logp.clone().requires_grad_(True), ent.clone().requires_grad_(True)
    ours_lp, ours_ent = logp.clone().requires_grad_(True), ent.clone().requires_grad_(True)
    theirs = ours = 0.0
    for sl in slices:
        theirs = theirs + _trl_loss(
            theirs_lp[sl],
            theirs_ent[sl],
            _inputs(sl, mask, adv, old, ref, weights),
            loss_type=loss_type,
            level=level,
            beta=beta,
            bias_correction=True,
            quantile=quantile,
            is_on=weights is not None,
            ga=ga,
            entropy_coef=coef,
        )
        select = grpo.high_entropy_mask(ent[sl], mask[sl], quantile)[0]
        params = grpo.LossParams(
            loss_type,
            OPTIONS,
            level=level,
            kl_beta=beta,
            kl_bias_correction=True,
            entropy_coef=coef,
            num_sequences=N,
            num_tokens=float(mask.sum()),
            max_len=MAX_LEN,
            num_micro_batches=ga,
        )
        ours = (
            ours
            + grpo.policy_loss(
                ours_lp[sl],
                old[sl],
                adv[sl],
                mask[sl],
                params,
                is_weights=None if weights is None else weights[sl],
                ref_logp=ref[sl],
                token_select=select,
                entropy=ours_ent[sl],
            )[0]
        )
    theirs.backward()
    ours.backward()
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(ours_lp.grad, theirs_lp.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ours_ent.grad, theirs_ent.grad, rtol=1e-5, atol=1e-7)
    assert theirs_lp.grad.abs().sum() > 0 and theirs_ent.grad.abs().sum() > 0


def test_bnpo_is_not_dapo_with_micro_batches():
    """The oracle can tell the two normalisers apart: micro-batches of unequal token counts."""
    logp, old, _, _, adv, _, mask = _batch(seed=7)
    parts = {
        lt: sum(
            float(
                grpo.policy_loss(
                    logp[i : i + 2],
                    old[i : i + 2],
                    adv[i : i + 2],
                    mask[i : i + 2],
                    grpo.LossParams(lt, OPTIONS, num_sequences=N, num_tokens=float(mask.sum()), num_micro_batches=3),
                )[0]
            )
            for i in (0, 2, 4)
        )
        for lt in ("bnpo", "dapo")
    }
    assert parts["bnpo"] != pytest.approx(parts["dapo"], rel=1e-3)
