"""The QeRL training loop: GRPO/DAPO on LoRA over a quantized base, with AQN.

One readable loop (torchtune style), its parts plain functions. Per step ``s``:

1. AQN: ``(stage, sigma) = aqn.sigma_at(s, steps)``; ``Z`` drawn for ``(aqn.seed, s)``; the
   engine's norm weights are set to ``clean + Z`` (``engine.update_weights``; also when
   sigma is 0, which restores the clean values, and every step when norms are trainable),
   then read back: ``aqn/sigma_effective`` is the std of served minus clean, and the
   trainer uses the values the engine serves. Norm weights are fp32 in both (``model.
   norm_dtype``, quantization/norms.py), so a bf16 model serves the noise as drawn.
2. Rollout: ``prompts_per_step`` prompts (a seeded permutation per epoch; the cursor is
   checkpointed), ``num_generations`` samples each, with the current adapter folder.
   Dynamic sampling (DAPO) drops groups with equal rewards and refills for up to
   ``max_refill_rounds`` extra rounds (same noise, new sampling seed); over data-parallel ranks
   each round is decided once for all of them (``step.collect``). Honest curves:
   ``reward/mean``, ``reward/accuracy``, ``reward/format`` (and ``accuracy``) are over every
   sampled group, before the filter, so a DAPO run's curve compares with a GRPO run's;
   ``reward/kept_mean``/``kept_accuracy``/``kept_format`` are over the groups trained on
   (``groups/sampled``, ``groups/kept`` count them). Without dynamic sampling both agree.
3. Rewards (``RewardScorer``, or a custom ``reward_fn``: argument or ``train.reward_fn``
   import path or a weighted list, see ``rewards/functions.py``) + optional overlong shaping; group advantages.
4. ``updates_per_rollout`` optimizer steps over the batch (micro-batches, gradient
   accumulation); forward and backward inside ``aqn.noisy_norms`` so the trainer's
   log-probs are those of the policy that generated the batch, ``optimizer.step()``
   outside it, so trained norms step from (and keep) their clean values. pi_old is the
   trainer's log-prob at the first update (taken from that forward, no extra pass).
   Importance sampling (``grpo.is_mode``, TRL's modes: token/sequence ratio pi_old /
   pi_rollout, truncated or masked at ``is_cap``/``is_lower``) corrects the rollout/trainer
   mismatch; the ratio's min/mean/max, the masked or clipped fraction and the mismatch KL
   between vLLM's and the trainer's log-probs are logged under ``mismatch/``. Options of the
   loss (``rl/grpo.py``): GSPO's sequence-level ratio (``grpo.importance_sampling_level``),
   the KL's bias correction, entropy-based token selection (``grpo.top_entropy_quantile``). With ``kl_beta > 0``
   (or ``log_kl_to_base``, on every ``log_kl_to_base_every``-th step) the reference log-probs are the clean base's: the same model
   with the adapter disabled, no noise, and the base's norm values (no second model).
   What the engine serves (``rollout/serving.py``: FP4 on CUDA, the decoded dense copy on
   CPU) and in which dtype is tagged on the run (``rollout.served_format``/``_dtype``).
5. The adapter is saved to a new step folder (the engine loads it under a new LoRA id);
   checkpoints every ``checkpoint_every`` steps.

The step's parts (prompts, rollout + rewards, log-probs, the update) live in
``rl/step.py``; this module is the loop, the optimizer, adapters and run control.

Resume: the newest intact checkpoint of ``<output_dir>/<method>`` (``open_run_dir``) restores
trainable tensors, optimizer, scheduler, RNG, data cursor and the MLflow run id; metrics go on in that run.
A fresh run never mixes with an earlier one's files: the earlier folder is moved aside
first (``open_run_dir``).
Every random draw is a function of ``(seed, step)`` (sampling seeds, AQN noise, data
order), so a resumed run reproduces the uninterrupted one.

A NaN/Inf loss raises ``TrainingDiverged`` naming the step before any optimizer update,
so the newest checkpoint is the last good state. A loop that ends early marks its MLflow run
(``tracking.mark_ended``): FAILED with the error's one-line summary, or KILLED (Ctrl-C, SIGTERM)
with the signal, both with the last completed step.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from qerl_pipeline import tracking as T
from qerl_pipeline.adapter import is_adapter, save_adapter, trained_norms
from qerl_pipeline.atomic import write_atomic
from qerl_pipeline.config import METHOD_FORMAT, QerlConfig, flatten
from qerl_pipeline.memory import limit_heap_fragmentation, peak_memory_bytes
from qerl_pipeline.models import load_tokenizer, resolve_dtype
from qerl_pipeline.platform import current_platform
from qerl_pipeline.quantization import aqn
from qerl_pipeline.quantization.norms import check_noise_precision, sigma_effective
from qerl_pipeline.quantization.policy import build_policy
from qerl_pipeline.quantization.store import read_stamp
from qerl_pipeline.rewards.functions import RewardFn, make_scorer, reward_component_metrics
from qerl_pipeline.rl import checkpoint as ckpt
from qerl_pipeline.rl import grpo
from qerl_pipeline.rl.dist import SINGLE, rank_device
from qerl_pipeline.rl.optim import build_optimizer, lr_factor
from qerl_pipeline.rl.step import (
    Batch,
    Optim,
    PromptSampler,
    _mean,
    collate,
    collect,
    completion_rows,
    policy_update,
    tokenize_prompts,
)
from qerl_pipeline.rollout.layout import engine_plan
from qerl_pipeline.rollout.serving import open_engine, resolve_sync, served_model, served_tags
from qerl_pipeline.rollout.sleep import EngineSleeper, engine_platform, sleep_plan
from qerl_pipeline.terminal import TrainProgress
from qerl_pipeline.tracking import MemoryLogger, MetricsLogger, git_commit, scalar_metrics

log = logging.getLogger(__name__)

# --------------------------------------------------------------- the loop
@dataclass
class TrainResult:
    run_dir: Path
    adapter_dir: Path
    steps: int
    resumed_from: int
    run_id: str | None
    history: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    #: where an earlier run's folder was moved before this fresh run (None: nothing was there, or a resume)
    moved_aside: Path | None = None
    #: True when the run folder held this run finished already (nothing was trained)
    reused: bool = False


def run_dir_for(cfg: QerlConfig, output_dir: str | Path | None = None) -> Path:
    """``<output_dir>/<method>`` (``output_dir`` defaults to ``train.output_dir``); see ``open_run_dir``."""
    return Path(output_dir or cfg.train.output_dir) / cfg.method


def open_run_dir(cfg: QerlConfig, output_dir: str | Path | None = None) -> tuple[Path, Path | None, Path | None]:
    """The run folder of this training, ready to write: ``(run_dir, checkpoint to resume or None, moved_aside)``.

    The rule: one run folder ``<output_dir>/<method>`` holds one run (one lineage of steps).

    - Resume (``train.resume: true`` and ``run_dir`` holds a complete checkpoint): the folder
      is kept as it is and the newest intact checkpoint is resumed (``checkpoint.find_resumable``:
      damaged newer ones are named in the log, then kept as ``step-NNNNNN.damaged`` and tagged
      ``qerl.resume_fallback`` by ``train``; none intact: ``CheckpointDamaged``).
    - Fresh run (``train.resume: false``, or no complete checkpoint) over a folder that holds
      anything (an earlier run, finished or not, or one killed before its first checkpoint):
      the folder is moved aside, renamed to the sibling
      ``<method>.previous-<UTC YYYYmmddTHHMMSSZ>`` (``-1``, ``-2``, ... when that name is taken;
      an earlier moved-aside folder is never overwritten), and the move is logged at WARNING.
      Nothing of it is deleted or mixed into the new run: its checkpoints, adapters and
      ``final_adapter/`` stay browsable there (``checkpoint.previous_runs`` lists them).
      An empty folder is simply reused.
    - The new run then starts in an empty ``run_dir``. Inside it, the adapter cleanup keeps
      the last two step folders *this* ``train`` call wrote (the one the engine is about to
      load and the one before) and deletes only other ``adapters/step-*`` folders of this
      run folder; checkpoints keep their ``keep_last`` (``checkpoint.save_checkpoint``).
    """
    run_dir = run_dir_for(cfg, output_dir)
    latest = ckpt.find_resumable(run_dir) if cfg.train.resume else None
    why = "train.resume is false" if not cfg.train.resume else "it holds no complete checkpoint to resume"
    if latest is not None:
        stored = ckpt.peek_state(latest).get("config")
        defaults = resume_config(QerlConfig.model_validate({"method": cfg.method}))
        changed = config_changes(stored, resume_config(cfg), defaults) if stored is not None else []
        if changed:
            latest = None
            shown = ", ".join(changed[:6]) + (f" (+{len(changed) - 6} more)" if len(changed) > 6 else "")
            why = f"its checkpoint was trained with other settings: {shown}"
    moved = None
    if latest is None and ckpt.has_leftovers(run_dir):
        moved = ckpt.move_aside(run_dir)
        log.warning("fresh run in %s (%s): the earlier run there was moved aside to %s", run_dir, why, moved)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir, latest, moved


#: Settings a resume may change: how long to train and how often to save/log, and the
#: sections training never reads. Any other difference makes the checkpoint another run.
RESUMABLE_CHANGES = ("train.steps", "train.resume", "train.checkpoint_every", "train.log_completions_every",
                     "train.output_dir", "train.nproc", "train.nnodes", "train.node_rank", "train.master_addr",
                     "train.master_port", "quantize.force", "quantize.verify", "rollout.shared_engines",
                     "rollout.gpu_memory_utilization", "rollout.sleep_between_steps", "rollout.sleep_level",
                     "reward.max_workers", "data.eval_files", "evaluate", "compare", "benchmark")


def resume_config(cfg: QerlConfig) -> dict[str, Any]:
    """The flattened settings a checkpoint must share with the config that resumes it."""
    flat = flatten(cfg.model_dump(mode="json"))
    return {k: v for k, v in flat.items() if not any(k == p or k.startswith(p + ".") for p in RESUMABLE_CHANGES)}


def config_changes(stored: dict[str, Any], current: dict[str, Any], defaults: dict[str, Any] | None = None) -> list[str]:
    """Dotted keys whose value differs between a checkpoint's settings and the current ones.

    A key the checkpoint lacks whose current value is its default (``defaults``) is no change:
    the checkpoint predates that setting, and a new setting's default keeps the behaviour it was trained with.
    """
    defaults = defaults or {}
    return sorted(k for k in stored.keys() | current.keys() if stored.get(k) != current.get(k)
                  and not (k not in stored and k in defaults and current.get(k) == defaults[k]))


def _log_fresh_run(logger: MetricsLogger, cfg: QerlConfig, base_dir: Path, *, dataset_name: str | None, optimizer_note: str,
                   data_report: dict | None, moved_aside: Path | None) -> None:
    """A fresh run's tags, resolved config and inputs (a resumed run has them already)."""
    logger.set_tags({
        "method": cfg.method, "model": cfg.model.name, "dataset": dataset_name or cfg.data.train_source,
        "git_commit": git_commit(), "optimizer": optimizer_note,
    })
    logger.log_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), "config/resolved_config.yaml")
    log_inputs(logger, base_dir, data_report)
    if moved_aside is not None:
        logger.set_tags({"qerl.previous_run_dir": str(moved_aside)})


def log_inputs(logger: MetricsLogger, base_dir: Path, data_report: dict | None) -> None:
    """A training run's record of its inputs: the data report and the base's stored quantize report."""
    stamp = read_stamp(base_dir) or {}
    report = stamp.get("report") or {}
    logger.log_metrics(scalar_metrics(report, "quantize/"), step=0)
    if report:
        logger.log_text(json.dumps(report, indent=1, default=str), "quantize/report.json")
        logger.log_text(json.dumps(stamp.get("fingerprint", {}), indent=1, default=str), "quantize/fingerprint.json")
    if data_report:
        logger.log_text(json.dumps(data_report, indent=1, default=str), "data/report.json")


def prune_adapters(adapters: Path, keep: list[Path]) -> None:
    """Delete the ``step-*`` folders of ``adapters`` except ``keep`` (this run's last two written)."""
    keep_names = {k.name for k in keep}
    for old in adapters.iterdir():
        if ckpt.step_of(old) is not None and old.name not in keep_names:
            shutil.rmtree(old, ignore_errors=True)


def _peak_memory_gb() -> float:
    return peak_memory_bytes() / 2**30


def train(
    cfg: QerlConfig,
    base_dir: str | Path,
    records: list[dict],
    *,
    output_dir: str | Path | None = None,
    make_logger: Callable[[str | None], MetricsLogger] | None = None,
    engine: Any = None,
    engine_factory: Callable[[Any], Any] | None = None,
    dataset_name: str | None = None,
    progress: bool = True,
    reward_fn: RewardFn | str | None = None,
    data_report: dict | None = None,
    dist: Any = None,
) -> TrainResult:
    """Train ``cfg.method`` on ``records`` (prompt records) over the base in ``base_dir``.

    ``make_logger(run_id)``: the metrics logger; called with the run id stored in the
    checkpoint when resuming (None for a fresh run). ``engine``: an already started
    ``RolloutEngine`` on the serving folder (tests share one); by default one is started
    and closed here; ``engine_factory(served)`` (instead of ``engine``): called with the
    ``ServedModel`` when the engine is needed (not for a run that is finished already), its
    engine is not closed here (compare's shared engine, ``rollout/pool.py``). ``reward_fn(completions, golds, samples) -> list[dict]`` (or an import
    path ``"module:function"``): a custom reward replacing the math ``RewardScorer``, the hook
    for custom rewards (like TRL's ``reward_funcs``); default ``cfg.train.reward_fn``.
    A fresh run logs what it trains on: ``data_report`` (data_prep's) as ``data/report.json``
    and the base's quantize report and fingerprint (stored with the base) as
    ``quantize/report.json``, ``quantize/fingerprint.json`` and ``quantize/<name>`` metrics.
    ``dist``: this rank of a data-parallel training (``rl/distributed.py``, which launches the
    ranks and passes it; None = one process): rank 0 alone writes files and MLflow.
    """
    t_start = time.perf_counter()
    d = dist or SINGLE
    base_dir = Path(base_dir)
    tc, gc, rc = cfg.train, cfg.grpo, cfg.rollout
    # rank 0 opens (or moves aside) the run folder; the others take its decision
    run_dir, latest, moved_aside = d.broadcast_object(open_run_dir(cfg, output_dir) if d.is_main else None)
    stored = ckpt.peek_state(latest) if latest is not None else {}
    if latest is not None and int(stored.get("world_size", 1)) != d.world_size:
        raise ValueError(
            f"{latest} was written by a training on {stored.get('world_size', 1)} rank(s); this run has {d.world_size} "
            f"(train.nproc x train.nnodes): resume it with the same number of ranks, or start anew with train.resume=false"
        )
    make_logger = make_logger or (lambda _run_id: MemoryLogger())
    logger = make_logger(stored.get("run_id"))
    run_id = getattr(logger, "run_id", None)
    final = run_dir / "final_adapter"
    if latest is not None and int(stored.get("step", 0)) >= tc.steps and is_adapter(final):
        # Finished already (a compare or a kedro run resumed after a later step failed): reuse it.
        log.info("%s: already trained to step %d in %s (MLflow run %s); reusing it (train.resume=false trains anew)",
                 cfg.method, int(stored["step"]), run_dir, run_id)
        return TrainResult(run_dir, final, tc.steps, int(stored["step"]), run_id, _full_history(logger),
                           time.perf_counter() - t_start, None, reused=True)

    torch.manual_seed(tc.seed)
    platform = current_platform()
    device = rank_device(platform, d.local_rank) if d.active else platform
    dtype = resolve_dtype(cfg.model, platform)
    check_noise_precision(cfg, dtype)  # before any model loads
    limit_heap_fragmentation()  # glibc keeps freed activations otherwise (qerl_pipeline.memory)
    served = served_model(base_dir, METHOD_FORMAT[cfg.method], platform=platform)
    sync = resolve_sync(rc.sync, served, rc.tensor_parallel_size)  # adapter | merge, before any model loads (rollout/serving.py)
    policy = build_policy(base_dir, METHOD_FORMAT[cfg.method], cfg.lora, dtype=dtype, device=device,
                          norm_dtype=cfg.model.norm_dtype)
    policy.train()
    # the base's values of trained norms, before a resume loads trained ones: the KL reference's norms
    base_norms = {n: t.clone() for n, t in trained_norms(policy).items()}
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer, opt_note = build_optimizer(params, cfg)
    updates = gc.updates_per_rollout
    total_updates = tc.steps * updates
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: lr_factor(i, warmup=cfg.optim.warmup_steps, total=total_updates, schedule=cfg.optim.schedule)
    )
    tokenizer = _tokenizer(base_dir, cfg)
    items, dropped = tokenize_prompts(records, tokenizer, cfg.model.max_seq_len - rc.max_new_tokens)
    sampler = PromptSampler(len(items), tc.seed)

    start_step = 0
    if latest is not None:
        state = ckpt.load_checkpoint(latest, policy=policy, optimizer=optimizer, scheduler=scheduler)
        start_step = int(state["step"])
        sampler = PromptSampler(len(items), tc.seed, **state["sampler"])
        log.info("resuming from %s (step %d, MLflow run %s)", latest, start_step, run_id)
        kept = ckpt.set_aside_damaged(run_dir, latest) if d.is_main else []
        fallback = {"qerl.resume_fallback": " | ".join(f"{dmg} (kept as {to.name})" for dmg, to in kept)[:4000]} if kept else {}
        logger.set_tags({"qerl.resumed_at_step": str(start_step), **fallback})
    else:
        _log_fresh_run(logger, cfg, base_dir, dataset_name=dataset_name, optimizer_note=opt_note, data_report=data_report,
                       moved_aside=moved_aside)
    if dropped:
        log.warning("%d prompts longer than %d tokens were dropped", dropped, cfg.model.max_seq_len - rc.max_new_tokens)


    ranks = dict(world_size=d.world_size, rank=d.rank, local_rank=d.local_rank)
    layout = engine_plan(rc, platform, **ranks)  # rollout.engines / tensor_parallel_size: this rank's engine and GPUs
    own_engine = engine is None and engine_factory is None
    if engine is None:
        # a merging engine needs no LoRA slots; its KV cache holds one step's rollout (CPU)
        kv_need = (math.ceil(tc.prompts_per_step / d.world_size) * gc.num_generations,
                   max((len(it.ids) for it in items), default=0) + rc.max_new_tokens)
        engine = engine_factory(served) if engine_factory else open_engine(
            served, cfg.model, rollout=rc, lora_rank=cfg.lora.rank if sync == "adapter" else None,
            devices=layout.devices, kv_need=kv_need)
    if sync == "adapter" and not own_engine:
        engine.unmerge()  # a shared engine may still serve an earlier run's merged adapter under its LoRAs
    engine_on = engine_platform(engine, platform)  # where the engine runs, as its process reports
    sleeper = EngineSleeper(engine, sleep_plan(rc, engine_on, colocated=engine_plan(rc, engine_on, **ranks).colocated))
    log.info("engine sleep during updates: %s (%s)", "on" if sleeper.enabled else "off", sleeper.plan.why)
    scorer = make_scorer(cfg, reward_fn)
    aqn_on = cfg.aqn_enabled()
    engine_norms = engine.norm_weight_names()
    sync_names = sorted(set((aqn.noisy_target_names(engine_norms) if aqn_on else []) + (engine_norms if cfg.lora.train_norms else [])))
    norm_params = aqn.norm_parameters(policy, sync_names) if sync_names else {}
    noisy_names = aqn.noisy_target_names(norm_params) if aqn_on else []
    ref_norms = {n: base_norms[n] for n in norm_params if n in base_norms} or None
    serving_tags = {**served_tags(served, engine), "model.norm_dtype": cfg.model.norm_dtype, "rollout.sync": sync}
    logger.set_tags(serving_tags)
    log.info("engine serves %s in %s", serving_tags["rollout.served_format"], serving_tags["rollout.served_dtype"])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    adapters = run_dir / "adapters"
    adapter_dir = _save_step_adapter(policy, adapters / f"step-{start_step:06d}", d)
    written = [adapter_dir]  # the step folders this call wrote, oldest first: prune_adapters keeps the last two
    history: list[dict] = []
    logger.log_metrics({"data/prompts": len(items), "data/dropped_prompts": dropped, "dist/world_size": d.world_size},
                       step=start_step)

    bar = TrainProgress(tc.steps, start_step) if progress and d.is_main else None
    try:
        for step in range(start_step, tc.steps):
            t0 = time.perf_counter()
            stage, sigma = aqn.sigma_at(step, tc.steps, cfg.aqn) if aqn_on else (0, 0.0)
            clean = {n: p.detach().cpu().clone() for n, p in norm_params.items()}
            noise = aqn.draw_noise(clean, sigma, seed=cfg.aqn.seed, step=step) if aqn_on else None
            noisy = aqn.apply_noise(clean, noise) if clean else {}
            sync_s = engine.update_weights(noisy) if noisy else 0.0
            if noisy:  # what the engine really serves (its dtype may round): the trainer uses the same values
                noisy = engine.read_weights(sorted(noisy))
            sigma_eff = sigma_effective(noisy, clean, noisy_names)
            if sync == "merge":  # the step's adapter into the served linears; the rollout then runs without LoRA
                sync_s += engine.merge_adapter(adapter_dir)
            lora = adapter_dir if sync == "adapter" else None

            groups, rewards, info, roll = collect(engine, scorer, sampler, items, cfg, step, lora, dist=d)
            sleeper.before_update(lora, groups[0][0].prompt_ids if groups else None)  # CUDA + colocated: the update gets the memory
            t_roll = time.perf_counter()
            samples = [s for g in groups for s in g]
            ids, p_lens, c_lens_local, roll_logp = collate(samples, pad_id)
            truncated_local = torch.tensor([s.finish_reason == "length" for s in samples])
            mask = grpo.completion_mask(c_lens_local, roll_logp.shape[1], truncated_local if gc.mask_truncated else None)
            # the global batch (every rank's share, in rank order): advantages and metrics are its
            g_all = _gather_step(d, rewards, info, roll, c_lens_local, truncated_local)
            offset = sum(g_all["counts"][: d.rank])
            r = torch.tensor([x["reward"] for x in g_all["rewards"]], dtype=torch.float32)
            adv_all = grpo.group_advantages(r, gc.num_generations, gc.advantage_scale, gc.advantage_eps)
            adv = adv_all[offset: offset + len(rewards)]
            engine_cpu0 = _engine_cpu(engine)
            upd = policy_update(policy, Optim(optimizer, scheduler, params, norm_params),
                                Batch(ids, p_lens, roll_logp, mask, adv, noisy), cfg, step, ref_norms=ref_norms, dist=d)
            t_upd = time.perf_counter()
            engine_cpu1 = _engine_cpu(engine)
            adapter_dir = _save_step_adapter(policy, adapters / f"step-{step + 1:06d}", d)
            written = [*written[-1:], adapter_dir]
            if d.is_main:
                prune_adapters(adapters, written)
            sleep_metrics = sleeper.after_update(adapter_dir if sync == "adapter" else None)  # wake, probe, register the next adapter

            metrics = _step_metrics(g_all, r, info, upd, sleep_metrics, stage=stage, sigma=sigma, sigma_eff=sigma_eff,
                                    times={T.SYNC_TIME_S: sync_s, T.UPDATE_TIME_S: t_upd - t_roll,
                                           T.STEP_TIME_S: time.perf_counter() - t0},
                                    engine_cpu=(engine_cpu0, engine_cpu1))
            logger.log_metrics(metrics, step=step + 1)
            history.append({"step": step + 1, **metrics})
            if (step + 1) % tc.log_completions_every == 0 or step == start_step:  # rank 0's share of the completions
                logger.log_table(completion_rows(groups, rewards, items, info, step + 1), f"completions/step_{step + 1:05d}.json")
            if d.is_main and ((step + 1) % tc.checkpoint_every == 0 or step + 1 == tc.steps):
                ckpt.save_checkpoint(
                    run_dir, step + 1, policy=policy, optimizer=optimizer, scheduler=scheduler,
                    state={"step": step + 1, "sampler": sampler.state(), "aqn_stage": stage, "aqn_sigma": sigma, "run_id": run_id,
                           "config": resume_config(cfg), "world_size": d.world_size},
                )
            if bar is not None:
                bar.advance(metrics)
            log.info(
                "step %d/%d reward %.3f acc %.3f entropy %.3f sigma %.1e | rollout %.1fs (%.0f tok/s) update %.1fs",
                step + 1, tc.steps, metrics[T.REWARD_MEAN], metrics[T.TRAIN_ACCURACY], metrics[T.POLICY_ENTROPY], sigma,
                roll["seconds"], roll["tokens_per_s"], metrics[T.UPDATE_TIME_S],
            )
    except BaseException as exc:  # the run says how it ended: KILLED (Ctrl-C, SIGTERM) or FAILED, after which step
        T.mark_ended(logger, exc, last_step=history[-1]["step"] if history else start_step)
        raise
    finally:
        if bar is not None:
            bar.close()
        scorer.close()
        if own_engine:
            engine.close()

    if d.is_main:
        save_adapter(policy, final, meta={
            "method": cfg.method, "model": cfg.model.name, "seed": tc.seed, "steps": tc.steps, "mlflow_run_id": run_id,
            "base_dir": str(base_dir), "run_dir": str(run_dir), "world_size": d.world_size,
        })
        logger.log_artifact(final, artifact_path="final_adapter")
        _log_curves(logger, run_dir, cfg.method)
    d.barrier()
    seconds = time.perf_counter() - t_start
    logger.log_metrics({"time/total_s": seconds}, step=tc.steps)
    return TrainResult(run_dir, final, tc.steps, start_step, run_id, history, seconds, moved_aside)


def _step_metrics(g_all: dict, r: torch.Tensor, info: dict, upd: dict, sleep_metrics: dict, *, stage: int, sigma: float,
                  sigma_eff: float, times: dict[str, float], engine_cpu: tuple[float | None, float | None]) -> dict:
    """One step's metrics: the global batch's rewards and lengths (``_gather_step``), the update's
    statistics, AQN's sigma, the step's times and memory."""
    sampled, c_lens, truncated = g_all["sampled"], g_all["lengths"], g_all["truncated"]
    metrics = {
        # every sampled group (before DAPO's filter): the curves that compare across methods
        T.REWARD_MEAN: _mean(x["reward"] for x in sampled), T.REWARD_ACCURACY: _mean(x["accuracy"] for x in sampled),
        T.REWARD_FORMAT: _mean(x["format"] for x in sampled), T.TRAIN_ACCURACY: _mean(x["accuracy"] for x in sampled),
        # the kept groups the update trains on (equal to the above without dynamic sampling)
        "reward/kept_mean": float(r.mean()), "reward/std": float(r.std(unbiased=False)),
        "reward/kept_accuracy": _mean(x["accuracy"] for x in g_all["rewards"]),
        "reward/kept_format": _mean(x["format"] for x in g_all["rewards"]),
        "groups/sampled": g_all["sampled_groups"], "groups/kept": g_all["kept_groups"],
        "reward/overlong": g_all["overlong"],
        T.COMPLETION_LENGTH: float(c_lens.float().mean()), "completion/truncated_fraction": float(truncated.float().mean()),
        "groups/zero_std_fraction": g_all["zero_std_fraction"], "groups/refill_rounds": info["rounds"] - 1,
        T.AQN_SIGMA: sigma, "aqn/sigma_effective": sigma_eff, T.AQN_STAGE: stage, "optim/lr": upd["lr"],
        T.ROLLOUT_TOKENS_PER_S: g_all["tokens_per_s"], "time/rollout_s": g_all["rollout_s"], "time/reward_s": g_all["reward_s"],
        T.SYNC_TIME_S: times[T.SYNC_TIME_S], T.UPDATE_TIME_S: times[T.UPDATE_TIME_S], T.STEP_TIME_S: times[T.STEP_TIME_S],
        T.PEAK_MEMORY_GB: _peak_memory_gb(), **{k: v for k, v in upd.items() if k != "lr"}, **sleep_metrics,
        **reward_component_metrics(sampled),  # rewards/<name>/mean|std of a train.reward_fn list
    }
    if engine_cpu[0] is not None and engine_cpu[1] is not None:  # ~0: the engine leaves the cores to the update
        metrics["time/engine_cpu_during_update_s"] = engine_cpu[1] - engine_cpu[0]
    return metrics


def _engine_cpu(engine) -> float | None:
    """The engine processes' CPU seconds so far (``RolloutEngine.cpu_seconds``; None for engines without it)."""
    reader = getattr(engine, "cpu_seconds", None)
    value = reader() if callable(reader) else None
    return value if isinstance(value, (int, float)) else None


def _save_step_adapter(policy, folder: Path, d) -> Path:
    """Rank 0 writes the step's adapter folder; after the barrier every rank's engine may load it."""
    if d.is_main:
        folder.parent.mkdir(parents=True, exist_ok=True)
        save_adapter(policy, folder)
    d.barrier()
    return folder


def _gather_step(d, rewards: list[dict], info: dict, roll: dict, lengths: torch.Tensor, truncated: torch.Tensor) -> dict:
    """The step's global numbers from every rank's share (one process: its own): rewards of the kept and of every
    sampled group, completion lengths and truncation, and the rollout's time (the slowest rank's) and throughput."""
    mine = {"rewards": rewards, "sampled": info["sampled"], "lengths": lengths.tolist(), "truncated": truncated.tolist(),
            "seconds": roll["seconds"], "tokens": roll["tokens_per_s"] * roll["seconds"], "reward_s": info["reward_s"],
            "zero_std": info["zero_std_fraction"], "sampled_groups": info["sampled_groups"],
            "kept_groups": info["kept_groups"]}
    parts = d.all_gather_object(mine)
    seconds = max(p["seconds"] for p in parts)
    kept = [x for p in parts for x in p["rewards"]]
    return {
        "rewards": kept, "sampled": [x for p in parts for x in p["sampled"]],
        "counts": [len(p["rewards"]) for p in parts],
        "lengths": torch.tensor([x for p in parts for x in p["lengths"]]),
        "truncated": torch.tensor([x for p in parts for x in p["truncated"]], dtype=torch.bool),
        "rollout_s": seconds, "tokens_per_s": sum(p["tokens"] for p in parts) / seconds if seconds else 0.0,
        "reward_s": max(p["reward_s"] for p in parts), "zero_std_fraction": _mean(p["zero_std"] for p in parts),
        "overlong": _mean(x.get("overlong", 0.0) for x in kept), "sampled_groups": sum(p["sampled_groups"] for p in parts),
        "kept_groups": sum(p["kept_groups"] for p in parts),
    }


def _log_curves(logger: MetricsLogger, run_dir: Path, method: str) -> None:
    """``<run_dir>/train_curves.png`` (every step, also those before a resume) -> MLflow ``plots/``."""
    from qerl_pipeline.evaluation.plots import figure_png, plot_training  # matplotlib: only when a run ends

    history = _full_history(logger)
    if not history:
        return
    path = run_dir / "train_curves.png"
    try:
        write_atomic(path, figure_png(plot_training(history, method)))
        logger.log_artifact(path, artifact_path="plots")
    except Exception as exc:  # noqa: BLE001 - a plot must never fail a finished training
        log.warning("could not draw the training curves: %s", exc)


#: Metrics drawn in ``train_curves.png``.


def _full_history(logger: MetricsLogger) -> list[dict]:
    """Per-step metrics from the logger (MLflow: the run's whole history, also before a resume)."""
    if not hasattr(logger, "history"):  # the protocol's optional reader
        return []
    metrics = logger.history(T.CURVE_METRICS)
    rows: dict[int, dict] = {}
    for name, pts in metrics.items():
        for step, value in pts:
            if step and step > 0:
                rows.setdefault(step, {"step": step})[name] = value
    return [rows[s] for s in sorted(rows)]


def _tokenizer(base_dir: Path, cfg: QerlConfig):
    """The base folder's tokenizer (quantize saves it there), else the configured model's."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(base_dir)
    except (OSError, ValueError):
        tok = load_tokenizer(cfg.model)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
