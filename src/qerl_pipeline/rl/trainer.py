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
   each round is decided once for all of them (``collect.collect``). Honest curves:
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
   (or ``log_kl_to_base``, on every ``log_kl_to_base_every``-th step) the reference log-probs are the clean base's:
   the same model with the adapter disabled, no noise, and the base's norm values (no second model).
   What the engine serves (``rollout/serving.py``: FP4 on CUDA, the decoded dense copy on
   CPU) and in which dtype is tagged on the run (``rollout.served_format``/``_dtype``).
5. The adapter is saved to a new step folder (the engine loads it under a new LoRA id);
   checkpoints every ``checkpoint_every`` steps.

``train`` reads as that loop: ``setup`` (``rl/run_setup.py``) builds the parts once, then each step is
``_train_step``. The step's parts live where their concept does: the rollout side (prompts, sampling
seeds, ``collect``) in ``rl/collect.py``, the update side (log-probs, ``policy_update``) in
``rl/update.py``, and the records passed between them (``Rollout``, ``Batch``, ``UpdateStats``,
``StepStats``: fields named as metrics in ``metric_names.py``) in ``rl/records.py``; this module is the
loop, the run folder and run control.

Resume: the newest intact checkpoint of ``<output_dir>/<method>`` (``open_run_dir``) restores
trainable tensors, optimizer, scheduler, RNG, data cursor and the MLflow run id; metrics go on in that run.
A fresh run never mixes with an earlier one's files: the earlier folder is moved aside
first (``open_run_dir``). A run folder trained to the last step is reused; if its run ended during
the wrap-up (final adapter and curves not yet in MLflow, ``RunFolder.logged``), the reuse logs them.
Every random draw is a function of ``(seed, step)`` (sampling seeds, AQN noise, data
order), so a resumed run reproduces the uninterrupted one.

Tracking server away: what the run logs waits in the run folder's journal (``JOURNAL_FILE``) and is sent
when it answers; past ``tracking.outage_s`` the loop checkpoints the step it finished and stops
(``tracking_journal.TrackingOutage``); run again, the journal is sent first and the run goes on.

A NaN/Inf loss raises ``TrainingDiverged`` naming the step before any optimizer update,
so the newest checkpoint is the last good state. A loop that ends early marks its MLflow run
(``tracking.mark_ended``): FAILED with the error's one-line summary, or KILLED (Ctrl-C, SIGTERM)
with the signal, both with the last completed step.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qerl_pipeline import metric_names, tracking
from qerl_pipeline.adapter import save_adapter
from qerl_pipeline.atomic import write_atomic
from qerl_pipeline.config import QerlConfig, flatten
from qerl_pipeline.memory import peak_memory_bytes
from qerl_pipeline.quantization import aqn
from qerl_pipeline.quantization.norms import sigma_effective
from qerl_pipeline.rewards.functions import RewardFn
from qerl_pipeline.rl import checkpoint as ckpt
from qerl_pipeline.rl.collect import collect, completion_rows
from qerl_pipeline.rl.ranks import SINGLE
from qerl_pipeline.rl.records import Batch, Rollout, RolloutStats, StepStats
from qerl_pipeline.rl.run_setup import Reporting, Run, RunFolder, _save_step_adapter, setup
from qerl_pipeline.rl.update import policy_update
from qerl_pipeline.terminal import TrainProgress
from qerl_pipeline.tracking import MetricsLogger
from qerl_pipeline.tracking_journal import JOURNAL_FILE

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
RESUMABLE_CHANGES = (
    "train.steps",
    "train.resume",
    "train.checkpoint_every",
    "train.log_completions_every",
    "train.output_dir",
    "train.nproc",
    "train.nnodes",
    "train.node_rank",
    "train.master_addr",
    "train.master_port",
    "quantize.force",
    "quantize.verify",
    "rollout.shared_engines",
    "rollout.gpu_memory_utilization",
    "rollout.sleep_between_steps",
    "rollout.sleep_level",
    "reward.max_workers",
    "data.eval_files",
    "evaluate",
    "compare",
    "benchmark",
)


def resume_config(cfg: QerlConfig) -> dict[str, Any]:
    """The flattened settings a checkpoint must share with the config that resumes it."""
    flat = flatten(cfg.model_dump(mode="json"))
    return {k: v for k, v in flat.items() if not any(k == p or k.startswith(p + ".") for p in RESUMABLE_CHANGES)}


def config_changes(
    stored: dict[str, Any], current: dict[str, Any], defaults: dict[str, Any] | None = None
) -> list[str]:
    """Dotted keys whose value differs between a checkpoint's settings and the current ones.

    A key the checkpoint lacks whose current value is its default (``defaults``) is no change:
    the checkpoint predates that setting, and a new setting's default keeps the behaviour it was trained with.
    """
    defaults = defaults or {}
    return sorted(
        k
        for k in stored.keys() | current.keys()
        if stored.get(k) != current.get(k)
        and not (k not in stored and k in defaults and current.get(k) == defaults[k])
    )


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
    reporting: Reporting | None = None,
    engine: Any = None,
    engine_factory: Callable[[Any], Any] | None = None,
    reward_fn: RewardFn | str | None = None,
    dist: Any = None,
) -> TrainResult:
    """Train ``cfg.method`` on ``records`` (prompt records) over the base in ``base_dir``.

    ``output_dir``: where the run folder goes (default ``train.output_dir``; ``open_run_dir``).
    ``reporting``: the metrics logger and what a fresh run logs (``Reporting``; in memory by default).
    ``engine``: an already started ``RolloutEngine`` on the serving folder (tests share one); by
    default one is started and closed here; ``engine_factory(served)`` (instead of ``engine``):
    called with the ``ServedModel`` when the engine is needed (not for a run that is finished
    already), its engine is not closed here (compare's shared engine, ``rollout/pool.py``).
    ``reward_fn(completions, golds, samples) -> list[dict]`` (or an import path
    ``"module:function"``): a custom reward replacing the math ``RewardScorer``, the hook for
    custom rewards (like TRL's ``reward_funcs``); default ``cfg.train.reward_fn``. ``dist``: this
    rank of a data-parallel training (``rl/launch.py``, which launches the ranks and passes it;
    None = one process): rank 0 alone writes files and MLflow.
    """
    t_start = time.perf_counter()
    d, tc, reporting = dist or SINGLE, cfg.train, reporting or Reporting()
    folder = open_run(cfg, output_dir, reporting, d)
    if folder.finished(tc.steps):  # a compare or a kedro run resumed after a later step failed: reuse it
        log.info(
            "%s: already trained to step %d in %s (MLflow run %s); reusing it (train.resume=false trains anew)",
            cfg.method,
            int(folder.state["step"]),
            folder.path,
            folder.run_id,
        )
        if d.is_main and not folder.logged(tc.steps):  # it ended after its final adapter, before the rest
            log.info("%s: its run ended before its final adapter and curves were logged; logging them", cfg.method)
            _log_final(folder, cfg.method, tc.steps)
        return TrainResult(
            folder.path,
            folder.final,
            tc.steps,
            int(folder.state["step"]),
            folder.run_id,
            _full_history(folder.logger),
            time.perf_counter() - t_start,
            None,
            reused=True,
        )
    run = setup(
        cfg,
        Path(base_dir),
        records,
        folder,
        reporting,
        engine=engine,
        engine_factory=engine_factory,
        reward_fn=reward_fn,
        dist=d,
    )
    logger, history = folder.logger, []
    bar = TrainProgress(tc.steps, run.start_step) if reporting.progress and d.is_main else None
    try:
        for step in range(run.start_step, tc.steps):
            rollout, stats = _train_step(run, step)
            metrics = stats.metrics()
            logger.log_metrics(metrics, step=step + 1)
            history.append({"step": step + 1, **metrics})
            if (
                step + 1
            ) % tc.log_completions_every == 0 or step == run.start_step:  # rank 0's share of the completions
                logger.log_table(
                    completion_rows(rollout, run.items, step + 1), f"completions/step_{step + 1:05d}.json"
                )
            if d.is_main and ((step + 1) % tc.checkpoint_every == 0 or step + 1 == tc.steps):
                _save_checkpoint(run, step + 1, stats)
            if bar is not None:
                bar.advance(metrics)
            log.info(
                "step %d/%d reward %.3f acc %.3f entropy %.3f sigma %.1e | rollout %.1fs (%.0f tok/s) update %.1fs",
                step + 1,
                tc.steps,
                metrics[metric_names.REWARD_MEAN],
                metrics[metric_names.TRAIN_ACCURACY],
                stats.update.entropy,
                stats.aqn_sigma,
                rollout.seconds,
                rollout.tokens_per_s,
                stats.update_s,
            )
            if away := (logger.outage() if hasattr(logger, "outage") else None):  # away past tracking.outage_s
                if d.is_main and (step + 1) % tc.checkpoint_every and step + 1 != tc.steps:
                    _save_checkpoint(run, step + 1, stats)  # a resume goes on after the step the journal holds
                raise away
        if d.is_main:
            _save_final_adapter(run, base_dir)
    except BaseException as exc:  # the run says how it ended: KILLED (Ctrl-C, SIGTERM) or FAILED, after which step
        tracking.mark_ended(logger, exc, last_step=history[-1]["step"] if history else run.start_step)
        raise
    finally:
        if bar is not None:
            bar.close()
        run.close()
    d.barrier()
    seconds = time.perf_counter() - t_start
    logger.log_metrics({metric_names.TOTAL_TIME_S: seconds}, step=tc.steps)
    return TrainResult(
        folder.path, folder.final, tc.steps, run.start_step, folder.run_id, history, seconds, folder.moved_aside
    )


def open_run(cfg: QerlConfig, output_dir: str | Path | None, reporting: Reporting, d) -> RunFolder:
    """Rank 0 opens (or moves aside) the run folder, the others take its decision; a checkpoint of another
    world size is refused; the logger is opened on the checkpoint's run id."""
    run_dir, latest, moved_aside = d.broadcast_object(open_run_dir(cfg, output_dir) if d.is_main else None)
    stored = ckpt.peek_state(latest) if latest is not None else {}
    if latest is not None and int(stored.get("world_size", 1)) != d.world_size:
        raise ValueError(
            f"{latest} was written by a training on {stored.get('world_size', 1)} rank(s); this run has "
            f"{d.world_size} (train.nproc x train.nnodes): resume it with the same number of ranks, or start anew "
            "with train.resume=false"
        )
    logger = reporting.make_logger(stored.get("run_id"))
    if d.is_main and hasattr(logger, "keep_journal"):  # what it logs survives a tracking server that is away
        logger.keep_journal(run_dir / JOURNAL_FILE, cfg.tracking.outage_s, after_step=stored.get("step"))
    return RunFolder(run_dir, latest, stored, moved_aside, logger, getattr(logger, "run_id", None))


def _train_step(run: Run, step: int) -> tuple[Rollout, StepStats]:
    """One step: the norms and adapter the engine serves, rollout + rewards (``collect``), the global batch's
    advantages, the update, the next adapter; this rank's rollout and the step's statistics."""
    cfg, d, engine = run.cfg, run.dist, run.engine
    t0 = time.perf_counter()
    norms = _serve_norms(run, step)
    sync_s = norms.seconds
    if run.sync == "merge":  # the step's adapter into the served linears; the rollout then runs without LoRA
        sync_s += engine.merge_adapter(run.adapter_dir)
    lora = run.adapter_dir if run.sync == "adapter" else None
    rollout = collect(engine, run.scorer, run.sampler, run.items, cfg, step, lora, dist=d)
    first = rollout.groups[0][0].prompt_ids if rollout.groups else None
    run.sleeper.before_update(lora, first)  # CUDA + colocated: the update gets the memory
    t_roll = time.perf_counter()
    totals = RolloutStats.gather(rollout, d)  # the global batch (every rank's share, in rank order)
    batch = Batch.of(
        rollout.samples,
        totals.advantages(cfg.grpo, d.rank),
        norms.values,
        pad_id=run.pad_id,
        mask_truncated=cfg.grpo.mask_truncated,
    )
    engine_cpu0 = _engine_cpu(engine)
    update = policy_update(run.policy, run.optim, batch, cfg, step, ref_norms=run.ref_norms, dist=d)
    t_upd = time.perf_counter()
    engine_cpu1 = _engine_cpu(engine)
    _next_adapter(run, step + 1)
    sleep = run.sleeper.after_update(run.adapter_dir if run.sync == "adapter" else None)  # wake, probe, register it
    engine_cpu = engine_cpu1 - engine_cpu0 if engine_cpu0 is not None and engine_cpu1 is not None else None
    return rollout, StepStats(
        totals,
        update,
        norms.stage,
        norms.sigma,
        norms.sigma_effective,
        sync_s=sync_s,
        update_s=t_upd - t_roll,
        step_s=time.perf_counter() - t0,
        peak_memory_gb=_peak_memory_gb(),
        sleep=sleep,
        engine_cpu_s=engine_cpu,
    )


@dataclass
class ServedNorms:
    """The norm weights the engine serves for a step: AQN's ``stage`` and ``sigma`` (0 without AQN), the
    values by name (``values``: AQN's noisy targets and trained norms; empty without either), the std of
    served minus clean on AQN's targets (``sigma_effective``) and the seconds the sync took."""

    stage: int
    sigma: float
    sigma_effective: float
    values: dict[str, torch.Tensor]
    seconds: float


def _serve_norms(run: Run, step: int) -> ServedNorms:
    """AQN's noise for ``(aqn.seed, step)`` on the clean norms, set on the engine (also at sigma 0, which
    restores the clean values, and every step when norms train), then read back: the trainer uses the
    values the engine serves (its dtype may round)."""
    cfg, engine = run.cfg, run.engine
    aqn_on = cfg.aqn_enabled()
    stage, sigma = aqn.sigma_at(step, cfg.train.steps, cfg.aqn) if aqn_on else (0, 0.0)
    clean = {n: p.detach().cpu().clone() for n, p in run.optim.norm_params.items()}
    noise = aqn.draw_noise(clean, sigma, seed=cfg.aqn.seed, step=step) if aqn_on else None
    noisy = aqn.apply_noise(clean, noise) if clean else {}
    seconds = engine.update_weights(noisy) if noisy else 0.0
    if noisy:
        noisy = engine.read_weights(sorted(noisy))
    return ServedNorms(stage, sigma, sigma_effective(noisy, clean, run.noisy_names), noisy, seconds)


def _next_adapter(run: Run, step: int) -> None:
    """The adapter after ``step`` steps into ``adapters/step-NNNNNN`` (rank 0 writes, every rank waits), the one
    the engine serves next; rank 0 then keeps this call's last two step folders (``prune_adapters``)."""
    run.adapter_dir = _save_step_adapter(run.policy, run.folder.path / "adapters" / f"step-{step:06d}", run.dist)
    run.written = [*run.written[-1:], run.adapter_dir]
    if run.dist.is_main:
        prune_adapters(run.adapter_dir.parent, run.written)


def _save_checkpoint(run: Run, step: int, stats: StepStats) -> None:
    """Checkpoint ``step`` (completed steps) of the run folder: what a resume restores (``rl/checkpoint.py``)."""
    ckpt.save_checkpoint(
        run.folder.path,
        step,
        policy=run.policy,
        optimizer=run.optim.optimizer,
        scheduler=run.optim.scheduler,
        state={
            "step": step,
            "sampler": run.sampler.state(),
            "aqn_stage": stats.aqn_stage,
            "aqn_sigma": stats.aqn_sigma,
            "run_id": run.folder.run_id,
            "config": resume_config(run.cfg),
            "world_size": run.dist.world_size,
        },
    )


def _save_final_adapter(run: Run, base_dir: str | Path) -> None:
    """Rank 0: ``final_adapter/`` with what it is, into MLflow with the training curves."""
    cfg, folder = run.cfg, run.folder
    save_adapter(
        run.policy,
        folder.final,
        meta={
            "method": cfg.method,
            "model": cfg.model.name,
            "seed": cfg.train.seed,
            "steps": cfg.train.steps,
            "mlflow_run_id": folder.run_id,
            "base_dir": str(base_dir),
            "run_dir": str(folder.path),
            "world_size": run.dist.world_size,
        },
    )
    _log_final(folder, cfg.method, cfg.train.steps)


def _log_final(folder: RunFolder, method: str, steps: int) -> None:
    """The final adapter and the curves into the run's tracking store, then the folder's ``wrapped_up`` marker
    (a reuse of a folder without it logs them again: the run ended in between)."""
    folder.logger.log_artifact(folder.final, artifact_path="final_adapter")
    _log_curves(folder.logger, folder.path, method)
    _log_summary(folder.logger, steps)
    write_atomic(folder.wrapped_up, {"run_id": folder.run_id, "steps": steps}, as_json=True)


def _engine_cpu(engine) -> float | None:
    """The engine processes' CPU seconds so far (``RolloutEngine.cpu_seconds``; None for engines without it)."""
    reader = getattr(engine, "cpu_seconds", None)
    value = reader() if callable(reader) else None
    return value if isinstance(value, (int, float)) else None


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
    except Exception as exc:  # a plot must never fail a finished training
        log.warning("could not draw the training curves: %s", exc)


def _log_summary(logger: MetricsLogger, steps: int) -> None:
    """The run's sort columns in MLflow's runs list (``metric_names.REWARD_AREA`` and the two after it)."""
    from qerl_pipeline.evaluation.stats import curve_auc

    if not hasattr(logger, "history"):
        return
    got = logger.history([metric_names.REWARD_MEAN, metric_names.STEP_TIME_S])
    reward, step_s = got[metric_names.REWARD_MEAN], [v for _, v in got[metric_names.STEP_TIME_S]]
    if reward:
        last = max(reward)[1]  # the point of the highest step
        summary = {metric_names.REWARD_AREA: curve_auc(reward), metric_names.FINAL_REWARD: last}
        if step_s:
            summary[metric_names.MEAN_STEP_S] = sum(step_s) / len(step_s)
        logger.log_metrics(summary, step=steps)


def _full_history(logger: MetricsLogger) -> list[dict]:
    """Per-step metrics from the logger (MLflow: the run's whole history, also before a resume)."""
    if not hasattr(logger, "history"):  # the protocol's optional reader
        return []
    metrics = logger.history(metric_names.CURVE_METRICS)
    rows: dict[int, dict] = {}
    for name, pts in metrics.items():
        for step, value in pts:
            if step and step > 0:
                rows.setdefault(step, {"step": step})[name] = value
    return [rows[s] for s in sorted(rows)]
