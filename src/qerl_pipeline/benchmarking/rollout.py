"""Rollout speed and per-step sync cost of the vLLM engine (measured, never asserted).

``measure_rollout``: output tokens/s at each batch size with a fixed prompt length and a
fixed completion length (EOS ignored, so every sequence decodes exactly
``completion_len`` tokens and batch sizes are comparable). Prompts are distinct random
token ids per call, so the prefix cache cannot turn prefill into a no-op; one small
warm-up call runs first (vLLM's first batch pays one-time costs). Sampling is at
temperature 1, as in RL rollouts.

``measure_sync``: what getting the current LoRA into the engine costs per training step:

* ``adapter``: the first ``generate`` with a new adapter version (vLLM loads the PEFT
  folder and builds its LoRA tensors) minus the same call once it is loaded. The
  trainer's ``save_pretrained`` is not included (both paths would pay a comparable write).
* ``merge``: what the trainer does per step under ``merge``: ``engine.merge_adapter(folder)``
  (the engine process reads A and B and sets every adapted linear to its checkpoint W +
  scale * B @ A; nothing accumulates), one call per simulated step, then one
  ``engine.unmerge()`` so the engine serves clean linears again. Only possible on a dense
  served base (``ServedModel.dense``): on a quantized one (packed NVFP4 or bitsandbytes NF4
  on CUDA) no merge is attempted and it is reported as unsupported, with the reason; an
  engine error during a merge is reported the same way. (Under AQN the trainer also sends
  the noisy norms each step, ``update_weights``: a few small vectors, not timed here.)

Merge also removes LoRA's decode overhead (about 3x in tokens/s on CPU), so
``recommend_sync`` weighs the sync time together with the rollout time of each path and
reports what the measurement recommends. The mode training really uses is
``rollout.serving.resolve_sync(rollout.sync, served)`` (``auto``: merge on CPU, adapter on
CUDA), recorded as ``sync[fmt]["used"]``: the benchmark table's "our step" follows it.

``measure_reward``: seconds of one call of our reward scorer (``rewards.functions.make_scorer(cfg)``,
the trainer's: math-verify in a process pool unless ``train.reward_fn``) on the completions
of the training-batch rollout (the used sync's path), each against the gold ``"42"``. One
untimed warm-up call on the same completions runs first (excluded from ``reward_s``): the
pool's workers import math-verify lazily. The completions come from synthetic prompts, so
the figure is the scorer's cost for a batch of that size and length, not a reward.

``rollout_benchmark(bases, cfg, bcfg)`` runs all of it per compared base format, on the engines
training would open for each sync: one with LoRA slots (the rows with the adapter attached, the
adapter sync) and, on a dense served base, one without (``lora_rank=None``, as the trainer
opens it under ``merge``: vLLM-CPU's LoRA-wrapped layers cost ~10% even with no adapter in the
batch; the rows without adapter, the merge sync). On a packed base the rows without adapter
come from the first engine. Every engine is started by ``rollout.serving.open_engine`` (the one
place engines are built) for what ``served_model`` decides, so it runs at
``engine_dtype(model)`` with the trainer's norm dtype (``model.norm_dtype``) and
``rollout.seed``, and with a CPU KV cache sized like a training engine's (``kv_need``: the
largest batch at ``prompt_len + completion_len``, not the 2 GiB default); LoRA adapters of the
configured shape with distinct weights stand in for successive training steps
(:func:`lora_adapters`). The engine's memory is its process tree's host RSS high-water mark
(``RolloutEngine.peak_memory_bytes``) read after every rollout and sync on the engine of the
used sync, ``served[fmt]["engine_peak_memory_bytes"]``. Every row carries ``format``,
``engine_start_s``, ``engine_lora`` (LoRA slots on that engine), ``is_train_batch``,
``served_format`` and ``served_dtype``.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from qerl_pipeline.benchmarking.bases import method_formats
from qerl_pipeline.config import BenchmarkConfig, LoraConfig, QerlConfig
from qerl_pipeline.quantization.policy import build_policy
from qerl_pipeline.rewards.functions import make_scorer
from qerl_pipeline.rl.collect import _score
from qerl_pipeline.rollout.engine import EngineError, RolloutEngine
from qerl_pipeline.rollout.serving import open_engine, resolve_sync, served_model, served_tags

log = logging.getLogger(__name__)

#: Token ids used for synthetic prompts: below 1000, valid in any real vocabulary.
_ID_LOW, _ID_HIGH = 100, 1000


def synthetic_prompts(batch_size: int, prompt_len: int, seed: int) -> list[list[int]]:
    """``batch_size`` distinct random prompts of exactly ``prompt_len`` token ids."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(_ID_LOW, _ID_HIGH, (batch_size, prompt_len), generator=gen).tolist()


def measure_rollout(
    engine: RolloutEngine,
    batch_sizes: list[int],
    prompt_len: int,
    completion_len: int,
    lora_path: str | Path | None = None,
    keep_samples: dict[int, list] | None = None,
) -> list[dict]:
    """One row per batch size: output tokens/s with fixed prompt and completion lengths.

    ``keep_samples``: when given, filled with ``{batch_size: the batch's Samples, flat}``
    (the reward phase scores the training batch's completions).
    """
    # warm-up
    engine.generate(
        synthetic_prompts(1, prompt_len, seed=0),
        n=1,
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=min(4, completion_len),
        seed=0,
        lora_path=lora_path,
        ignore_eos=True,
    )
    rows = []
    for i, bs in enumerate(batch_sizes):
        prompts = synthetic_prompts(bs, prompt_len, seed=1000 + i)
        t0 = time.perf_counter()
        res = engine.generate(
            prompts,
            n=1,
            temperature=1.0,
            top_p=1.0,
            max_new_tokens=completion_len,
            seed=i,
            lora_path=lora_path,
            ignore_eos=True,
        )
        wall = time.perf_counter() - t0
        if keep_samples is not None:
            keep_samples[bs] = [s for group in res.samples for s in group]
        rows.append(
            {
                "batch_size": bs,
                "prompt_len": prompt_len,
                "completion_len": completion_len,
                "lora": lora_path is not None,
                "output_tokens": res.output_tokens,
                "expected_tokens": bs * completion_len,
                "seconds": res.seconds,
                "wall_seconds": wall,
                "tokens_per_s": res.tokens_per_s,
            }
        )
    return rows


def _adapter_sync_seconds(engine: RolloutEngine, adapter_dirs: list[Path]) -> list[float]:
    probe = synthetic_prompts(1, 8, seed=7)
    out = []
    for d in adapter_dirs:
        kw = dict(n=1, temperature=1.0, top_p=1.0, max_new_tokens=1, seed=0, lora_path=d)
        t0 = time.perf_counter()
        engine.generate(probe, **kw)  # first use of this version: loads the adapter
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.generate(probe, **kw)  # already loaded
        again = time.perf_counter() - t0
        out.append(max(first - again, 0.0))
    return out


def measure_adapter_sync(engine: RolloutEngine, adapter_dirs: list[str | Path]) -> dict:
    """Per-step seconds of the ``adapter`` sync, one simulated step per PEFT folder (module docstring)."""
    dirs = [Path(d) for d in adapter_dirs]
    report: dict = {"steps": len(dirs)}
    try:
        times = _adapter_sync_seconds(engine, dirs)
        report.update(adapter_supported=True, adapter_sync_s=statistics.mean(times), adapter_sync_all_s=times)
    except EngineError as err:
        report.update(adapter_supported=False, adapter_sync_s=None, adapter_error=str(err).splitlines()[0])
    return report


def merge_unsupported() -> dict:
    """The ``merge`` entries of a packed served base (nothing is tried)."""
    return {
        "merge_supported": False,
        "merge_sync_s": None,
        "merge_error": (
            "the served base is quantized: a merge writes dense weights, which only a dense served base takes "
            "(rollout.sync: adapter)"
        ),
    }


def measure_merge_sync(engine: RolloutEngine, adapter_dirs: list[str | Path]) -> dict:
    """Per-step seconds of the ``merge`` sync (``engine.merge_adapter`` per folder), then ``engine.unmerge()``."""
    times, report = [], {}
    try:
        for d in adapter_dirs:
            times.append(engine.merge_adapter(Path(d)))
        report.update(merge_supported=True, merge_sync_s=statistics.mean(times), merge_sync_all_s=times)
    except EngineError as err:
        report.update(merge_supported=False, merge_sync_s=None, merge_error=str(err).splitlines()[0])
    finally:
        engine.unmerge()
    return report


def measure_sync(engine: RolloutEngine, adapter_dirs: list[str | Path], *, dense: bool = True) -> dict:
    """Per-step sync seconds for ``adapter`` and ``merge`` on one engine (one step per adapter folder).

    ``adapter_dirs``: PEFT folders, one per simulated step (distinct contents, as after each
    optimizer step). ``dense``: whether the engine serves dense linears
    (``ServedModel.dense``); when not, merge is reported unsupported without being tried.
    Merge is timed as the trainer does it, ``engine.merge_adapter(folder)`` per step; one
    ``engine.unmerge()`` at the end leaves the engine serving its clean linears.
    """
    if not adapter_dirs:
        raise ValueError("measure_sync needs adapter_dirs (one PEFT folder per simulated step)")
    report = measure_adapter_sync(engine, adapter_dirs)
    report.update(measure_merge_sync(engine, adapter_dirs) if dense else merge_unsupported())
    return report


def recommend_sync(sync: dict, adapter_tokens_per_s: float, merged_tokens_per_s: float, tokens_per_step: int) -> dict:
    """Pick ``adapter`` or ``merge`` by the per-step total: sync time + rollout time of that path."""
    adapter_total = (sync.get("adapter_sync_s") or 0.0) + tokens_per_step / adapter_tokens_per_s
    if not sync.get("merge_supported"):
        return {"sync": "adapter", "adapter_step_s": adapter_total, "merge_step_s": None}
    merge_total = sync["merge_sync_s"] + tokens_per_step / merged_tokens_per_s
    choice = "merge" if merge_total < adapter_total else "adapter"
    return {"sync": choice, "adapter_step_s": adapter_total, "merge_step_s": merge_total}


def measure_reward(cfg: QerlConfig, samples: list, gold: str = "42") -> dict:
    """Seconds of one call of our reward scorer on ``samples`` (after an untimed warm-up call)."""

    texts = [s.text for s in samples]
    golds = [gold] * len(texts)
    scorer = make_scorer(cfg)
    try:
        _score(scorer, texts, golds, samples)  # warm-up: the workers import math-verify on first use
        t0 = time.perf_counter()
        _score(scorer, texts, golds, samples)
        seconds = time.perf_counter() - t0
    finally:
        scorer.close()
    return {"reward_s": seconds, "sequences": len(texts), "scorer": type(scorer).__name__}


# ------------------------------------------------------------------------- the whole measurement
def lora_adapters(base_dir: Path, fmt: str, lcfg: LoraConfig, out_dir: Path, count: int) -> list[Path]:
    """``count`` LoRA adapters of the configured shape with distinct weights (one per simulated step)."""

    policy = build_policy(base_dir, fmt, lcfg, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(0)
    folders = []
    for k in range(count):
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:  # PEFT starts B at zero; a trained adapter is not
                    p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
        folder = out_dir / f"step-{k}"
        policy.save_pretrained(str(folder))
        folders.append(folder)
    return folders


def train_batch_size(cfg: QerlConfig, bcfg: BenchmarkConfig) -> int:
    """Sequences in the training batch: ``benchmark.train_prompts x grpo.num_generations``."""
    return bcfg.train_prompts * cfg.grpo.num_generations


def rollout_benchmark(bases: dict[str, str], cfg: QerlConfig, bcfg: BenchmarkConfig) -> dict[str, Any]:
    """Rollout tokens/s per compared format and batch size, with and without LoRA; sync and reward time per step.

    ``cfg`` supplies ``model`` (engine dtype, norm dtype), ``lora`` (adapter shape, vLLM
    rank), ``rollout`` (engine settings, ``sync``), ``grpo`` (group size) and ``reward`` /
    ``train.reward_fn`` (the scorer; their defaults where not given). The result: ``rows``
    (one per format, batch size and LoRA on/off), ``sync`` (per format: the measured sync,
    ``configured`` = ``rollout.sync``, ``recommended`` by the measurement, ``used`` = what
    training uses, ``resolve_sync``; ``used`` is None with ``used_error`` where training
    would refuse it), ``reward`` (per format: ``reward_s``, ``sequences``, ``scorer``),
    ``train_batch`` and ``served`` (per format: path, served_format, dense, the engine's
    dtype, ``engine_peak_memory_bytes``).
    """

    lcfg, rcfg = cfg.lora, cfg.rollout
    train_batch = train_batch_size(cfg, bcfg)
    sizes = sorted(set(bcfg.batch_sizes) | {train_batch})
    tokens_per_sequence = bcfg.prompt_len + bcfg.completion_len
    rows, sync, reward, served_info = [], {}, {}, {}
    for fmt in method_formats(bcfg):
        base = Path(bases[fmt])
        served = served_model(base)
        try:
            used, used_error = resolve_sync(rcfg.sync, served, rcfg.tensor_parallel_size), None
        except ValueError as err:
            used, used_error = None, str(err)
        kept: dict[str, dict[int, list]] = {"adapter": {}, "merge": {}}
        engine_kw = dict(max_model_len=tokens_per_sequence + 16, kv_need=(max(sizes), tokens_per_sequence))

        def timed_rows(engine, lora_path, path, start_s, engine_lora, fmt=fmt, served=served, kept=kept):
            # this format's loop values bound as defaults
            for row in measure_rollout(
                engine, sizes, bcfg.prompt_len, bcfg.completion_len, lora_path=lora_path, keep_samples=kept[path]
            ):
                rows.append(
                    {
                        **row,
                        "format": fmt,
                        "engine_start_s": start_s,
                        "is_train_batch": int(row["batch_size"]) == train_batch,
                        "served_format": served.served_format,
                        "served_dtype": served_info[fmt]["dtype"],
                        "engine_lora": engine_lora,
                    }
                )

        with tempfile.TemporaryDirectory(prefix="qerl-bench-lora-") as tmp:
            adapters = lora_adapters(base, fmt, lcfg, Path(tmp), bcfg.sync_steps + 1)
            # 1. the engine as training opens it under rollout.sync adapter: LoRA slots on
            t0 = time.perf_counter()
            with open_engine(served, cfg.model, rollout=rcfg, lora_rank=lcfg.rank, **engine_kw) as engine:
                start_s = time.perf_counter() - t0
                tags = served_tags(served, engine)
                served_info[fmt] = {
                    "path": str(served.path),
                    "served_format": served.served_format,
                    "dense": served.dense,
                    "dtype": tags["rollout.served_dtype"],
                }
                timed_rows(engine, adapters[0], "adapter", start_s, engine_lora=True)
                s = measure_adapter_sync(engine, adapters[1:])
                if not served.dense:  # packed: no merge; the plain rows are the base without an adapter
                    timed_rows(engine, None, "merge", start_s, engine_lora=True)
                    s.update(merge_unsupported())
                if used != "merge":
                    served_info[fmt]["engine_peak_memory_bytes"] = engine.peak_memory_bytes()
            # 2. under merge: no LoRA slots (what the trainer opens), the adapter merged into the linears
            if served.dense:
                t0 = time.perf_counter()
                with open_engine(served, cfg.model, rollout=rcfg, lora_rank=None, **engine_kw) as engine:
                    start_s = time.perf_counter() - t0
                    timed_rows(engine, None, "merge", start_s, engine_lora=False)
                    s.update(measure_merge_sync(engine, adapters[1:]))
                    if used == "merge":
                        served_info[fmt]["engine_peak_memory_bytes"] = engine.peak_memory_bytes()
        reward[fmt] = measure_reward(cfg, kept[used or "adapter"][train_batch])
        with_lora = {r["batch_size"]: r for r in rows if r["format"] == fmt and r["lora"]}
        merged = {r["batch_size"]: r for r in rows if r["format"] == fmt and not r["lora"]}
        rec = recommend_sync(
            s,
            with_lora[train_batch]["tokens_per_s"],
            merged[train_batch]["tokens_per_s"],
            train_batch * bcfg.completion_len,
        )
        sync[fmt] = {
            **{k: v for k, v in s.items() if not isinstance(v, list)},
            "configured": rcfg.sync,
            "recommended": rec["sync"],
            "used": used,
            "adapter_step_s": rec["adapter_step_s"],
            "merge_step_s": rec["merge_step_s"],
        }
        if used_error:
            sync[fmt]["used_error"] = used_error
        log.info(
            "rollout %s: %s; adapter sync %.3f s; sync used: %s; reward %.3f s",
            fmt,
            ", ".join(f"b{r['batch_size']}={r['tokens_per_s']:.0f}" for r in with_lora.values()),
            sync[fmt].get("adapter_sync_s") or float("nan"),
            used,
            reward[fmt]["reward_s"],
        )
    return {"rows": rows, "sync": sync, "reward": reward, "train_batch": train_batch, "served": served_info}
