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
* ``merge``: ``W + scale * B @ A`` computed from the clean base weights plus
  ``load_dense_weights`` (transfer, in-place write, kernel repack on CPU, prefix-cache
  reset). Only possible on a dense served base; on a quantized one it is reported as
  unsupported with the engine's reason.

Merge also removes LoRA's decode overhead (about 3x in tokens/s on CPU), so the per-step
decision (``recommend_sync``) weighs the sync time together with the rollout time of
each path.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from qerl_pipeline.rollout.engine import EngineError, RolloutEngine, lora_deltas, merged_weights

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
) -> list[dict]:
    """One row per batch size: output tokens/s with fixed prompt and completion lengths."""
    engine.generate(synthetic_prompts(1, prompt_len, seed=0), n=1, temperature=1.0, top_p=1.0,
                    max_new_tokens=min(4, completion_len), seed=0, lora_path=lora_path, ignore_eos=True)  # warm-up
    rows = []
    for i, bs in enumerate(batch_sizes):
        prompts = synthetic_prompts(bs, prompt_len, seed=1000 + i)
        t0 = time.perf_counter()
        res = engine.generate(prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=completion_len,
                              seed=i, lora_path=lora_path, ignore_eos=True)
        wall = time.perf_counter() - t0
        rows.append({
            "batch_size": bs,
            "prompt_len": prompt_len,
            "completion_len": completion_len,
            "lora": lora_path is not None,
            "output_tokens": res.output_tokens,
            "expected_tokens": bs * completion_len,
            "seconds": res.seconds,
            "wall_seconds": wall,
            "tokens_per_s": res.tokens_per_s,
        })
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


def measure_sync(
    engine: RolloutEngine,
    adapter_dirs: list[str | Path] | None = None,
    *,
    tensors: list[dict[str, torch.Tensor]] | None = None,
) -> dict:
    """Per-step sync seconds for ``adapter`` and ``merge`` (one step per adapter folder).

    ``adapter_dirs``: PEFT folders, one per simulated step (distinct contents, as after each
    optimizer step). ``tensors``: alternatively, ready merged dense weights per step (merge
    timing only). The served weights are restored to their clean values afterwards.
    """
    if not adapter_dirs and not tensors:
        raise ValueError("measure_sync needs adapter_dirs or tensors")
    dirs = [Path(d) for d in adapter_dirs or []]
    report: dict = {"steps": len(dirs) or len(tensors or [])}
    if dirs:
        try:
            times = _adapter_sync_seconds(engine, dirs)
            report.update(adapter_supported=True, adapter_sync_s=statistics.mean(times), adapter_sync_all_s=times)
        except EngineError as err:
            report.update(adapter_supported=False, adapter_sync_s=None, adapter_error=str(err).splitlines()[0])
    names = sorted(lora_deltas(dirs[0])) if dirs else sorted(tensors[0])
    try:
        clean = engine.read_weights(names)
    except EngineError as err:
        report.update(merge_supported=False, merge_sync_s=None, merge_error=str(err).splitlines()[0])
        return report
    times = []
    try:
        for step in range(report["steps"]):
            t0 = time.perf_counter()
            dense = merged_weights(clean, dirs[step]) if dirs else tensors[step]
            engine.load_dense_weights(dense)
            times.append(time.perf_counter() - t0)
        report.update(merge_supported=True, merge_sync_s=statistics.mean(times), merge_sync_all_s=times)
    except EngineError as err:
        report.update(merge_supported=False, merge_sync_s=None, merge_error=str(err).splitlines()[0])
    finally:
        engine.update_weights(clean)
    return report


def recommend_sync(sync: dict, adapter_tokens_per_s: float, merged_tokens_per_s: float, tokens_per_step: int) -> dict:
    """Pick ``adapter`` or ``merge`` by the per-step total: sync time + rollout time of that path."""
    adapter_total = (sync.get("adapter_sync_s") or 0.0) + tokens_per_step / adapter_tokens_per_s
    if not sync.get("merge_supported"):
        return {"sync": "adapter", "adapter_step_s": adapter_total, "merge_step_s": None}
    merge_total = sync["merge_sync_s"] + tokens_per_step / merged_tokens_per_s
    choice = "merge" if merge_total < adapter_total else "adapter"
    return {"sync": choice, "adapter_step_s": adapter_total, "merge_step_s": merge_total}
