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

from qerl_pipeline.config import EvaluateConfig, ModelConfig, RewardConfig, RolloutConfig, TrainConfig, parse
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


def adapter_dir(method: str, train: dict[str, Any] | TrainConfig) -> Path:
    """Where the train pipeline leaves the final adapter: ``<train.output_dir>/<method>/final_adapter``."""
    tc: TrainConfig = parse(TrainConfig, train, "train")
    path = Path(tc.output_dir) / method / "final_adapter"
    if not (path / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"no trained adapter for method {method!r} at {path} (train.output_dir={tc.output_dir!r}); "
            f"run `kedro run --pipeline=train --params method={method}` first (same --env)"
        )
    return path


def base_weight_mib(base_dir: str | Path) -> float:
    """Size of the base checkpoint's files (without its serving/ and bnb/ copies), MiB."""
    from qerl_pipeline.quantization.checkpoint import folder_bytes

    return folder_bytes(Path(base_dir)) / 2**20


def run_evaluation(
    eval_prompts: dict[str, list[dict[str, Any]]],
    base_dir: Any,
    method: str,
    evaluate: dict[str, Any],
    reward: dict[str, Any],
    model: dict[str, Any],
    rollout: dict[str, Any],
    train: dict[str, Any],
) -> EvalResult:
    """Evaluate ``trained`` (base + adapter of ``method``) and, if configured, ``base`` in one engine.

    The engine serves ``served_model(base_dir)`` at ``engine_dtype(model)``; its
    ``rollout.served_format`` / ``rollout.served_dtype`` tags go to the active MLflow run.
    """
    from qerl_pipeline.rollout.serving import engine_dtype, served_model
    from qerl_pipeline.tracking import MlflowLogger

    cfg: EvaluateConfig = parse(EvaluateConfig, evaluate, "evaluate")
    mc: ModelConfig = parse(ModelConfig, model, "model")
    policies: dict[str, Path | None] = {"trained": adapter_dir(method, train)}
    if cfg.include_base:
        policies["base"] = None
    records = flatten_prompts(eval_prompts)
    base_dir = folder_of(base_dir)
    log.info("evaluate %s on %s (limit %s, k=%d, greedy=%s)", method, ", ".join(cfg.benchmarks), cfg.limit, cfg.samples_k, cfg.greedy)
    served = served_model(base_dir)
    result = evaluate_policies(
        served, records, cfg, parse(RewardConfig, reward, "reward"), policies,
        max_model_len=mc.max_seq_len, rollout_cfg=parse(RolloutConfig, rollout, "rollout"),
        dtype=engine_dtype(mc, served.platform, served), norm_dtype="float32" if mc.norm_dtype == "float32" else None,
    )
    result.timings["base/weight_mib"] = base_weight_mib(base_dir)
    MlflowLogger().set_tags(result.tags)
    return result


def accuracy_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (policy, benchmark): ``metrics.aggregate`` of the per-problem records."""
    if not records:
        raise ValueError("evaluation produced no records (no benchmark had prompts; check evaluate.benchmarks vs data.eval_sources)")
    return M.aggregate(records, keys=("policy", "source"))


def eval_outputs(result: EvalResult) -> tuple[list[dict[str, Any]], pd.DataFrame, dict[str, dict[str, float]]]:
    """Per-problem records, the accuracy table and the MLflow metrics of one evaluation."""
    rows = accuracy_rows(result.records)
    metrics = M.metric_dict(rows)
    for key, value in result.timings.items():
        name = key if key.startswith("base/") else f"eval/{key}"
        metrics[name] = float(value)
    metrics["eval/skipped_prompts"] = float(len(result.skipped))
    table = pd.DataFrame(rows).drop(columns=["source"])
    return result.records, table, {k: {"value": v, "step": 0} for k, v in metrics.items()}
