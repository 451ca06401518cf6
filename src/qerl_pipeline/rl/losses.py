"""The loss types: one registry, each type one registered function. The place to add a loss.

A loss type is a function of the policy's terms (``LossTerms``: log-probs, the policy ratio at
``grpo.importance_sampling_level``, the advantages, the mask, the importance weights) and of its
options (the ``grpo.*`` fields it reads, by name) that returns its per-token loss and the tokens
where a hard clip is active (``TokenLoss``). ``@register_loss`` declares beside the function:

- ``aggregation``: how ``rl/grpo.py``'s ``aggregate`` reduces the per-token loss (``AGGREGATIONS``);
- ``fields``: the ``grpo.*`` fields it reads, each with the TRL ``GRPOConfig`` argument that holds
  the same value (None: TRL has none); ``grpo.LossParams.of`` copies them into the options;
- ``trl_name``: TRL 1.16's ``loss_type`` for it (None: TRL has no such loss; the benchmark's TRL
  peer reads it);
- ``rules``: checks of the rest of the ``grpo`` section (``Rule``), refusals or warnings, as TRL
  1.16 has them;
- ``folds_is_weights``: the function uses the importance weights itself, so they do not multiply
  its loss.

Everything else of the policy loss (the ratio, the entropy selection, the importance weights,
the KL term, the reduction, the entropy bonus) is common to every type and lives in
``rl/grpo.py::policy_loss``. config.py reads this registry when it validates: ``grpo.loss_type``
must be a registered name, the description of that option is built from the functions'
docstrings and each type's rules apply. A name is registered once; a test may register a loss of
its own (config.py accepts it by the time it validates). This module is a leaf that config.py
imports (docs/ARCHITECTURE.md places it in layer 1): it imports torch and nothing of the project.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

#: the reductions ``rl/grpo.py::aggregate`` knows: ``sequence`` (each sequence's token mean, mean over sequences),
#: ``token`` (sum over the batch's tokens / their number), ``micro_batch`` (each micro-batch's token mean, averaged
#: over the micro-batches), ``dr_grpo`` (sum / (sequences * max_new_tokens)), ``sequence_sum`` (each sequence's token
#: sum, mean over sequences)
AGGREGATIONS: tuple[str, ...] = ("sequence", "token", "micro_batch", "dr_grpo", "sequence_sum")


@dataclass(frozen=True)
class LossTerms:
    """What every loss type may read, ``[N, T]`` over the completion tokens unless said.

    ``logp``: the policy's log-probs (differentiable); ``log_ratio``: ``logp - old_logp`` (pi_old
    detached); ``ratio``: the policy ratio at the configured level (token, or GSPO's sequence ratio
    broadcast over the tokens); ``advantages``: ``[N, 1]`` in ``logp``'s dtype; ``mask``: 1 for
    the real tokens; ``is_weights``: the detached importance weights, or None.
    """

    logp: torch.Tensor
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    is_weights: torch.Tensor | None = None


@dataclass(frozen=True)
class TokenLoss:
    """A loss type's per-token loss ``[N, T]`` and where a hard clip is active (bool ``[N, T]``, or None for
    none): ``low`` below the range with A < 0, ``high`` above it with A > 0 (their gradient is zero)."""

    per_token: torch.Tensor
    low: torch.Tensor | None = None
    high: torch.Tensor | None = None


@dataclass(frozen=True)
class Rule:
    """A check of the ``grpo`` section under one loss type: when ``broken(section)`` holds, ``message``
    (``str.format``-ed with ``g=section``) refuses the config (``refuse``) or is logged as a warning."""

    broken: Callable[[Any], bool]
    message: str
    refuse: bool = False


LossFn = Callable[[LossTerms, Mapping[str, float]], TokenLoss]


@dataclass(frozen=True)
class LossSpec:
    """One registered loss type (see the module docstring for each field)."""

    name: str
    fn: LossFn
    aggregation: str
    fields: Mapping[str, str | None] = field(default_factory=dict)
    trl_name: str | None = None
    rules: tuple[Rule, ...] = ()
    folds_is_weights: bool = False

    @property
    def summary(self) -> str:
        """The function's docstring as one line: what the loss is (config.py's description of ``loss_type``)."""
        return " ".join((self.fn.__doc__ or self.name).split())

    def trl_options(self, section: Any) -> dict[str, Any]:
        """The fields it reads as TRL ``GRPOConfig`` keyword arguments (those TRL has), valued from ``section``."""
        return {trl: getattr(section, ours) for ours, trl in self.fields.items() if trl is not None}


#: every registered loss type by name, in registration order
LOSSES: dict[str, LossSpec] = {}


def register_loss(
    name: str,
    *,
    aggregation: str,
    fields: Mapping[str, str | None] | None = None,
    trl_name: str | None = None,
    rules: tuple[Rule, ...] = (),
    folds_is_weights: bool = False,
) -> Callable[[LossFn], LossFn]:
    """Decorator: register the function as loss type ``name`` (refused when the name is taken or the
    aggregation unknown). Returns the function unchanged."""
    if name in LOSSES:
        raise ValueError(f"loss type {name!r} is already registered")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"loss type {name!r}: unknown aggregation {aggregation!r} ({' | '.join(AGGREGATIONS)})")

    def register(fn: LossFn) -> LossFn:
        LOSSES[name] = LossSpec(name, fn, aggregation, dict(fields or {}), trl_name, tuple(rules), folds_is_weights)
        return fn

    return register


def loss_names() -> tuple[str, ...]:
    """The registered loss types, in registration order."""
    return tuple(LOSSES)


def loss_spec(name: Any) -> LossSpec:
    """The registered loss type ``name``; a ValueError naming the registered ones otherwise."""
    spec = LOSSES.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"unknown loss type {name!r}; registered: {', '.join(LOSSES)}")
    return spec


# ----------------------------------------------------------------------------- the built-in loss types
#: the clipped surrogate's options and TRL's names for them
CLIP_FIELDS = {"clip_eps_low": "epsilon", "clip_eps_high": "epsilon_high"}
#: TRL 1.16's warning for a token-summed loss at the sequence level
LENGTH_WEIGHTED = Rule(
    lambda g: g.importance_sampling_level == "sequence",
    "grpo.importance_sampling_level 'sequence' with loss_type {g.loss_type!r} sums per-token terms, so each "
    "sequence weighs by its length; GSPO's own objective is loss_type 'grpo'",
)


def clipped_surrogate(t: LossTerms, options: Mapping[str, float]) -> TokenLoss:
    """PPO's ``-min(rho A, clip(rho, 1 - clip_eps_low, 1 + clip_eps_high) A)``."""
    eps_low, eps_high = options["clip_eps_low"], options["clip_eps_high"]
    unclipped = t.ratio * t.advantages
    clipped = torch.clamp(t.ratio, 1.0 - eps_low, 1.0 + eps_high) * t.advantages
    low = (t.ratio < 1.0 - eps_low) & (t.advantages < 0)
    high = (t.ratio > 1.0 + eps_high) & (t.advantages > 0)
    return TokenLoss(-torch.minimum(unclipped, clipped), low, high)


@register_loss("grpo", aggregation="sequence", fields=CLIP_FIELDS, trl_name="grpo")
def grpo(t: LossTerms, options: Mapping[str, float]) -> TokenLoss:
    """clipped surrogate, mean over each sequence's tokens then over sequences (DeepSeekMath, arXiv 2402.03300;
    short correct / long wrong answers weigh more)."""
    return clipped_surrogate(t, options)


@register_loss("bnpo", aggregation="micro_batch", fields=CLIP_FIELDS, trl_name="bnpo", rules=(LENGTH_WEIGHTED,))
def bnpo(t: LossTerms, options: Mapping[str, float]) -> TokenLoss:
    """clipped surrogate, token mean of each micro-batch (train.micro_batch_size sequences), averaged over the
    micro-batches (TRL's bnpo; dapo when the batch is one micro-batch)."""
    return clipped_surrogate(t, options)


@register_loss("dr_grpo", aggregation="dr_grpo", fields=CLIP_FIELDS, trl_name="dr_grpo", rules=(LENGTH_WEIGHTED,))
def dr_grpo(t: LossTerms, options: Mapping[str, float]) -> TokenLoss:
    """clipped surrogate, token sum / (sequences * rollout.max_new_tokens) (Dr. GRPO, arXiv 2503.20783)."""
    return clipped_surrogate(t, options)


@register_loss("dapo", aggregation="token", fields=CLIP_FIELDS, trl_name="dapo", rules=(LENGTH_WEIGHTED,))
def dapo(t: LossTerms, options: Mapping[str, float]) -> TokenLoss:
    """clipped surrogate, token sum / the whole batch's tokens (DAPO, arXiv 2503.14476; TRL's default)."""
    return clipped_surrogate(t, options)


@register_loss(
    "cispo", aggregation="token", fields={"cispo_clip_max": "epsilon_high"}, trl_name="cispo", rules=(LENGTH_WEIGHTED,)
)
def cispo(t: LossTerms, options: Mapping[str, float]) -> TokenLoss:
    """-sg(min(ratio, cispo_clip_max)) A logp, the ratio clipped as a detached weight so clipped tokens keep their
    gradient, dapo's normaliser (MiniMax-M1, arXiv 2506.13585; ScaleRL, arXiv 2510.13786)."""
    cap = options["cispo_clip_max"]
    per_token = -t.ratio.clamp(max=cap).detach() * t.advantages * t.logp
    return TokenLoss(per_token, high=(t.ratio > cap) & (t.advantages > 0))


@register_loss(
    "sapo",
    aggregation="sequence",
    fields={"sapo_temperature_pos": "sapo_temperature_pos", "sapo_temperature_neg": "sapo_temperature_neg"},
    trl_name="sapo",
)
def sapo(t: LossTerms, options: Mapping[str, float]) -> TokenLoss:
    """a soft, temperature-controlled gate -(4/tau) sigmoid(tau (ratio - 1)) A instead of the clip
    (sapo_temperature_pos for A > 0, sapo_temperature_neg otherwise), grpo's normaliser (SAPO, arXiv 2511.20347)."""
    adv = t.advantages
    tau = torch.where(adv > 0, options["sapo_temperature_pos"], options["sapo_temperature_neg"]).to(t.logp.dtype)
    return TokenLoss(-(torch.sigmoid(tau * (t.ratio - 1.0)) * 4.0 / tau) * adv)


@register_loss(
    "luspo",
    aggregation="sequence_sum",
    fields=CLIP_FIELDS,
    trl_name="luspo",
    rules=(
        Rule(
            lambda g: g.importance_sampling_level != "sequence",
            "grpo.loss_type luspo is meant for importance_sampling_level 'sequence' (the LUSPO paper's setup), "
            "got {g.importance_sampling_level!r}",
        ),
    ),
)
def luspo(t: LossTerms, options: Mapping[str, float]) -> TokenLoss:
    """GSPO with each sequence's loss scaled by its length: clipped surrogate summed over each sequence's tokens,
    mean over sequences (LUSPO, arXiv 2602.05261; meant for importance_sampling_level sequence, warned otherwise
    as TRL)."""
    return clipped_surrogate(t, options)


VESPO_FIELDS = {f: f for f in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")}
#: VESPO's bounds of log-ratios: log(1e-8) below (as its reference implementation), 20 above
VESPO_LOG_MIN, VESPO_LOG_MAX = math.log(1e-8), 20.0


@register_loss(
    "vespo",
    aggregation="token",
    fields=VESPO_FIELDS,
    trl_name="vespo",
    folds_is_weights=True,
    rules=(
        Rule(
            lambda g: g.is_mode not in ("token_truncate", "token_mask", "none"),
            "grpo.loss_type vespo folds the token importance weights into its sequence weight: grpo.is_mode must be "
            "token_truncate, token_mask or none, got {g.is_mode!r} (TRL 1.16 refuses the same)",
            refuse=True,
        ),
        Rule(
            lambda g: g.importance_sampling_level != "token",
            "grpo.loss_type vespo computes its sequence weight itself: importance_sampling_level should be 'token' "
            "(it only changes the KL's bias correction here), got {g.importance_sampling_level!r}",
        ),
    ),
)
def vespo(t: LossTerms, options: Mapping[str, float]) -> TokenLoss:
    """-sg(phi(w)) A logp with the Gamma weight phi(w) = exp(lambda) w^k exp(-lambda w) of the sequence ratio w
    (times the token IS weights, which then do not multiply the loss), dapo's normaliser (VESPO, arXiv 2602.10693;
    vespo_k_*/vespo_lambda_*; is_mode must be token_truncate, token_mask or none, as TRL)."""
    weight = vespo_weights(t.log_ratio, t.mask, t.advantages, t.is_weights, options)
    return TokenLoss(-weight * t.advantages * t.logp)


@torch.no_grad()
def vespo_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    is_weights: torch.Tensor | None,
    options: Mapping[str, float],
) -> torch.Tensor:
    """VESPO's Gamma weights ``phi(w) = exp(lambda + k log w - lambda w)`` ``[N, 1]`` (detached; phi(1) = 1).

    ``log_ratio`` ``[N, T]``: ``logp - old_logp`` per token, each clamped to +-20; ``w`` is the
    sequence ratio ``exp(sum_t log_ratio)`` times the product of the token importance weights
    ``is_weights`` (``[N, T]``, token modes only; their logs clamped to [log 1e-8, 20]),
    ``log w`` clamped to [log 1e-8, 20]. ``k``/``lambda`` by the sign of ``advantages``
    (``[N, 1]``; ``>= 0`` takes ``vespo_*_pos`` of ``options``). Sums run over the real tokens
    (mask 1) only: TRL adds the IS weights' logs over the padding too, where they are 1 (log 0)
    unless ``is_lower > 1`` masks padding. Non-finite weights become 0, as TRL.
    """
    seq = (log_ratio.detach().clamp(-20.0, 20.0) * mask).sum(dim=1, keepdim=True)
    if is_weights is not None:
        seq = seq + (torch.log(is_weights.detach()).clamp(VESPO_LOG_MIN, VESPO_LOG_MAX) * mask).sum(
            dim=1, keepdim=True
        )
    log_w = seq.clamp(VESPO_LOG_MIN, VESPO_LOG_MAX)
    pos = advantages >= 0
    k = torch.where(pos, options["vespo_k_pos"], options["vespo_k_neg"]).to(log_w.dtype)
    lam = torch.where(pos, options["vespo_lambda_pos"], options["vespo_lambda_neg"]).to(log_w.dtype).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
