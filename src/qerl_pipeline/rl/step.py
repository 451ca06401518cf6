"""One training step's parts: prompts, rollout + rewards, log-probs, the policy update.

Plain functions the loop in ``rl/trainer.py`` calls in order (rollout -> reward ->
advantages -> update); each is usable alone (``benchmarking/training.py`` times
``policy_update`` on a fixed batch).

Rewards: the scorer ``rewards.functions.make_scorer`` builds from ``train.reward_fn``: the math
``RewardScorer`` by default, a user function, or the weighted sum of a list of them (as TRL's
``reward_funcs``/``reward_weights``); ``collect`` calls it with the rollout samples.

Log-probs are computed from the decoder's hidden states at the completion positions
only (right-padded batch), divided by the sampling temperature, which is what vLLM
reports in ``processed_logprobs`` mode; ``rl/logprobs.py`` applies lm_head in chunks of
positions, so neither the logits nor the log-softmax over the vocabulary ever exist as a
``[n, T, V]`` tensor (forward or backward).

A NaN/Inf loss or gradient norm raises ``TrainingDiverged`` naming the step before the
optimizer update, so the newest checkpoint stays the last good state.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qerl_pipeline import tracking as T
from qerl_pipeline.config import QerlConfig
from qerl_pipeline.quantization import aqn
from qerl_pipeline.quantization.policy import decoded_weights, keeps_decoded_weights
from qerl_pipeline.rewards.scorer import RewardScorer
from qerl_pipeline.rl import grpo
from qerl_pipeline.rl.ranks import SINGLE, shard_bounds
from qerl_pipeline.rl.logprobs import token_logprobs
from qerl_pipeline.rl.prefix import shared_prompt_hidden


class TrainingDiverged(RuntimeError):
    """The loss became NaN/Inf; the message names the step."""


# ------------------------------------------------------------------ data
@dataclass
class PromptItem:
    ids: list[int]
    gold: str
    record: dict


def tokenize_prompts(records: list[dict], tokenizer, max_prompt_len: int) -> tuple[list[PromptItem], int]:
    """Chat-template each record's messages; drop (and count) prompts longer than ``max_prompt_len``."""
    items, dropped = [], 0
    for i, rec in enumerate(records):
        for key in ("messages", "gold"):
            if key not in rec:
                raise KeyError(f"prompt record {i} (id={rec.get('id')!r}) has no {key!r} field")
        ids = tokenizer.apply_chat_template(rec["messages"], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        ids = [int(t) for t in ids]
        if len(ids) > max_prompt_len:
            dropped += 1
            continue
        items.append(PromptItem(ids, str(rec["gold"]), rec))
    if not items:
        raise ValueError(f"no usable prompts: all {len(records)} are longer than {max_prompt_len} tokens or the set is empty")
    return items, dropped


class PromptSampler:
    """Epochs of seeded permutations; the state is ``(epoch, pos)`` (checkpointed)."""

    def __init__(self, n: int, seed: int, epoch: int = 0, pos: int = 0):
        self.n, self.seed, self.epoch, self.pos = n, seed, epoch, pos
        self._perm = self._permutation(epoch)

    def _permutation(self, epoch: int) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed * 7919 + epoch)
        return torch.randperm(self.n, generator=gen).tolist()

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos >= self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
            out.append(self._perm[self.pos])
            self.pos += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}


# ----------------------------------------------------------------- rewards
def _score(scorer, texts: list[str], golds: list[str], samples: list) -> list[dict]:
    """``scorer``'s rows for the completions; the math ``RewardScorer`` takes no samples, user rewards do."""
    if isinstance(scorer, RewardScorer):
        return scorer.score(texts, golds)
    return scorer.score(texts, golds, samples)


def _mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else 0.0


# --------------------------------------------------------------- log-probs
def collate(samples: list, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids ``[n, L]``, prompt and completion lengths, rollout log-probs ``[n, T]`` (``n`` may be 0:
    a data-parallel rank whose share of the batch is empty)."""
    p_lens = torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long)
    c_lens = torch.tensor([len(s.completion_ids) for s in samples], dtype=torch.long)
    length = int((p_lens + c_lens).max()) if samples else 1
    t_max = max(1, int(c_lens.max()) if samples else 1)
    ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    roll = torch.zeros(len(samples), t_max)
    for i, s in enumerate(samples):
        seq = list(s.prompt_ids) + list(s.completion_ids)
        ids[i, : len(seq)] = torch.tensor(seq)
        if s.completion_ids:
            roll[i, : len(s.completion_ids)] = torch.tensor(s.logprobs, dtype=torch.float32)
    return ids, p_lens, c_lens, roll


def completion_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, prompt_lens: torch.Tensor, t_max: int, temperature: float,
    *, share_prompts: bool = True, entropy_grad: bool = False,
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
        pos = (prompt_lens.to(device).unsqueeze(1) - 1 + torch.arange(t_max, device=device).unsqueeze(0)).clamp(max=length - 2)
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
    return token_logprobs(hidden, head.weight, targets, bias=head.bias, temperature=temperature, entropy_grad=entropy_grad)


# ------------------------------------------------------------ rollout + update
#: Per-prompt seeds stay below this, leaving room for vLLM's ``seed + i`` of the i-th of n samples.
SEED_SPACE = 2**62


def sampling_seeds(seed: int, step: int, round_: int, prompts: list[int]) -> list[int]:
    """One sampling seed per prompt: a hash of ``(seed, step, round, position, prompt index)``.

    vLLM seeds the i-th of a request's n samples with ``seed + i``. Seeds formed as sums of
    offsets (``seed + step * a + round * b + prompt * n``) overlap as soon as a step's
    prompts x n exceed an offset, so two prompts, rounds or steps could replay the same
    random stream; hashed seeds collide only by chance (~n * 2^-62 per pair). The position
    in the step is part of the key: a prompt drawn twice in one step (an epoch boundary)
    gets two streams. Deterministic, so a resumed run draws the same samples.
    """
    out = []
    for pos, prompt in enumerate(prompts):
        key = f"{int(seed)}:{int(step)}:{int(round_)}:{pos}:{int(prompt)}".encode()
        out.append(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % SEED_SPACE)
    return out


def collect(engine, scorer, sampler: PromptSampler, items: list[PromptItem], cfg: QerlConfig, step: int, adapter_dir: Path | None,
            dist=None):
    """Rollout + rewards for one step, with DAPO dynamic sampling when enabled.

    Returns this rank's rows of the batch the update trains on (groups of samples, their reward
    rows, ``info["idx"]`` each group's prompt); ``info["sampled"]`` holds the rewards of every
    group this rank sampled in every round, before the filter, so DAPO's reward curves can be
    drawn over the same population as GRPO's (the kept groups exclude the all-right and
    all-wrong ones, which biases their mean towards 0.5).

    ``dist`` (``rl/ranks.py``'s ``Dist``; None = one process): every rank draws the same prompts
    each round and rolls out its contiguous share (``dist.shard_bounds``), each prompt with the
    seed of its global position. Dynamic sampling gathers every group's rewards each round, so
    all ranks take the decision one process would, then split the kept groups in balanced
    contiguous shares of rows (``_rows_of_rank``; design: ``rl/launch.py``); without it a
    rank trains on its own share.

    ``info``'s counts are this rank's share (the trainer sums them): ``sampled_groups`` the groups
    it rolled out, ``kept_groups`` the kept ones among them; ``zero_std_fraction`` is over the
    first round's groups it saw (all with dynamic sampling); ``rounds`` is the same on every rank.
    """
    d = dist or SINGLE
    gc, rc, tc = cfg.grpo, cfg.rollout, cfg.train
    g, want = gc.num_generations, tc.prompts_per_step
    global_view = gc.dynamic_sampling and d.active  # every rank sees every group's rewards
    mine: dict[tuple, list] = {}  # key (round, position in the round) -> a group of samples this rank rolled out
    owner: dict[tuple, int] = {}  # key -> the rank that rolled it out
    seen, kept, sampled = [], [], []  # (key, prompt, reward rows) of the groups in view, of the kept ones; my reward rows
    seconds = tokens = reward_s = 0.0
    rounds, zero_std, need, first = 0, None, want, 0
    while True:
        idx = sampler.take(need)
        seeds = sampling_seeds(rc.seed, step, rounds, idx)
        bounds = [shard_bounds(len(idx), r, d.world_size, balanced=True) for r in range(d.world_size)]
        lo, hi = bounds[d.rank]
        groups, rows, timing = _roll_out(engine, scorer, [items[i] for i in idx[lo:hi]], seeds[lo:hi], cfg, adapter_dir)
        seconds, tokens, reward_s = seconds + timing[0], tokens + timing[1], reward_s + timing[2]
        sampled += [x for grp in rows for x in grp]
        mine.update({(rounds, lo + j): grp for j, grp in enumerate(groups)})
        if global_view:
            rows, lo = [grp for part in d.all_gather_object(rows) for grp in part], 0
        view = [((rounds, lo + j), idx[lo + j], grp) for j, grp in enumerate(rows)]
        owner.update({key: next(r for r, (a, b) in enumerate(bounds) if a <= key[1] < b) for key, _, _ in view})
        r = torch.tensor([x["reward"] for _, _, grp in view for x in grp])
        if zero_std is None:
            zero_std, first = grpo.zero_std_fraction(r, g), len(view)
        rounds += 1
        seen += view
        if not gc.dynamic_sampling:
            kept = view
            break
        kept += [v for v, k in zip(view, grpo.dynamic_sampling_keep(r, g).tolist()) if k]
        need = want - len(kept)
        if need <= 0 or rounds > gc.max_refill_rounds:
            break
    chosen = (kept or seen[:first])[:want]  # nothing informative: the first round (zero advantages, zero loss)
    share = _rows_of_rank(chosen, mine, owner, g, d) if global_view else [(k, p, mine[k], grp) for k, p, grp in chosen]
    info = {"rounds": rounds, "zero_std_fraction": zero_std, "reward_s": reward_s, "idx": [p for _, p, _, _ in share],
            "sampled": sampled, "sampled_groups": len(mine), "kept_groups": sum(owner[k] == d.rank for k, _, _ in chosen)}
    return ([grp for _, _, grp, _ in share], [x for *_, grp in share for x in grp], info,
            {"seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0})


def _roll_out(engine, scorer, prompts: list[PromptItem], seeds: list[int], cfg: QerlConfig, adapter_dir: Path | None):
    """``prompts``' groups of samples, each group's reward rows (with DAPO's overlong shaping when on) and
    ``(rollout seconds, output tokens, reward seconds)``; nothing to do for an empty share."""
    gc, rc = cfg.grpo, cfg.rollout
    g = gc.num_generations
    if not prompts:
        return [], [], (0.0, 0, 0.0)
    res = engine.generate(
        [p.ids for p in prompts], n=g, temperature=rc.temperature, top_p=rc.top_p,
        max_new_tokens=rc.max_new_tokens, seed=seeds, lora_path=adapter_dir,
    )
    t0 = time.perf_counter()
    flat = [s for grp in res.samples for s in grp]
    scored = _score(scorer, [s.text for s in flat], [p.gold for p in prompts for _ in range(g)], flat)
    if gc.overlong.enabled:
        lengths = torch.tensor([len(s.completion_ids) for s in flat])
        pen = grpo.overlong_penalty(lengths, rc.max_new_tokens, gc.overlong.buffer_tokens, gc.overlong.penalty)
        for x, p in zip(scored, pen.tolist()):
            x["overlong"] = p
            x["reward"] = x["reward"] + p
    rows = [scored[j * g : (j + 1) * g] for j in range(len(prompts))]
    return res.samples, rows, (res.seconds, res.output_tokens, time.perf_counter() - t0)


def _rows_of_rank(chosen: list, mine: dict, owner: dict, g: int, d) -> list[tuple]:
    """This rank's contiguous share of the rows of the ``chosen`` groups (global order), as
    ``(key, prompt, samples, reward rows)`` per whole or partial group: the groups another rank
    rolled out arrive from it (every rank sends those of its groups that reach past its own rows)."""
    lo, hi = shard_bounds(len(chosen) * g, d.rank, d.world_size, balanced=True)
    outgoing = {key: mine[key] for q, (key, _, _) in enumerate(chosen)
                if owner[key] == d.rank and not lo <= q * g < (q + 1) * g <= hi}
    arrived = {key: grp for part in d.all_gather_object(outgoing) for key, grp in part.items()}
    share = []
    for q, (key, prompt, rows) in enumerate(chosen):
        a, b = max(lo, q * g) - q * g, min(hi, (q + 1) * g) - q * g
        if a < b:
            samples = mine[key] if owner[key] == d.rank else arrived[key]
            share.append((key, prompt, samples[a:b], rows[a:b]))
    return share


def reference_every(cfg: QerlConfig) -> int:
    """Steps between the KL reference's forwards (0: never): 1 with ``kl_beta > 0`` (the loss needs it),
    ``log_kl_to_base_every`` when only the diagnostic asks (on 0-based steps that are its multiples)."""
    g = cfg.grpo
    if g.kl_beta > 0:
        return 1
    return g.log_kl_to_base_every if g.log_kl_to_base else 0


@dataclass
class Batch:
    """One rollout batch as the update takes it: this rank's rows of the step's sequences.

    ``ids`` ``[n, L]`` right-padded prompt + completion ids, ``p_lens`` ``[n]`` prompt lengths,
    ``roll_logp`` ``[n, T]`` the rollout's (vLLM's) log-probs of the completion tokens,
    ``mask`` ``[n, T]`` the completion tokens the loss counts (``grpo.completion_mask``),
    ``adv`` ``[n]`` advantages (``grpo.group_advantages`` over the global batch), ``noisy``
    the norm values that generated it (AQN's noisy norms and trained norms, by name; empty
    without either).
    """

    ids: torch.Tensor
    p_lens: torch.Tensor
    roll_logp: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor
    noisy: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Optim:
    """What an update steps: the optimiser and its schedule, the parameters it clips
    (``params``: every trainable one) and the norm weights it sets per batch (``norm_params``,
    by name: AQN's targets and trained norms; empty without either)."""

    optimizer: torch.optim.Optimizer
    scheduler: Any
    params: list[torch.nn.Parameter]
    norm_params: dict[str, torch.nn.Parameter] = field(default_factory=dict)


def policy_update(policy, opt: Optim, batch: Batch, cfg: QerlConfig, step: int, *,
                  ref_norms: dict[str, torch.Tensor] | None = None, dist=None) -> dict:
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


def _policy_update(policy, opt: Optim, batch: Batch, cfg: QerlConfig, step: int, ref_norms, dist) -> dict:
    optimizer, scheduler, params, norm_params = opt.optimizer, opt.scheduler, opt.params, opt.norm_params
    ids, p_lens, roll_logp, mask, adv, noisy = batch.ids, batch.p_lens, batch.roll_logp, batch.mask, batch.adv, batch.noisy
    d = dist or SINGLE
    gc, tc, rc = cfg.grpo, cfg.train, cfg.rollout
    n_local, t_max = roll_logp.shape
    n = int(d.sum(n_local))  # sequences of the global batch
    n_tok = d.sum(float(mask.sum()))  # real tokens of the global batch
    mb = tc.micro_batch_size
    share = tc.share_prompt_forward
    chunks = [slice(i, min(n_local, i + mb)) for i in range(0, n_local, mb)]
    n_mb = int(d.sum(len(chunks)))  # micro-batches of the global batch (bnpo's and the entropy bonus's divisor)
    loss_params = grpo.LossParams.of(gc, num_sequences=n, num_tokens=n_tok, max_len=rc.max_new_tokens,
                                     num_micro_batches=n_mb)
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
    select_info: dict[str, float] = {}
    if want_ref:
        with torch.no_grad(), policy.disable_adapter(), aqn.noisy_norms(norm_params, ref_norms):
            for k, sl in enumerate(chunks):
                ref_logp[k] = completion_logprobs(policy, ids[sl], p_lens[sl], t_max, rc.temperature, share_prompts=share)[0].detach().cpu()
    if gc.top_entropy_quantile < 1.0:  # the batch's entropies before the first backward (and pi_old with them)
        ents = []
        with torch.no_grad(), aqn.noisy_norms(norm_params, noisy):
            for k, sl in enumerate(chunks):
                logp0, ent0 = completion_logprobs(policy, ids[sl], p_lens[sl], t_max, rc.temperature, share_prompts=share)
                old_logp[k] = logp0.detach().cpu()
                ents.append(ent0.detach().cpu())
        ent_all = torch.cat(ents) if ents else torch.zeros(0, t_max)  # no rows: a rank's empty share
        real_ent = ent_all[mask > 0]
        threshold = grpo.entropy_threshold(torch.cat(d.all_gather_object(real_ent)) if d.active else real_ent,
                                           gc.top_entropy_quantile)
        chosen = ((ent_all >= threshold) & (mask > 0)).to(mask.dtype)
        for k, sl in enumerate(chunks):
            select[k] = chosen[sl]
        select_info = {"policy/selected_token_fraction": d.sum(float(chosen.sum())) / max(n_tok, 1.0),
                       "policy/entropy_threshold": threshold}
    for u in range(gc.updates_per_rollout):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        with aqn.noisy_norms(norm_params, noisy):
            for k, sl in enumerate(chunks):
                logp, ent = completion_logprobs(policy, ids[sl], p_lens[sl], t_max, rc.temperature, share_prompts=share,
                                                entropy_grad=want_entropy_grad)
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
                loss, st = grpo.policy_loss(logp, old_logp[k], adv[sl], m, loss_params, is_weights=is_w[k],
                                            ref_logp=ref_logp.get(k), token_select=select.get(k),
                                            entropy=ent if want_entropy_grad else None)
                if not torch.isfinite(loss):
                    raise TrainingDiverged(
                        f"non-finite loss ({float(loss.detach())}) at step {step + 1} (update {u + 1}, micro-batch {k + 1}); "
                        f"training stopped before the optimizer update, the newest checkpoint is the last good state"
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
            raise TrainingDiverged(f"non-finite gradient norm at step {step + 1} (update {u + 1}); training stopped before the optimizer update")
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()  # clean norms are back: their update sticks
        scheduler.step()
        grad_norms.append(float(gn))
        losses.append(d.sum(total))
    if d.active:  # each rank's statistics are its share of the global ones (global denominators): add them up
        sums = d.sum_tensor(torch.tensor([clip_sum, clip_low, clip_high, *stats_acc.values()], dtype=torch.float64)).tolist()
        clip_sum, clip_low, clip_high = sums[:3]
        stats_acc = dict(zip(stats_acc, sums[3:]))
        is_parts = [p for parts in d.all_gather_object(is_parts) for p in parts]
    out = {
        "lr": lr, T.LOSS: _mean(losses), T.GRAD_NORM: _mean(grad_norms), T.POLICY_ENTROPY: stats_acc["entropy"],
        "policy/clip_fraction": clip_sum, "policy/clip_low_fraction": clip_low, "policy/clip_high_fraction": clip_high,
        "mismatch/kl": stats_acc["mismatch_kl"], **select_info,
    }
    if is_parts:
        out.update(grpo.ISStats.merge(is_parts).metrics())
        out["mismatch/is_weight_mean"] = stats_acc["is_weight"]
    if want_ref:
        out["policy/kl_to_base"] = stats_acc["kl_to_base"]
    return out

def completion_rows(groups, rewards, items, info, step: int) -> list[dict]:
    rows, k = [], 0
    for j, grp in enumerate(groups):
        item = items[info["idx"][j]]
        for s in grp:
            x = rewards[k]
            rows.append({
                "step": step, "prompt_id": item.record.get("id"), "question": item.record.get("question", ""),
                "gold": item.gold, "completion": s.text, "reward": x["reward"], "accuracy": x["accuracy"],
                "extracted": x.get("extracted"), "length": len(s.completion_ids), "finish_reason": s.finish_reason,
                **({"rewards": x["rewards"]} if "rewards" in x else {}),
            })
            k += 1
    return rows
