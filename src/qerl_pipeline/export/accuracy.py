"""What deploying in 4 bits costs: ``merged_nvfp4/`` scored beside base + adapter on the same problems and seeds.

``evaluate_export`` scores, per training (seed):

* ``trained`` (and ``base`` with ``evaluate.include_base``): base + adapter exactly as the evaluate
  pipeline and compare score it (``evaluation.seeds.evaluate_adapters``; logged into the training's
  run with its evaluation key, so an evaluation already there, a compare branch's, is reused);
* ``merged_nvfp4``: the exported 4-bit folder served by itself (``evaluate_folder``, also the
  evaluate pipeline's ``evaluate.model_path``): packed on CUDA, a dense copy decoded from its codes
  on CPU (``serve.served_export``); the same prompts, samples, sampling seed and scorer.

``cost_rows`` states the result per benchmark and metric (``report_tables.paired_rows``, which the
compare report uses too): each policy's mean with its 95% interval over seeds and problems, and
the paired difference ``merged_nvfp4 - trained`` per problem and seed with its interval: the
4-bit cost. ``log_cost`` puts the ``merged_nvfp4`` metrics (``eval/merged_nvfp4/<benchmark>/<name>``,
the names the compare report reads) and records (``export/result.json``) into each training's run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from qerl_pipeline.config import EvaluateConfig, ModelConfig, RewardConfig, RolloutConfig
from qerl_pipeline.evaluation.evaluator import EvalResult, evaluate_policies
from qerl_pipeline.evaluation.metrics import aggregate, metric_dict
from qerl_pipeline.evaluation.report_runs import DEPLOYED_4BIT, EXPORT_RESULT_ARTIFACT
from qerl_pipeline.evaluation.report_tables import paired_rows
from qerl_pipeline.evaluation.seeds import evaluate_adapters
from qerl_pipeline.export.serve import served_export
from qerl_pipeline.tracking import MlflowLogger

TRAINED = "trained"
#: The exported 4-bit policy scored beside ``trained`` (``merged_nvfp4/``).
QUANTIZED = DEPLOYED_4BIT


def evaluate_folder(
    folder: Path,
    records: list[dict[str, Any]],
    cfg: EvaluateConfig,
    reward_cfg: RewardConfig,
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    policy: str | None = None,
) -> EvalResult:
    """Score the model folder ``folder`` alone as the policy ``policy`` (default: the folder's name)."""
    folder = Path(folder)
    with served_export(folder) as served:
        return evaluate_policies(
            served,
            records,
            cfg,
            reward_cfg,
            {policy or folder.name: None},
            model_cfg=model_cfg,
            rollout_cfg=rollout_cfg,
        )


def evaluate_export(
    method: str,
    base_dir: Path,
    adapters: dict[int, Path],
    exports: dict[int, Path],
    records: list[dict[str, Any]],
    cfg: EvaluateConfig,
    reward_cfg: RewardConfig,
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
) -> EvalResult:
    """``trained`` (+ ``base``) and ``merged_nvfp4`` of every seed (module docstring); records carry ``seed``."""
    out = evaluate_adapters(
        method, Path(base_dir), adapters, records, cfg, reward_cfg, model_cfg, rollout_cfg, branch=True
    )
    for seed, folder in exports.items():
        res = evaluate_folder(Path(folder) / QUANTIZED, records, cfg, reward_cfg, model_cfg, rollout_cfg, QUANTIZED)
        out.records += [{**r, "seed": seed} for r in res.records]
        out.skipped += [{**r, "seed": seed} for r in res.skipped]
        out.timings.update({f"seed-{seed}/{QUANTIZED}/{k}": v for k, v in res.timings.items()})
    return out


def cost_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``merged_nvfp4`` against ``trained`` per benchmark and metric, paired by seed and problem (``paired_rows``)."""
    return paired_rows(records, QUANTIZED, TRAINED)


def cost_sentence(row: dict[str, Any], policy: str = QUANTIZED) -> str:
    """One line a report prints for a ``cost_rows`` row."""

    def num(x: float) -> str:
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"

    return (
        f"{row['benchmark']} {row['metric']}: trained {num(row[TRAINED])} [{num(row[f'{TRAINED}_ci_low'])}, "
        f"{num(row[f'{TRAINED}_ci_high'])}], {policy} {num(row[policy])} [{num(row[f'{policy}_ci_low'])}, "
        f"{num(row[f'{policy}_ci_high'])}], difference {num(row['difference'])} [{num(row['difference_ci_low'])}, "
        f"{num(row['difference_ci_high'])}] ({row['n_seeds']} seed(s) x {row['n_problems']} problems)"
    )


def seed_rows(records: list[dict[str, Any]], seed: Any, policy: str = QUANTIZED) -> list[dict[str, Any]]:
    """The accuracy rows (``metrics.aggregate``) of ``policy`` for one seed."""
    mine = [
        {k: v for k, v in r.items() if k != "seed"}
        for r in records
        if r.get("seed") == seed and r.get("policy") == policy
    ]
    return aggregate(mine) if mine else []


def log_cost(run_id: str, records: list[dict[str, Any]], seed: Any) -> dict[str, float]:
    """Log one seed's ``merged_nvfp4`` evaluation into its training run: metrics ``eval/merged_nvfp4/...`` and
    the records as ``export/result.json``. Returns the metrics."""
    rows = seed_rows(records, seed)
    if not rows:
        return {}
    metrics = metric_dict(rows)
    logger = MlflowLogger(run_id=run_id)
    logger.log_metrics(metrics, step=0)
    mine = [r for r in records if r.get("seed") == seed and r.get("policy") == QUANTIZED]
    logger.log_text(json.dumps(EvalResult(records=mine).as_dict(), default=str), EXPORT_RESULT_ARTIFACT)
    return metrics
