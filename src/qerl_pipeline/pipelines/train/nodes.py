"""train nodes: one long-running node around ``qerl_pipeline.rl.trainer.train``.

The node gathers its parameter sections into a ``QerlConfig``, lets ``tracking.training_loggers``
choose where metrics go and returns ``({method: adapter folder}, summary)``. MLflow: a fresh
run logs into the run kedro-mlflow opened for this ``kedro run``. A resumed run (a
checkpoint in ``<train.output_dir>/<method>``) logs into the run id stored in the checkpoint
through ``MlflowClient``, so the whole training stays one MLflow run; the run kedro-mlflow
opened for the resuming ``kedro run`` gets a ``qerl.resumed_run_id`` tag pointing there, and
the original run is marked FINISHED when training completes (a SIGKILLed run is left
RUNNING by MLflow). ``train.nproc > 1``: the node launches the ranks with torchrun and follows
them (``rl/distributed.py``); rank 0 logs into the same MLflow run. In a compare branch (``compare_group``) the node trains once per seed of
``compare.seeds`` (``seeded_sections``: each seed sets ``train.seed``, ``rollout.seed`` and
``aqn.seed``), each in its own run folder ``<train.output_dir>/compare/seed-<k>/<method>`` and
its own child run of the compare run (tagged ``seed``), sharing the compare's engines.
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
    seeds: list[int] | None = None,
) -> tuple[dict[str, str], dict[str, Any]]:
    """Train ``method`` on ``train_prompts`` over the base folder; return ``({method: final adapter}, summary)``.

    ``data_report`` (data_prep's) and the base's quantize report (stored with the base) are
    logged into the training run (``data/report.json``, ``quantize/report.json`` and
    ``quantize/<name>`` metrics), so the run holds what it was trained on.

    The first output is the ``trained_adapters`` dataset's save (the adapter folder of this
    method: PEFT files, trained norms, ``qerl_adapter.json``), which evaluate reads. The run
    folder (checkpoints, step adapters) is ``<train.output_dir>/<method>``.

    ``compare_group`` (compare's branches only: ``{"run_id": <compare run>}``): one training
    per seed of ``seeds`` (``compare.seeds``), each with ``seeded_sections``, its run folder
    ``<train.output_dir>/compare/seed-<k>/<method>`` and its metrics in a child run of the
    compare run tagged ``seed`` (created on a fresh run; a resumed or finished one keeps its
    run, re-nested under this compare run). The outputs are then ``{"seed-<k>": adapter}``
    (the branch's ``trained_adapters`` folder holds ``seed-<k>/``) and a summary with one
    entry per seed under ``runs``.
    """
    sections = dict(model=model, lora=lora, rollout=rollout, grpo=grpo, aqn=aqn, optim=optim, train=train, reward=reward,
                    data=data)
    if not compare_group:
        cfg = train_config(method, sections)
        adapter, summary = _train_one(cfg, train_prompts, base_model, data_report)
        return {cfg.method: adapter}, summary
    adapters, runs = {}, []
    for seed in seeds if seeds is not None else [int((train or {}).get("seed", 0))]:
        cfg = train_config(method, seeded_sections(sections, seed))
        adapters[f"seed-{seed}"], summary = _train_one(cfg, train_prompts, base_model, data_report, compare_group, seed)
        runs.append(summary)
    return adapters, {"method": method, "seeds": [r["seed"] for r in runs], "runs": runs}


def seeded_sections(sections: dict[str, Any], seed: int) -> dict[str, Any]:
    """``sections`` with ``train.seed``, ``rollout.seed`` and ``aqn.seed`` set to ``seed`` (compare's seeds).

    These are every random stream of one training: data order, dropout and torch's seed
    (``train.seed``), the rollout sampling (``rollout.seed``) and the AQN noise draws
    (``aqn.seed``). The model's random initialisation, the data (generator, shuffles) and the
    evaluation's sampling seed stay as configured: every seed trains the same base on the same
    prompts and is evaluated the same way, so the seeds differ only in the training's randomness.
    """
    out = dict(sections)
    for name in ("train", "rollout", "aqn"):
        out[name] = {**(sections.get(name) or {}), "seed": int(seed)}
    return out


def _tagged(make_logger, tags: dict[str, str]):
    """``make_logger`` whose logger sets ``tags`` on its run (a compare branch's ``seed``)."""
    def make(run_id: str | None):
        logger = make_logger(run_id)
        logger.set_tags(tags)
        return logger

    return make


def _launch_ranks(cfg: QerlConfig, base_model: Any, train_prompts: list[dict], data_report: dict | None, name: str,
                  used: dict[str, Any]):
    """``train.nproc`` ranks under torchrun (``rl/distributed.py``); rank 0 logs into this run's MLflow run
    (or, resuming, the checkpoint's). ``used`` is filled as ``tracking.training_loggers`` would."""
    import mlflow

    from qerl_pipeline.config import flatten
    from qerl_pipeline.rl.distributed import launch
    from qerl_pipeline.tracking import MlflowLogger

    active = MlflowLogger()
    tracking = {"uri": mlflow.get_tracking_uri(), "active_run_id": active.run_id, "name": name,
                "params": flatten(cfg.model_dump(mode="json"))}
    result = launch(cfg, folder_of(base_model), list(train_prompts), tracking=tracking, dataset_name=cfg.data.train_source,
                    data_report=data_report, reward_fn=cfg.train.reward_fn)
    used["active"] = active.run_id
    used["run"] = active if result.run_id in (None, active.run_id) else MlflowLogger(run_id=result.run_id)
    return result


def _train_one(cfg: QerlConfig, train_prompts: list[dict], base_model: Any, data_report: dict | None,
               compare_group: dict | None = None, seed: int | None = None) -> tuple[str, dict[str, Any]]:
    """One training of ``cfg``: ``(final adapter folder, summary)``; ``compare_group``: a branch's (seed ``seed``)."""
    from qerl_pipeline.config import flatten
    from qerl_pipeline.rl.trainer import run_dir_for, train as run_training
    from qerl_pipeline.tracking import name_run, run_name, training_loggers

    name = run_name("train", cfg.method, cfg.model, cfg.train.seed)
    parent = compare_group["run_id"] if compare_group else None
    make_logger, used = training_loggers(name, cfg.method, flatten(cfg.model_dump(mode="json")), parent)
    output_dir = engine_factory = None
    if compare_group:  # the seed's run folder, and the engine the compare's nodes share (rollout/pool.py)
        from functools import partial

        from qerl_pipeline.rollout.pool import shared_engine

        output_dir = str(Path(cfg.train.output_dir) / "compare" / f"seed-{seed}")
        log.info("compare branch %s seed %d: run folder %s", cfg.method, seed, run_dir_for(cfg, output_dir))
        engine_factory = partial(shared_engine, model_cfg=cfg.model, rollout=cfg.rollout, lora_rank=cfg.lora.rank)
        make_logger = _tagged(make_logger, {"seed": str(seed)})

    if cfg.train.nproc * cfg.train.nnodes > 1:
        if compare_group:
            raise ValueError("train.nproc > 1 is not supported in compare branches (their engines are shared within one "
                             "process, rollout/pool.py): run compare with train.nproc=1, or train each method alone")
        result = _launch_ranks(cfg, base_model, train_prompts, data_report, name, used)
    else:
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
    if compare_group:
        summary["seed"] = seed
    return str(result.adapter_dir), summary
