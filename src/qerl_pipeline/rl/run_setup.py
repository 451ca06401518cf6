"""A training's setup: the parts ``rl/trainer.py``'s loop runs on, built once before the first step.

``setup`` builds them in the order their random draws and side effects need: the seed
(``train.seed``) before the LoRA's initialisation, the policy and its optimiser, the prompts, the
checkpoint's state (a resume) or the fresh run's record in the tracking run, the rollout engine
and its sleep during updates, the scorer, the norm weights the engine serves, the first step's
adapter. ``Run`` holds them; ``RunFolder`` is the run folder the trainer opened (``open_run``)
and its logger; ``Reporting`` what a training reports and where.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from qerl_pipeline import metric_names
from qerl_pipeline.adapter import adapter_meta, is_adapter, save_adapter, trained_norms
from qerl_pipeline.config import METHOD_FORMAT, QerlConfig
from qerl_pipeline.memory import limit_heap_fragmentation
from qerl_pipeline.models import load_tokenizer, resolve_dtype
from qerl_pipeline.platform import current_platform
from qerl_pipeline.quantization import aqn
from qerl_pipeline.quantization.norms import check_noise_precision
from qerl_pipeline.quantization.policy import build_policy
from qerl_pipeline.quantization.store import read_stamp
from qerl_pipeline.rewards.functions import RewardFn, make_scorer
from qerl_pipeline.rl import checkpoint as ckpt
from qerl_pipeline.rl.collect import PromptItem, PromptSampler, tokenize_prompts
from qerl_pipeline.rl.optim import build_optimizer, lr_factor
from qerl_pipeline.rl.ranks import SINGLE, rank_device
from qerl_pipeline.rl.update import Optim
from qerl_pipeline.rollout.layout import engine_plan
from qerl_pipeline.rollout.serving import open_engine, resolve_sync, served_model, served_tags
from qerl_pipeline.rollout.sleep import EngineSleeper, engine_platform, sleep_plan
from qerl_pipeline.tracking import MemoryLogger, MetricsLogger, scalar_metrics
from qerl_pipeline.tracking_view import TRAINING, dataset_input, git_commit

log = logging.getLogger(__name__)


def _memory_logger(_run_id: str | None) -> MetricsLogger:
    return MemoryLogger()


@dataclass
class Reporting:
    """Where and what a training reports.

    ``make_logger(run_id)``: the metrics logger; called with the run id stored in the checkpoint
    when resuming (None for a fresh run); in memory by default. A fresh run logs what it trains
    on: ``dataset_name`` (tag ``dataset``; default ``data.train_source``), ``data_report``
    (data_prep's) as ``data/report.json`` and the base's quantize report and fingerprint (stored
    with the base) as ``quantize/report.json``, ``quantize/fingerprint.json`` and
    ``quantize/<name>`` metrics. ``progress``: the console bar (rank 0's).
    """

    make_logger: Callable[[str | None], MetricsLogger] = _memory_logger
    dataset_name: str | None = None
    data_report: dict | None = None
    progress: bool = True


@dataclass
class RunFolder:
    """Where a training runs and what it resumes: the run folder (``open_run_dir``), the checkpoint to
    resume (None: a fresh run) and its stored state, where an earlier run was moved aside, the logger."""

    path: Path
    checkpoint: Path | None
    state: dict
    moved_aside: Path | None
    logger: MetricsLogger
    run_id: str | None

    @property
    def final(self) -> Path:
        return self.path / "final_adapter"

    def finished(self, steps: int) -> bool:
        """Trained to ``steps`` already, its final adapter of that many steps in place (a run resumed with more
        steps keeps the shorter run's final adapter until it writes its own; one without ``steps`` counts)."""
        return (
            self.checkpoint is not None
            and int(self.state.get("step", 0)) >= steps
            and is_adapter(self.final)
            and int(adapter_meta(self.final).get("steps", steps)) >= steps
        )

    @property
    def wrapped_up(self) -> Path:
        """Written last, once the final adapter and the curves are in the run's tracking store."""
        return self.path / "final_logged.json"

    def logged(self, steps: int) -> bool:
        """The final adapter of ``steps`` steps and the curves are in the tracking store (``wrapped_up`` says so):
        without it the run ended during its wrap-up, and its reuse logs them (``trainer.train``)."""
        try:
            return int(json.loads(self.wrapped_up.read_text())["steps"]) >= steps
        except (OSError, ValueError, KeyError, TypeError):
            return False


@dataclass
class Run:
    """A training's parts once ``setup`` built them, and the adapter the engine serves next
    (``adapter_dir``; ``written``: the step folders this call wrote, oldest first)."""

    cfg: QerlConfig
    dist: Any
    folder: RunFolder
    start_step: int
    policy: torch.nn.Module
    optim: Optim
    ref_norms: dict[str, torch.Tensor] | None
    noisy_names: list[str]
    sampler: PromptSampler
    items: list[PromptItem]
    pad_id: int
    engine: Any
    own_engine: bool
    sleeper: EngineSleeper
    scorer: Any
    sync: str
    adapter_dir: Path | None = None
    written: list[Path] = field(default_factory=list)

    def close(self) -> None:
        self.scorer.close()
        if self.own_engine:
            self.engine.close()


def setup(
    cfg: QerlConfig,
    base_dir: Path,
    records: list[dict],
    folder: RunFolder,
    reporting: Reporting,
    *,
    engine: Any = None,
    engine_factory: Callable[[Any], Any] | None = None,
    reward_fn: RewardFn | str | None = None,
    dist: Any = SINGLE,
) -> Run:
    """A training's parts, in the order their random draws need (``torch.manual_seed(train.seed)``, then the
    LoRA's initialisation): the policy and its optimiser, the prompts, the checkpoint's state (a resume) or
    the fresh run's record, the engine, the scorer, the norms the engine serves, the first step's adapter."""
    d, tc, rc = dist, cfg.train, cfg.rollout
    torch.manual_seed(tc.seed)
    platform = current_platform()
    dtype = resolve_dtype(cfg.model, platform)
    check_noise_precision(cfg, dtype)  # before any model loads
    limit_heap_fragmentation()  # glibc keeps freed activations otherwise (qerl_pipeline.memory)
    served = served_model(base_dir, METHOD_FORMAT[cfg.method], platform=platform)
    # adapter | merge, before any model loads (rollout/serving.py)
    sync = resolve_sync(rc.sync, served, rc.tensor_parallel_size)
    policy = build_policy(
        base_dir,
        METHOD_FORMAT[cfg.method],
        cfg.lora,
        dtype=dtype,
        device=rank_device(platform, d.local_rank) if d.active else platform,
        norm_dtype=cfg.model.norm_dtype,
    )
    policy.train()
    # the base's values of trained norms, before a resume loads trained ones: the KL reference's norms
    base_norms = {n: t.clone() for n, t in trained_norms(policy).items()}
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer, opt_note = build_optimizer(params, cfg)
    total_updates = tc.steps * cfg.grpo.updates_per_rollout
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda i: lr_factor(i, warmup=cfg.optim.warmup_steps, total=total_updates, schedule=cfg.optim.schedule),
    )
    tokenizer = _tokenizer(base_dir, cfg)
    items, dropped = tokenize_prompts(records, tokenizer, cfg.model.max_seq_len - rc.max_new_tokens)
    sampler, start_step = PromptSampler(len(items), tc.seed), 0
    if folder.checkpoint is not None:
        state = ckpt.load_checkpoint(folder.checkpoint, policy=policy, optimizer=optimizer, scheduler=scheduler)
        start_step = int(state["step"])
        sampler = PromptSampler(len(items), tc.seed, **state["sampler"])
        _log_resume(folder, start_step, d)
    else:
        _log_fresh_run(
            folder.logger,
            cfg,
            base_dir,
            dataset_name=reporting.dataset_name,
            optimizer_note=opt_note,
            data_report=reporting.data_report,
            moved_aside=folder.moved_aside,
            records=records,
        )
    if dropped:
        log.warning(
            "%d prompts longer than %d tokens were dropped", dropped, cfg.model.max_seq_len - rc.max_new_tokens
        )
    own_engine = engine is None and engine_factory is None
    engine, sleeper = _start_engine(cfg, served, sync, items, d, platform, engine, engine_factory)
    scorer = make_scorer(cfg, reward_fn)
    aqn_on = cfg.aqn_enabled()
    engine_norms = engine.norm_weight_names()
    sync_names = sorted(
        set((aqn.noisy_target_names(engine_norms) if aqn_on else []) + (engine_norms if cfg.lora.train_norms else []))
    )
    norm_params = aqn.norm_parameters(policy, sync_names) if sync_names else {}
    serving_tags = {**served_tags(served, engine), "model.norm_dtype": cfg.model.norm_dtype, "rollout.sync": sync}
    folder.logger.set_tags(serving_tags)
    log.info("engine serves %s in %s", serving_tags["rollout.served_format"], serving_tags["rollout.served_dtype"])
    run = Run(
        cfg,
        d,
        folder,
        start_step,
        policy,
        Optim(optimizer, scheduler, params, norm_params),
        ref_norms={n: base_norms[n] for n in norm_params if n in base_norms} or None,
        noisy_names=aqn.noisy_target_names(norm_params) if aqn_on else [],
        sampler=sampler,
        items=items,
        pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        engine=engine,
        own_engine=own_engine,
        sleeper=sleeper,
        scorer=scorer,
        sync=sync,
    )
    run.adapter_dir = _save_step_adapter(policy, folder.path / "adapters" / f"step-{start_step:06d}", d)
    run.written = [run.adapter_dir]
    folder.logger.log_metrics(
        {
            metric_names.DATA_PROMPTS: len(items),
            metric_names.DATA_DROPPED_PROMPTS: dropped,
            metric_names.WORLD_SIZE: d.world_size,
        },
        step=start_step,
    )
    return run


def _log_resume(folder: RunFolder, start_step: int, d) -> None:
    """A resumed run's log line and tags; rank 0 keeps damaged newer checkpoints aside (``qerl.resume_fallback``)."""
    log.info("resuming from %s (step %d, MLflow run %s)", folder.checkpoint, start_step, folder.run_id)
    kept = ckpt.set_aside_damaged(folder.path, folder.checkpoint) if d.is_main else []
    fallback = (
        {"qerl.resume_fallback": " | ".join(f"{dmg} (kept as {to.name})" for dmg, to in kept)[:4000]} if kept else {}
    )
    folder.logger.set_tags({"qerl.resumed_at_step": str(start_step), **fallback})


def _start_engine(
    cfg: QerlConfig,
    served,
    sync: str,
    items: list[PromptItem],
    d,
    platform: str,
    engine: Any,
    engine_factory: Callable[[Any], Any] | None,
) -> tuple[Any, EngineSleeper]:
    """The rollout engine (``engine`` as given, else ``engine_factory(served)``'s, else one started here on
    this rank's GPUs) and its sleep during the updates (``rollout/sleep.py``)."""
    rc = cfg.rollout
    ranks = dict(world_size=d.world_size, rank=d.rank, local_rank=d.local_rank)
    layout = engine_plan(rc, platform, **ranks)  # rollout.engines / tensor_parallel_size: this rank's engine and GPUs
    own_engine = engine is None and engine_factory is None
    if engine is None:
        # a merging engine needs no LoRA slots; its KV cache holds one step's rollout (CPU)
        kv_need = (
            math.ceil(cfg.train.prompts_per_step / d.world_size) * cfg.grpo.num_generations,
            max((len(it.ids) for it in items), default=0) + rc.max_new_tokens,
        )
        engine = (
            engine_factory(served)
            if engine_factory
            else open_engine(
                served,
                cfg.model,
                rollout=rc,
                lora_rank=cfg.lora.rank if sync == "adapter" else None,
                devices=layout.devices,
                kv_need=kv_need,
            )
        )
    if sync == "adapter" and not own_engine:
        engine.unmerge()  # a shared engine may still serve an earlier run's merged adapter under its LoRAs
    engine_on = engine_platform(engine, platform)  # where the engine runs, as its process reports
    sleeper = EngineSleeper(engine, sleep_plan(rc, engine_on, colocated=engine_plan(rc, engine_on, **ranks).colocated))
    log.info("engine sleep during updates: %s (%s)", "on" if sleeper.enabled else "off", sleeper.plan.why)
    return engine, sleeper


def _log_fresh_run(
    logger: MetricsLogger,
    cfg: QerlConfig,
    base_dir: Path,
    *,
    dataset_name: str | None,
    optimizer_note: str,
    data_report: dict | None,
    moved_aside: Path | None,
    records: list[dict[str, Any]],
) -> None:
    """A fresh run's tags, resolved config and inputs: its prompts a dataset input (a resumed run has them)."""
    logger.set_tags(
        {
            "method": cfg.method,
            "format": METHOD_FORMAT[cfg.method],
            "seed": str(cfg.train.seed),
            "model": cfg.model.name,
            "dataset": dataset_name or cfg.data.train_source,
            "git_commit": git_commit(),
            "optimizer": optimizer_note,
        }
    )
    logger.log_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), "config/resolved_config.yaml")
    log_inputs(logger, base_dir, data_report)
    logger.log_input(dataset_input(records, "train_prompts"), TRAINING)
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


def _save_step_adapter(policy, folder: Path, d) -> Path:
    """Rank 0 writes the step's adapter folder; after the barrier every rank's engine may load it."""
    if d.is_main:
        folder.parent.mkdir(parents=True, exist_ok=True)
        save_adapter(policy, folder)
    d.barrier()
    return folder


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
