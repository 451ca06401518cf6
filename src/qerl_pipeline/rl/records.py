"""The records a training step passes between its parts, as dataclasses.

One step (``rl/trainer.py``) is: ``collect`` (``rl/collect.py``) returns this rank's ``Rollout``;
``RolloutStats.gather`` joins every rank's into the step's global numbers (rewards, lengths, times)
and the advantages over the global batch; ``Batch.of`` turns this rank's samples and advantages
into the tensors ``policy_update`` (``rl/update.py``) trains on, which returns its ``UpdateStats``;
``StepStats`` holds the step's whole account. Each statistics record names its fields as metrics
in ``metrics()``, under the names ``metric_names.py`` declares (one place for every metric name).

Reward rows stay the scorer's dicts (``reward``, ``accuracy``, ``format``, with ``overlong`` under
DAPO's shaping and ``rewards`` per entry of a weighted reward: ``rewards/functions.py``), the
format user reward functions return, as TRL's ``reward_funcs`` do.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from qerl_pipeline import metric_names
from qerl_pipeline.rewards.functions import reward_component_metrics
from qerl_pipeline.rl import grpo
from qerl_pipeline.rollout.engine import Sample


def mean(values) -> float:
    """The mean of ``values`` as floats; 0.0 for none."""
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else 0.0


# ------------------------------------------------------------------------ the rollout
@dataclass
class Rollout:
    """One step's rollout on this rank, as ``collect`` returns it.

    ``groups``: this rank's rows of the batch the update trains on, the samples of each whole or
    partial group in global order; ``rewards``: their reward rows, flat in the same order;
    ``prompts``: each group's prompt (an index into the step's prompt items). ``sampled``: the
    reward rows of every group this rank rolled out in every round, before DAPO's filter (the
    honest curves). ``rounds``: the rounds rolled out (the same on every rank);
    ``zero_std_fraction``: of the first round's groups this rank saw (all of them with dynamic
    sampling); ``sampled_groups``/``kept_groups``: the groups this rank rolled out, and those of
    them kept. ``seconds``, ``tokens``: generation time and output tokens over the rounds;
    ``reward_s``: the scoring time.
    """

    groups: list[list[Sample]]
    rewards: list[dict]
    prompts: list[int]
    sampled: list[dict]
    rounds: int
    zero_std_fraction: float
    sampled_groups: int
    kept_groups: int
    seconds: float = 0.0
    tokens: float = 0.0
    reward_s: float = 0.0

    @property
    def samples(self) -> list[Sample]:
        """The rows, flat."""
        return [s for grp in self.groups for s in grp]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class RolloutStats:
    """A step's rollout over every rank (one process: its own), from which the advantages and the
    reward, length and time metrics come.

    ``rewards``: the kept rows' reward rows of every rank, in rank order (the global batch);
    ``counts``: how many each rank holds; ``sampled``: every sampled group's reward rows;
    ``lengths``/``truncated``: the kept rows' completion lengths and whether each hit the length
    limit; ``seconds``: the slowest rank's generation time; ``tokens``: the output tokens of all;
    ``reward_s``: the slowest rank's scoring time; ``zero_std_fraction``: the ranks' mean;
    ``sampled_groups``/``kept_groups``: summed; ``rounds``: the rounds rolled out.
    """

    rewards: list[dict]
    counts: list[int]
    sampled: list[dict]
    lengths: list[int]
    truncated: list[bool]
    seconds: float
    tokens: float
    reward_s: float
    zero_std_fraction: float
    sampled_groups: int
    kept_groups: int
    rounds: int

    @classmethod
    def of(cls, rollout: Rollout) -> RolloutStats:
        """One rank's share."""
        samples = rollout.samples
        return cls(
            rollout.rewards,
            [len(rollout.rewards)],
            rollout.sampled,
            [len(s.completion_ids) for s in samples],
            [s.finish_reason == "length" for s in samples],
            rollout.seconds,
            rollout.tokens,
            rollout.reward_s,
            rollout.zero_std_fraction,
            rollout.sampled_groups,
            rollout.kept_groups,
            rollout.rounds,
        )

    @classmethod
    def gather(cls, rollout: Rollout, dist) -> RolloutStats:
        """Every rank's share joined (``dist``: ``rl/ranks.py``'s ``Dist``; one process: its own share)."""
        return cls.join(dist.all_gather_object(cls.of(rollout)))

    @classmethod
    def join(cls, parts: list[RolloutStats]) -> RolloutStats:
        """The ranks' shares, in rank order, as one: rows concatenated, counts summed, the slowest rank's times."""
        return cls(
            [x for p in parts for x in p.rewards],
            [c for p in parts for c in p.counts],
            [x for p in parts for x in p.sampled],
            [n for p in parts for n in p.lengths],
            [t for p in parts for t in p.truncated],
            max(p.seconds for p in parts),
            sum(p.tokens for p in parts),
            max(p.reward_s for p in parts),
            mean(p.zero_std_fraction for p in parts),
            sum(p.sampled_groups for p in parts),
            sum(p.kept_groups for p in parts),
            parts[0].rounds,
        )

    def reward_tensor(self) -> torch.Tensor:
        """The kept rows' rewards ``[N]`` (float32), the global batch's."""
        return torch.tensor([x["reward"] for x in self.rewards], dtype=torch.float32)

    def advantages(self, grpo_cfg, rank: int) -> torch.Tensor:
        """Rank ``rank``'s rows of the group advantages over the global batch (``grpo.group_advantages``)."""
        adv = grpo.group_advantages(
            self.reward_tensor(), grpo_cfg.num_generations, grpo_cfg.advantage_scale, grpo_cfg.advantage_eps
        )
        offset = sum(self.counts[:rank])
        return adv[offset : offset + self.counts[rank]]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def metrics(self) -> dict[str, float]:
        r, sampled, kept = self.reward_tensor(), self.sampled, self.rewards
        return {
            metric_names.REWARD_MEAN: mean(x["reward"] for x in sampled),
            metric_names.REWARD_ACCURACY: mean(x["accuracy"] for x in sampled),
            metric_names.REWARD_FORMAT: mean(x["format"] for x in sampled),
            metric_names.TRAIN_ACCURACY: mean(x["accuracy"] for x in sampled),
            metric_names.REWARD_KEPT_MEAN: float(r.mean()),
            metric_names.REWARD_STD: float(r.std(unbiased=False)),
            metric_names.REWARD_KEPT_ACCURACY: mean(x["accuracy"] for x in kept),
            metric_names.REWARD_KEPT_FORMAT: mean(x["format"] for x in kept),
            metric_names.GROUPS_SAMPLED: self.sampled_groups,
            metric_names.GROUPS_KEPT: self.kept_groups,
            metric_names.REWARD_OVERLONG: mean(x.get("overlong", 0.0) for x in kept),
            metric_names.COMPLETION_LENGTH: float(torch.tensor(self.lengths).float().mean()),
            metric_names.TRUNCATED_FRACTION: float(torch.tensor(self.truncated, dtype=torch.bool).float().mean()),
            metric_names.GROUPS_ZERO_STD_FRACTION: self.zero_std_fraction,
            metric_names.GROUPS_REFILL_ROUNDS: self.rounds - 1,
            metric_names.ROLLOUT_TOKENS_PER_S: self.tokens_per_s,
            metric_names.ROLLOUT_TIME_S: self.seconds,
            metric_names.REWARD_TIME_S: self.reward_s,
            **reward_component_metrics(sampled),  # rewards/<name>/mean|std of a train.reward_fn list
        }


# ------------------------------------------------------------------------ the batch
def collate(samples: list[Sample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
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

    @classmethod
    def of(
        cls,
        samples: list[Sample],
        adv: torch.Tensor,
        noisy: dict[str, torch.Tensor],
        *,
        pad_id: int,
        mask_truncated: bool,
    ) -> Batch:
        """The batch of ``samples`` (``collate``); with ``mask_truncated`` (``grpo.mask_truncated``) the rows that
        hit the length limit count no token."""
        ids, p_lens, c_lens, roll_logp = collate(samples, pad_id)
        truncated = torch.tensor([s.finish_reason == "length" for s in samples])
        mask = grpo.completion_mask(c_lens, roll_logp.shape[1], truncated if mask_truncated else None)
        return cls(ids, p_lens, roll_logp, mask, adv, noisy)


# ------------------------------------------------------------------------ the statistics
@dataclass(frozen=True, eq=False)
class UpdateStats(Mapping):
    """What ``policy_update`` reports, the global batch's (every rank holds the same).

    ``loss`` summed over the micro-batches, mean over the updates; ``grad_norm`` before clipping,
    mean over the updates; ``lr`` of the last update; ``entropy`` and ``mismatch_kl`` token means
    at the first update; the clip fractions token means over the updates. Entropy selection
    (``grpo.top_entropy_quantile < 1``) sets ``selected_token_fraction`` and ``entropy_threshold``;
    importance sampling (``grpo.is_mode``) ``importance`` (the ratios of every micro-batch of every
    rank) and ``is_weight_mean``; a step with the KL reference ``kl_to_base``. None: not computed.

    Read as a mapping it is ``metrics()``: the values by metric name, what the logger takes.
    """

    lr: float
    loss: float
    grad_norm: float
    entropy: float
    clip_fraction: float
    clip_low_fraction: float
    clip_high_fraction: float
    mismatch_kl: float
    selected_token_fraction: float | None = None
    entropy_threshold: float | None = None
    importance: grpo.ISStats | None = None
    is_weight_mean: float | None = None
    kl_to_base: float | None = None

    def metrics(self) -> dict[str, float]:
        out = {
            metric_names.LEARNING_RATE: self.lr,
            metric_names.LOSS: self.loss,
            metric_names.GRAD_NORM: self.grad_norm,
            metric_names.POLICY_ENTROPY: self.entropy,
            metric_names.CLIP_FRACTION: self.clip_fraction,
            metric_names.CLIP_LOW_FRACTION: self.clip_low_fraction,
            metric_names.CLIP_HIGH_FRACTION: self.clip_high_fraction,
            metric_names.MISMATCH_KL: self.mismatch_kl,
        }
        if self.selected_token_fraction is not None:
            out[metric_names.SELECTED_TOKEN_FRACTION] = self.selected_token_fraction
            out[metric_names.ENTROPY_THRESHOLD] = self.entropy_threshold
        if self.importance is not None:
            out.update(self.importance.metrics())
            out[metric_names.IS_WEIGHT_MEAN] = self.is_weight_mean
        if self.kl_to_base is not None:
            out[metric_names.KL_TO_BASE] = self.kl_to_base
        return out

    def __getitem__(self, name: str) -> float:
        return self.metrics()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.metrics())

    def __len__(self) -> int:
        return len(self.metrics())


@dataclass
class StepStats:
    """One step's account: its rollout over every rank, the update, AQN's noise (``aqn_stage``,
    ``aqn_sigma`` as scheduled, ``aqn_sigma_effective`` as served), the seconds of the engine's
    sync, of the update (batch, advantages and ``policy_update``) and of the whole step, the
    process's peak memory, what the engine's sleep reported (``rollout/sleep.py``; empty when it
    does not sleep) and the engine's CPU seconds during the update (None: the engine cannot say).
    """

    rollout: RolloutStats
    update: UpdateStats
    aqn_stage: int
    aqn_sigma: float
    aqn_sigma_effective: float
    sync_s: float
    update_s: float
    step_s: float
    peak_memory_gb: float
    sleep: dict[str, Any] = field(default_factory=dict)
    engine_cpu_s: float | None = None

    def metrics(self) -> dict[str, float]:
        out = {
            **self.rollout.metrics(),
            metric_names.AQN_SIGMA: self.aqn_sigma,
            metric_names.AQN_SIGMA_EFFECTIVE: self.aqn_sigma_effective,
            metric_names.AQN_STAGE: self.aqn_stage,
            metric_names.SYNC_TIME_S: self.sync_s,
            metric_names.UPDATE_TIME_S: self.update_s,
            metric_names.STEP_TIME_S: self.step_s,
            metric_names.PEAK_MEMORY_GB: self.peak_memory_gb,
            **self.update.metrics(),
            **self.sleep,
        }
        if self.engine_cpu_s is not None:
            out[metric_names.ENGINE_CPU_DURING_UPDATE_S] = self.engine_cpu_s
        return out
