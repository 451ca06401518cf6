"""compare nodes: train and evaluate several methods on one config, then the side-by-side report.

How the methods run (design choices)
------------------------------------
* In this process, through the library, one method after the other: ``rl.trainer.train``
  with an explicit ``MlflowLogger(run_id=<the method's run>)``, then
  ``evaluation.evaluator``. Every method gets the same parameter tree with only
  ``method`` changed, so config and seeds are the same by construction (a subprocess
  ``kedro run --params method=X`` would have to re-derive the env and every override).
  vLLM still runs in its own process (``RolloutEngine``), as everywhere.
* One MLflow run per method, created in the experiment of the compare run that
  kedro-mlflow opened, tagged ``method``, ``qerl.compare_group = <compare run id>`` and
  ``mlflow.parentRunId`` (the UI nests them). The compare run itself is tagged
  ``qerl.role = compare``; it receives the report.
* Bases: each format's base is written fresh from the configured model into the compare
  workspace (``<train.output_dir>/compare/bases/base_<format>``) by the quantize pipeline's
  own node function (``quantize.nodes.quantize_base``: same algorithm, ignore list and
  serving dtype), so a stale base from another config can never slip in. Its scalar
  statistics go to each method's run as ``quantize/<name>``.
* Adapters go to ``<train.output_dir>/compare/<method>``, wiped first: compare runs are
  fresh runs, never a resume of an older one.
* One vLLM engine per base format (an engine start is ~30-45 s on CPU, most of a smoke
  run): it serves the training rollouts of every method on that base (qerl and qerl_noaqn
  share the NVFP4 engine) and then their evaluation. The engine serves what
  ``rollout.serving.served_model`` decides for the base (packed NVFP4 / bitsandbytes NF4 on
  CUDA, the dense decoded ``serving/`` copy on CPU) at ``model.dtype``; each method's run is
  tagged ``rollout.served_format`` and ``rollout.served_dtype``. Training leaves AQN noise
  (or trained norms) in the engine, so after each method the clean norm weights are written
  back from the served folder and read back to check they are exact; sampling seeds are per request,
  so a shared engine draws from the same seeds as a fresh one. Each method's run gets its
  ``trained`` evaluation rows and the shared ``base`` rows.
* ``compare.reuse_runs``: no training; the runs are read from MLflow: those of one compare
  group (``compare.reuse_group``), or for each method its newest finished training run
  paired with its newest evaluation run (separate ``kedro run``s; ``report.load_runs``).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import pandas as pd

from qerl_pipeline.config import METHOD_FORMAT, CompareConfig, QerlConfig, flatten, parse, validate
from qerl_pipeline.evaluation import metrics as M
from qerl_pipeline.evaluation import report as R

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------ mlflow
def _tracking():
    """(client, compare run id, experiment id): the active kedro-mlflow run (or a new one outside Kedro)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from qerl_pipeline.tracking import MlflowLogger

    logger = MlflowLogger()  # the active run (kedro-mlflow's), or a new one outside Kedro
    run = mlflow.get_run(logger.run_id)
    return MlflowClient(), logger.run_id, run.info.experiment_id


def _new_method_run(client, experiment_id: str, parent_id: str, method: str, cfg: QerlConfig) -> str:
    from qerl_pipeline.tracking import MlflowLogger

    run = client.create_run(
        experiment_id,
        run_name=f"{method}",
        tags={"method": method, R.GROUP_TAG: parent_id, "mlflow.parentRunId": parent_id},
    )
    MlflowLogger(run_id=run.info.run_id).log_params(flatten(cfg.model_dump(mode="json")))
    return run.info.run_id


def reset_peak_memory() -> bool:
    """Start a fresh peak-memory window for the next method (methods share this process).

    CUDA: ``torch.cuda.reset_peak_memory_stats``. CPU: the trainer reads the process's
    ``ru_maxrss``, a lifetime high-water mark; on Linux writing 5 to
    ``/proc/self/clear_refs`` resets it to the current RSS, so each method's peak is the
    largest RSS during its own training (resident data of earlier methods included).
    Elsewhere the CPU number stays cumulative (logged as ``compare/peak_memory_reset = 0``).
    """
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------- bases
def write_bases(cfg: QerlConfig, methods: list[str], root: Path) -> tuple[dict[str, Path], dict[str, dict]]:
    """``({format: base_dir}, {format: quantize report})`` for the methods' formats, fresh under ``root``.

    Uses the quantize pipeline's own node function (same algorithm, ignore list, serving
    dtype), once per format, and moves each result into ``root/base_<format>``.
    """
    from qerl_pipeline.pipelines.quantize.nodes import quantize_base

    root.mkdir(parents=True, exist_ok=True)
    bases, reports = {}, {}
    for method in methods:
        fmt = METHOD_FORMAT[method]
        if fmt in bases:
            continue
        t0 = time.perf_counter()
        written, report = quantize_base(cfg.model.model_dump(), cfg.quantize.model_dump(), method)
        src = Path(written[f"base_{fmt}"])
        target = root / f"base_{fmt}"
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(str(src), str(target))
        shutil.rmtree(src.parent, ignore_errors=True)  # quantize_base's temporary parent folder
        log.info("compare: base_%s written in %.1f s", fmt, time.perf_counter() - t0)
        bases[fmt], reports[fmt] = target, report
    return bases, reports


def quantize_metrics(report: dict) -> dict[str, float]:
    """The scalar numbers of a quantize report as ``quantize/<name>`` metrics."""
    return {f"quantize/{k}": float(v) for k, v in report.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


# ---------------------------------------------------------------------- evaluate
def clean_norms(engine, serving: Path) -> dict:
    """The served model's RMSNorm weights as stored in the served folder ``serving`` (the clean values)."""
    from safetensors import safe_open

    from qerl_pipeline.quantization.checkpoint import safetensor_files

    names = set(engine.norm_weight_names())
    out = {}
    for f in safetensor_files(serving):
        with safe_open(str(f), "pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys() if k in names})
    if missing := sorted(names - out.keys()):
        raise KeyError(f"{serving}: norm weights served by the engine but not in the folder: {missing[:5]}")
    return out


def restore_norms(engine, clean: dict) -> None:
    """Put the clean norm weights back (AQN leaves the last step's noise in the engine) and check."""
    import torch

    engine.update_weights(clean)
    back = engine.read_weights(sorted(clean))
    bad = [n for n, t in clean.items() if not torch.equal(back[n].to(t.dtype), t)]
    if bad:
        raise RuntimeError(f"engine norm weights differ from the clean ones after restore: {bad[:5]}")


def _log_eval(run_id: str, rows: list[dict], records: list[dict], timings: dict[str, float], base_dir: Path,
              tags: dict[str, str] | None = None) -> None:
    from qerl_pipeline.pipelines.evaluate.nodes import base_weight_mib
    from qerl_pipeline.tracking import MlflowLogger

    logger = MlflowLogger(run_id=run_id)
    if tags:
        logger.set_tags(tags)
    metrics = M.metric_dict(rows)
    metrics["base/weight_mib"] = base_weight_mib(base_dir)
    metrics.update({f"eval/{k}": v for k, v in timings.items()})
    logger.log_metrics(metrics, step=0)
    logger.log_table(rows, "eval/accuracy.json")
    logger.log_table(records, "eval/records.json")


def evaluate_format(engine, cfg: QerlConfig, adapters: dict[str, Path], base_dir: Path, run_ids: dict[str, str],
                    eval_records: list[dict], served=None) -> None:
    """Evaluate the adapters trained on one base (and the base once) on its engine; log per method.

    ``served``: what the engine serves (``rollout.serving.ServedModel``; default: the decision
    for ``base_dir`` on this machine); it picks the adapter mode and gives the runs' tags.
    """
    from transformers import AutoTokenizer

    from qerl_pipeline.evaluation.evaluator import evaluate_on_engine
    from qerl_pipeline.rewards.math import RewardScorer
    from qerl_pipeline.rollout.serving import served_model, served_tags

    served = served or served_model(base_dir)
    tags = served_tags(served, engine)
    tokenizer = AutoTokenizer.from_pretrained(served.path)
    results = {}
    with RewardScorer(cfg.reward) as scorer:
        policies: dict[str, Path | None] = dict(adapters)
        if cfg.evaluate.include_base:
            policies["base"] = None
        for name, path in policies.items():
            results[name] = evaluate_on_engine(
                engine, tokenizer, eval_records, cfg.evaluate, scorer, policy=name, lora_path=path,
                max_model_len=cfg.model.max_seq_len, served=served,
            )
    base_records = [{**r, "policy": "base"} for r in results["base"].records] if "base" in results else []
    for m in adapters:
        mine = [{**r, "policy": "trained"} for r in results[m].records] + base_records
        rows = M.aggregate(mine, keys=("policy", "source"))
        timings = {f"trained/{k}": v for k, v in results[m].timings.items()}
        timings["skipped_prompts"] = float(len(results[m].skipped))
        _log_eval(run_ids[m], rows, mine, timings, base_dir, tags)


# --------------------------------------------------------------------------- nodes
def run_methods(train_prompts: list[dict], eval_prompts: dict[str, list[dict]], parameters: dict[str, Any]) -> dict[str, dict]:
    """Train and evaluate each of ``compare.methods`` (one MLflow run each).

    Returns ``{method: {"run_id", "eval_run_id"}}`` (``eval_run_id`` only for reused
    runs whose evaluation was a separate ``kedro run``).

    One engine per base format serves the training rollouts of every method on that base
    (``train(..., engine=...)``), with the clean norm weights restored and checked after
    each method, and then its evaluation. With ``compare.reuse_runs`` nothing is trained:
    the runs are looked up in MLflow.
    """
    from qerl_pipeline.pipelines.evaluate.nodes import flatten_prompts
    from qerl_pipeline.rl.trainer import engine_norm_dtype, train, vllm_lora_rank
    from qerl_pipeline.rollout.engine import RolloutEngine
    from qerl_pipeline.rollout.serving import engine_dtype, served_model, served_tags
    from qerl_pipeline.tracking import MlflowLogger

    base_cfg: QerlConfig = validate(dict(parameters), QerlConfig)
    cc: CompareConfig = base_cfg.compare
    client, parent_id, experiment_id = _tracking()
    client.set_tag(parent_id, R.ROLE_TAG, "compare")
    if cc.reuse_runs:
        exp = client.get_experiment(experiment_id)
        runs = R.load_runs(exp.name, cc.methods, client=client, group=cc.reuse_group, require_eval=True, finished_only=True)
        log.info("compare: reusing runs %s", R.selection(runs))
        return R.selection(runs)

    workspace = Path(base_cfg.train.output_dir) / "compare"
    t0 = time.perf_counter()
    bases, quant_reports = write_bases(base_cfg, list(cc.methods), workspace / "bases")
    timings: dict[str, float] = {"compare/bases_s": time.perf_counter() - t0}
    eval_records = flatten_prompts(eval_prompts)
    by_format: dict[str, list[str]] = {}
    for method in cc.methods:
        by_format.setdefault(METHOD_FORMAT[method], []).append(method)
    run_ids: dict[str, str] = {}
    for fmt, methods in by_format.items():
        served = served_model(bases[fmt])
        rc = base_cfg.rollout
        t_fmt = time.perf_counter()
        with RolloutEngine(
            served.path, max_model_len=base_cfg.model.max_seq_len, enable_lora=True,
            max_lora_rank=vllm_lora_rank(base_cfg.lora.rank), dtype=engine_dtype(base_cfg.model, served.platform, served),
            seed=rc.seed, rollout=rc, extra_engine_args=served.engine_args, norm_dtype=engine_norm_dtype(base_cfg),
        ) as engine:
            timings[f"compare/{fmt}/engine_start_s"] = engine.start_seconds
            tags = served_tags(served, engine)
            log.info("compare: %s base served from %s as %s (%s)", fmt, served.path, served.served_format,
                     tags["rollout.served_dtype"])
            clean = clean_norms(engine, served.path)
            adapters: dict[str, Path] = {}
            for method in methods:
                cfg = validate({**base_cfg.model_dump(mode="json"), "method": method}, QerlConfig)
                run_id = run_ids[method] = _new_method_run(client, experiment_id, parent_id, method, cfg)
                MlflowLogger(run_id=run_id).log_metrics(quantize_metrics(quant_reports[fmt]), step=0)
                MlflowLogger(run_id=run_id).set_tags(tags)
                shutil.rmtree(workspace / method, ignore_errors=True)
                log.info("compare: training %s (MLflow run %s)", method, run_id)
                reset_ok = reset_peak_memory()
                MlflowLogger(run_id=run_id).log_metrics({"compare/peak_memory_reset": float(reset_ok)}, step=0)
                t1 = time.perf_counter()
                try:
                    result = train(
                        cfg, bases[fmt], train_prompts, output_dir=workspace, engine=engine,
                        make_logger=lambda stored, rid=run_id: MlflowLogger(run_id=stored or rid),
                    )
                    restore_norms(engine, clean)
                except BaseException:
                    client.set_terminated(run_id, "FAILED")
                    raise
                adapters[method] = result.adapter_dir
                timings[f"compare/{method}/train_s"] = time.perf_counter() - t1
            t2 = time.perf_counter()
            try:
                evaluate_format(engine, base_cfg, adapters, bases[fmt], run_ids, eval_records, served)
            except BaseException:
                for m in methods:
                    client.set_terminated(run_ids[m], "FAILED")
                raise
            timings[f"compare/{fmt}/evaluate_s"] = time.perf_counter() - t2
        for m in methods:
            client.set_terminated(run_ids[m], "FINISHED")
        timings[f"compare/{fmt}/total_s"] = time.perf_counter() - t_fmt
    timings["compare/total_s"] = time.perf_counter() - t0
    MlflowLogger(run_id=parent_id).log_metrics(timings, step=0)
    log.info("compare: %s", ", ".join(f"{k}={v:.1f}" for k, v in timings.items()))
    return {m: {"run_id": run_ids[m], "eval_run_id": None} for m in cc.methods}


def build_report(run_ids: dict[str, dict], compare: dict[str, Any]) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Write the report from the runs (``compare.report_dir``) and log it to the compare run.

    Returns the long accuracy table (every method, policy, benchmark) and a summary
    (run ids, written paths, system numbers) for the catalog.
    """
    from mlflow.tracking import MlflowClient

    from qerl_pipeline.tracking import MlflowLogger

    cc: CompareConfig = parse(CompareConfig, compare, "compare")
    methods = [m for m in cc.methods if m in run_ids]
    runs = R.load_selected({m: run_ids[m] for m in methods}, client=MlflowClient())
    paths = R.build_report(runs, cc.report_dir, title=f"QeRL comparison: {', '.join(methods)}")
    R.log_report(paths, MlflowLogger())
    system = R.system_table(runs).reset_index().to_dict(orient="records")
    summary = {"runs": run_ids, "files": {k: str(p) for k, p in paths.items()}, "system": system}
    log.info("compare report: %s", paths["html"])
    return R.accuracy_frame(runs), summary
