"""One method's evaluation over its trained adapters, one per seed: the evaluate pipeline's and a compare branch's.

``evaluate_adapters`` is the one loop. Each adapter is evaluated as the policy ``trained`` and,
with ``evaluate.include_base``, the base alone as ``base``, both on an engine serving
``rollout.serving.served_model(base_dir)`` (``evaluator.evaluate_policies``).

* The evaluate pipeline: one adapter (seed key None), its own engine; the result is returned
  as it is, and the pipeline's datasets log it into the ``kedro run``'s MLflow run.
* A compare branch (``branch=True``): one adapter per seed, on the compare's shared engine
  (``rollout/pool.py``). Each seed's evaluation is logged into its training run (the
  adapter's ``mlflow_run_id``) with its ``evaluation_key``, through that training's run folder
  journal (``tracking_journal.py``: a server away keeps it there up to ``tracking.outage_s``, and a
  rerun sends it first); a run that already holds an evaluation with that key is reused, not
  redone (a resumed compare). The base alone is
  evaluated once, with the first seed evaluated here: same base, prompts and settings give the
  same numbers, so later seeds' results get a copy of its records (tag
  ``qerl.base_eval_of_seed``). Records, skipped prompts and timings then carry the seed
  (``seed`` field, ``seed-<k>/`` timing prefix).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from qerl_pipeline.adapter import adapter_meta
from qerl_pipeline.config import (
    DataConfig,
    EvaluateConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TrackingConfig,
)
from qerl_pipeline.evaluation.evaluator import (
    EvalResult,
    adapter_rank,
    evaluate_policies,
    evaluation_key,
    evaluation_metrics,
    log_benchmark_inputs,
    log_evaluation,
    logged_evaluation,
)
from qerl_pipeline.evaluation.metrics import aggregate
from qerl_pipeline.metric_names import BASE_WEIGHT_MIB
from qerl_pipeline.quantization.checkpoint import folder_bytes
from qerl_pipeline.rollout.pool import shared_engine
from qerl_pipeline.rollout.serving import served_model
from qerl_pipeline.tracking import MlflowLogger
from qerl_pipeline.tracking_journal import JOURNAL_FILE, await_server

log = logging.getLogger(__name__)


def flatten_prompts(eval_prompts: dict[str, list[dict[str, Any]]] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """data_prep's ``{source: [records]}`` (the ``eval_prompts`` dataset) as one list;
    the dict key is the benchmark name."""
    if isinstance(eval_prompts, list):
        return list(eval_prompts)
    out = []
    for source, records in eval_prompts.items():
        out += [{**r, "source": source} for r in records]
    return out


def evaluate_config(evaluate: EvaluateConfig, data: DataConfig) -> EvaluateConfig:
    """The ``evaluate`` section with the user's sets (``data.eval_files``) scored after ``evaluate.benchmarks``."""
    user_sets = [n for n in data.eval_files if n not in evaluate.benchmarks]
    return evaluate.model_copy(update={"benchmarks": [*evaluate.benchmarks, *user_sets]}) if user_sets else evaluate


def base_weight_mib(base_dir: str | Path) -> float:
    """Size of the base checkpoint's files (without its serving/ and bnb/ copies), MiB."""
    return folder_bytes(Path(base_dir)) / 2**20


def accuracy_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (policy, benchmark), per (seed, policy, benchmark) when records carry a seed (compare)."""
    if not records:
        raise ValueError(
            "evaluation produced no records (no benchmark had prompts; check evaluate.benchmarks vs data.eval_sources)"
        )
    seeded = any("seed" in r for r in records)
    return aggregate(records, keys=("seed", "policy", "source") if seeded else ("policy", "source"))


def result_metrics(result: EvalResult, rows: list[dict[str, Any]]) -> dict[str, float]:
    """The MLflow metrics of ``result`` (``evaluator.evaluation_metrics``); with seeds, each seed's
    under ``seed-<k>/``, the names logged into that seed's run prefixed."""
    if not any("seed" in r for r in rows):
        return evaluation_metrics(result, rows)
    metrics = {}
    for seed in dict.fromkeys(r["seed"] for r in rows):
        mine = [{k: v for k, v in r.items() if k != "seed"} for r in rows if r["seed"] == seed]
        timings = {k.split("/", 1)[1]: v for k, v in result.timings.items() if k.startswith(f"seed-{seed}/")}
        part = EvalResult(records=[], skipped=[x for x in result.skipped if x.get("seed") == seed], timings=timings)
        metrics.update({f"seed-{seed}/{k}": v for k, v in evaluation_metrics(part, mine).items()})
    return metrics


def training_run_logger(run_id: str, run_dir: str | None, outage_s: float) -> MlflowLogger:
    """A logger into the training run ``run_id`` through its run folder's journal, once its server answers:
    what the journal kept from before (the training's, an earlier evaluation's) is sent first."""
    logger = MlflowLogger(run_id=run_id)
    if run_dir is not None and Path(run_dir).is_dir():  # a folder moved or deleted since: straight to the server
        logger.keep_journal(Path(run_dir) / JOURNAL_FILE, outage_s)
    await_server(logger.uri, outage_s)
    return logger


def evaluate_adapters(
    method: str,
    base_dir: Path,
    adapters: dict[int | None, Path],
    records: list[dict[str, Any]],
    cfg: EvaluateConfig,
    reward_cfg: RewardConfig,
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    *,
    branch: bool = False,
    outage_s: float = TrackingConfig().outage_s,
) -> EvalResult:
    """Evaluate ``method``'s adapters (seed -> folder) and the base alone over ``base_dir`` (module docstring)."""
    served = served_model(base_dir)
    results: dict[int | None, EvalResult] = {}
    base_records: tuple[int | None, list[dict[str, Any]]] | None = None
    for seed, adapter in adapters.items():
        meta = adapter_meta(adapter) if branch else {}
        trained_run = meta.get("mlflow_run_id")
        logger = training_run_logger(trained_run, meta.get("run_dir"), outage_s) if trained_run else None
        key = evaluation_key(adapter, cfg, records, served) if trained_run else None
        prior = logged_evaluation(trained_run, key) if trained_run else None
        label = method if seed is None else f"{method} seed {seed}"
        if prior is not None:
            log.info(
                "evaluate %s: run %s already holds this evaluation (same adapter, settings and prompts); reused",
                label,
                trained_run,
            )
            results[seed] = prior
        else:
            log.info(
                "evaluate %s on %s (limit %s, k=%d, greedy=%s)",
                label,
                ", ".join(cfg.benchmarks),
                cfg.limit,
                cfg.samples_k,
                cfg.greedy,
            )
            with_base = cfg.include_base and base_records is None
            policies: dict[str, Path | None] = {"trained": adapter, **({"base": None} if with_base else {})}
            engine = (
                shared_engine(served, model_cfg, rollout=rollout_cfg, lora_rank=adapter_rank(adapter))
                if branch
                else None
            )
            result = evaluate_policies(
                served, records, cfg, reward_cfg, policies, model_cfg=model_cfg, rollout_cfg=rollout_cfg, engine=engine
            )
            result.timings[BASE_WEIGHT_MIB] = base_weight_mib(base_dir)
            if cfg.include_base and not with_base:
                result.records += [dict(r) for r in base_records[1]]
                result.tags = {**result.tags, "qerl.base_eval_of_seed": str(base_records[0])}
            if logger is not None:
                log_evaluation(logger, result, accuracy_rows(result.records), key=key)
                log_benchmark_inputs(logger, records, cfg)
                logger.drain()
            results[seed] = result
        if base_records is None:
            mine = [r for r in results[seed].records if r.get("policy") == "base"]
            base_records = (seed, mine) if mine else None
    if not branch:
        return results[next(iter(adapters))]
    out = EvalResult(records=[])
    for seed, result in results.items():
        out.records += [{**r, "seed": seed} for r in result.records]
        out.skipped += [{**r, "seed": seed} for r in result.skipped]
        out.timings.update({f"seed-{seed}/{k}": v for k, v in result.timings.items()})
        out.tags.update(result.tags)
    return out
