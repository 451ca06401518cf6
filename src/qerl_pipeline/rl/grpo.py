"""GRPO and its relatives (TRL 1.16's ``loss_type`` zoo) as pure functions on tensors.

Shapes: a rollout batch has ``N = num_prompts * G`` completions, grouped consecutively
(rows ``g*G .. g*G+G-1`` answer prompt ``g``). Per-token tensors are ``[N, T]`` over the
completion tokens, with a float ``mask`` (1 = token counts in the loss).

- ``group_advantages``: ``A_i = (r_i - mean_group) / (std_group + eps)``; ``scale`` chooses
  the divisor: the group's std (GRPO), the whole batch's std, or none (Dr. GRPO). std is the
  population std (``unbiased=False``), as in the DAPO/Dr. GRPO write-ups; TRL uses the sample
  std, which only rescales A for fixed G.
- ``policy_loss``: the loss type's per-token term (the clipped surrogate
  ``-min(rho A, clip(rho, 1-eps_low, 1+eps_high) A)`` for most) with
  ``rho = exp(logp - old_logp)``, optionally weighted per token by truncated importance
  sampling weights, plus ``kl_beta * KL(pi || pi_ref)`` (k3 estimator
  ``exp(ref - logp) - (ref - logp) - 1``, the base model without LoRA being the reference).
- ``aggregate``: how per-token losses become one number: ``sequence`` (mean over each
  sequence's tokens, then over sequences: GRPO, SAPO), ``token`` (sum over all tokens of the
  batch / their number: DAPO, CISPO, VESPO), ``micro_batch`` (each micro-batch's token mean,
  averaged over the micro-batches: BNPO as TRL defines it; equal to ``token`` with one
  micro-batch), ``dr_grpo`` (sum / (num_sequences * max_new_tokens)), ``sequence_sum`` (sum
  over each sequence's tokens, mean over sequences: LUSPO). The batch's counts are passed in
  so that the micro-batches of one batch add up to the batch's loss as TRL's gradient
  accumulation does.
- ``loss_type``: each of TRL 1.16's loss types (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo,
  vespo) is a function registered in ``rl/losses.py``, the place to add one: its per-token term,
  its reduction, the ``grpo.*`` fields it reads, TRL's name and its rules. ``policy_loss`` takes
  one ``LossParams`` (the loss type, its options, the KL and entropy coefficients, the batch's
  counts) and the tensors; all but the per-token term is common to every type.
- ``is_weights``: importance sampling for the rollout/trainer mismatch (vLLM's log-probs
  differ from the trainer's, more so on a quantized base), under TRL 1.x's names
  (``vllm_importance_sampling_mode``): the ratio ``rho = pi_old_trainer / pi_rollout`` per
  token (``token_*``) or per sequence (``sequence_*``: ``exp(sum_t (old - rollout))``, the
  product of the token ratios, as TRL), then ``*_truncate``: ``clamp(rho, lower, cap)``, or
  ``*_mask``: 0 where ``rho > cap`` or ``rho < lower`` (with ``lower`` set this is IcePop's /
  verl's two-sided masking); ``none``: no correction. Detached. ``token_truncate`` with
  ``lower=None`` is ``min(rho, cap)``, the project's only mode before (the truncated IS of
  Yao et al. 2025); TRL's default is ``sequence_mask`` with cap 3. The weights multiply the
  clipped surrogate, not the KL term (as TRL). Its statistics (``ISStats``) are of the raw
  ratio, before truncation or masking (TRL logs the ratio after them).
  ``mismatch_kl``: k3 estimate of KL(pi_rollout || pi_trainer) on the sampled
  tokens (the tokens were drawn from the rollout policy).
- ``LossParams.level="sequence"``: GSPO (Zheng et al. 2025), one ratio per sequence,
  ``s_i = exp(mean_t (logp - old_logp))`` (the length-normalised sequence likelihood ratio),
  broadcast to the sequence's tokens and clipped as a whole; TRL's
  ``importance_sampling_level="sequence"``. GSPO's own runs use clip ranges of 3e-4 / 4e-4
  and the per-sequence mean (loss type ``grpo``, which makes the loss exactly GSPO's
  (1/G) sum_i min(s_i A_i, clip(s_i) A_i)); with ``token``/``dr_grpo`` aggregation long
  sequences weigh more (TRL warns about the same combination).
- ``kl_bias_correction``: the KL term multiplied by the (differentiable) policy ratio
  ``pi_theta / pi_old`` (token or sequence level, as the surrogate), the unbiased reverse-KL
  gradient of DeepSeek-V3.2 and TRL 1.x's default (``use_bias_correction_kl=True``). Ours is
  off by default: the plain k3 penalty of GRPO (DeepSeekMath), and the paper (like our
  defaults) trains with ``kl_beta = 0``, where neither variant changes anything.
- ``token_select``: entropy-based token selection ("Beyond the 80/20 rule", Wang et al.
  2025): a 0/1 ``[N, T]`` mask multiplying the surrogate (not the KL) of each token;
  ``high_entropy_mask`` keeps the tokens whose entropy is at or above the ``1 - q``
  quantile of the batch's real tokens (TRL's ``top_entropy_quantile``, same rule). The
  normaliser still counts every token (as TRL), so q < 1 shrinks the loss, not only its support.
- ``dynamic_sampling_keep``: DAPO's filter (keep groups whose rewards are not all equal).
- ``overlong_penalty``: DAPO's soft overlong punishment (0 up to ``L_max - L_buffer``, then
  a linear ramp to ``-penalty`` at ``L_max``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from qerl_pipeline import metric_names
from qerl_pipeline.rl import losses


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """Advantages for rewards ``[N]`` in consecutive groups of ``group_size``."""
    rewards = rewards.to(torch.float32)
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} entries, got {tuple(rewards.shape)}"
        )
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


def overlong_penalty(
    lengths: torch.Tensor, max_new_tokens: int, buffer_tokens: int, penalty: float = 1.0
) -> torch.Tensor:
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
    how: str,
    *,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    max_len: int | None = None,
    num_micro_batches: int = 1,
) -> torch.Tensor:
    """Reduce ``[N, T]`` per-token values to a scalar.

    ``num_sequences``/``num_tokens`` are the full batch's counts (default: this tensor's own),
    ``num_micro_batches`` the number of micro-batches the batch is split into (over every
    data-parallel rank; ``micro_batch`` only); summing the results over the micro-batches of
    one batch gives the batch's value.
    """
    n_seq = per_token.shape[0] if num_sequences is None else num_sequences
    masked = per_token * mask
    if how == "sequence":
        per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return per_seq.sum() / n_seq
    if how == "token":
        n_tok = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=per_token.dtype)
        return masked.sum() / torch.clamp(n_tok, min=1.0)
    if how == "micro_batch":
        return masked.sum() / mask.sum().clamp(min=1.0) / num_micro_batches
    if how == "dr_grpo":
        length = per_token.shape[1] if max_len is None else max_len
        return masked.sum() / (n_seq * length)
    if how == "sequence_sum":
        return masked.sum() / n_seq
    raise ValueError(f"aggregate: unknown reduction {how!r} ({' | '.join(losses.AGGREGATIONS)})")


IS_MODES: tuple[str, ...] = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none")
#: exp() of a sequence's summed log-ratio is taken after clamping it to +-this (exp(80) ~ 5e34: finite in fp32)
MAX_LOG_RATIO = 80.0


@dataclass
class ISStats:
    """The raw importance ratios of one batch (or micro-batch) and what the mode did to them.

    ``ratios``: the raw ratio of every real token (token modes) or of every sequence with at
    least one real token (sequence modes), before truncation or masking; ``masked``/``clipped``:
    how many of them were set to 0 / truncated to a bound. Micro-batches are joined with ``merge``.
    """

    level: str
    ratios: torch.Tensor
    masked: int = 0
    clipped: int = 0

    @staticmethod
    def merge(parts: list[ISStats]) -> ISStats:
        if not parts:
            return ISStats("token", torch.zeros(0))
        return ISStats(
            parts[0].level,
            torch.cat([p.ratios for p in parts]),
            sum(p.masked for p in parts),
            sum(p.clipped for p in parts),
        )

    def metrics(self) -> dict[str, float]:
        """The raw ratios' min/mean/max and the masked/clipped fractions (of tokens or sequences), by metric name."""
        n = int(self.ratios.numel())
        if n == 0:
            return {}
        r = self.ratios.double()
        return {
            metric_names.IS_RATIO_MIN: float(r.min()),
            metric_names.IS_RATIO_MEAN: float(r.mean()),
            metric_names.IS_RATIO_MAX: float(r.max()),
            metric_names.IS_MASKED_FRACTION: self.masked / n,
            metric_names.IS_CLIPPED_FRACTION: self.clipped / n,
        }


def is_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_truncate",
    cap: float | None = 2.0,
    lower: float | None = None,
) -> tuple[torch.Tensor | None, ISStats | None]:
    """Importance weights ``[N, T]`` (detached) for ``mode`` (``IS_MODES``) and their ``ISStats``;
    ``(None, None)`` for none.

    ``old_logp``/``rollout_logp``/``mask``: ``[N, T]``; padding (mask 0) never enters a ratio.
    ``cap``/``lower``: the upper / lower bound (None: that side unbounded).
    """
    if mode == "none":
        return None, None
    if mode not in IS_MODES:
        raise ValueError(f"grpo.is_mode: unknown {mode!r} ({' | '.join(IS_MODES)})")
    level, how = mode.split("_")
    diff = (old_logp.detach() - rollout_logp.detach()).to(torch.float32) * mask
    real = mask > 0
    if level == "sequence":
        log_r = diff.sum(dim=1, keepdim=True).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        ratio = torch.exp(log_r)  # [N, 1]
        valid = real.any(dim=1, keepdim=True)
    else:
        ratio = torch.exp(diff)
        valid = real
    hi = torch.zeros_like(valid) if cap is None else (ratio > cap) & valid
    lo = torch.zeros_like(valid) if lower is None else (ratio < lower) & valid
    if how == "truncate":
        weights = ratio.clamp(min=lower, max=cap) if (cap is not None or lower is not None) else ratio
        stats = ISStats(level, ratio[valid], 0, int((hi | lo).sum()))
    else:
        weights = ratio.masked_fill(hi | lo, 0.0)
        stats = ISStats(level, ratio[valid], int((hi | lo).sum()), 0)
    return weights.expand_as(mask).to(old_logp.dtype), stats


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> tuple[torch.Tensor, float]:
    """``(select [N, T] float 0/1, threshold)``: real tokens whose entropy is >= the ``1 - quantile`` quantile.

    The quantile is taken over the real tokens (mask 1) of the tensors passed in: pass the
    whole rollout batch, not a micro-batch, to select "the top q of each batch". ``quantile``
    in (0, 1]; 1 keeps every real token. Ties at the threshold are kept (so slightly more than
    a fraction q may be selected).
    """
    real = mask > 0
    threshold = entropy_threshold(entropy.detach()[real], quantile)
    return ((entropy.detach() >= threshold) & real).to(mask.dtype), threshold


def entropy_threshold(values: torch.Tensor, quantile: float) -> float:
    """The ``1 - quantile`` quantile (linear interpolation, as ``torch.quantile``) of the real tokens' entropies
    ``values`` (1-D); ``-inf`` (keep all) when ``quantile >= 1`` or there are none. Data-parallel ranks pass
    the entropies gathered from every rank, so the threshold is the global batch's."""
    values = values.reshape(-1).to(torch.float32)
    if values.numel() == 0 or quantile >= 1.0:
        return float("-inf")
    return float(torch.quantile(values, 1.0 - quantile))


def k3(logp_p: torch.Tensor, logp_q: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(p || q) from samples of p: ``exp(q - p) - (q - p) - 1`` (>= 0)."""
    d = logp_q - logp_p
    return torch.exp(d) - d - 1.0


def mismatch_kl(rollout_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """Token-mean k3 estimate of KL(pi_rollout || pi_trainer) on the rollout's tokens."""
    per_tok = k3(rollout_logp.detach().double(), trainer_logp.detach().double())  # float64: tiny gaps
    return float((per_tok * mask.double()).sum() / mask.double().sum().clamp(min=1.0))


@dataclass(frozen=True)
class LossParams:
    """The scalars of one policy-loss evaluation: what ``policy_loss`` takes beside the tensors.

    ``loss_type``: a registered loss type (``rl/losses.py``); ``options``: the ``grpo.*`` fields it
    reads, by name (more may be given); ``level``: ``token`` (PPO/GRPO ratios) or ``sequence``
    (GSPO); ``kl_beta``/``kl_bias_correction``: the KL term's weight and its bias correction;
    ``entropy_coef``: the entropy bonus. The batch's counts, so that the micro-batches of one
    batch add up to its loss: ``num_sequences``/``num_tokens`` (default: each call's own),
    ``max_len`` (``dr_grpo``'s length; default: the tensors' ``T``) and ``num_micro_batches``
    (over every data-parallel rank). ``LossParams.of`` reads them from ``config.GRPOConfig``.
    """

    loss_type: str = "dapo"
    options: Mapping[str, float] = field(default_factory=dict)
    level: str = "token"
    kl_beta: float = 0.0
    kl_bias_correction: bool = False
    entropy_coef: float = 0.0
    num_sequences: int | None = None
    num_tokens: float | None = None
    max_len: int | None = None
    num_micro_batches: int = 1

    def __post_init__(self) -> None:
        try:
            spec = losses.loss_spec(self.loss_type)
        except ValueError as err:
            raise ValueError(f"grpo.loss_type: {err}") from None
        missing = [f for f in spec.fields if f not in self.options]
        if missing:
            raise ValueError(
                f"loss_type {self.loss_type!r} reads {', '.join(missing)}: missing from LossParams.options"
            )
        if self.level not in ("token", "sequence"):
            raise ValueError(f"grpo.importance_sampling_level: unknown {self.level!r} (token | sequence)")

    @classmethod
    def of(cls, section: Any, **counts: Any) -> LossParams:
        """The loss settings of ``section`` (``config.GRPOConfig``: ``loss_type``, the fields that type reads,
        ``importance_sampling_level``, ``kl_beta``, ``kl_bias_correction``, ``entropy_coef``) with the batch's
        ``counts`` (``num_sequences``, ``num_tokens``, ``max_len``, ``num_micro_batches``)."""
        spec = losses.loss_spec(section.loss_type)
        return cls(
            loss_type=spec.name,
            options={f: float(getattr(section, f)) for f in spec.fields},
            level=section.importance_sampling_level,
            kl_beta=section.kl_beta,
            kl_bias_correction=section.kl_bias_correction,
            entropy_coef=section.entropy_coef,
            **counts,
        )


@dataclass
class LossStats:
    """Diagnostics of one policy-loss evaluation (token means over the mask).

    Clipped tokens: those where a hard clip is active (``TokenLoss.low``/``high`` of the loss
    type: the clipped surrogate's, or CISPO's upper bound with A > 0); SAPO and VESPO have none (0)."""

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
    params: LossParams,
    *,
    is_weights: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    token_select: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The policy loss of ``params.loss_type`` (+ optional KL to the reference) and its diagnostics.

    ``logp``/``old_logp``/``ref_logp``/``is_weights``/``token_select``/``entropy``/``mask``:
    ``[N, T]``; ``advantages``: ``[N]``. The loss type's registered function gives the per-token
    term; ``is_weights`` multiply it unless the type folds them into its own weights (VESPO; token
    weights only: ``config.GRPOConfig`` refuses sequence IS modes with it), ``token_select`` masks
    it, ``ref_logp`` with ``params.kl_beta > 0`` adds the KL term, then the type's reduction. A
    token is "clipped" when the clip is the active branch of the min: ratio below
    ``1 - eps_low`` with A < 0, or above ``1 + eps_high`` with A > 0 (its gradient is zero).
    ``entropy`` (differentiable) with ``params.entropy_coef != 0``: minus ``entropy_coef`` times the
    micro-batch's mean entropy over the selected real tokens, divided by ``num_micro_batches``
    (TRL's entropy bonus, the same for every loss type).
    """
    p = params
    spec = losses.loss_spec(p.loss_type)
    adv = advantages.to(logp.dtype).unsqueeze(1)
    log_ratio = logp - old_logp.detach()
    if p.level == "sequence":  # GSPO: the length-normalised sequence ratio, one per row
        seq = (log_ratio * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        ratio = torch.exp(seq).expand_as(logp)
    else:
        ratio = torch.exp(log_ratio)
    term = spec.fn(losses.LossTerms(logp, log_ratio, ratio, adv, mask, is_weights), p.options)
    per_token = term.per_token
    if per_token.shape != mask.shape:
        raise ValueError(
            f"loss_type {p.loss_type!r}: per-token loss of shape {tuple(per_token.shape)}, "
            f"expected the mask's {tuple(mask.shape)}"
        )
    if token_select is not None:
        per_token = per_token * token_select.detach()
    if is_weights is not None and not spec.folds_is_weights:
        per_token = per_token * is_weights.detach()
    kl_val = None
    if ref_logp is not None:
        kl_tok = k3(logp, ref_logp.detach())
        if p.kl_beta > 0:
            per_token = per_token + p.kl_beta * (kl_tok * ratio if p.kl_bias_correction else kl_tok)
        kl_val = float((kl_tok.detach() * mask).sum() / mask.sum().clamp(min=1.0))
    loss = aggregate(
        per_token,
        mask,
        spec.aggregation,
        num_sequences=p.num_sequences,
        num_tokens=p.num_tokens,
        max_len=p.max_len,
        num_micro_batches=p.num_micro_batches,
    )
    if entropy is not None and p.entropy_coef != 0.0:
        chosen = mask if token_select is None else mask * token_select.detach()
        loss = loss - p.entropy_coef * (entropy * chosen).sum() / chosen.sum().clamp(min=1.0) / p.num_micro_batches
    with torch.no_grad():
        none = torch.zeros_like(mask)
        low = none if term.low is None else term.low.to(mask.dtype) * mask
        high = none if term.high is None else term.high.to(mask.dtype) * mask
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
