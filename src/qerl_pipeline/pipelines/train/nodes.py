"""train nodes: one node around ``qerl_pipeline.rl.trainer.train``, trains one method for some seeds.

A standalone run and a compare branch are the same loop over seeds (``train_policy``); what
differs is where each training goes:

* standalone: one training, ``train.seed`` as configured; run folder ``<train.output_dir>/<method>``;
  it logs into the run kedro-mlflow opened for this ``kedro run`` (``tracking.TrainingRun``);
  outputs ``({method: adapter}, summary)``.
* compare branch (``compare_group``, the compare's MLflow run): every seed of ``compare.seeds``
  (``seeded``), run folder ``<train.output_dir>/compare/seed-<k>/<method>``, a child run
  of the compare run tagged ``seed``, the compare's shared engines (``rollout/pool.py``); outputs
  ``({"seed-<k>": adapter}, {"method", "seeds", "runs"})`` (the branch's ``trained_adapters``
  folder holds ``seed-<k>/``).

A resumed training (a checkpoint in its run folder) logs into the run id stored in the
checkpoint, so one training stays one MLflow run (``tracking.TrainingRun``). ``train.nproc > 1``:
the node launches the ranks with torchrun and follows them (``rl/launch.py``); rank 0 logs
into the same MLflow run. Compare branches share engines within one process, so they train with
one rank.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any

from qerl_pipeline.config import SKIPPED_BRANCH, CompareConfig, QerlConfig, compare_branch, flatten
from qerl_pipeline.datasets.hf_model_folder import folder_of
from qerl_pipeline.metric_names import REWARD_MEAN
from qerl_pipeline.rl.launch import launch
from qerl_pipeline.rl.run_setup import Reporting
from qerl_pipeline.rl.trainer import TrainResult, run_dir_for
from qerl_pipeline.rl.trainer import train as run_training
from qerl_pipeline.rollout.pool import shared_engine
from qerl_pipeline.tracking import TrainingRun, run_name

log = logging.getLogger(__name__)


def train_policy(
    train_prompts: list[dict],
    base_model: Any,
    cfg: QerlConfig,
    data_report: dict | None = None,
    compare_group: dict | None = None,
    compare: CompareConfig | None = None,
) -> tuple[dict[str, str], dict[str, Any]]:
    """Train ``cfg.method`` on ``train_prompts`` over the base folder, once per seed (module docstring).

    ``cfg``: the ``training_config`` the pipeline gathers from the sections the training reads
    (``pipeline.SECTIONS``, ``config.gather``). A compare branch (``compare_group``) trains every seed of
    ``compare.seeds``; one whose method ``compare.methods`` leaves out trains nothing: it logs why and returns no
    adapter and the summary ``{"method", "skipped", "seeds": [], "runs": []}`` (``config.compare_branch``).

    ``data_report`` (data_prep's) and the base's quantize report (stored with the base) are
    logged into each training run (``data/report.json``, ``quantize/report.json`` and
    ``quantize/<name>`` metrics), so the run holds what it was trained on. The first output is
    the ``trained_adapters`` dataset's save (PEFT files, trained norms, ``qerl_adapter.json``).
    """
    method = cfg.method
    if not compare_group:
        adapter, summary = _train_seed(cfg, train_prompts, base_model, data_report)
        return {method: adapter}, summary
    seeds, skipped = compare_branch(compare or CompareConfig(), method)
    if skipped:
        log.info(skipped)
        return {}, {"method": method, SKIPPED_BRANCH: skipped, "seeds": [], "runs": []}
    adapters, runs = {}, []
    for seed in seeds:
        adapters[f"seed-{seed}"], summary = _train_seed(
            seeded(cfg, seed), train_prompts, base_model, data_report, compare_group, seed
        )
        runs.append(summary)
    return adapters, {"method": method, "seeds": [r["seed"] for r in runs], "runs": runs}


def dataset_name(cfg: QerlConfig) -> str:
    """What the training set is called in MLflow and the summary: ``data.train_source``,
    for ``file`` the path or Hub id."""
    user = cfg.data.train_file
    return (user.path or user.hub_id) if cfg.data.train_source == "file" and user else cfg.data.train_source


def seeded(cfg: QerlConfig, seed: int) -> QerlConfig:
    """``cfg`` with ``train.seed``, ``rollout.seed`` and ``aqn.seed`` set to ``seed`` (compare's seeds).

    These are every random stream of one training: data order, dropout and torch's seed
    (``train.seed``), the rollout sampling (``rollout.seed``) and the AQN noise draws
    (``aqn.seed``). The model's random initialisation, the data (generator, shuffles) and the
    evaluation's sampling seed stay as configured: every seed trains the same base on the same
    prompts and is evaluated the same way, so the seeds differ only in the training's randomness.
    """
    return cfg.model_copy(
        update={
            name: getattr(cfg, name).model_copy(update={"seed": int(seed)}) for name in ("train", "rollout", "aqn")
        }
    )


def _train_seed(
    cfg: QerlConfig,
    train_prompts: list[dict],
    base_model: Any,
    data_report: dict | None,
    compare_group: dict | None = None,
    seed: int | None = None,
) -> tuple[str, dict[str, Any]]:
    """One training of ``cfg``: ``(final adapter folder, summary)``; ``compare_group``: a branch's, seed ``seed``."""
    parent = compare_group["run_id"] if compare_group else None
    run = TrainingRun(
        run_name("train", cfg.method, cfg.model, cfg.train.seed),
        cfg.method,
        flatten(cfg.model_dump(mode="json")),
        parent,
        tags={"seed": str(seed)} if parent else None,
    )
    base_dir = folder_of(base_model)
    if cfg.train.nproc * cfg.train.nnodes > 1:
        if parent:  # hooks.cross_field_errors refuses it before any node; this for callers outside Kedro
            raise ValueError(cfg.train.compare_ranks_error())
        # the ranks read train.reward_fn from cfg
        result = launch(
            cfg,
            base_dir,
            list(train_prompts),
            tracking=run.launch_spec(),
            dataset_name=dataset_name(cfg),
            data_report=data_report,
        )
        run.adopt(result.run_id)
    else:
        output_dir = engine_factory = None
        if parent:  # the seed's run folder, and the engine the compare's nodes share
            output_dir = str(Path(cfg.train.output_dir) / "compare" / f"seed-{seed}")
            log.info("compare branch %s seed %d: run folder %s", cfg.method, seed, run_dir_for(cfg, output_dir))
            engine_factory = partial(shared_engine, model_cfg=cfg.model, rollout=cfg.rollout, lora_rank=cfg.lora.rank)
        try:
            reporting = Reporting(make_logger=run.logger, dataset_name=dataset_name(cfg), data_report=data_report)
            result = run_training(
                cfg,
                base_dir,
                list(train_prompts),
                output_dir=output_dir,
                reporting=reporting,
                engine_factory=engine_factory,
            )
        except BaseException as exc:  # a branch's or a resumed run the training opened never stays RUNNING
            run.fail(exc)
            raise
    run.finish()
    summary = train_summary(cfg, base_dir, result)
    if parent:
        summary["seed"] = seed
    return str(result.adapter_dir), summary


def train_summary(cfg: QerlConfig, base_dir: Path, result: TrainResult) -> dict[str, Any]:
    """The ``train_summary`` of one training: where its files and run are, its steps and reward curve."""
    history = result.history
    first, last = (history[0], history[-1]) if history else ({}, {})
    return {
        "method": cfg.method,
        "model": cfg.model.name,
        "dataset": dataset_name(cfg),
        "base_dir": str(base_dir),
        "adapter_dir": str(result.adapter_dir),
        "run_dir": str(result.run_dir),
        "mlflow_run_id": result.run_id,
        "steps": result.steps,
        "resumed_from_step": result.resumed_from,
        "reused": result.reused,
        "seconds": round(result.seconds, 2),
        "reward_first": first.get(REWARD_MEAN),
        "reward_last": last.get(REWARD_MEAN),
        "history": [dict(h) for h in history],
    }
