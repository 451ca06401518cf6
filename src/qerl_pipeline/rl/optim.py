"""The optimiser and its learning-rate schedule (``optim.*``).

AdamW as in the paper's scripts (``optim.lr`` per method: 1e-5 for QeRL and QLoRA, 5e-6 for
LoRA), optionally bitsandbytes' 8-bit AdamW on CUDA; linear warmup, then cosine to 0 or
constant, per optimizer step (``grpo.updates_per_rollout`` steps per rollout batch).
"""

from __future__ import annotations

import logging
import math

import torch

from qerl_pipeline.config import QerlConfig

log = logging.getLogger(__name__)


def build_optimizer(params: list[torch.nn.Parameter], cfg: QerlConfig) -> tuple[torch.optim.Optimizer, str]:
    """AdamW (8-bit through bitsandbytes when asked and it runs on CUDA), and a note saying which."""
    o = cfg.optim
    kwargs = dict(lr=o.lr[cfg.method], betas=tuple(o.betas), weight_decay=o.weight_decay)
    if o.name == "adamw_8bit":
        on_cuda = any(p.is_cuda for p in params)
        try:
            import bitsandbytes as bnb

            if on_cuda:
                return bnb.optim.AdamW8bit(params, **kwargs), "bitsandbytes AdamW8bit"
            note = "adamw_8bit asked, but the parameters are on CPU: plain torch AdamW"
        except ImportError:
            note = "adamw_8bit asked, but bitsandbytes is not installed: plain torch AdamW"
        log.warning(note)
        return torch.optim.AdamW(params, **kwargs), note
    return torch.optim.AdamW(params, **kwargs), "torch AdamW"


def lr_factor(step: int, *, warmup: int, total: int, schedule: str) -> float:
    """Linear warmup over ``warmup`` optimizer steps, then cosine to 0 (or constant)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))
