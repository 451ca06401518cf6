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
) -> EvalResult:
    """Evaluate ``trained`` (base + the adapter of ``method``) and, if configured, ``base`` in one engine.

    The engine serves ``served_model(base_dir)`` at ``engine_dtype(model)``. Its
    ``rollout.served_format`` / ``rollout.served_dtype`` tags go to the active MLflow run (a
    separate evaluation run, named and tagged with the training run it evaluates), or, in a
    compare branch (``compare_group``), the evaluation is logged into the training run itself.
    """
    from qerl_pipeline.adapter import adapter_meta
    from qerl_pipeline.evaluation.evaluator import log_evaluation
    from qerl_pipeline.rollout.serving import served_model
    from qerl_pipeline.tracking import MlflowLogger, name_run, run_name

    cfg: EvaluateConfig = parse(EvaluateConfig, evaluate, "evaluate")
    mc: ModelConfig = parse(ModelConfig, model, "model")
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
    engine, key = None, None
    if compare_group and trained_run:
        from qerl_pipeline.evaluation.evaluator import adapter_rank, evaluation_key, logged_evaluation
        from qerl_pipeline.rollout.pool import shared_engine

        key = evaluation_key(adapter, cfg, records, served)
        prior = logged_evaluation(trained_run, key)
        if prior is not None:
            log.info("evaluate %s: run %s already holds this evaluation (same adapter, settings and prompts); reused",
                     method, trained_run)
            return prior
        engine = shared_engine(served, mc, rollout=rc, lora_rank=adapter_rank(adapter))
    result = evaluate_policies(served, records, cfg, parse(RewardConfig, reward, "reward"), policies,
                               model_cfg=mc, rollout_cfg=rc, engine=engine)
    result.timings["base/weight_mib"] = base_weight_mib(base_dir)
    if compare_group and trained_run:
        log_evaluation(MlflowLogger(run_id=trained_run), result, accuracy_rows(result.records), key=key)
    else:
        logger = MlflowLogger()
        logger.set_tags({**result.tags, "method": method, **({"qerl.trained_run_id": trained_run} if trained_run else {})})
        name_run(logger.run_id, run_name("evaluate", method, mc, meta.get("seed")), "evaluate")
    return result


def accuracy_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (policy, benchmark): ``metrics.aggregate`` of the per-problem records."""
    if not records:
        raise ValueError("evaluation produced no records (no benchmark had prompts; check evaluate.benchmarks vs data.eval_sources)")
    return M.aggregate(records, keys=("policy", "source"))


def eval_outputs(result: EvalResult) -> tuple[list[dict[str, Any]], pd.DataFrame, dict[str, dict[str, float]]]:
    """Per-problem records, the accuracy table and the MLflow metrics of one evaluation."""
    from qerl_pipeline.evaluation.evaluator import evaluation_metrics

    rows = accuracy_rows(result.records)
    metrics = evaluation_metrics(result, rows)
    table = pd.DataFrame(rows).drop(columns=["source"])
    return result.records, table, {k: {"value": v, "step": 0} for k, v in metrics.items()}
