"""train nodes: one long-running node around ``qerl_pipeline.rl.trainer.train``.

The node gathers its parameter sections into a ``QerlConfig``, chooses where metrics go
and returns a JSON-able summary. MLflow: a fresh run logs into the run kedro-mlflow
opened for this ``kedro run``. A resumed run (a checkpoint in
``<train.output_dir>/<method>``) logs into the run id stored in the checkpoint through
``MlflowClient``, so the whole training stays one MLflow run; the run kedro-mlflow opened
for the resuming ``kedro run`` gets a ``qerl.resumed_run_id`` tag pointing there, and the
original run is marked FINISHED when training completes (a SIGKILLed run is left
RUNNING by MLflow).
"""

from __future__ import annotations

import logging
from typing import Any

from qerl_pipeline.config import QerlConfig, validate
from qerl_pipeline.datasets.hf_model_folder import folder_of

log = logging.getLogger(__name__)


def train_config(method: str, sections: dict[str, Any]) -> QerlConfig:
    """A ``QerlConfig`` from the node's parameter sections (validated, dotted-path errors)."""
    return validate({"method": method, **{k: v for k, v in sections.items() if v is not None}}, QerlConfig)


def _mlflow_logger_factory():
    """``make_logger(run_id)`` for the trainer, and a list that records which run it used."""
    from qerl_pipeline.tracking import MlflowLogger

    used: dict[str, Any] = {}

    def make(run_id: str | None):
        logger = MlflowLogger()  # the active run (kedro-mlflow's), or a new one outside Kedro
        used["active"] = logger.run_id
        if run_id and run_id != logger.run_id:
            logger.set_tags({"qerl.resumed_run_id": run_id})
            try:
                logger.client.get_run(run_id)
            except Exception:  # noqa: BLE001 - e.g. a different tracking store: keep the new run
                log.warning("MLflow run %s of the checkpoint not found; logging to run %s", run_id, logger.run_id)
                return logger
            logger = MlflowLogger(run_id=run_id)
        used["run"] = logger
        return logger

    return make, used


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
) -> dict[str, Any]:
    """Train ``method`` on ``train_prompts`` over the base folder; return the training summary.

    Writes checkpoints and ``final_adapter/`` under ``<train.output_dir>/<method>`` (where the
    evaluate pipeline finds it) and logs metrics, tables and the adapter to MLflow.
    """
    from qerl_pipeline.rl.trainer import train as run_training

    cfg = train_config(method, dict(model=model, lora=lora, rollout=rollout, grpo=grpo, aqn=aqn, optim=optim,
                                    train=train, reward=reward, data=data))
    make_logger, used = _mlflow_logger_factory()
    result = run_training(cfg, folder_of(base_model), list(train_prompts), make_logger=make_logger,
                          dataset_name=cfg.data.train_source)
    run = used.get("run")
    if run is not None and run.run_id != used.get("active"):
        # the resumed original run (left RUNNING by the killed process); kedro-mlflow closes its own
        run.client.set_terminated(run.run_id, status="FINISHED")
    history = result.history
    first, last = (history[0], history[-1]) if history else ({}, {})
    return {
        "method": cfg.method,
        "model": cfg.model.name,
        "dataset": cfg.data.train_source,
        "base_dir": str(folder_of(base_model)),
        "adapter_dir": str(result.adapter_dir),
        "run_dir": str(result.run_dir),
        "mlflow_run_id": result.run_id,
        "steps": result.steps,
        "resumed_from_step": result.resumed_from,
        "seconds": round(result.seconds, 2),
        "reward_first": first.get("reward/mean"),
        "reward_last": last.get("reward/mean"),
        "history": [{k: v for k, v in h.items()} for h in history],
    }
