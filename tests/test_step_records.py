"""The records a training step passes between its parts (``rl/records.py``).

* Every metric a training writes is named in ``metric_names.py`` (one place for metric names): a
  real ``trainer.train`` on the fake engine, with every option that adds metrics on (engine
  sleep, importance sampling, entropy selection, the KL reference, overlong shaping, DAPO's
  refill, a weighted reward list), logs no name ``metric_names.py`` does not declare.
* ``UpdateStats`` read as a mapping is its metrics, the statistics not computed left out.
* ``RolloutStats``: the shares of two ranks join into what one process holding both has, and
  each rank's advantages are its rows of the global batch's.
"""

from __future__ import annotations

import re

import pytest
import torch

from qerl_pipeline import metric_names
from qerl_pipeline.config import QerlConfig
from qerl_pipeline.rl import grpo
from qerl_pipeline.rl.records import Batch, Rollout, RolloutStats, UpdateStats
from qerl_pipeline.rollout.engine import Sample

#: what metric_names.py declares: its string constants, and those with ``{...}`` fields as patterns
DECLARED = {v for k, v in vars(metric_names).items() if k.isupper() and isinstance(v, str)}
PATTERNS = [re.compile(re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(v)) + "$") for v in DECLARED if "{" in v]


def declared(name: str) -> bool:
    return name in DECLARED or any(p.match(name) for p in PATTERNS)


def test_the_declared_check_sees_what_it_looks_for():
    assert declared("reward/kept_mean") and declared("rewards/math/std") and declared("accuracy")
    assert not declared("reward/kept_mean2") and not declared("rewards/math") and not declared("policy/new_thing")


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """Three steps of ``trainer.train`` on a bf16 base with the fake engine that says it runs on CUDA (so it
    sleeps during the update), every metric-adding option on; the logger."""
    from safetensors import safe_open

    from qerl_pipeline.rl import trainer
    from qerl_pipeline.rl.run_setup import Reporting
    from qerl_pipeline.tracking import MemoryLogger
    from tests.helpers.engines import FakeEngine
    from tests.helpers.models import tokenized_base

    work = tmp_path_factory.mktemp("records")
    base = tokenized_base(tiny_model_dir, "bf16", work / "bf16")
    with safe_open(str(base / "model.safetensors"), "pt") as fh:
        norms = {k: fh.get_tensor(k).float() for k in fh.keys() if k.endswith("norm.weight")}
    cfg = QerlConfig.model_validate(
        {
            "method": "lora_aqn",
            "model": {"dtype": "float32", "max_seq_len": 256},
            "lora": {"rank": 4, "alpha": 8},
            "aqn": {"num_stages": 2},
            "grpo": {
                "num_generations": 2,
                "kl_beta": 0.05,
                "top_entropy_quantile": 0.5,
                "is_mode": "token_truncate",
                "dynamic_sampling": True,
                "max_refill_rounds": 1,
                "loss_type": "dapo",
                "overlong": {"enabled": True, "buffer_tokens": 2},
            },
            "rollout": {"max_new_tokens": 4, "temperature": 1.0, "sync": "adapter"},
            "train": {
                "steps": 3,
                "prompts_per_step": 2,
                "micro_batch_size": 4,
                "checkpoint_every": 3,
                "output_dir": str(work / "out"),
                "reward_fn": ["tests.helpers.rewards:letter_fraction", "tests.helpers.rewards:odd_first_token"],
            },
        }
    )
    records = [
        {"id": str(i), "messages": [{"role": "user", "content": f"What is {i} plus {i}?"}], "gold": str(2 * i)}
        for i in range(1, 7)
    ]
    logger = MemoryLogger()
    trainer.train(
        cfg,
        base,
        records,
        engine=FakeEngine(cuda=True, norms=norms),
        reporting=Reporting(make_logger=lambda _rid: logger, progress=False),
    )
    return logger


def test_every_metric_a_training_writes_is_named_in_metric_names(trained):
    names = set(trained.metrics)
    # the options are on: their metrics are there (a check that cannot pass on a run that logs few names)
    for want in (
        metric_names.SLEEP_TIME_S,
        metric_names.IS_RATIO_MAX,
        metric_names.SELECTED_TOKEN_FRACTION,
        metric_names.KL_TO_BASE,
        metric_names.REWARD_OVERLONG,
        metric_names.GROUPS_REFILL_ROUNDS,
        metric_names.reward_component("letter_fraction"),
        metric_names.AQN_SIGMA_EFFECTIVE,
        metric_names.LEARNING_RATE,
        metric_names.TOTAL_TIME_S,
        metric_names.WORLD_SIZE,
    ):
        assert want in names, want
    # quantize/<name>: the base's quantize report as it was stored (its own names; none for this bf16 base)
    assert not [n for n in names if not n.startswith("quantize/") and not declared(n)]


def test_update_stats_read_as_their_metrics():
    full = UpdateStats(
        lr=1e-3,
        loss=0.5,
        grad_norm=2.0,
        entropy=1.5,
        clip_fraction=0.1,
        clip_low_fraction=0.04,
        clip_high_fraction=0.06,
        mismatch_kl=0.01,
        selected_token_fraction=0.25,
        entropy_threshold=0.9,
        importance=grpo.ISStats("token", torch.tensor([0.5, 1.0, 2.0]), masked=1),
        is_weight_mean=0.8,
        kl_to_base=0.02,
    )
    assert dict(full) == full.metrics() and len(full) == 17
    assert (
        full[metric_names.LOSS] == 0.5
        and full[metric_names.IS_RATIO_MAX] == 2.0
        and full[metric_names.IS_MASKED_FRACTION] == 1 / 3
    )
    assert {**full}[metric_names.ENTROPY_THRESHOLD] == 0.9
    bare = UpdateStats(
        lr=1e-3,
        loss=0.5,
        grad_norm=2.0,
        entropy=1.5,
        clip_fraction=0.0,
        clip_low_fraction=0.0,
        clip_high_fraction=0.0,
        mismatch_kl=0.0,
    )
    assert set(bare) == {
        metric_names.LEARNING_RATE,
        metric_names.LOSS,
        metric_names.GRAD_NORM,
        metric_names.POLICY_ENTROPY,
        metric_names.CLIP_FRACTION,
        metric_names.CLIP_LOW_FRACTION,
        metric_names.CLIP_HIGH_FRACTION,
        metric_names.MISMATCH_KL,
    }


def _rollout(rewards: list[float], lengths: list[int], seconds: float, tokens: float) -> Rollout:
    samples = [Sample([1, 2], list(range(n)), "x", [-1.0] * n, "length" if n == 4 else "stop") for n in lengths]
    rows = [{"reward": r, "accuracy": float(r > 0.5), "format": 0.0} for r in rewards]
    return Rollout(
        groups=[samples[i : i + 2] for i in range(0, len(samples), 2)],
        rewards=rows,
        prompts=list(range(len(samples) // 2)),
        sampled=rows,
        rounds=1,
        zero_std_fraction=0.0,
        sampled_groups=len(samples) // 2,
        kept_groups=len(samples) // 2,
        seconds=seconds,
        tokens=tokens,
    )


def test_two_ranks_shares_join_as_one_process_and_split_the_advantages_back():
    rank0 = _rollout([1.0, 0.0, 0.2, 0.6], [4, 1, 2, 3], seconds=2.0, tokens=10)
    rank1 = _rollout([0.3, 0.9], [4, 4], seconds=3.0, tokens=8)
    both = _rollout([1.0, 0.0, 0.2, 0.6, 0.3, 0.9], [4, 1, 2, 3, 4, 4], seconds=3.0, tokens=18)
    joined = RolloutStats.join([RolloutStats.of(rank0), RolloutStats.of(rank1)])
    one = RolloutStats.of(both)
    assert joined.counts == [4, 2] and one.counts == [6]
    for field in ("rewards", "lengths", "truncated", "seconds", "tokens", "sampled_groups", "kept_groups"):
        assert getattr(joined, field) == getattr(one, field), field
    assert joined.metrics() == one.metrics()
    assert joined.metrics()[metric_names.ROLLOUT_TOKENS_PER_S] == 6.0  # 18 tokens over the slowest rank's 3 s
    assert joined.metrics()[metric_names.TRUNCATED_FRACTION] == 0.5
    cfg = QerlConfig.model_validate({"grpo": {"num_generations": 2, "advantage_scale": "batch"}}).grpo
    whole = one.advantages(cfg, 0)
    assert torch.equal(torch.cat([joined.advantages(cfg, 0), joined.advantages(cfg, 1)]), whole)
    assert joined.advantages(cfg, 1).shape == (2,)


def test_a_batch_masks_truncated_rows_only_when_asked():
    rollout = _rollout([1.0, 0.0], [4, 2], seconds=1.0, tokens=6)
    adv = torch.tensor([1.0, -1.0])
    kept = Batch.of(rollout.samples, adv, {}, pad_id=0, mask_truncated=False)
    masked = Batch.of(rollout.samples, adv, {}, pad_id=0, mask_truncated=True)
    assert kept.ids.shape == (2, 6) and kept.mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert masked.mask.tolist() == [[0, 0, 0, 0], [1, 1, 0, 0]]  # the first hit the length limit
    assert torch.equal(kept.adv, adv) and kept.noisy == {}
