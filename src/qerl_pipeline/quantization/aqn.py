"""Adaptive Quantization Noise (AQN): the sigma schedule and the norm-weight noise.

QeRL (arXiv 2510.11696, Sec. 3.3) adds Gaussian noise to the weights of the RMSNorm layers
that feed the quantized linears, so the policy explores more early in training; the noise
decays in K stages.

Schedule (``sigma_at``). The total steps are split into K equal stages; step ``s``
(0-based) is in stage ``k = floor(s * K / total_steps)``. Stage 0 has sigma 0 (only the
quantization noise itself); stages 1..K-1 follow the decay from ``sigma_start`` to
``sigma_end``. With ``t = (k - 1) / (K - 2)`` (t = 0 when K = 2, the single noisy stage then
sits at ``sigma_start``):

- exponential (the paper): ``sigma_start * (sigma_end / sigma_start) ** t``
- linear: ``sigma_start + (sigma_end - sigma_start) * t``
- cosine: ``sigma_end + (sigma_start - sigma_end) * (1 + cos(pi t)) / 2``
- logarithmic: ``sigma_start - (sigma_start - sigma_end) * ln(1 + 9 t) / ln(10)``
  (falls fast first, then flattens; the paper's ablation names the shape but not its
  formula, so this one is ours).

Noise (``draw_noise``). For each rollout, ``Z ~ N(0, sigma^2)`` is drawn afresh for every
noisy norm layer from a generator seeded by ``(aqn.seed, step, round)``, so a resumed run
redraws exactly the same noise. The noisy weights are always ``clean + Z`` computed from the
clean weights: noise is never accumulated (the released paper code adds noise on top of
the previous noisy weights, and its noise never reaches vLLM's norm layers; we do neither).
With sigma 0 the noisy weights are the clean weights bit for bit.

Where noise goes. ``noisy_target_names`` keeps the norms directly before quantized linears
(``input_layernorm`` before q/k/v, ``post_attention_layernorm`` before gate/up), the layers
the paper merges the noise into; the final norm feeds the unquantized lm_head and is left
clean. The engine gets ``clean + Z`` through ``engine.update_weights``; the trainer's policy
gets the same tensors through ``noisy_norms`` (below) while it computes the log-probs of
the batch those weights generated.

``noisy_norms`` is a context manager that writes ``clean + Z`` into the norm parameters'
storage and restores the clean values bit-exactly on exit. Autograd then differentiates at
the noisy point and accumulates the gradient into the (clean) parameter, which is exactly
``d loss / d w`` of ``f(w + Z)``: trainable norms keep learning their clean values. The
backward pass must run inside the context (saved tensors alias the parameter storage).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch

from qerl_pipeline.adapter import hf_name
from qerl_pipeline.config import AQNConfig

#: Suffixes of the HF parameter names that receive noise (norms feeding quantized linears).
NOISY_NORM_SUFFIXES: tuple[str, ...] = ("input_layernorm.weight", "post_attention_layernorm.weight")


def stage_of(step: int, total_steps: int, num_stages: int) -> int:
    """The stage (0..K-1) of 0-based ``step`` when ``total_steps`` are split into K equal stages."""
    if total_steps <= 0:
        raise ValueError(f"total_steps must be > 0, got {total_steps}")
    if not 0 <= step < total_steps:
        raise ValueError(f"step {step} outside 0..{total_steps - 1}")
    return min(num_stages - 1, (step * num_stages) // total_steps)


def stage_sigma(stage: int, cfg: AQNConfig) -> float:
    """Sigma of a stage: 0 for stage 0, else the configured decay between start and end."""
    k_total = cfg.num_stages
    if not 0 <= stage < k_total:
        raise ValueError(f"stage {stage} outside 0..{k_total - 1}")
    if stage == 0:
        return 0.0
    t = 0.0 if k_total == 2 else (stage - 1) / (k_total - 2)
    start, end = cfg.sigma_start, cfg.sigma_end
    if cfg.decay == "exponential":
        if start == 0.0:
            return 0.0
        return start * (end / start) ** t
    if cfg.decay == "linear":
        return start + (end - start) * t
    if cfg.decay == "cosine":
        return end + (start - end) * (1.0 + math.cos(math.pi * t)) / 2.0
    if cfg.decay == "logarithmic":
        return start - (start - end) * math.log1p(9.0 * t) / math.log(10.0)
    raise ValueError(f"aqn.decay: unknown shape {cfg.decay!r}")


def sigma_at(step: int, total_steps: int, cfg: AQNConfig) -> tuple[int, float]:
    """``(stage, sigma)`` for 0-based ``step`` of a run of ``total_steps`` steps."""
    stage = stage_of(step, total_steps, cfg.num_stages)
    return stage, stage_sigma(stage, cfg)


def noisy_target_names(names: Iterable[str]) -> list[str]:
    """The norm weights that get noise, sorted (the draw order is part of the seed contract)."""
    return sorted(n for n in names if n.endswith(NOISY_NORM_SUFFIXES))


def noise_generator(seed: int, step: int, round_: int = 0) -> torch.Generator:
    """A CPU generator whose state depends only on ``(seed, step, round_)``."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed((int(seed) * 1_000_003 + int(step) * 1_009 + int(round_)) % (2**63 - 1))
    return gen


def draw_noise(
    clean: Mapping[str, torch.Tensor], sigma: float, *, seed: int, step: int, round_: int = 0
) -> dict[str, torch.Tensor]:
    """``Z ~ N(0, sigma^2)`` per tensor of ``clean`` (same shapes, float32, CPU), drawn in name order.

    Drawn from a fresh generator for ``(seed, step, round_)``: never a function of earlier
    draws, so the noise of step s is the same in a resumed run. sigma 0 gives exact zeros.
    """
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    gen = noise_generator(seed, step, round_)
    out = {}
    for name in sorted(clean):
        shape = clean[name].shape
        if sigma == 0.0:
            out[name] = torch.zeros(shape, dtype=torch.float32)
        else:
            out[name] = torch.randn(shape, generator=gen, dtype=torch.float32) * sigma
    return out


def apply_noise(
    clean: Mapping[str, torch.Tensor], noise: Mapping[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """``clean + Z`` in the clean tensors' dtype (what both the engine and the trainer use).

    Missing noise entries (or ``noise=None``) leave the tensor clean; adding exact zeros gives
    back the clean values bit for bit.
    """
    out = {}
    for name, w in clean.items():
        z = None if noise is None else noise.get(name)
        if z is None:
            out[name] = w.detach().clone()
        else:
            out[name] = (w.detach().float().cpu() + z.float().cpu()).to(w.dtype)
    return out


def norm_parameters(model: torch.nn.Module, names: Iterable[str]) -> dict[str, torch.nn.Parameter]:
    """Map HF parameter names (``model.layers.0.input_layernorm.weight``) to ``model``'s parameters.

    ``model`` may be a PEFT model: its names carry a ``base_model.model.`` prefix (and norms
    made trainable by PEFT may carry ``.original_module``/``modules_to_save`` wrappers); a
    parameter matches when its name, stripped of those, ends with the HF name.
    """
    wanted = list(names)
    found: dict[str, torch.nn.Parameter] = {}
    for pname, param in model.named_parameters(remove_duplicate=False):
        plain = hf_name(pname, unwrap=True)
        if plain in wanted and plain not in found:
            found[plain] = param
    missing = [n for n in wanted if n not in found]
    if missing:
        raise KeyError(f"norm weights not found in the policy: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return found


@contextmanager
def noisy_norms(params: Mapping[str, torch.nn.Parameter], noisy: Mapping[str, torch.Tensor] | None) -> Iterator[None]:
    """Within the block, each named parameter holds ``noisy[name]``; the clean values return on exit.

    ``params``: from ``norm_parameters``. ``noisy``: ``apply_noise(clean, Z)`` (``None`` or an
    empty mapping = no change). Gradients computed inside accumulate into the parameters, i.e.
    they are gradients at the noisy point applied to the clean weights (run backward inside,
    step the optimizer outside). Restoring copies the saved clean values back, bit-exact.
    """
    if not noisy:
        yield
        return
    saved: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad():
            for name, tensor in noisy.items():
                p = params[name]
                saved[name] = p.detach().clone()
                p.copy_(tensor.to(device=p.device, dtype=p.dtype))
        yield
    finally:
        with torch.no_grad():
            for name, clean in saved.items():
                params[name].copy_(clean)
