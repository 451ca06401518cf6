"""What this machine can do at best: measured bandwidth and matmul rate, and the limits they set.

A speed figure means little on its own; a fraction of what the hardware allows says how
much is left on the table. This module measures two numbers and turns them into limits:

* **Memory bandwidth** (GB/s): the best of several copies of a large tensor
  (``dst.copy_(src)``), counting the bytes read *and* written (2 x size), the way STREAM's
  "copy" counts them. The tensor is far larger than any cache, so the figure is DRAM (or
  HBM) bandwidth as the framework can reach it.
* **Matmul rate** (FLOP/s): the best of several square matrix products, 2 n^3 FLOPs each,
  in fp32 on CPU (bf16 is about 17x slower than fp32 on the CPUs this project meets) and in
  bf16 on CUDA, the dtypes the training step computes in.

Limits (upper bounds, never predictions):

* **Rollout**: a decode step reads every served weight once and yields one token per
  sequence in the batch, so ``tokens/s <= batch * bandwidth / weight_bytes``. It is also
  bounded by compute: ``tokens/s <= matmul_rate / flops_per_token``; the limit is the
  smaller. ``weight_bytes`` is counted from the checkpoint actually served
  (:func:`served_weight_bytes`): on a GPU the packed NVFP4 codes and scales, on a CPU the
  dense weights decoded from them, because vLLM has no FP4 kernel there. KV-cache and
  activation traffic are left out, which keeps the figure an upper bound.
* **Training**: the FLOPs of one optimizer step (:func:`training_step_flops`) over the
  matmul rate give the least time a step can take; its tokens/s is the matching limit.
  Dequantization and optimiser arithmetic are not matmuls and are not counted, again
  keeping the limit an upper bound.

``fraction_of_limit(measured, limit)`` is the figure the report shows: 1.0 would be
hardware speed.
"""

from __future__ import annotations

import json
import math
import os
import platform
import struct
import time
from pathlib import Path
from typing import Any

import torch

#: Bytes per element of each safetensors dtype string.
_DTYPE_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_memory_bandwidth(nbytes: int | None = None, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """Best copy bandwidth in GB/s (1e9 bytes/s), bytes read plus bytes written.

    ``nbytes`` is the size of one buffer; default 256 MiB on CPU, 2 GiB on CUDA (both far
    beyond the last-level cache). One untimed copy warms the pages first.
    """
    device = torch.device(device)
    if nbytes is None:
        nbytes = (2 << 30) if device.type == "cuda" else (256 << 20)
    n = max(1, nbytes // 4)
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    best = math.inf
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    moved = 2 * n * 4
    del src, dst
    return moved / max(best, 1e-9) / 1e9


def measure_matmul_rate(
    n: int | None = None,
    dtype: torch.dtype | None = None,
    repeats: int = 5,
    device: str | torch.device = "cpu",
) -> float:
    """Best square-matmul rate in FLOP/s (2 n^3 per product).

    Defaults: fp32 with n=1024 on CPU, bf16 with n=8192 on CUDA (the dtypes our training
    step runs in). Two untimed products warm up (thread pools, cuBLAS heuristics).
    """
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if n is None:
        n = 8192 if device.type == "cuda" else 1024
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(2):
        torch.matmul(a, b, out=out)
    _sync(device)
    best = math.inf
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        torch.matmul(a, b, out=out)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / max(best, 1e-12)


def hardware_info(device: str | torch.device = "cpu") -> dict[str, Any]:
    """Where the figures were measured: device name, cores, torch threads, versions."""
    device = torch.device(device)
    info: dict[str, Any] = {
        "device": device.type,
        "cpu": platform.processor() or platform.machine(),
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def measure_hardware(device: str | torch.device = "cpu", repeats: int = 5) -> dict[str, Any]:
    """Both measurements plus :func:`hardware_info`, as one record."""
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return {
        **hardware_info(device),
        "bandwidth_gbs": measure_memory_bandwidth(repeats=repeats, device=device),
        "matmul_flops": measure_matmul_rate(repeats=repeats, device=device, dtype=dtype),
        "matmul_dtype": str(dtype).removeprefix("torch."),
    }


# ----------------------------------------------------------------------------- model arithmetic
def _read_safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    header.pop("__metadata__", None)
    return header


def served_weight_bytes(folder: str | Path) -> dict[str, int]:
    """Bytes of weights one decode step reads from a Hugging Face model folder.

    Every tensor of every ``*.safetensors`` file counts (packed codes, scales, norms),
    except the input embedding table when a separate ``lm_head`` exists: a decode step
    gathers only one embedding row per sequence. With tied embeddings the table is read
    in full as the output projection, so it counts once. Returns
    ``{"total": ..., "linear": ..., "embedding": ..., "other": ...}`` (bytes).
    """
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files (not a model folder?)")
    sizes: dict[str, int] = {}
    for f in files:
        for name, meta in _read_safetensors_header(f).items():
            start, end = meta["data_offsets"]
            sizes[name] = int(end - start)
    has_lm_head = any(name.endswith("lm_head.weight") for name in sizes)
    out = {"total": 0, "linear": 0, "embedding": 0, "other": 0}
    for name, size in sizes.items():
        if "embed_tokens" in name:
            if has_lm_head:
                continue
            out["embedding"] += size
        elif "lm_head" in name or "_proj" in name:
            out["linear"] += size
        else:
            out["other"] += size
        out["total"] += size
    return out


def model_shape(config: dict[str, Any]) -> dict[str, int]:
    """The few numbers of a decoder config the FLOP counts need."""
    h = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    return {
        "hidden": h,
        "layers": int(config["num_hidden_layers"]),
        "heads": heads,
        "kv_heads": int(config.get("num_key_value_heads") or heads),
        "head_dim": int(config.get("head_dim") or h // heads),
        "intermediate": int(config["intermediate_size"]),
        "vocab": int(config["vocab_size"]),
    }


def matmul_params(config: dict[str, Any], include_lm_head: bool = True) -> int:
    """Weights that take part in matmuls: q/k/v/o, gate/up/down per layer, and lm_head."""
    s = model_shape(config)
    q = s["hidden"] * s["heads"] * s["head_dim"]
    kv = 2 * s["hidden"] * s["kv_heads"] * s["head_dim"]
    o = s["heads"] * s["head_dim"] * s["hidden"]
    mlp = 3 * s["hidden"] * s["intermediate"]
    total = s["layers"] * (q + kv + o + mlp)
    return total + (s["hidden"] * s["vocab"] if include_lm_head else 0)


def lora_params(config: dict[str, Any], rank: int, target_modules: list[str]) -> int:
    """LoRA weights (A and B) on the targeted projections: r * (in + out) each."""
    s = model_shape(config)
    h, q_out, kv_out, inter = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["intermediate"]
    dims = {
        "q_proj": (h, q_out),
        "k_proj": (h, kv_out),
        "v_proj": (h, kv_out),
        "o_proj": (q_out, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    unknown = [m for m in target_modules if m not in dims]
    if unknown:
        raise ValueError(f"lora target_modules: unknown module(s) {unknown}; known: {sorted(dims)}")
    return s["layers"] * sum(rank * (dims[m][0] + dims[m][1]) for m in target_modules)


def decode_flops_per_token(config: dict[str, Any], context_len: int = 0) -> float:
    """Forward FLOPs to decode one token: 2 per matmul weight, plus attention over the context."""
    s = model_shape(config)
    attention = 4 * s["layers"] * s["heads"] * s["head_dim"] * context_len
    return 2.0 * matmul_params(config) + attention


def training_step_flops(
    config: dict[str, Any],
    num_sequences: int,
    seq_len: int,
    lora_rank: int,
    target_modules: list[str],
    *,
    logit_positions: int | None = None,
    gradient_checkpointing: bool = False,
    forwards_without_grad: float = 0,
    shared_prompts: tuple[int, int] | None = None,
) -> float:
    """Matmul FLOPs of one optimizer step of LoRA over a frozen base.

    Per token: forward ``2N`` (N = matmul weights of the decoder layers); backward ``2N``
    for activation gradients only (the base is frozen: no weight gradients for it); LoRA
    ``2L`` forward and ``4L`` backward (L = LoRA weights). The output projection (h x vocab)
    runs on ``logit_positions`` positions per sequence (default all; our trainer and TRL
    apply it to the completion positions only), ``2`` FLOPs per weight forward and ``2``
    backward. Causal attention per sequence and layer: ``2 * heads * head_dim * S^2``
    forward (QK^T and AV over half the square), twice that backward. Gradient
    checkpointing recomputes one forward; ``forwards_without_grad`` adds forwards that need
    no backward (e.g. old-policy or reference log-probs computed in a separate pass).

    ``shared_prompts = (groups, prompt_len)``: the sequences are ``groups`` prompts of
    ``prompt_len`` tokens with their completions, scored with each prompt run once
    (``rl/prefix.py``): the decoder runs ``groups x (prompt_len - 1)`` prefix tokens and
    ``num_sequences x T`` suffix tokens (``T = seq_len - prompt_len``); attention covers each
    prefix's causal square once and each suffix's queries over its prefix and itself.
    """
    s = model_shape(config)
    body = matmul_params(config, include_lm_head=False)
    head = s["hidden"] * s["vocab"]
    lora = lora_params(config, lora_rank, target_modules)
    tokens = num_sequences * seq_len
    logit_tokens = num_sequences * (seq_len if logit_positions is None else logit_positions)
    pairs = num_sequences * seq_len**2 / 2.0  # (query, key) pairs of causal attention, summed over sequences
    if shared_prompts is not None:
        groups, prompt_len = shared_prompts
        prefix, suffix = prompt_len - 1, seq_len - prompt_len
        tokens = groups * prefix + num_sequences * suffix
        pairs = groups * prefix**2 / 2.0 + num_sequences * (suffix * prefix + suffix**2 / 2.0)
    attn_fwd = s["layers"] * 4.0 * s["heads"] * s["head_dim"] * pairs
    fwd = 2.0 * (body + lora) * tokens + 2.0 * head * logit_tokens + attn_fwd
    bwd = 2.0 * body * tokens + 4.0 * lora * tokens + 2.0 * head * logit_tokens + 2.0 * attn_fwd
    extra = (1 if gradient_checkpointing else 0) + forwards_without_grad
    return fwd + bwd + extra * fwd


# ------------------------------------------------------------------------------------ limits
def rollout_limit_tokens_per_s(
    bandwidth_gbs: float,
    weight_bytes: float,
    batch_size: int,
    matmul_flops: float | None = None,
    flops_per_token: float | None = None,
) -> float:
    """Upper bound on decode tokens/s: ``min(batch * BW / bytes, rate / flops_per_token)``."""
    if bandwidth_gbs <= 0 or weight_bytes <= 0 or batch_size <= 0:
        raise ValueError(
            f"rollout limit needs positive bandwidth_gbs, weight_bytes, batch_size; got "
            f"{bandwidth_gbs}, {weight_bytes}, {batch_size}"
        )
    limit = batch_size * bandwidth_gbs * 1e9 / weight_bytes
    if matmul_flops and flops_per_token:
        limit = min(limit, matmul_flops / flops_per_token)
    return limit


def training_limit(step_flops: float, matmul_flops: float, tokens_per_step: int) -> dict[str, float]:
    """Least step time (s) and most tokens/s the matmul rate allows for a step of ``step_flops``."""
    if step_flops <= 0 or matmul_flops <= 0 or tokens_per_step <= 0:
        raise ValueError(
            f"training limit needs positive step_flops, matmul_flops, tokens_per_step; got "
            f"{step_flops}, {matmul_flops}, {tokens_per_step}"
        )
    min_time = step_flops / matmul_flops
    return {"min_step_time_s": min_time, "max_tokens_per_s": tokens_per_step / min_time}


def fraction_of_limit(measured: float, limit: float) -> float:
    """``measured / limit`` (rates); NaN when either is missing or not positive."""
    if measured is None or limit is None or not (measured > 0 and limit > 0):
        return float("nan")
    return float(measured) / float(limit)
