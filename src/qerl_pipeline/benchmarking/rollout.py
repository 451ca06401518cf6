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
  reset). Only possible on a dense served base (``ServedModel.dense``): on a quantized one
  (packed NVFP4 or bitsandbytes NF4 on CUDA) no merge is attempted and it is reported as
  unsupported, with the reason; an engine error during a merge is reported the same way.

Merge also removes LoRA's decode overhead (about 3x in tokens/s on CPU), so the per-step
decision (``recommend_sync``) weighs the sync time together with the rollout time of
each path.

``rollout_benchmark(bases, cfg, bcfg)`` runs all of it per compared base format: one engine
per format, started by ``rollout.serving.open_engine`` (the one place engines are built)
for what ``served_model`` decides, so it runs at ``engine_dtype(model)`` with the trainer's
norm dtype (``model.norm_dtype``) and ``rollout.seed``; LoRA adapters of the configured shape with distinct weights
stand in for successive training steps (:func:`lora_adapters`). Every row carries
``format``, ``engine_start_s``, ``is_train_batch``, ``served_format`` and ``served_dtype``.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from qerl_pipeline.config import BenchmarkConfig, LoraConfig, QerlConfig
from qerl_pipeline.rollout.engine import EngineError, RolloutEngine, lora_deltas, merged_weights

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
    dense: bool = True,
) -> dict:
    """Per-step sync seconds for ``adapter`` and ``merge`` (one step per adapter folder).

    ``adapter_dirs``: PEFT folders, one per simulated step (distinct contents, as after each
    optimizer step). ``tensors``: alternatively, ready merged dense weights per step (merge
    timing only). ``dense``: whether the engine serves dense linears (``ServedModel.dense``);
    when not, merge is reported unsupported without being tried. The served weights are
    restored to their clean values afterwards.
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
    if not dense:
        report.update(merge_supported=False, merge_sync_s=None, merge_error=(
            "the served base is quantized: a merge writes dense weights, which only a dense served base takes "
            "(rollout.sync: adapter)"))
        return report
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


# ------------------------------------------------------------------------- the whole measurement
def lora_adapters(base_dir: Path, fmt: str, lcfg: LoraConfig, out_dir: Path, count: int) -> list[Path]:
    """``count`` LoRA adapters of the configured shape with distinct weights (one per simulated step)."""
    from qerl_pipeline.quantization.policy import build_policy

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
    """Rollout tokens/s per compared format and batch size, with and without LoRA; sync time per step.

    ``cfg`` supplies ``model`` (engine dtype, norm dtype), ``lora`` (adapter shape, vLLM
    rank), ``rollout`` (engine settings, ``sync``) and ``grpo`` (group size). The result:
    ``rows`` (one per format, batch size and LoRA on/off), ``sync`` (per format: the
    measured sync, configured and recommended mode), ``train_batch`` and ``served`` (per
    format: path, served_format, dense, the engine's dtype).
    """
    from qerl_pipeline.benchmarking.bases import method_formats
    from qerl_pipeline.rollout.serving import open_engine, served_model, served_tags

    lcfg, rcfg = cfg.lora, cfg.rollout
    train_batch = train_batch_size(cfg, bcfg)
    sizes = sorted(set(bcfg.batch_sizes) | {train_batch})
    rows, sync, served_info = [], {}, {}
    for fmt in method_formats(bcfg):
        base = Path(bases[fmt])
        served = served_model(base)
        with tempfile.TemporaryDirectory(prefix="qerl-bench-lora-") as tmp:
            adapters = lora_adapters(base, fmt, lcfg, Path(tmp), bcfg.sync_steps + 1)
            t0 = time.perf_counter()
            with open_engine(served, cfg.model, rollout=rcfg, lora_rank=lcfg.rank,
                             max_model_len=bcfg.prompt_len + bcfg.completion_len + 16) as engine:
                start_s = time.perf_counter() - t0
                tags = served_tags(served, engine)
                served_info[fmt] = {"path": str(served.path), "served_format": served.served_format,
                                    "dense": served.dense, "dtype": tags["rollout.served_dtype"]}
                for lora_path in (adapters[0], None):
                    for row in measure_rollout(engine, sizes, bcfg.prompt_len, bcfg.completion_len, lora_path=lora_path):
                        rows.append({**row, "format": fmt, "engine_start_s": start_s,
                                     "is_train_batch": int(row["batch_size"]) == train_batch,
                                     "served_format": served.served_format, "served_dtype": tags["rollout.served_dtype"]})
                s = measure_sync(engine, adapters[1:], dense=served.dense)
        with_lora = {r["batch_size"]: r for r in rows if r["format"] == fmt and r["lora"]}
        merged = {r["batch_size"]: r for r in rows if r["format"] == fmt and not r["lora"]}
        rec = recommend_sync(s, with_lora[train_batch]["tokens_per_s"], merged[train_batch]["tokens_per_s"],
                             train_batch * bcfg.completion_len)
        sync[fmt] = {**{k: v for k, v in s.items() if not isinstance(v, list)},
                     "configured": rcfg.sync, "recommended": rec["sync"],
                     "adapter_step_s": rec["adapter_step_s"], "merge_step_s": rec["merge_step_s"]}
        log.info("rollout %s: %s; adapter sync %.3f s", fmt, ", ".join(
            f"b{r['batch_size']}={r['tokens_per_s']:.0f}" for r in with_lora.values()),
            sync[fmt].get("adapter_sync_s") or float("nan"))
    return {"rows": rows, "sync": sync, "train_batch": train_batch, "served": served_info}
