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
from pathlib import Path
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


def base_metrics(base_dir) -> dict[str, float]:
    """The scalar numbers of the base's quantize report (stored with the base) as ``quantize/<name>``
    metrics of the training run (the report's bytes-ratio column reads ``quantize/linear_bytes_ratio``)."""
    from qerl_pipeline.quantization.store import read_stamp

    report = (read_stamp(base_dir) or {}).get("report") or {}
    return {f"quantize/{k}": float(v) for k, v in report.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def log_inputs(logger, base_dir, data_report: dict | None) -> None:
    """The training run's record of its inputs: the data report and the base's quantize report."""
    import json

    from qerl_pipeline.quantization.store import read_stamp

    stamp = read_stamp(base_dir) or {}
    logger.log_metrics(base_metrics(base_dir), step=0)
    if stamp.get("report"):
        logger.log_text(json.dumps(stamp["report"], indent=1, default=str), "quantize/report.json")
        logger.log_text(json.dumps(stamp.get("fingerprint", {}), indent=1, default=str), "quantize/fingerprint.json")
    if data_report:
        logger.log_text(json.dumps(data_report, indent=1, default=str), "data/report.json")


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
    from qerl_pipeline.rl.trainer import run_dir_for, train as run_training
    from qerl_pipeline.tracking import MlflowLogger, child_run, name_run, regroup, run_name

    cfg = train_config(method, dict(model=model, lora=lora, rollout=rollout, grpo=grpo, aqn=aqn, optim=optim,
                                    train=train, reward=reward, data=data))
    name = run_name("train", cfg.method, cfg.model, cfg.train.seed)
    output_dir, engine_factory = None, None
    if compare_group:
        from qerl_pipeline.config import flatten
        from qerl_pipeline.rollout.pool import shared_engine

        def _shared(served):
            return shared_engine(served, cfg.model, rollout=cfg.rollout, lora_rank=cfg.lora.rank)

        engine_factory = _shared

        output_dir = str(Path(cfg.train.output_dir) / "compare")
        parent = compare_group["run_id"]
        log.info("compare branch %s: run folder %s", cfg.method, run_dir_for(cfg, output_dir))

        def make_logger(stored: str | None):
            if stored:
                regroup(stored, parent)
                return MlflowLogger(run_id=stored)
            rid = child_run(parent, name, tags={"method": cfg.method})
            name_run(rid, name, "train")
            logger = MlflowLogger(run_id=rid)
            logger.log_params(flatten(cfg.model_dump(mode="json")))
            return logger

        used: dict[str, Any] = {}
    else:
        make_logger, used = _mlflow_logger_factory()
    result = run_training(cfg, folder_of(base_model), list(train_prompts), make_logger=make_logger,
                          dataset_name=cfg.data.train_source, output_dir=output_dir, engine_factory=engine_factory)
    if compare_group:
        from mlflow.tracking import MlflowClient

        MlflowClient().set_terminated(result.run_id, status="FINISHED")
    else:
        run = used.get("run")
        if run is not None and run.run_id != used.get("active"):
            # the resumed original run (left RUNNING by the killed process); kedro-mlflow closes its own
            run.client.set_terminated(run.run_id, status="FINISHED")
        if result.run_id and not result.resumed_from:
            name_run(result.run_id, name, "train")
    if result.run_id and not result.reused:
        log_inputs(MlflowLogger(run_id=result.run_id), folder_of(base_model), data_report)
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
