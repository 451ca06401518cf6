"""A training step's rollout side: prompts, sampling seeds, rollout + rewards, DAPO's refill.

``collect`` is the step's first part (``rl/trainer.py``): it draws the step's prompts
(``PromptSampler``: seeded permutations per epoch), rolls them out on the engine, each prompt
with its own hashed sampling seed (``sampling_seeds``), scores the samples and, with DAPO's
dynamic sampling, refills the groups whose rewards are all equal; it returns this rank's
``Rollout`` (``rl/records.py``). The update side is ``rl/update.py``.

Rewards: the scorer ``rewards.functions.make_scorer`` builds from ``train.reward_fn``: the math
``RewardScorer`` by default, a user function, or the weighted sum of a list of them (as TRL's
``reward_funcs``/``reward_weights``); ``collect`` calls it with the rollout samples.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qerl_pipeline.config import QerlConfig
from qerl_pipeline.rewards.scorer import RewardScorer
from qerl_pipeline.rl import grpo
from qerl_pipeline.rl.ranks import SINGLE, shard_bounds
from qerl_pipeline.rl.records import Rollout


# ------------------------------------------------------------------ prompts
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
        raise ValueError(
            f"no usable prompts: all {len(records)} are longer than {max_prompt_len} tokens or the set is empty"
        )
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


# ------------------------------------------------------------ rollout + rewards
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


def collect(
    engine,
    scorer,
    sampler: PromptSampler,
    items: list[PromptItem],
    cfg: QerlConfig,
    step: int,
    adapter_dir: Path | None,
    dist=None,
) -> Rollout:
    """Rollout + rewards for one step, with DAPO dynamic sampling when enabled: this rank's ``Rollout``.

    Its rows are this rank's of the batch the update trains on (groups of samples, their reward
    rows, each group's prompt); ``sampled`` holds the rewards of every group this rank sampled in
    every round, before the filter, so DAPO's reward curves can be drawn over the same population
    as GRPO's (the kept groups exclude the all-right and all-wrong ones, which biases their mean
    towards 0.5).

    ``dist`` (``rl/ranks.py``'s ``Dist``; None = one process): every rank draws the same prompts
    each round and rolls out its contiguous share (``ranks.shard_bounds``), each prompt with the
    seed of its global position. Dynamic sampling gathers every group's rewards each round, so
    all ranks take the decision one process would, then split the kept groups in balanced
    contiguous shares of rows (``_rows_of_rank``; design: ``rl/launch.py``); without it a
    rank trains on its own share.

    The counts are this rank's share (the trainer sums them): ``sampled_groups`` the groups it
    rolled out, ``kept_groups`` the kept ones among them; ``zero_std_fraction`` is over the
    first round's groups it saw (all with dynamic sampling); ``rounds`` is the same on every rank.
    """
    d = dist or SINGLE
    gc, rc, tc = cfg.grpo, cfg.rollout, cfg.train
    g, want = gc.num_generations, tc.prompts_per_step
    global_view = gc.dynamic_sampling and d.active  # every rank sees every group's rewards
    mine: dict[tuple, list] = {}  # key (round, position in the round) -> a group of samples this rank rolled out
    owner: dict[tuple, int] = {}  # key -> the rank that rolled it out
    # (key, prompt, reward rows) of the groups in view, of the kept ones; my reward rows
    seen, kept, sampled = [], [], []
    seconds = tokens = reward_s = 0.0
    rounds, zero_std, need, first = 0, None, want, 0
    while True:
        idx = sampler.take(need)
        seeds = sampling_seeds(rc.seed, step, rounds, idx)
        bounds = [shard_bounds(len(idx), r, d.world_size, balanced=True) for r in range(d.world_size)]
        lo, hi = bounds[d.rank]
        groups, rows, timing = _roll_out(
            engine, scorer, [items[i] for i in idx[lo:hi]], seeds[lo:hi], cfg, adapter_dir
        )
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
        kept += [v for v, k in zip(view, grpo.dynamic_sampling_keep(r, g).tolist(), strict=True) if k]
        need = want - len(kept)
        if need <= 0 or rounds > gc.max_refill_rounds:
            break
    chosen = (kept or seen[:first])[:want]  # nothing informative: the first round (zero advantages, zero loss)
    share = _rows_of_rank(chosen, mine, owner, g, d) if global_view else [(k, p, mine[k], grp) for k, p, grp in chosen]
    return Rollout(
        groups=[grp for _, _, grp, _ in share],
        rewards=[x for *_, grp in share for x in grp],
        prompts=[p for _, p, _, _ in share],
        sampled=sampled,
        rounds=rounds,
        zero_std_fraction=zero_std,
        sampled_groups=len(mine),
        kept_groups=sum(owner[k] == d.rank for k, _, _ in chosen),
        seconds=seconds,
        tokens=tokens,
        reward_s=reward_s,
    )


def _roll_out(engine, scorer, prompts: list[PromptItem], seeds: list[int], cfg: QerlConfig, adapter_dir: Path | None):
    """``prompts``' groups of samples, each group's reward rows (with DAPO's overlong shaping when on) and
    ``(rollout seconds, output tokens, reward seconds)``; nothing to do for an empty share."""
    gc, rc = cfg.grpo, cfg.rollout
    g = gc.num_generations
    if not prompts:
        return [], [], (0.0, 0, 0.0)
    res = engine.generate(
        [p.ids for p in prompts],
        n=g,
        temperature=rc.temperature,
        top_p=rc.top_p,
        max_new_tokens=rc.max_new_tokens,
        seed=seeds,
        lora_path=adapter_dir,
    )
    t0 = time.perf_counter()
    flat = [s for grp in res.samples for s in grp]
    scored = _score(scorer, [s.text for s in flat], [p.gold for p in prompts for _ in range(g)], flat)
    if gc.overlong.enabled:
        lengths = torch.tensor([len(s.completion_ids) for s in flat])
        pen = grpo.overlong_penalty(lengths, rc.max_new_tokens, gc.overlong.buffer_tokens, gc.overlong.penalty)
        for x, p in zip(scored, pen.tolist(), strict=True):
            x["overlong"] = p
            x["reward"] = x["reward"] + p
    rows = [scored[j * g : (j + 1) * g] for j in range(len(prompts))]
    return res.samples, rows, (res.seconds, res.output_tokens, time.perf_counter() - t0)


def _rows_of_rank(chosen: list, mine: dict, owner: dict, g: int, d) -> list[tuple]:
    """This rank's contiguous share of the rows of the ``chosen`` groups (global order), as
    ``(key, prompt, samples, reward rows)`` per whole or partial group: the groups another rank
    rolled out arrive from it (every rank sends those of its groups that reach past its own rows)."""
    lo, hi = shard_bounds(len(chosen) * g, d.rank, d.world_size, balanced=True)
    outgoing = {
        key: mine[key]
        for q, (key, _, _) in enumerate(chosen)
        if owner[key] == d.rank and not lo <= q * g < (q + 1) * g <= hi
    }
    arrived = {key: grp for part in d.all_gather_object(outgoing) for key, grp in part.items()}
    share = []
    for q, (key, prompt, rows) in enumerate(chosen):
        a, b = max(lo, q * g) - q * g, min(hi, (q + 1) * g) - q * g
        if a < b:
            samples = mine[key] if owner[key] == d.rank else arrived[key]
            share.append((key, prompt, samples[a:b], rows[a:b]))
    return share


def completion_rows(rollout: Rollout, items: list[PromptItem], step: int) -> list[dict]:
    """The rollout's completions as table rows (prompt, gold, completion, its reward row), for ``completions/``."""
    rows, k = [], 0
    for j, grp in enumerate(rollout.groups):
        item = items[rollout.prompts[j]]
        for s in grp:
            x = rollout.rewards[k]
            rows.append(
                {
                    "step": step,
                    "prompt_id": item.record.get("id"),
                    "question": item.record.get("question", ""),
                    "gold": item.gold,
                    "completion": s.text,
                    "reward": x["reward"],
                    "accuracy": x["accuracy"],
                    "extracted": x.get("extracted"),
                    "length": len(s.completion_ids),
                    "finish_reason": s.finish_reason,
                    **({"rewards": x["rewards"]} if "rewards" in x else {}),
                }
            )
            k += 1
    return rows
