"""One engine shared by the nodes of one Kedro run (compare's branches): start it once, not per node.

Why: an engine start takes tens of seconds on CPU for a tiny model and minutes for a 32B one. The
compare pipeline has a train and an evaluate node per method, and two methods share the
NVFP4 base; started per node that is eight engine starts. Kedro runs every branch's
training before the evaluations (the nodes of one topological layer, in name order), so
with one engine kept alive it is six (one per base and phase), with one per base three.

Design:

* ``shared_engine(served, model_cfg, rollout=..., lora_rank=...)`` returns a live engine
  that serves the same folder in the same dtype, norm dtype and length, with LoRA on and
  a ``max_lora_rank`` at least the one asked (a LoRA-enabled engine also serves evaluation
  without adapters or with merged ones); otherwise it starts one (``serving.open_engine``),
  first closing the least recently used engine when ``capacity`` are alive.
  ``capacity`` is ``rollout.shared_engines``; None = 1 on CUDA (two engines would not share
  one GPU's memory), 3 on CPU (one per base format; each holds its KV cache,
  ``VLLM_CPU_KVCACHE_SPACE``).
* Every hand-out after the first puts the clean RMSNorm weights back, read from the served
  folder at start (training leaves AQN noise or trained norms in the engine), and reads
  them back to check, and the clean linears (``unmerge``: a training with ``rollout.sync:
  merge`` leaves its last adapter merged); LoRA adapters are loaded per request by path,
  merged deltas are undone by ``evaluator.applied_adapter`` itself. Sampling seeds are per request, so a
  shared engine draws what a fresh one would.
* ``close_shared()``: at the end of the Kedro run (``SharedEngineHook``: after the pipeline
  and on its error) and at interpreter exit (the engine's own ``atexit``); a killed run's
  engines die with it (``rollout/server.py``'s guards).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kedro.framework.hooks import hook_impl

from qerl_pipeline.platform import current_platform

# settings.py imports this module whenever the Kedro CLI starts: the engine-side imports (torch,
# safetensors, the engine client) wait inside the functions until a run uses an engine.
log = logging.getLogger(__name__)


@dataclass
class _Shared:
    key: tuple
    lora_rank: int
    engine: Any
    clean: dict = field(default_factory=dict)
    handed_out: int = 0


_live: list[_Shared] = []  # least recently used first


def capacity(rollout=None, platform: str | None = None) -> int:
    """How many engines stay alive: ``rollout.shared_engines``, or 1 on CUDA and 3 on CPU."""
    platform = platform or current_platform()
    asked = getattr(rollout, "shared_engines", None)
    if asked is not None:
        if platform == "cuda" and asked > 1:
            log.warning("rollout.shared_engines=%d on CUDA: kept at 1 (engines do not share a GPU)", asked)
            return 1
        return asked
    return 1 if platform == "cuda" else 3


def clean_norms(engine, serving: Path) -> dict:
    """The served model's RMSNorm weights as stored in the served folder ``serving`` (the clean values)."""
    from safetensors import safe_open

    from qerl_pipeline.quantization.checkpoint import safetensor_files

    names = set(engine.norm_weight_names())
    out = {}
    for f in safetensor_files(serving):
        with safe_open(str(f), "pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys() if k in names})
    if missing := sorted(names - out.keys()):
        raise KeyError(f"{serving}: norm weights served by the engine but not in the folder: {missing[:5]}")
    return out


def restore_norms(engine, clean: dict) -> None:
    """Put the clean norm weights back and check them (exact, in the engine's norm dtype)."""
    import torch

    if not clean:
        return
    engine.update_weights(clean)
    back = engine.read_weights(sorted(clean))
    bad = [n for n, t in clean.items() if not torch.equal(back[n].to(t.dtype), t)]
    if bad:
        raise RuntimeError(f"engine norm weights differ from the clean ones after restore: {bad[:5]}")


def _key(served, model_cfg, max_model_len: int | None) -> tuple:
    from qerl_pipeline.config import ModelConfig, parse
    from qerl_pipeline.rollout.serving import engine_dtype, engine_norm_dtype

    mc = model_cfg if isinstance(model_cfg, ModelConfig) else parse(ModelConfig, dict(model_cfg or {}), "model")
    return (
        str(Path(served.path).resolve()),
        engine_dtype(mc, served.platform, served),
        engine_norm_dtype(mc),
        max_model_len or mc.max_seq_len,
    )


def shared_engine(served, model_cfg, *, rollout=None, lora_rank: int = 8, max_model_len: int | None = None):
    """The run's shared engine for ``served`` (a live one with its norms restored, or a new one)."""
    from qerl_pipeline.rollout.serving import open_engine

    key = _key(served, model_cfg, max_model_len)
    for shared in list(_live):
        if getattr(shared.engine, "_closed", False):
            _live.remove(shared)
        elif shared.key == key and shared.lora_rank >= lora_rank:
            _live.remove(shared)
            _live.append(shared)
            shared.handed_out += 1
            shared.engine.unmerge()  # a training with rollout.sync merge leaves its adapter in the linears
            restore_norms(shared.engine, shared.clean)
            log.info(
                "shared engine reused for %s (hand-out %d, clean linears and norms restored)",
                served.path,
                shared.handed_out,
            )
            return shared.engine
    keep = capacity(rollout, served.platform)
    while len(_live) >= keep:
        _live.pop(0).engine.close()
    engine = open_engine(served, model_cfg, rollout=rollout, lora_rank=lora_rank, max_model_len=max_model_len)
    _live.append(_Shared(key, lora_rank, engine, clean_norms(engine, Path(served.path)), 1))
    log.info(
        "shared engine started for %s in %.1f s (%d of at most %d alive)",
        served.path,
        engine.start_seconds,
        len(_live),
        keep,
    )
    return engine


def close_shared() -> None:
    """Close every shared engine."""
    while _live:
        _live.pop().engine.close()


class SharedEngineHook:
    """Closes the run's shared engine when the Kedro run ends, also when it fails."""

    @hook_impl
    def after_pipeline_run(self) -> None:
        close_shared()

    @hook_impl
    def on_pipeline_error(self) -> None:
        close_shared()
