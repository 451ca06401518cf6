"""GRPO / DAPO / Dr. GRPO as pure functions on tensors.

Shapes: a rollout batch has ``N = num_prompts * G`` completions, grouped consecutively
(rows ``g*G .. g*G+G-1`` answer prompt ``g``). Per-token tensors are ``[N, T]`` over the
completion tokens, with a float ``mask`` (1 = token counts in the loss).

- ``group_advantages``: ``A_i = (r_i - mean_group) / (std_group + eps)``; ``scale`` chooses
  the divisor: the group's std (GRPO), the whole batch's std, or none (Dr. GRPO). std is the
  population std (``unbiased=False``), as in the DAPO/Dr. GRPO write-ups; TRL uses the sample
  std, which only rescales A for fixed G.
- ``policy_loss``: the clipped surrogate ``-min(rho A, clip(rho, 1-eps_low, 1+eps_high) A)``
  with ``rho = exp(logp - old_logp)``, optionally weighted per token by truncated importance
  sampling weights, plus ``kl_beta * KL(pi || pi_ref)`` (k3 estimator
  ``exp(ref - logp) - (ref - logp) - 1``, the base model without LoRA being the reference).
- ``aggregate``: how per-token losses become one number: ``sequence`` (mean over each
  sequence's tokens, then over sequences: GRPO), ``token`` (sum over all tokens / number of
  tokens: DAPO / BNPO), ``dr_grpo`` (sum / (num_sequences * max_new_tokens)). The counts are
  passed in so that micro-batches of one batch add up exactly to the full-batch loss.
- ``tis_weights``: truncated importance sampling for the rollout/trainer mismatch (vLLM
  log-probs differ from the trainer's): ``w = min(pi_old_trainer / pi_rollout, cap)``,
  detached. ``mismatch_kl``: k3 estimate of KL(pi_rollout || pi_trainer) on the sampled
  tokens (the tokens were drawn from the rollout policy).
- ``dynamic_sampling_keep``: DAPO's filter (keep groups whose rewards are not all equal).
- ``overlong_penalty``: DAPO's soft overlong punishment (0 up to ``L_max - L_buffer``, then
  a linear ramp to ``-penalty`` at ``L_max``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Aggregation = str  # "sequence" | "token" | "dr_grpo"


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """Advantages for rewards ``[N]`` in consecutive groups of ``group_size``."""
    rewards = rewards.to(torch.float32)
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, got {tuple(rewards.shape)}")
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        std = grouped.std(dim=1, unbiased=False, keepdim=True)
        return (centred / (std + eps)).reshape(-1)
    if scale == "batch":
        return (centred / (rewards.std(unbiased=False) + eps)).reshape(-1)
    if scale == "none":
        return centred.reshape(-1)
    raise ValueError(f"grpo.advantage_scale: unknown {scale!r} (group | batch | none)")


def zero_std_fraction(rewards: torch.Tensor, group_size: int) -> float:
    """Fraction of groups whose rewards are all equal (they carry no GRPO signal)."""
    grouped = rewards.view(-1, group_size)
    return float((grouped.max(dim=1).values == grouped.min(dim=1).values).float().mean())


def dynamic_sampling_keep(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: a bool per group, True when its rewards are not all equal."""
    grouped = rewards.view(-1, group_size)
    return grouped.max(dim=1).values != grouped.min(dim=1).values


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer_tokens: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment per completion (<= 0), to be added to the reward."""
    lengths = lengths.to(torch.float32)
    start = max_new_tokens - buffer_tokens
    ramp = (start - lengths) / float(buffer_tokens)
    out = torch.where(lengths <= start, torch.zeros_like(lengths), ramp)
    return torch.clamp(out, min=-1.0) * penalty


def completion_mask(lengths: torch.Tensor, max_len: int, truncated: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, max_len]`` float mask of real completion tokens; rows in ``truncated`` fully masked."""
    positions = torch.arange(max_len).unsqueeze(0)
    mask = (positions < lengths.unsqueeze(1)).to(torch.float32)
    if truncated is not None:
        mask = mask * (~truncated.bool()).to(torch.float32).unsqueeze(1)
    return mask


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    how: Aggregation,
    *,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Reduce ``[N, T]`` per-token values to a scalar.

    ``num_sequences``/``num_tokens`` are the full batch's counts (default: this tensor's own);
    summing the results over the micro-batches of one batch gives the full-batch value.
    """
    n_seq = per_token.shape[0] if num_sequences is None else num_sequences
    masked = per_token * mask
    if how == "sequence":
        per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return per_seq.sum() / n_seq
    if how == "token":
        n_tok = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=per_token.dtype)
        return masked.sum() / torch.clamp(n_tok, min=1.0)
    if how == "dr_grpo":
        length = per_token.shape[1] if max_len is None else max_len
        return masked.sum() / (n_seq * length)
    raise ValueError(f"grpo.loss_aggregation: unknown {how!r} (sequence | token | dr_grpo)")


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float | None) -> torch.Tensor | None:
    """Truncated importance weights ``min(exp(old_logp - rollout_logp), cap)``, detached; None if disabled."""
    if cap is None:
        return None
    return torch.exp(old_logp.detach() - rollout_logp.detach()).clamp(max=cap)


def k3(logp_p: torch.Tensor, logp_q: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(p || q) from samples of p: ``exp(q - p) - (q - p) - 1`` (>= 0)."""
    d = logp_q - logp_p
    return torch.exp(d) - d - 1.0


def mismatch_kl(rollout_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """Token-mean k3 estimate of KL(pi_rollout || pi_trainer) on the rollout's tokens."""
    per_tok = k3(rollout_logp.detach().double(), trainer_logp.detach().double())  # float64: tiny gaps
    return float((per_tok * mask.double()).sum() / mask.double().sum().clamp(min=1.0))


@dataclass
class LossStats:
    """Diagnostics of one policy-loss evaluation (token means over the mask)."""

    clip_fraction: float
    clip_low_fraction: float
    clip_high_fraction: float
    ratio_mean: float
    kl_to_ref: float | None
    tokens: float


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    aggregation: Aggregation = "token",
    is_weights: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Clipped-ratio policy loss (+ optional KL to the reference) and its diagnostics.

    ``logp``/``old_logp``/``ref_logp``/``is_weights``/``mask``: ``[N, T]``; ``advantages``: ``[N]``.
    A token is "clipped" when the clip is the active branch of the min: ratio below
    ``1 - eps_low`` with A < 0, or above ``1 + eps_high`` with A > 0 (its gradient is zero).
    """
    adv = advantages.to(logp.dtype).unsqueeze(1)
    ratio = torch.exp(logp - old_logp.detach())
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    kl_val = None
    if ref_logp is not None:
        kl_tok = k3(logp, ref_logp.detach())
        if kl_beta > 0:
            per_token = per_token + kl_beta * kl_tok
        kl_val = float((kl_tok.detach() * mask).sum() / mask.sum().clamp(min=1.0))
    loss = aggregate(per_token, mask, aggregation, num_sequences=num_sequences, num_tokens=num_tokens, max_len=max_len)
    with torch.no_grad():
        low = ((ratio < 1.0 - eps_low) & (adv < 0)).to(mask.dtype) * mask
        high = ((ratio > 1.0 + eps_high) & (adv > 0)).to(mask.dtype) * mask
        n = mask.sum().clamp(min=1.0)
        stats = LossStats(
            clip_fraction=float((low + high).sum() / n),
            clip_low_fraction=float(low.sum() / n),
            clip_high_fraction=float(high.sum() / n),
            ratio_mean=float((ratio.detach() * mask).sum() / n),
            kl_to_ref=kl_val,
            tokens=float(mask.sum()),
        )
    return loss, stats
