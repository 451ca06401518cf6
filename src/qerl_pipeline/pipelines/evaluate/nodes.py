"""evaluate nodes: benchmark accuracy of the trained policy (base + adapter) and of the base alone.

The heavy lifting is ``evaluation.evaluator`` (vLLM in its own process, math-verify
scoring) and ``evaluation.metrics`` (pass@1 over k, greedy, Wilson intervals). The nodes
only resolve where things are, call those, and shape the outputs:

* ``eval_records``: one row per (policy, problem): prompt, completions, extracted answers,
  correct flags, greedy completion (JSON, logged to MLflow as an artifact);
* ``eval_accuracy``: one row per (policy, benchmark) with pass@1, greedy accuracy, their
  95% intervals, pass@k and the truncated fraction (CSV, logged as an artifact);
* ``eval_metrics``: the same numbers as MLflow metrics ``eval/<policy>/<benchmark>/<name>``
  plus ``eval/<policy>/tokens_per_s``, ``eval/engine_start_s`` and ``base/weight_mib``
  (the size of the base checkpoint's weights, the report's weight-bytes column).

What the engine serves is ``rollout.serving.served_model``'s decision (packed NVFP4 /
bitsandbytes NF4 on CUDA, the dense decoded copy on CPU), at ``model.dtype``
(``engine_dtype``); the run is tagged ``rollout.served_format`` and ``rollout.served_dtype``.

Policy names: ``trained`` (base + the adapter of ``params:method``) and ``base`` (the same
served base without adapter, when ``evaluate.include_base``).

In a compare branch (``compare_group``) every seed's adapter (``<trained_adapters>/seed-<k>``)
is evaluated and logged into its own training run; records, table rows and the metrics
file carry the seed. The base alone is evaluated once per branch (with the first seed that
needs an evaluation): its records are the same for every seed (same base, prompts and
settings), so later seeds' runs get a copy of them (tag ``qerl.base_eval_of_seed``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pandas as pd

from qerl_pipeline.config import EvaluateConfig, ModelConfig, RewardConfig, RolloutConfig, parse
from qerl_pipeline.evaluation import metrics as M
from qerl_pipeline.datasets.hf_model_folder import folder_of
from qerl_pipeline.evaluation.evaluator import EvalResult, evaluate_policies

log = logging.getLogger(__name__)


def flatten_prompts(eval_prompts: dict[str, list[dict[str, Any]]] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """data_prep's ``{source: [records]}`` as one list; the dict key is the benchmark name."""
    if isinstance(eval_prompts, list):
        return list(eval_prompts)
    out = []
    for source, records in eval_prompts.items():
        out += [{**r, "source": source} for r in records]
    return out


def adapter_dir(method: str, trained_adapters: Any) -> Path:
    """The adapter of ``method`` in the ``trained_adapters`` dataset's folder (``<folder>/<method>``)."""
    from qerl_pipeline.adapter import is_adapter

    path = folder_of(trained_adapters) / method
    if not is_adapter(path):
        raise FileNotFoundError(
            f"no trained adapter for method {method!r} at {path}; "
            f"run `kedro run --pipelines=train --params method={method}` first (same --env)"
        )
    return path


def base_weight_mib(base_dir: str | Path) -> float:
    """Size of the base checkpoint's files (without its serving/ and bnb/ copies), MiB."""
    from qerl_pipeline.quantization.checkpoint import folder_bytes

    return folder_bytes(Path(base_dir)) / 2**20


def run_evaluation(
    eval_prompts: dict[str, list[dict[str, Any]]],
    base_dir: Any,
    trained_adapters: Any,
    method: str,
    evaluate: dict[str, Any],
    reward: dict[str, Any],
    model: dict[str, Any],
    rollout: dict[str, Any],
    compare_group: dict | None = None,
    seeds: list[int] | None = None,
) -> EvalResult:
    """Evaluate ``trained`` (base + the adapter of ``method``) and, if configured, ``base`` in one engine.

    The engine serves ``served_model(base_dir)`` at ``engine_dtype(model)``. Its
    ``rollout.served_format`` / ``rollout.served_dtype`` tags go to the active MLflow run (a
    separate evaluation run, named and tagged with the training run it evaluates), or, in a
    compare branch (``compare_group``), each seed's evaluation (``seeds``: ``compare.seeds``)
    is logged into that seed's training run (``evaluate_seeds``).
    """
    from qerl_pipeline.adapter import adapter_meta
    from qerl_pipeline.rollout.serving import served_model
    from qerl_pipeline.tracking import MlflowLogger, name_run, run_name

    cfg: EvaluateConfig = parse(EvaluateConfig, evaluate, "evaluate")
    mc: ModelConfig = parse(ModelConfig, model, "model")
    if compare_group:
        return evaluate_seeds(eval_prompts, base_dir, trained_adapters, method, cfg, parse(RewardConfig, reward, "reward"), mc,
                              parse(RolloutConfig, rollout, "rollout"), seeds if seeds is not None else [0])
    adapter = adapter_dir(method, trained_adapters)
    meta = adapter_meta(adapter)
    policies: dict[str, Path | None] = {"trained": adapter}
    if cfg.include_base:
        policies["base"] = None
    records = flatten_prompts(eval_prompts)
    base_dir = folder_of(base_dir)
    log.info("evaluate %s on %s (limit %s, k=%d, greedy=%s)", method, ", ".join(cfg.benchmarks), cfg.limit, cfg.samples_k, cfg.greedy)
    served = served_model(base_dir)
    rc = parse(RolloutConfig, rollout, "rollout")
    trained_run = meta.get("mlflow_run_id")
    result = evaluate_policies(served, records, cfg, parse(RewardConfig, reward, "reward"), policies,
                               model_cfg=mc, rollout_cfg=rc)
    result.timings["base/weight_mib"] = base_weight_mib(base_dir)
    logger = MlflowLogger()
    logger.set_tags({**result.tags, "method": method, **({"qerl.trained_run_id": trained_run} if trained_run else {})})
    name_run(logger.run_id, run_name("evaluate", method, mc, meta.get("seed")), "evaluate")
    return result


def evaluate_seeds(eval_prompts: Any, base_dir: Any, trained_adapters: Any, method: str, cfg: EvaluateConfig,
                   reward_cfg: RewardConfig, mc: ModelConfig, rc: RolloutConfig, seeds: list[int]) -> EvalResult:
    """A compare branch's evaluation: each seed's adapter ``<trained_adapters>/seed-<k>`` on the shared engine.

    Each seed's evaluation is logged into its training run (the adapter's ``mlflow_run_id``)
    with its ``evaluation_key``; a run that already holds an evaluation with that key is
    reused, not redone. ``base`` (``evaluate.include_base``) is evaluated once, with the first
    seed evaluated here, and its records copied to the other seeds (same base, prompts and
    settings: the same numbers). Returns every seed's records with a ``seed`` field.
    """
    from qerl_pipeline.adapter import adapter_meta, is_adapter
    from qerl_pipeline.evaluation.evaluator import adapter_rank, evaluation_key, log_evaluation, logged_evaluation
    from qerl_pipeline.rollout.pool import shared_engine
    from qerl_pipeline.rollout.serving import served_model
    from qerl_pipeline.tracking import MlflowLogger

    records = flatten_prompts(eval_prompts)
    base_dir = folder_of(base_dir)
    served = served_model(base_dir)
    results: dict[int, EvalResult] = {}
    base_records: tuple[int, list[dict[str, Any]]] | None = None
    for seed in seeds:
        adapter = folder_of(trained_adapters) / f"seed-{seed}"
        if not is_adapter(adapter):
            raise FileNotFoundError(f"no trained adapter for method {method!r} seed {seed} at {adapter}; "
                                    f"compare.seeds lists {seed}: run the branch's train_policy node first")
        trained_run = adapter_meta(adapter).get("mlflow_run_id")
        key = evaluation_key(adapter, cfg, records, served)
        prior = logged_evaluation(trained_run, key) if trained_run else None
        if prior is not None:
            log.info("evaluate %s seed %d: run %s already holds this evaluation (same adapter, settings and prompts); reused",
                     method, seed, trained_run)
            results[seed] = prior
        else:
            log.info("evaluate %s seed %d on %s (limit %s, k=%d, greedy=%s)", method, seed, ", ".join(cfg.benchmarks), cfg.limit,
                     cfg.samples_k, cfg.greedy)
            policies: dict[str, Path | None] = {"trained": adapter}
            if cfg.include_base and base_records is None:
                policies["base"] = None
            engine = shared_engine(served, mc, rollout=rc, lora_rank=adapter_rank(adapter))
            result = evaluate_policies(served, records, cfg, reward_cfg, policies, model_cfg=mc, rollout_cfg=rc, engine=engine)
            result.timings["base/weight_mib"] = base_weight_mib(base_dir)
            if cfg.include_base and "base" not in policies:
                result.records += [dict(r) for r in base_records[1]]
                result.tags = {**result.tags, "qerl.base_eval_of_seed": str(base_records[0])}
            if trained_run:
                log_evaluation(MlflowLogger(run_id=trained_run), result, accuracy_rows(result.records), key=key)
            results[seed] = result
        if base_records is None:
            mine = [r for r in results[seed].records if r.get("policy") == "base"]
            base_records = (seed, mine) if mine else None
    out = EvalResult(records=[])
    for seed, result in results.items():
        out.records += [{**r, "seed": seed} for r in result.records]
        out.skipped += [{**r, "seed": seed} for r in result.skipped]
        out.timings.update({f"seed-{seed}/{k}": v for k, v in result.timings.items()})
        out.tags.update(result.tags)
    return out


def accuracy_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (policy, benchmark), per (seed, policy, benchmark) when records carry a seed (compare)."""
    if not records:
        raise ValueError("evaluation produced no records (no benchmark had prompts; check evaluate.benchmarks vs data.eval_sources)")
    seeded = any("seed" in r for r in records)
    return M.aggregate(records, keys=("seed", "policy", "source") if seeded else ("policy", "source"))


def eval_outputs(result: EvalResult) -> tuple[list[dict[str, Any]], pd.DataFrame, dict[str, dict[str, float]]]:
    """Per-problem records, the accuracy table and the MLflow metrics of one evaluation
    (compare's seeds: metric names ``seed-<k>/eval/...``, as logged into each seed's run)."""
    from qerl_pipeline.evaluation.evaluator import evaluation_metrics

    rows = accuracy_rows(result.records)
    if any("seed" in r for r in rows):
        metrics = {}
        for seed in dict.fromkeys(r["seed"] for r in rows):
            mine = [{k: v for k, v in r.items() if k != "seed"} for r in rows if r["seed"] == seed]
            timings = {k.split("/", 1)[1]: v for k, v in result.timings.items() if k.startswith(f"seed-{seed}/")}
            part = EvalResult(records=[], skipped=[x for x in result.skipped if x.get("seed") == seed], timings=timings)
            metrics.update({f"seed-{seed}/{k}": v for k, v in evaluation_metrics(part, mine).items()})
    else:
        metrics = evaluation_metrics(result, rows)
    table = pd.DataFrame(rows).drop(columns=["source"])
    return result.records, table, {k: {"value": v, "step": 0} for k, v in metrics.items()}
