"""evaluate nodes: benchmark accuracy of the trained policy (base + adapter) and of the base alone.

The work is ``evaluation.seeds.evaluate_adapters`` (one method's adapters, one per seed, on
``evaluation.evaluator``'s vLLM engine with math-verify scoring) and ``evaluation.metrics``
(pass@1 over k, greedy, Wilson intervals). The nodes find the adapters, call those and shape
the outputs:

* ``eval_result``: every policy's records, skipped prompts, timings and engine tags (JSON);
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

Policy names: ``trained`` (base + the adapter of the method) and ``base`` (the same
served base without adapter, when ``evaluate.include_base``). With ``evaluate.model_path`` (an
exported folder, e.g. ``merged_nvfp4/``) that folder alone, served as ``export/serve.py`` says and
scored the same way, is the policy, named after the folder; base and adapter are not read. In a compare branch
(``compare_group``) the adapters are ``<trained_adapters>/seed-<k>``, one per seed of
``compare.seeds``, each evaluation logged into its own training run; records, table rows and
metric names carry the seed.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pandas as pd

from qerl_pipeline.adapter import adapter_meta, trained_adapter
from qerl_pipeline.config import SKIPPED_BRANCH, EvaluateConfig, QerlConfig, compare_branch
from qerl_pipeline.datasets.hf_model_folder import folder_of
from qerl_pipeline.evaluation.evaluator import EvalResult, log_benchmark_inputs
from qerl_pipeline.evaluation.seeds import (
    accuracy_rows,
    evaluate_adapters,
    evaluate_config,
    flatten_prompts,
    result_metrics,
)
from qerl_pipeline.export.accuracy import evaluate_folder
from qerl_pipeline.export.folders import read_manifest
from qerl_pipeline.tracking import MlflowLogger, label_run, run_name
from qerl_pipeline.tracking_journal import await_server

log = logging.getLogger(__name__)


def run_evaluation(
    eval_prompts: dict[str, list[dict[str, Any]]],
    base_dir: Any,
    trained_adapters: Any,
    cfg: QerlConfig,
    compare_group: dict | None = None,
) -> dict[str, Any]:
    """Evaluate ``trained`` (base + the adapter of ``cfg.method``, per seed in a compare branch) and ``base``.

    ``cfg``: the ``evaluation_config`` the pipeline gathers (``evaluate``, ``reward``, ``model``, ``rollout``,
    ``data``, ``tracking``; ``compare`` in a branch). Standalone, the active MLflow run (a separate evaluation run)
    is named and tagged with the engine's ``rollout.served_*`` tags, the method and the training run it evaluates
    (``qerl.trained_run_id``); in a compare branch each seed's evaluation is logged into that
    seed's training run (``evaluation.seeds``). The user's sets (``data.eval_files``) are
    evaluated after ``evaluate.benchmarks``. Returns the ``eval_result`` dataset's data.
    A compare branch whose method ``compare.methods`` leaves out evaluates
    nothing and starts no engine: it logs why and returns an empty result marked ``skipped``
    (``config.compare_branch``). A tracking server away is waited for up to ``tracking.outage_s``.
    """
    method, mc, outage_s = cfg.method, cfg.model, cfg.tracking.outage_s
    branch_seeds: list[int | None] = [None]
    if compare_group:
        branch_seeds, skipped = compare_branch(cfg.compare, method)
        if skipped:
            log.info(skipped)
            return {**EvalResult(records=[]).as_dict(), SKIPPED_BRANCH: skipped}
    ecfg = evaluate_config(cfg.evaluate, cfg.data)
    records = flatten_prompts(eval_prompts)
    if ecfg.model_path and not compare_group:
        return _evaluate_folder(Path(ecfg.model_path), records, ecfg, cfg)
    adapters = {s: trained_adapter(folder_of(trained_adapters), method, s) for s in branch_seeds}
    result = evaluate_adapters(
        method,
        folder_of(base_dir),
        adapters,
        records,
        ecfg,
        cfg.reward,
        mc,
        cfg.rollout,
        branch=bool(compare_group),
        outage_s=outage_s,
    )
    if not compare_group:
        logger = MlflowLogger()  # the kedro run's own (an evaluation run)
        await_server(logger.uri, outage_s)
        meta = adapter_meta(adapters[None])
        trained_run = meta.get("mlflow_run_id")
        label_run(
            run_name("evaluate", method, mc, meta.get("seed")),
            "evaluate",
            {**result.tags, "method": method, **({"qerl.trained_run_id": trained_run} if trained_run else {})},
        )
        log_benchmark_inputs(logger, records, ecfg)
    return result.as_dict()


def _evaluate_folder(
    folder: Path, records: list[dict[str, Any]], ecfg: EvaluateConfig, cfg: QerlConfig
) -> dict[str, Any]:
    """``evaluate.model_path``: the exported folder alone, as the policy named after it; the run tagged with it
    and, when the folder is part of an export (``export.json`` beside it), the training run it came from."""
    result = evaluate_folder(folder, records, ecfg, cfg.reward, cfg.model, cfg.rollout)
    manifest = read_manifest(folder.parent)
    tags = {**result.tags, "method": manifest.get("method") or cfg.method, "qerl.model_path": str(folder)}
    if manifest.get("training_run_id"):
        tags["qerl.trained_run_id"] = manifest["training_run_id"]
    label_run(
        run_name("evaluate", f"{tags['method']} {folder.name}", cfg.model, manifest.get("seed")), "evaluate", tags
    )
    return result.as_dict()


def eval_outputs(
    eval_result: dict[str, Any],
) -> tuple[list[dict[str, Any]], pd.DataFrame, dict[str, dict[str, float]]]:
    """Per-problem records, the accuracy table and the MLflow metrics of one evaluation
    (compare's seeds: metric names ``seed-<k>/eval/...``, as logged into each seed's run). A skipped
    compare branch's result (``skipped``): no records, a table of one ``skipped`` cell saying why, no metrics."""
    if eval_result.get(SKIPPED_BRANCH):
        return [], pd.DataFrame({SKIPPED_BRANCH: [eval_result[SKIPPED_BRANCH]]}), {}
    result = EvalResult.from_dict(eval_result)
    rows = accuracy_rows(result.records)
    table = pd.DataFrame(rows).drop(columns=["source"])
    return result.records, table, {k: {"value": v, "step": 0} for k, v in result_metrics(result, rows).items()}
