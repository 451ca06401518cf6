#!/usr/bin/env python
"""One prepared GPU check: NVFP4 x BF16 LoRA against BF16 LoRA on Qwen2.5-7B-shaped layers.

Run on one H200 (torch + triton, no vLLM, no weights, no internet), under 8 minutes:

    python scripts/gpu_check.py                 # full shapes on CUDA
    python scripts/gpu_check.py --dry-run       # tiny shapes on CPU, no Triton (CI test)
    python scripts/gpu_check.py --dry-run --interpret   # tiny, CPU, Triton kernels in the interpreter

It prints one JSON summary and writes it to ``$OUT/gpu_check.json`` when ``OUT`` is set.

What it measures, on random-initialised layers shaped like Qwen2.5-7B (hidden 3584,
intermediate 18944, 28 query / 4 KV heads of 128; a few layers, not 28):

1. ``ops``: per projection shape, with T tokens: the BF16 matmul, the dequantization of
   the packed NVFP4 weight (the project's torch codec, and a Triton kernel), dequantize
   then matmul, and a fused Triton dequant-matmul (forward ``x W^T`` and the backward
   input gradient ``g W``), each correctness-checked against the torch reference
   (``x @ decode(W)^T``). ``dequant_per_layer_ms`` sums the seven projections.
   ``ops_small_m`` repeats the forward at a decode-like token count (64), where the
   matmul is memory-bound and reading 4.5-bit weights is where fusion can pay.
2. ``stack``: forward + backward of ``layers`` decoder layers with LoRA (rank r on all
   seven projections) over (a) a dense BF16 base, (b) the packed NVFP4 base dequantized
   per layer in forward and backward (never kept dense): the training policy's own
   ``PackedLinear`` (``kernel="torch"``) when ``qerl_pipeline.quantization.policy`` imports
   (it needs pydantic), else an equivalent script-local layer (``packed_layer`` in the JSON
   says which), (c) the same with the fused Triton kernels (``kernel="triton"``), and
   (d) ``nvfp4_lora_policy_auto``: ``kernel="auto"``, what training runs by default (the
   one-time per-shape check picks Triton or torch; ``auto_decisions`` lists its choices,
   timings and errors). Time per step, peak CUDA memory, resident parameter bytes, and the
   agreement of (b)-(d) with the base decoded to dense.

The packed base uses the project's codec (``qerl_pipeline.quantization.nvfp4``) and the
Triton kernels are the library's (``qerl_pipeline.quantization.triton_nvfp4``: dequant,
fused forward, fused input gradient, per-shape config choice in ``triton_configs``), both
imported from ``src/`` without installing the project. The decoder layer is a
minimal Qwen2-shaped block (RMSNorm, GQA attention through SDPA, SiLU-gated MLP) without
rotary embeddings and biases: they cost the same in every variant and do not touch the
weights being compared.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

# The interpreter must be chosen before triton is imported.
if "--interpret" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
# nvfp4 is pure torch; triton_nvfp4 holds the Triton kernels (library code; importing it never fails,
# HAVE_TRITON says whether they run).
from qerl_pipeline.quantization import nvfp4, triton_nvfp4

try:  # the policy's own packed layer (imports pydantic through the config; absent on a bare GPU box)
    from qerl_pipeline.quantization.policy import PackedLinear as ProjectPackedLinear
except Exception:  # pragma: no cover - depends on the machine
    ProjectPackedLinear = None

HAVE_TRITON = triton_nvfp4.HAVE_TRITON
triton = triton_nvfp4.triton

SHAPES = {
    "full": dict(
        hidden=3584,
        intermediate=18944,
        heads=28,
        kv_heads=4,
        head_dim=128,
        layers=4,
        seq_len=1024,
        seqs=4,
        rank=32,
        small_m=64,
    ),
    "dry": dict(
        hidden=128,
        intermediate=256,
        heads=2,
        kv_heads=1,
        head_dim=64,
        layers=2,
        seq_len=16,
        seqs=2,
        rank=4,
        small_m=16,
    ),
}
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def proj_shapes(s: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection."""
    h, q, kv, i = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["intermediate"]
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
    }


# ------------------------------------------------------------------------------------- timing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


bench_ms = triton_nvfp4.bench_ms  # median ms (CUDA events on GPU)
rel_err = triton_nvfp4.rel_err  # ||a - b|| / ||b|| in float32


# ------------------------------------------------------------------------- packed LoRA layers
class PackedMatmul(torch.autograd.Function):
    """``x @ dequant(W)^T`` whose backward dequantizes again instead of saving the dense W."""

    @staticmethod
    def forward(ctx, x, weight_holder, mode, kernels):
        ctx.weight_holder, ctx.mode, ctx.kernels = weight_holder, mode, kernels
        w = weight_holder.w
        x2 = x.reshape(-1, x.shape[-1])
        if mode == "fused":
            y = kernels.fwd(x2.contiguous(), w)
        else:
            y = x2 @ w.decode(x.dtype).t()
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, g):
        w = ctx.weight_holder.w
        g2 = g.reshape(-1, g.shape[-1]).contiguous()
        if ctx.mode == "fused":
            dx = ctx.kernels.dx(g2, w)
        else:
            dx = g2 @ w.decode(g.dtype)
        return dx.reshape(*g.shape[:-1], dx.shape[-1]), None, None, None


class _Holder:
    def __init__(self, w):
        self.w = w


class LoraLinear(torch.nn.Module):
    """Frozen base (dense, or packed NVFP4) plus a trainable LoRA ``B A`` scaled by alpha/r."""

    def __init__(self, out_f, in_f, rank, base, mode, kernels, dtype, device, gen):
        super().__init__()
        self.mode, self.kernels = mode, kernels
        self.project_layer = None
        if mode == "dense":
            self.weight = torch.nn.Parameter(base, requires_grad=False)
        elif ProjectPackedLinear is not None:
            # the training policy's layer: codes + scales resident; "torch" decodes in forward and again in
            # backward, "fused" forces its Triton kernels, "auto" lets its one-time per-shape check choose
            kernel = {"torch": "torch", "fused": "triton", "auto": "auto"}[mode]
            self.project_layer = ProjectPackedLinear(
                in_f, out_f, "nvfp4", base.state_dict(), compute_dtype=dtype, kernel=kernel
            )
        else:
            self.holder = _Holder(base)
        self.lora_A = torch.nn.Parameter((torch.randn(rank, in_f, generator=gen) / math.sqrt(in_f)).to(device, dtype))
        # B is random too (not PEFT's zeros) so that the LoRA path carries real gradients.
        self.lora_B = torch.nn.Parameter((torch.randn(out_f, rank, generator=gen) * 0.01).to(device, dtype))
        self.scaling = 2.0

    def forward(self, x):
        if self.mode == "dense":
            y = torch.nn.functional.linear(x, self.weight)
        elif self.project_layer is not None:
            y = self.project_layer(x)
        else:
            y = PackedMatmul.apply(x, self.holder, self.mode, self.kernels)
        return y + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scaling

    def base_bytes(self) -> int:
        if self.mode == "dense":
            return self.weight.numel() * self.weight.element_size()
        if self.project_layer is not None:
            return self.project_layer.packed_bytes()
        return self.holder.w.nbytes()


class Block(torch.nn.Module):
    """Minimal Qwen2-shaped decoder layer (no rotary, no biases)."""

    def __init__(self, s, bases, mode, kernels, dtype, device, gen):
        super().__init__()
        self.s = s
        shapes = proj_shapes(s)
        self.proj = torch.nn.ModuleDict(
            {
                name: LoraLinear(*shapes[name], s["rank"], bases[name], mode, kernels, dtype, device, gen)
                for name in PROJ
            }
        )
        self.norm1 = torch.nn.RMSNorm(s["hidden"], eps=1e-6, device=device, dtype=dtype)
        self.norm2 = torch.nn.RMSNorm(s["hidden"], eps=1e-6, device=device, dtype=dtype)
        for norm in (self.norm1, self.norm2):
            norm.weight.requires_grad_(False)

    def forward(self, x):
        s, p = self.s, self.proj
        b, t, _ = x.shape
        h = self.norm1(x)
        q = p["q_proj"](h).view(b, t, s["heads"], s["head_dim"]).transpose(1, 2)
        k = p["k_proj"](h).view(b, t, s["kv_heads"], s["head_dim"]).transpose(1, 2)
        v = p["v_proj"](h).view(b, t, s["kv_heads"], s["head_dim"]).transpose(1, 2)
        rep = s["heads"] // s["kv_heads"]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + p["o_proj"](a)
        h = self.norm2(x)
        return x + p["down_proj"](torch.nn.functional.silu(p["gate_proj"](h)) * p["up_proj"](h))


# --------------------------------------------------------------------------------- the checks
def random_layer_weights(s, device, dtype, gen):
    """Random projections (std 0.02, like a fresh Qwen2 init), quantized as fused groups."""
    dense = {
        n: (torch.randn(*shape, generator=gen) * 0.02).to(device=device, dtype=dtype)
        for n, shape in proj_shapes(s).items()
    }
    packed = nvfp4.encode_linears(dense)
    return dense, packed


def check_ops(s, device, dtype, kernels, tokens, gen) -> dict:
    """Per projection shape: matmul, dequant (torch/Triton), dequant+matmul, fused; errors."""
    shapes = proj_shapes(s)
    dense, packed = random_layer_weights(s, device, dtype, gen)
    x = (torch.randn(tokens, s["hidden"], generator=gen)).to(device, dtype)
    xi = (torch.randn(tokens, s["intermediate"], generator=gen)).to(device, dtype)
    rows, per_layer = {}, {"dequant_torch_ms": 0.0, "dequant_triton_ms": 0.0}
    seen = {}
    for name in PROJ:
        out_f, in_f = shapes[name]
        key = (out_f, in_f)
        if key in seen:  # same shape: same timings
            rows[name] = dict(rows[seen[key]], same_as=seen[key])
            for k in per_layer:
                per_layer[k] += rows[name].get(k) or 0.0
            continue
        seen[key] = name
        w, wd = packed[name], packed[name].decode(dtype)
        inp = (x if in_f == s["hidden"] else xi)[:, :in_f].contiguous()
        g = torch.randn(tokens, out_f, generator=gen).to(device, dtype)
        ref = inp.float() @ wd.float().t()
        ref_dx = g.float() @ wd.float()
        row = {
            "out": out_f,
            "in": in_f,
            "tokens": tokens,
            "matmul_ms": bench_ms(lambda inp=inp, wd=wd: inp @ wd.t(), device),
            "dequant_torch_ms": bench_ms(lambda w=w: w.decode(dtype), device),
            "dequant_then_matmul_torch_ms": bench_ms(lambda inp=inp, w=w: inp @ w.decode(dtype).t(), device),
            "torch_rel_err": rel_err(inp @ w.decode(dtype).t(), ref),
        }
        if kernels is not None:
            deq = kernels.dequant(w, dtype)
            row["triton_dequant_max_abs_diff"] = float((deq.float() - w.decode(torch.float32)).abs().max())
            row["fused_fwd_rel_err"] = rel_err(kernels.fwd(inp, w), ref)
            row["fused_dx_rel_err"] = rel_err(kernels.dx(g, w), ref_dx)
            if device.type == "cuda":
                row["dequant_triton_ms"] = bench_ms(lambda w=w: kernels.dequant(w, dtype), device)
                row["dequant_then_matmul_triton_ms"] = bench_ms(
                    lambda inp=inp, w=w: inp @ kernels.dequant(w, dtype).t(), device
                )
                row["fused_fwd_ms"] = bench_ms(lambda inp=inp, w=w: kernels.fwd(inp, w), device)
                row["dx_matmul_ms"] = bench_ms(lambda g=g, wd=wd: g @ wd, device)
                row["dx_dequant_then_matmul_ms"] = bench_ms(lambda g=g, w=w: g @ kernels.dequant(w, dtype), device)
                row["fused_dx_ms"] = bench_ms(lambda g=g, w=w: kernels.dx(g, w), device)
                row["fused_beats_dequant_then_matmul_fwd"] = row["fused_fwd_ms"] < min(
                    row["dequant_then_matmul_triton_ms"], row["dequant_then_matmul_torch_ms"]
                )
                row["fused_beats_dequant_then_matmul_dx"] = row["fused_dx_ms"] < row["dx_dequant_then_matmul_ms"]
        rows[name] = row
        for k in per_layer:
            per_layer[k] += row.get(k) or 0.0
    bf16_bytes = sum(o * i * torch.tensor([], dtype=dtype).element_size() for o, i in shapes.values())
    return {
        "per_projection": rows,
        "dequant_per_layer_ms": per_layer,
        "layer_base_bytes": {"dense": bf16_bytes, "nvfp4": sum(p.nbytes() for p in packed.values())},
    }


def check_small_m(s, device, dtype, kernels, tokens, gen) -> dict:
    """Forward only at a decode-like token count, where the matmul is memory-bound."""
    shapes = proj_shapes(s)
    _, packed = random_layer_weights(s, device, dtype, gen)
    rows = {}
    for name in ("q_proj", "k_proj", "gate_proj", "down_proj"):
        out_f, in_f = shapes[name]
        w = packed[name]
        wd = w.decode(dtype)
        inp = torch.randn(tokens, in_f, generator=gen).to(device, dtype)
        row = {
            "out": out_f,
            "in": in_f,
            "tokens": tokens,
            "matmul_ms": bench_ms(lambda inp=inp, wd=wd: inp @ wd.t(), device),
            "dequant_then_matmul_torch_ms": bench_ms(lambda inp=inp, w=w: inp @ w.decode(dtype).t(), device),
            "fused_fwd_rel_err": rel_err(kernels.fwd(inp, w), inp.float() @ wd.float().t()),
        }
        if device.type == "cuda":
            row["dequant_then_matmul_triton_ms"] = bench_ms(
                lambda inp=inp, w=w: inp @ kernels.dequant(w, dtype).t(), device
            )
            row["fused_fwd_ms"] = bench_ms(lambda inp=inp, w=w: kernels.fwd(inp, w), device)
            row["fused_beats_dequant_then_matmul_fwd"] = row["fused_fwd_ms"] < min(
                row["dequant_then_matmul_triton_ms"], row["dequant_then_matmul_torch_ms"]
            )
            row["fused_vs_bf16_matmul"] = row["fused_fwd_ms"] / row["matmul_ms"]
        rows[name] = row
    return rows


def check_stack(s, device, dtype, kernels, gen, iters: int) -> dict:
    """Forward+backward of ``layers`` LoRA decoder layers over dense, packed and fused bases."""
    layer_weights = [random_layer_weights(s, device, dtype, gen) for _ in range(s["layers"])]
    x = (torch.randn(s["seqs"], s["seq_len"], s["hidden"], generator=gen) * 0.5).to(device, dtype)
    modes = {"bf16_lora": "dense", "nvfp4_lora_decoded_dense": "dense", "nvfp4_lora_dequant_matmul": "torch"}
    if kernels is not None:
        modes["nvfp4_lora_fused_triton"] = "fused"
        if ProjectPackedLinear is not None:  # what the training policy runs by default (kernel="auto")
            modes["nvfp4_lora_policy_auto"] = "auto"
    out, outputs = {}, {}
    for label, mode in modes.items():
        lora_gen = torch.Generator(device="cpu").manual_seed(1)  # the same LoRA in every variant
        blocks = []
        for dense, packed in layer_weights:
            if label == "bf16_lora":
                bases = dense
            elif label == "nvfp4_lora_decoded_dense":
                bases = {n: p.decode(dtype) for n, p in packed.items()}
            else:
                bases = packed
            blocks.append(Block(s, bases, mode, kernels, dtype, device, lora_gen))
        model = torch.nn.Sequential(*blocks)
        params = [p for p in model.parameters() if p.requires_grad]

        def step(model=model, params=params):  # this variant's; deleted with them at the end of the iteration
            for p in params:
                p.grad = None
            y = model(x)
            loss = y.float().pow(2).mean()
            loss.backward()
            return loss

        loss = step()
        grads = torch.cat([p.grad.float().flatten() for p in params])
        outputs[label] = (float(loss), grads)
        if device.type == "cuda":
            sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            step()
            sync(device)
            peak = torch.cuda.max_memory_allocated(device)
        else:
            before = peak = None
        ms = bench_ms(step, device, warmup=1, iters=iters)
        tokens = s["seqs"] * s["seq_len"]
        lora_bytes = sum(p.numel() * p.element_size() for p in params)
        out[label] = {
            "step_ms": ms,
            "tokens_per_s": tokens / (ms / 1e3),
            "peak_mem_bytes": peak,
            "peak_over_resident_bytes": None if peak is None else peak - before,
            "base_bytes": sum(m.base_bytes() for m in model.modules() if isinstance(m, LoraLinear)),
            "lora_bytes": lora_bytes,
        }
        del model, blocks, params, step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ref_loss, ref_grads = outputs["nvfp4_lora_decoded_dense"]
    for label, (loss, grads) in outputs.items():
        out[label]["loss"] = loss
        out[label]["loss_rel_diff_vs_decoded_dense"] = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
        out[label]["lora_grad_rel_err_vs_decoded_dense"] = rel_err(grads, ref_grads)
    base = out["bf16_lora"]["step_ms"]
    for label in out:
        out[label]["step_time_vs_bf16_lora"] = out[label]["step_ms"] / base
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, no Triton unless --interpret")
    ap.add_argument(
        "--interpret", action="store_true", help="with --dry-run: run the Triton kernels in Triton's CPU interpreter"
    )
    ap.add_argument("--layers", type=int, help="decoder layers in the stack check")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations per figure")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    dry = args.dry_run or not torch.cuda.is_available()
    s = dict(SHAPES["dry" if dry else "full"])
    if dry and args.interpret:
        s["layers"] = 1  # the interpreter runs kernels element by element: keep it short
    if args.layers:
        s["layers"] = args.layers
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    use_triton = HAVE_TRITON and (not dry or args.interpret)
    # the library's shared launchers: the policy's PackedLinear (and its auto check) reuse their tuned configs
    kernels = triton_nvfp4.KERNELS if use_triton else None
    gen = torch.Generator(device="cpu").manual_seed(0)
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "mode": "dry-run" if dry else "full",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": getattr(triton, "__version__", None),
        "triton_used": kernels is not None,
        "triton_interpreter": os.environ.get("TRITON_INTERPRET") == "1",
        "dtype": str(dtype).removeprefix("torch."),
        "shape": s,
        "codec": "qerl_pipeline.quantization.nvfp4",
        "packed_layer": "qerl_pipeline.quantization.policy.PackedLinear"
        if ProjectPackedLinear is not None
        else "script-local (same decode-in-forward-and-backward; the policy module did not import)",
    }
    tokens = s["seqs"] * s["seq_len"]
    with torch.no_grad():
        summary["ops"] = check_ops(s, device, dtype, kernels, tokens, gen)
        if kernels is not None:
            summary["ops_small_m"] = check_small_m(s, device, dtype, kernels, s["small_m"], gen)
    summary["stack"] = check_stack(
        s, device, dtype, kernels, gen, iters=(1 if args.interpret else 2) if dry else args.iters
    )
    if kernels is not None:
        summary["triton_configs"] = {"/".join(map(str, k)): v for k, v in kernels.chosen.items()}
        # the policy's one-time choices (CUDA only; empty on CPU, where auto is always the torch path)
        summary["auto_decisions"] = triton_nvfp4.DISPATCHER.summary()
    if kernels is not None and device.type == "cuda":
        rows = [r for r in summary["ops"]["per_projection"].values() if "same_as" not in r]
        summary["fused_beats_dequant_then_matmul"] = {
            "forward": all(r["fused_beats_dequant_then_matmul_fwd"] for r in rows),
            "forward_small_m": all(r["fused_beats_dequant_then_matmul_fwd"] for r in summary["ops_small_m"].values()),
            "backward_dx": all(r["fused_beats_dequant_then_matmul_dx"] for r in rows),
            "stack": summary["stack"]["nvfp4_lora_fused_triton"]["step_ms"]
            < summary["stack"]["nvfp4_lora_dequant_matmul"]["step_ms"],
        }
    summary["wall_s"] = time.perf_counter() - t_start
    text = json.dumps(summary, indent=2, default=str)
    print(text)
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "gpu_check.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return summary


if __name__ == "__main__":
    main()
