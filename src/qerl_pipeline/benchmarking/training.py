"""Training-step speed and memory per method, each measured in its own clean process.

``measure_training(base_dir, method, cfg, ...)`` builds the method's policy
(``quantization.policy.build_policy``: packed NVFP4 / NF4 codes decoded on the fly, or the
plain bf16 base, with PEFT LoRA), makes one fixed GRPO batch, and times optimizer steps:

* The step is the trainer's own update, ``rl.update.policy_update`` (completion log-probs,
  clipped GRPO loss from ``rl.grpo``, importance sampling, gradient clipping, AdamW), on a
  ``rl.records.Batch``: the benchmark times the code that trains, called as the trainer calls it.
* The batch: ``num_prompts x grpo.num_generations`` sequences of exactly ``prompt_len``
  prompt + ``completion_len`` completion tokens (random ids, every completion token
  counted), random group rewards, rollout log-probs set to a constant. Only shapes matter
  for speed; no value is asserted anywhere.
* One untimed warm-up step (allocator, thread pools), then ``steps`` timed ones; the
  figure is their median. When the KL reference forward runs one step in N
  (``grpo.log_kl_to_base_every``), the timed steps are ones without it, one more step
  with it is timed (``reference_step_s``), and the figure is the average step
  ``median + (reference_step - median) / N``. With ``grpo.updates_per_rollout = u`` one call does u optimizer
  steps and the time per optimizer step is divided by u.
* Memory: ``parameter_bytes(policy)`` (packed base, LoRA, other) and the optimiser state
  bytes after a step; peak process memory is ``memory.peak_memory_bytes`` (the one home:
  the RSS high-water mark on CPU, ``torch.cuda.max_memory_allocated`` on CUDA). A process's
  high-water mark only grows, so each method runs in a fresh interpreter
  (:func:`run_isolated`): one method's peak never leaks into another's, and the Kedro
  process stays small. The child writes its result with ``atomic.write_atomic``.

``measure_methods(bases, cfg, bcfg)``: every ``benchmark.methods`` entry on its format's
base, each isolated, one result row per method.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from qerl_pipeline.atomic import write_atomic
from qerl_pipeline.benchmarking import hardware
from qerl_pipeline.config import METHOD_FORMAT, BenchmarkConfig, QerlConfig
from qerl_pipeline.memory import limit_heap_fragmentation, peak_memory_bytes
from qerl_pipeline.models import resolve_dtype
from qerl_pipeline.platform import current_platform
from qerl_pipeline.quantization.policy import build_policy, parameter_bytes
from qerl_pipeline.rl import grpo
from qerl_pipeline.rl.optim import build_optimizer
from qerl_pipeline.rl.prefix import share_plan
from qerl_pipeline.rl.records import Batch
from qerl_pipeline.rl.update import Optim, policy_update, reference_every

log = logging.getLogger(__name__)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimiser state (AdamW: two moments per trainable weight)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                total += value.numel() * value.element_size()
    return total


def make_batch(vocab: int, num_prompts: int, group: int, prompt_len: int, completion_len: int, seed: int = 0) -> Batch:
    """A fixed GRPO batch: right-padded ids (no padding: all lengths equal), masks, advantages.

    As in a real GRPO batch, the ``group`` rows of a prompt share its tokens (what
    ``train.share_prompt_forward`` exploits); completions differ row by row.
    """
    gen = torch.Generator().manual_seed(seed)
    n = num_prompts * group
    prompts = torch.randint(3, vocab, (num_prompts, prompt_len), generator=gen).repeat_interleave(group, dim=0)
    ids = torch.cat([prompts, torch.randint(3, vocab, (n, completion_len), generator=gen)], dim=1)
    rewards = torch.rand(n, generator=gen)
    return Batch(
        ids=ids,
        p_lens=torch.full((n,), prompt_len, dtype=torch.long),
        roll_logp=torch.full((n, completion_len), -2.0),
        mask=torch.ones(n, completion_len),
        adv=grpo.group_advantages(rewards, group, "group", 1e-4),
    )


def _reference_forwards(every: int) -> float:
    """No-grad forwards per rollout batch besides the trained ones, on average: the base without
    LoRA (the KL reference) on one step in ``every`` (``rl.update.reference_every``: 1 with
    ``kl_beta > 0``, ``log_kl_to_base_every`` for the diagnostic, 0 for none)."""
    return 1.0 / every if every else 0.0


def measure_training(
    base_dir: str | Path,
    method: str,
    cfg: QerlConfig,
    *,
    num_prompts: int,
    prompt_len: int,
    completion_len: int,
    steps: int,
    seed: int = 0,
    device: str | None = None,
) -> dict[str, Any]:
    """Time ``steps`` training steps of ``method`` on its base; see the module docstring."""
    device = device or current_platform()
    cfg = cfg.model_copy(update={"method": method})
    cfg.rollout.max_new_tokens = completion_len
    fmt = METHOD_FORMAT[method]
    torch.manual_seed(seed)
    limit_heap_fragmentation()  # as the trainer does (qerl_pipeline.memory)
    t0 = time.perf_counter()
    policy = build_policy(
        Path(base_dir),
        fmt,
        cfg.lora,
        dtype=resolve_dtype(cfg.model, device),
        device=device,
        norm_dtype=cfg.model.norm_dtype,
    )
    build_s = time.perf_counter() - t0
    policy.train()
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer, opt_note = build_optimizer(params, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _i: 1.0)
    model_config = json.loads((Path(base_dir) / "config.json").read_text())
    group = cfg.grpo.num_generations
    batch = make_batch(int(model_config["vocab_size"]), num_prompts, group, prompt_len, completion_len, seed)
    opt = Optim(optimizer, scheduler, params)

    def step(i: int) -> dict:
        return policy_update(policy, opt, batch, cfg, i)

    every = reference_every(cfg)
    # step indices as the trainer numbers them: with a periodic reference (every > 1) the timed steps
    # skip it and one more timed step has it, so the figure is the average step: plain + (ref - plain) / every
    plain = [i for i in range(1, 10 * (steps + 2)) if every <= 1 or i % every][: steps + 1]

    def timed(i: int) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        step(i)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    rss_before = peak_memory_bytes()
    warmup_s = timed(plain[0])
    times = [timed(i) for i in plain[1:]]
    updates = cfg.grpo.updates_per_rollout
    step_s = statistics.median(times) / updates
    ref_step_s = None
    if every > 1:
        ref_step_s = timed(every) / updates  # a step with the reference forward
        step_s += (ref_step_s - step_s) / every
    n_seq = num_prompts * group
    tokens = n_seq * (prompt_len + completion_len)
    pbytes = parameter_bytes(policy)
    plan = (
        share_plan(batch.ids, batch.p_lens, completion_len, cfg.lora.gradient_checkpointing)
        if cfg.train.share_prompt_forward
        else None
    )
    flops = hardware.training_step_flops(
        model_config,
        n_seq,
        prompt_len + completion_len,
        cfg.lora.rank,
        list(cfg.lora.target_modules),
        logit_positions=completion_len,
        gradient_checkpointing=cfg.lora.gradient_checkpointing,
        forwards_without_grad=_reference_forwards(every) / updates,
        shared_prompts=(len(plan[0]), prompt_len) if plan else None,
    )
    return {
        "method": method,
        "format": fmt,
        "device": device,
        "step_impl": "rl.update.policy_update",
        "optimizer": opt_note,
        "sequences": n_seq,
        "tokens_per_step": tokens,
        "completion_tokens_per_step": n_seq * completion_len,
        "step_time_s": step_s,
        "step_times_s": times,
        "reference_step_s": ref_step_s,
        "warmup_step_s": warmup_s,
        "tokens_per_s": tokens / step_s,
        "build_policy_s": build_s,
        "flops_per_step": flops,
        "reference_forwards_per_batch": _reference_forwards(every),
        "param_bytes_packed_base": pbytes["packed_base"],
        "param_bytes_lora": pbytes["lora"],
        "param_bytes_other": pbytes["other"],
        "param_bytes_total": pbytes["total"],
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),
        "peak_memory_bytes": peak_memory_bytes(),
        "memory_before_steps_bytes": rss_before,
    }


# ----------------------------------------------------------------------------- isolation
def run_isolated(module: str, spec: dict, *, timeout_s: float, label: str, env: dict[str, str] | None = None) -> dict:
    """Run ``python -m module <spec.json> <result.json>`` in a fresh interpreter; return the result.

    The child gets its own process group, so a timeout ends it and everything it started.
    A failure raises ``RuntimeError`` with the child's exit code and the tail of its log.
    """
    with tempfile.TemporaryDirectory(prefix="qerl-bench-") as tmp:
        spec_path, out_path, log_path = Path(tmp) / "spec.json", Path(tmp) / "result.json", Path(tmp) / "log.txt"
        spec_path.write_text(json.dumps(spec))
        with log_path.open("w") as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", module, str(spec_path), str(out_path)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        if rc is None:
            raise RuntimeError(f"{label}: no result within {timeout_s:.0f} s (benchmark.timeout_s); log tail:\n{tail}")
        if rc != 0 or not out_path.is_file():
            raise RuntimeError(f"{label}: process failed (exit {rc}); log tail:\n{tail}")
        return json.loads(out_path.read_text())


def measure_training_isolated(
    base_dir: str | Path, method: str, cfg: QerlConfig, *, timeout_s: float = 900.0, **kwargs
) -> dict:
    """:func:`measure_training` in its own process (see the module docstring)."""
    spec = {"base_dir": str(base_dir), "method": method, "config": cfg.model_dump(mode="json"), **kwargs}
    return run_isolated(__name__, spec, timeout_s=timeout_s, label=f"training benchmark ({method})")


def measure_methods(bases: dict[str, str], cfg: QerlConfig, bcfg: BenchmarkConfig) -> list[dict[str, Any]]:
    """One :func:`measure_training_isolated` row per ``benchmark.methods`` entry, on its format's base."""
    rows = []
    for method in bcfg.methods:
        row = measure_training_isolated(
            bases[METHOD_FORMAT[method]],
            method,
            cfg,
            timeout_s=bcfg.timeout_s,
            num_prompts=bcfg.train_prompts,
            prompt_len=bcfg.prompt_len,
            completion_len=bcfg.completion_len,
            steps=bcfg.train_steps,
        )
        log.info(
            "training %s: %.2f s/step, %.0f tok/s, peak %.0f MiB",
            method,
            row["step_time_s"],
            row["tokens_per_s"],
            row["peak_memory_bytes"] / 2**20,
        )
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    """Child entry point: ``python -m qerl_pipeline.benchmarking.training spec.json result.json``."""
    spec_path, out_path = (argv or sys.argv[1:])[:2]
    spec = json.loads(Path(spec_path).read_text())
    cfg = QerlConfig.model_validate(spec.pop("config"))
    result = measure_training(spec.pop("base_dir"), spec.pop("method"), cfg, **spec)
    write_atomic(out_path, json.dumps(result))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
