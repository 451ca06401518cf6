"""Norm-weight precision: AQN noise and trained norms that survive a bf16 model.

The problem. AQN (quantization/aqn.py) serves ``clean + Z`` as the RMSNorm weights, ``Z ~ N(0,
sigma^2)``. In bf16 (the compute dtype on CUDA, and ``model.dtype: bfloat16`` anywhere) a
norm weight near 1 has a spacing of 2^-8 (below 1) to 2^-7 (above 1), so ``clean + Z``
cast back to bf16 loses most of Z: about a third of the entries keep their clean value at
sigma 1e-2, nearly all at 2e-3, and the paper's later stages (down to 5e-4) serve no
noise at all. The same rounding swallows trained-norm updates of lr-sized steps.

The fix (``model.norm_dtype: float32``, the default). Norm weights are held in float32 in
both places where the policy runs, whatever ``model.dtype`` is:

* vLLM: ``rollout/vllm_plugin.py`` makes the engine build its RMSNorm weights in fp32
  (vLLM's out-of-tree op mechanism; its RMSNorm IR op computes ``x.to(w.dtype) * w`` and
  returns the input's dtype, falling back from the fused kernels, which need equal dtypes).
* the trainer: ``keep_norm_weights_fp32`` swaps every Hugging Face ``*RMSNorm`` of the
  policy for ``Fp32WeightRMSNorm``, which computes what vLLM's op computes: normalise in
  fp32, multiply by the fp32 weight, round once to the input's dtype. With an fp32 model
  the swap is skipped: the stock module computes exactly that already.

So ``clean + Z`` is served and trained on as drawn; activations stay in the compute dtype,
and the only rounding is the norm output's, which happens with clean weights too.
Cost: the norm runs vLLM's native torch implementation instead of its fused CUDA kernel
(a memory-bound op, small next to the matmuls), and 4 bytes per norm weight instead of 2.

Measured, not assumed: the trainer reads the engine's noisy norms back after every push
and logs ``aqn/sigma_effective`` (``sigma_effective``: std of served minus clean over the
noisy norms) next to ``aqn/sigma``; and the trainer's forward uses the values read back.

``model.norm_dtype: model`` keeps the stock behaviour (norm weights in the compute dtype).
``check_noise_precision`` refuses such a configuration when the served noise of some AQN
stage would be off by more than ``SIGMA_TOLERANCE``, naming the stage, sigma and dtype: it
simulates the rounding of ``1 + Z`` (norm weights are initialised to 1 and stay near it)
in the compute dtype.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from qerl_pipeline.config import ConfigError
from qerl_pipeline.quantization.aqn import stage_sigma

#: |sigma_effective / sigma - 1| allowed at every noisy stage.
SIGMA_TOLERANCE = 0.10
#: Entries of the rounding simulation (a fixed draw: the check is deterministic).
_SIM_ENTRIES = 1 << 16


class Fp32WeightRMSNorm(nn.Module):
    """RMSNorm with a float32 weight whose output keeps the input's dtype (as vLLM's native op)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().to(torch.float32).clone(), requires_grad=weight.requires_grad)
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        orig = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * self.weight).to(orig)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, weight fp32"


def _is_hf_rmsnorm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)


def keep_norm_weights_fp32(model: nn.Module, compute_dtype: torch.dtype) -> int:
    """Swap each ``*RMSNorm`` of ``model`` for ``Fp32WeightRMSNorm`` (same name ``weight``); returns the count.

    Nothing to do when ``compute_dtype`` is float32. Call before the optimizer is built (the
    parameters are new objects).
    """
    if compute_dtype == torch.float32:
        return 0
    swaps = []
    for name, module in model.named_modules():
        if _is_hf_rmsnorm(module) and not isinstance(module, Fp32WeightRMSNorm):
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
            swaps.append((name, Fp32WeightRMSNorm(module.weight, float(eps)).to(module.weight.device)))
    for name, new in swaps:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return len(swaps)


def sigma_effective(served: Mapping[str, torch.Tensor], clean: Mapping[str, torch.Tensor], names) -> float:
    """Std of ``served - clean`` over the entries of ``names`` (population std, float64)."""
    diffs = [(served[n].double().cpu() - clean[n].double().cpu()).flatten() for n in names]
    if not diffs:
        return 0.0
    d = torch.cat(diffs)
    return float(d.std(unbiased=False))


def rounded_sigma_ratio(sigma: float, dtype: torch.dtype) -> float:
    """``sigma_effective / sigma`` when ``1 + Z`` is stored in ``dtype`` (fixed simulated draw)."""
    if sigma <= 0:
        return 1.0
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(_SIM_ENTRIES, generator=gen, dtype=torch.float64) * sigma
    served = (1.0 + z).to(dtype).double()
    return float((served - 1.0).std(unbiased=False)) / float(z.std(unbiased=False))


def check_noise_precision(cfg, compute_dtype: torch.dtype) -> None:
    """Refuse an AQN schedule whose noise the norms' storage dtype cannot carry (ConfigError).

    Only ``model.norm_dtype: model`` with a non-fp32 compute dtype can fail: fp32 norm
    weights carry ``clean + Z`` exactly.
    """

    if not cfg.aqn_enabled() or cfg.model.norm_dtype == "float32" or compute_dtype == torch.float32:
        return
    bad = []
    for stage in range(1, cfg.aqn.num_stages):
        sigma = stage_sigma(stage, cfg.aqn)
        ratio = rounded_sigma_ratio(sigma, compute_dtype)
        if abs(ratio - 1.0) > SIGMA_TOLERANCE:
            bad.append(f"stage {stage}: sigma {sigma:.3g} would be served as {ratio * sigma:.3g} ({ratio:.2f}x)")
    if bad:
        dtype = str(compute_dtype).removeprefix("torch.")
        raise ConfigError(
            f"invalid parameters:\n  model.norm_dtype: 'model' stores the RMSNorm weights in {dtype}, which rounds "
            f"away the AQN noise (more than {SIGMA_TOLERANCE:.0%} off) at "
            + "; ".join(bad)
            + ". Set model.norm_dtype: float32 (norm weights in fp32 in the trainer and vLLM), model.dtype: float32, "
            "or a larger aqn.sigma_end"
        )
