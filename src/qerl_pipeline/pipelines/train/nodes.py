"""train nodes: one long-running node around ``qerl_pipeline.rl.trainer.train``.

The node gathers its parameter sections into a ``QerlConfig``, lets ``tracking.training_loggers``
choose where metrics go and returns ``({method: adapter folder}, summary)``. MLflow: a fresh
run logs into the run kedro-mlflow opened for this ``kedro run``. A resumed run (a
checkpoint in ``<train.output_dir>/<method>``) logs into the run id stored in the checkpoint
through ``MlflowClient``, so the whole training stays one MLflow run; the run kedro-mlflow
opened for the resuming ``kedro run`` gets a ``qerl.resumed_run_id`` tag pointing there, and
the original run is marked FINISHED when training completes (a SIGKILLed run is left
RUNNING by MLflow). In a compare branch (``compare_group``) the training has a child run of
the compare run and shares the compare's engines.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from qerl_pipeline.config import QerlConfig, validate
from qerl_pipeline.datasets.hf_model_folder import folder_of

log = logging.getLogger(__name__)


def train_config(method: str, sections: dict[str, Any]) -> QerlConfig:
    """A ``QerlConfig`` from the node's parameter sections (validated, dotted-path errors)."""
    return validate({"method": method, **{k: v for k, v in sections.items() if v is not None}}, QerlConfig)


def train_policy(
    train_prompts: list[dict],
    base_model: Any,
    method: str,
    model: dict,
    lora: dict,
    rollout: dict,
    grpo: dict,
    aqn: dict,
    optim: dict,
    train: dict,
    reward: dict,
    data: dict,
    data_report: dict | None = None,
    compare_group: dict | None = None,
) -> tuple[dict[str, str], dict[str, Any]]:
    """Train ``method`` on ``train_prompts`` over the base folder; return ``({method: final adapter}, summary)``.

    ``data_report`` (data_prep's) and the base's quantize report (stored with the base) are
    logged into the training run (``data/report.json``, ``quantize/report.json`` and
    ``quantize/<name>`` metrics), so the run holds what it was trained on.

    The first output is the ``trained_adapters`` dataset's save (the adapter folder of this
    method: PEFT files, trained norms, ``qerl_adapter.json``), which evaluate reads. The run
    folder (checkpoints, step adapters) is ``<train.output_dir>/<method>``.

    ``compare_group`` (compare's branches only: ``{"run_id": <compare run>}``): the run
    folder is ``<train.output_dir>/compare/<method>`` and the metrics go to a child run of
    the compare run (created on a fresh run; a resumed or finished branch keeps its run,
    re-nested under this compare run).
    """
    from qerl_pipeline.config import flatten
    from qerl_pipeline.rl.trainer import run_dir_for, train as run_training
    from qerl_pipeline.tracking import name_run, run_name, training_loggers

    cfg = train_config(method, dict(model=model, lora=lora, rollout=rollout, grpo=grpo, aqn=aqn, optim=optim,
                                    train=train, reward=reward, data=data))
    name = run_name("train", cfg.method, cfg.model, cfg.train.seed)
    parent = compare_group["run_id"] if compare_group else None
    make_logger, used = training_loggers(name, cfg.method, flatten(cfg.model_dump(mode="json")), parent)
    output_dir = engine_factory = None
    if compare_group:  # the branch's run folder, and the engine the compare's nodes share (rollout/pool.py)
        from functools import partial

        from qerl_pipeline.rollout.pool import shared_engine

        output_dir = str(Path(cfg.train.output_dir) / "compare")
        log.info("compare branch %s: run folder %s", cfg.method, run_dir_for(cfg, output_dir))
        engine_factory = partial(shared_engine, model_cfg=cfg.model, rollout=cfg.rollout, lora_rank=cfg.lora.rank)

    result = run_training(cfg, folder_of(base_model), list(train_prompts), make_logger=make_logger,
                          dataset_name=cfg.data.train_source, output_dir=output_dir, engine_factory=engine_factory,
                          data_report=data_report)
    run = used.get("run")
    if run is not None and (compare_group or run.run_id != used.get("active")):
        # a branch's own run, or the resumed original run (left RUNNING by a killed process);
        # kedro-mlflow closes the run it opened itself
        run.client.set_terminated(run.run_id, status="FINISHED")
    if result.run_id and not compare_group and not result.resumed_from:
        name_run(result.run_id, name, "train")
    history = result.history
    first, last = (history[0], history[-1]) if history else ({}, {})
    summary = {
        "method": cfg.method,
        "model": cfg.model.name,
        "dataset": cfg.data.train_source,
        "base_dir": str(folder_of(base_model)),
        "adapter_dir": str(result.adapter_dir),
        "run_dir": str(result.run_dir),
        "mlflow_run_id": result.run_id,
        "steps": result.steps,
        "resumed_from_step": result.resumed_from,
        "reused": result.reused,
        "seconds": round(result.seconds, 2),
        "reward_first": first.get("reward/mean"),
        "reward_last": last.get("reward/mean"),
        "history": [{k: v for k, v in h.items()} for h in history],
    }
    return {cfg.method: str(result.adapter_dir)}, summary
