"""vLLM general plugin: RMSNorm weights held in float32 while the model computes in bf16.

Why. AQN (quantization/aqn.py) sets each noisy norm weight to ``clean + Z`` with ``Z ~ N(0, sigma^2)``.
Stored in bf16, whose spacing is 2^-8..2^-7 for weights near 1, most of the paper's noise
rounds away: at sigma 2e-3 nearly every entry stays at its clean value, and the later
stages (down to 5e-4) are no noise at all. The same rounding undoes small updates of
trained norms (``lora.train_norms``). Keeping the norm weights in fp32 keeps ``clean + Z``
exactly as drawn; only the norm's output is rounded to the compute dtype, once, as with
clean weights.

How, without patching vLLM. vLLM 0.32 computes RMSNorm through its IR ops
(``vllm.ir.ops.rms_norm`` / ``fused_add_rms_norm``), whose native implementation takes a
weight of another dtype (``x.to(weight.dtype) * weight``, then back to the input dtype);
the fused C kernels declare (``supports_args``) that they need matching dtypes, so the
dispatcher falls back to the native implementation for an fp32 weight. What is left is to
create the norm weights in fp32: vLLM's supported out-of-tree mechanism
``CustomOp.register_oot(name="RMSNorm")`` makes every ``RMSNorm(...)`` the model builds an
instance of the subclass below, whose weight is created in float32 (the checkpoint loader
then copies the bf16 values into it exactly). It acts at model construction, so CUDA
graphs and torch.compile capture the fp32 weights too.

When. vLLM loads ``vllm.general_plugins`` entry points (pyproject.toml) in every process
it starts (front end, engine core, workers); ``register`` does nothing unless the engine
process was started with ``QERL_NORM_WEIGHT_DTYPE=float32`` (``RolloutEngine(norm_dtype=
"float32")``), so no other vLLM use in the environment is affected.

Reliance on vLLM internals, each guarded by tests/test_norm_precision.py: the OOT registry
keyed by the class name ``RMSNorm``; ``RMSNorm.__init__``'s ``dtype`` argument; the IR
ops' native mixed-dtype path. This module imports only vLLM and torch (it runs inside
vLLM's processes, see rollout/server.py).
"""

from __future__ import annotations

import os

ENV = "QERL_NORM_WEIGHT_DTYPE"


def register() -> None:
    """Entry point (``vllm.general_plugins``): install the fp32-weight RMSNorm when asked."""
    if os.environ.get(ENV, "") != "float32":
        return
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot
    from vllm.model_executor.layers.layernorm import RMSNorm

    if "RMSNorm" in op_registry_oot:  # vLLM may load plugins more than once per process
        return

    class Fp32WeightRMSNorm(RMSNorm):
        """vLLM's RMSNorm with its weight in float32 (outputs stay in the input's dtype)."""

        def __init__(self, hidden_size, eps=1e-6, var_hidden_size=None, has_weight=True, dtype=None):
            import torch

            super().__init__(hidden_size, eps, var_hidden_size, has_weight, torch.float32 if has_weight else dtype)

    CustomOp.register_oot(name="RMSNorm")(Fp32WeightRMSNorm)
    # register_oot renames the class to its registry key; keep vLLM's op name so that
    # `custom_ops` settings (+rms_norm / -rms_norm) still apply to it
    Fp32WeightRMSNorm.name = RMSNorm.name
