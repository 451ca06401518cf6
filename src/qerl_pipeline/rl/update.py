"""A training step's update side: the policy's log-probs and the policy update on one rollout batch.

``policy_update`` is the step's last part (``rl/trainer.py``): ``updates_per_rollout`` optimizer
steps on the ``Batch`` (``rl/records.py``) the rollout side (``rl/collect.py``) produced, returning
its ``UpdateStats``. Usable alone: ``benchmarking/training.py`` times it on a fixed batch.

Log-probs are computed from the decoder's hidden states at the completion positions
only (right-padded batch), divided by the sampling temperature, which is what vLLM
reports in ``processed_logprobs`` mode; ``rl/logprobs.py`` applies lm_head in chunks of
positions, so neither the logits nor the log-softmax over the vocabulary ever exist as a
``[n, T, V]`` tensor (forward or backward).

A NaN/Inf loss or gradient norm raises ``TrainingDiverged`` naming the step before the
optimizer update, so the newest checkpoint stays the last good state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from qerl_pipeline.config import QerlConfig
from qerl_pipeline.quantization import aqn
from qerl_pipeline.quantization.policy import decoded_weights, keeps_decoded_weights
from qerl_pipeline.rl import grpo
from qerl_pipeline.rl.logprobs import token_logprobs
from qerl_pipeline.rl.prefix import shared_prompt_hidden
from qerl_pipeline.rl.ranks import SINGLE
from qerl_pipeline.rl.records import Batch, UpdateStats, mean


class TrainingDiverged(RuntimeError):
    """The loss became NaN/Inf; the message names the step."""


# --------------------------------------------------------------- log-probs
def completion_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    prompt_lens: torch.Tensor,
    t_max: int,
    temperature: float,
    *,
    share_prompts: bool = True,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs ``[n, T]`` of the completion tokens and the policy entropy ``[n, T]``.

    The entropy is detached unless ``entropy_grad`` (``grpo.entropy_coef != 0``: the loss's entropy bonus).

    ``model``: a (PEFT-wrapped) causal LM; lm_head runs only on the ``T`` positions that
    predict completion tokens. ``share_prompts`` (``train.share_prompt_forward``): rows
    that share a prompt (a GRPO group) run it once (``rl/prefix.py``); otherwise, or when
    that path does not apply, the decoder runs on the full right-padded rows (causal
    attention never lets a real token see the padding after it).
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    device = next(inner.parameters()).device
    input_ids = input_ids.to(device)
    shared = shared_prompt_hidden(inner.model, input_ids, prompt_lens, t_max) if share_prompts else None
    if shared is not None:
        hidden, targets = shared  # [n, T, H], [n, T]
    else:
        hidden = inner.model(input_ids=input_ids, use_cache=False).last_hidden_state  # [n, L, H]
        length = input_ids.shape[1]
        pos = (prompt_lens.to(device).unsqueeze(1) - 1 + torch.arange(t_max, device=device).unsqueeze(0)).clamp(
            max=length - 2
        )
        rows = torch.arange(input_ids.shape[0], device=device).unsqueeze(1)
        targets = input_ids[rows, pos + 1]
        hidden = hidden[rows, pos]
    head = inner.lm_head
    if type(head) is not torch.nn.Linear:  # a wrapped head (LoRA on lm_head, ...): its own forward, [n, T, V]
        logits = head(hidden).float() / temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy
    # chunked: log-softmax at the targets and the entropy without materialising [n, T, V] (rl/logprobs.py)
    return token_logprobs(
        hidden, head.weight, targets, bias=head.bias, temperature=temperature, entropy_grad=entropy_grad
    )


# --------------------------------------------------------------- the update
def reference_every(cfg: QerlConfig) -> int:
    """Steps between the KL reference's forwards (0: never): 1 with ``kl_beta > 0`` (the loss needs it),
    ``log_kl_to_base_every`` when only the diagnostic asks (on 0-based steps that are its multiples)."""
    g = cfg.grpo
    if g.kl_beta > 0:
        return 1
    return g.log_kl_to_base_every if g.log_kl_to_base else 0


@dataclass
class Optim:
    """What an update steps: the optimiser and its schedule, the parameters it clips
    (``params``: every trainable one) and the norm weights it sets per batch (``norm_params``,
    by name: AQN's targets and trained norms; empty without either)."""

    optimizer: torch.optim.Optimizer
    scheduler: Any
    params: list[torch.nn.Parameter]
    norm_params: dict[str, torch.nn.Parameter] = field(default_factory=dict)


def policy_update(
    policy,
    opt: Optim,
    batch: Batch,
    cfg: QerlConfig,
    step: int,
    *,
    ref_norms: dict[str, torch.Tensor] | None = None,
    dist=None,
) -> UpdateStats:
    """``updates_per_rollout`` optimizer steps on one rollout batch.

    Forward and backward run under the batch's noisy norms (``aqn.noisy_norms``: the
    log-probs are those of the policy that generated the batch, the gradient is taken at
    the noisy point); the clean values are back before ``optimizer.step()``, so trained
    norms (``lora.train_norms``) step from their clean values and keep their updates.

    The KL reference (``kl_beta > 0`` every step, or ``log_kl_to_base`` on the steps of
    :func:`reference_every`) is the clean base: adapter
    disabled, no noise, and the base's own norm values ``ref_norms`` in place of trained
    ones (``None``: the norms are not trained, the clean ones are the base's).

    pi_old is the first update's forward (no extra pass), except with entropy selection
    (``grpo.top_entropy_quantile < 1``): the selection needs the entropies of the whole
    batch before the first backward, so one no-grad pass over the batch gives pi_old and
    the entropies first. The importance weights (``grpo.is_mode``) are computed once per
    batch from pi_old and the rollout's log-probs and reused by every update.

    A token whose vLLM log-prob is missing (NaN) gets pi_old as its rollout log-prob, so its
    importance ratio is 1 in every update of the batch.

    The loss is ``grpo.loss_type``'s with the global batch's counts (sequences, tokens,
    micro-batches over every rank: bnpo's and the entropy bonus's divisor), so the micro-batches
    add up as TRL's gradient accumulation does; with ``grpo.entropy_coef != 0`` the entropy of
    each forward is differentiable and its bonus enters the loss.

    ``dist`` (``rl/ranks.py``'s ``Dist``; None = one process): this rank's rows are its
    share of the global batch; the normalisers (sequences, tokens), the entropy threshold, the
    gradients (summed before clipping) and every returned statistic are the global batch's.
    """
    keep = keeps_decoded_weights(cfg.train.keep_decoded_weights, next(policy.parameters()).device.type)
    with decoded_weights(policy, keep):  # each packed linear decoded once for the whole update (CPU default)
        return _policy_update(policy, opt, batch, cfg, step, ref_norms, dist)


def _policy_update(policy, opt: Optim, batch: Batch, cfg: QerlConfig, step: int, ref_norms, dist) -> UpdateStats:
    optimizer, scheduler, params, norm_params = opt.optimizer, opt.scheduler, opt.params, opt.norm_params
    ids, p_lens, roll_logp, mask, adv, noisy = (
        batch.ids,
        batch.p_lens,
        batch.roll_logp,
        batch.mask,
        batch.adv,
        batch.noisy,
    )
    d = dist or SINGLE
    gc, tc, rc = cfg.grpo, cfg.train, cfg.rollout
    n_local, t_max = roll_logp.shape
    n = int(d.sum(n_local))  # sequences of the global batch
    n_tok = d.sum(float(mask.sum()))  # real tokens of the global batch
    mb = tc.micro_batch_size
    share = tc.share_prompt_forward
    chunks = [slice(i, min(n_local, i + mb)) for i in range(0, n_local, mb)]
    n_mb = int(d.sum(len(chunks)))  # micro-batches of the global batch (bnpo's and the entropy bonus's divisor)
    loss_params = grpo.LossParams.of(
        gc, num_sequences=n, num_tokens=n_tok, max_len=rc.max_new_tokens, num_micro_batches=n_mb
    )
    want_entropy_grad = gc.entropy_coef != 0.0
    old_logp: dict[int, torch.Tensor] = {}
    is_w: dict[int, torch.Tensor | None] = {}
    select: dict[int, torch.Tensor] = {}
    ref_logp: dict[int, torch.Tensor] = {}
    is_parts: list[grpo.ISStats] = []
    every = reference_every(cfg)
    want_ref = every > 0 and step % every == 0
    stats_acc: dict[str, float] = {"entropy": 0.0, "mismatch_kl": 0.0, "is_weight": 0.0, "kl_to_base": 0.0}
    clip_sum = clip_low = clip_high = 0.0
    grad_norms, losses = [], []
    selected = threshold = None  # entropy selection's fraction of the real tokens and its threshold
    if want_ref:
        with torch.no_grad(), policy.disable_adapter(), aqn.noisy_norms(norm_params, ref_norms):
            for k, sl in enumerate(chunks):
                ref_logp[k] = (
                    completion_logprobs(policy, ids[sl], p_lens[sl], t_max, rc.temperature, share_prompts=share)[0]
                    .detach()
                    .cpu()
                )
    if gc.top_entropy_quantile < 1.0:  # the batch's entropies before the first backward (and pi_old with them)
        ents = []
        with torch.no_grad(), aqn.noisy_norms(norm_params, noisy):
            for k, sl in enumerate(chunks):
                logp0, ent0 = completion_logprobs(
                    policy, ids[sl], p_lens[sl], t_max, rc.temperature, share_prompts=share
                )
                old_logp[k] = logp0.detach().cpu()
                ents.append(ent0.detach().cpu())
        ent_all = torch.cat(ents) if ents else torch.zeros(0, t_max)  # no rows: a rank's empty share
        real_ent = ent_all[mask > 0]
        threshold = grpo.entropy_threshold(
            torch.cat(d.all_gather_object(real_ent)) if d.active else real_ent, gc.top_entropy_quantile
        )
        chosen = ((ent_all >= threshold) & (mask > 0)).to(mask.dtype)
        for k, sl in enumerate(chunks):
            select[k] = chosen[sl]
        selected = d.sum(float(chosen.sum())) / max(n_tok, 1.0)
    for u in range(gc.updates_per_rollout):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        with aqn.noisy_norms(norm_params, noisy):
            for k, sl in enumerate(chunks):
                logp, ent = completion_logprobs(
                    policy,
                    ids[sl],
                    p_lens[sl],
                    t_max,
                    rc.temperature,
                    share_prompts=share,
                    entropy_grad=want_entropy_grad,
                )
                logp = logp.cpu() if logp.device.type != "cpu" else logp
                ent = ent.cpu() if ent.device.type != "cpu" else ent
                m = mask[sl]
                if u == 0:
                    if k not in old_logp:
                        old_logp[k] = logp.detach()
                    roll = roll_logp[sl]
                    roll_filled = torch.where(torch.isfinite(roll), roll, old_logp[k])  # missing: ratio 1
                    w = m.sum().clamp(min=1.0) / max(n_tok, 1.0)
                    stats_acc["entropy"] += float((ent.detach() * m).sum() / m.sum().clamp(min=1.0)) * float(w)
                    stats_acc["mismatch_kl"] += grpo.mismatch_kl(roll_filled, old_logp[k], m) * float(w)
                    is_w[k], st_is = grpo.is_weights(old_logp[k], roll_filled, m, gc.is_mode, gc.is_cap, gc.is_lower)
                    if st_is is not None:
                        is_parts.append(st_is)
                        stats_acc["is_weight"] += float((is_w[k] * m).sum()) / max(n_tok, 1.0)
                loss, st = grpo.policy_loss(
                    logp,
                    old_logp[k],
                    adv[sl],
                    m,
                    loss_params,
                    is_weights=is_w[k],
                    ref_logp=ref_logp.get(k),
                    token_select=select.get(k),
                    entropy=ent if want_entropy_grad else None,
                )
                if not torch.isfinite(loss):
                    raise TrainingDiverged(
                        f"non-finite loss ({float(loss.detach())}) at step {step + 1} (update {u + 1}, micro-batch "
                        f"{k + 1}); training stopped before the optimizer update, the newest checkpoint is the last "
                        "good state"
                    )
                loss.backward()  # inside the context: saved tensors alias the noisy norm storage
                total += float(loss.detach())
                frac = st.tokens / max(n_tok, 1.0)
                clip_sum += st.clip_fraction * frac / gc.updates_per_rollout
                clip_low += st.clip_low_fraction * frac / gc.updates_per_rollout
                clip_high += st.clip_high_fraction * frac / gc.updates_per_rollout
                if u == 0 and st.kl_to_ref is not None:
                    stats_acc["kl_to_base"] += st.kl_to_ref * frac
        d.all_reduce_grads(params)  # the global batch's gradient on every rank (each loss is its share)
        gn = torch.nn.utils.clip_grad_norm_(params, cfg.optim.max_grad_norm)
        if not torch.isfinite(gn):
            raise TrainingDiverged(
                f"non-finite gradient norm at step {step + 1} (update {u + 1}); training stopped before the "
                "optimizer update"
            )
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()  # clean norms are back: their update sticks
        scheduler.step()
        grad_norms.append(float(gn))
        losses.append(d.sum(total))
    if d.active:  # each rank's statistics are its share of the global ones (global denominators): add them up
        sums = d.sum_tensor(
            torch.tensor([clip_sum, clip_low, clip_high, *stats_acc.values()], dtype=torch.float64)
        ).tolist()
        clip_sum, clip_low, clip_high = sums[:3]
        stats_acc = dict(zip(stats_acc, sums[3:], strict=True))
        is_parts = [p for parts in d.all_gather_object(is_parts) for p in parts]
    return UpdateStats(
        lr=lr,
        loss=mean(losses),
        grad_norm=mean(grad_norms),
        entropy=stats_acc["entropy"],
        clip_fraction=clip_sum,
        clip_low_fraction=clip_low,
        clip_high_fraction=clip_high,
        mismatch_kl=stats_acc["mismatch_kl"],
        selected_token_fraction=selected,
        entropy_threshold=threshold,
        importance=grpo.ISStats.merge(is_parts) if is_parts else None,
        is_weight_mean=stats_acc["is_weight"] if is_parts else None,
        kl_to_base=stats_acc["kl_to_base"] if want_ref else None,
    )
