"""Our loss options against TRL 1.16's own loss code (the independent oracle), value and gradient.

``GRPOTrainer._compute_loss`` is called unbound on a stand-in for the trainer: its model
forward (``_get_per_token_logps_and_entropies``) returns the log-probs and entropies we
give it, its accelerator is a single process. Everything after the forward is TRL's: the
surrogate at token or sequence level (GSPO), the clip, the KL with and without its bias
correction, the entropy selection, the vLLM importance weights multiplying the surrogate,
and the loss types' normalisers. Our ``grpo.policy_loss`` must give the same loss and the
same gradient with respect to the log-probs.

Name map: TRL ``loss_type`` grpo / bnpo / dr_grpo = our ``loss_aggregation`` sequence /
token / dr_grpo; ``importance_sampling_level`` the same; ``use_bias_correction_kl`` = our
``kl_bias_correction``; ``top_entropy_quantile`` the same (TRL takes the quantile over the
batch it is given; we give it the whole batch, as ours does); ``importance_sampling_ratio``
(the vLLM IS weights) = our ``is_weights`` (the weights themselves are checked against hand
values in test_grpo.py: TRL computes them inside generation, which needs a live vLLM).
"""

from __future__ import annotations

import itertools
import types
from collections import defaultdict

import pytest
import torch

from qerl_pipeline.rl import grpo

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL (the bench extra) is the oracle")

N, T, MAX_LEN = 6, 5, 7


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


def _trl_loss(logp, entropies, inputs, *, loss_type, level, beta, bias_correction, quantile, eps_low, eps_high):
    fake = types.SimpleNamespace(
        aux_loss_enabled=False, top_entropy_quantile=quantile, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=beta, loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high,
        use_vllm=True, vllm_importance_sampling_correction=True, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)},
        accelerator=_OneProcess(), max_completion_length=MAX_LEN,
        args=types.SimpleNamespace(use_bias_correction_kl=bias_correction, delta=None),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, entropies, None),
    )
    fake.get_high_entropy_mask = types.MethodType(trl_grpo.GRPOTrainer.get_high_entropy_mask, fake)
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


AGG = {"grpo": "sequence", "bnpo": "token", "dr_grpo": "dr_grpo"}
CASES = list(itertools.product(
    ["grpo", "bnpo", "dr_grpo"], ["token", "sequence"], [(0.0, False), (0.1, False), (0.1, True)], [1.0, 0.3],
    ["token_mask", "sequence_truncate"],
))


@pytest.mark.parametrize("loss_type, level, kl, quantile, is_mode", CASES)
def test_loss_and_gradient_equal_trl(loss_type, level, kl, quantile, is_mode):
    beta, bias_correction = kl
    logp, old, ref, roll, adv, ent, mask = _batch(seed=len(loss_type) + 3 * len(level) + int(10 * quantile))
    weights, _ = grpo.is_weights(old, roll, mask, is_mode, cap=1.6, lower=0.6)
    eps_low, eps_high = 0.2, 0.28
    inputs = {
        "prompt_ids": torch.zeros(N, 2, dtype=torch.long), "prompt_mask": torch.ones(N, 2, dtype=torch.long),
        "completion_ids": torch.zeros(N, T, dtype=torch.long), "completion_mask": mask.long(),
        "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref, "importance_sampling_ratio": weights,
    }
    theirs_lp = logp.clone().requires_grad_(True)
    theirs = _trl_loss(theirs_lp, ent, inputs, loss_type=loss_type, level=level, beta=beta, bias_correction=bias_correction,
                       quantile=quantile, eps_low=eps_low, eps_high=eps_high)
    theirs.backward()

    ours_lp = logp.clone().requires_grad_(True)
    select = grpo.high_entropy_mask(ent, mask, quantile)[0] if quantile < 1.0 else None
    ours, _ = grpo.policy_loss(
        ours_lp, old, adv, mask, eps_low=eps_low, eps_high=eps_high, aggregation=AGG[loss_type], is_weights=weights,
        ref_logp=ref if beta > 0 else None, kl_beta=beta, max_len=MAX_LEN, level=level,
        kl_bias_correction=bias_correction, token_select=select,
    )
    ours.backward()
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(ours_lp.grad, theirs_lp.grad, rtol=1e-5, atol=1e-7)
    assert theirs_lp.grad.abs().sum() > 0  # the comparison is not of two zeros
