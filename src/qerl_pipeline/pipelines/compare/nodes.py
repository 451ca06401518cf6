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
* Bases: all methods' bases are written fresh from the configured model into the
  compare workspace (``<train.output_dir>/compare/bases/base_<format>``) with the quantize
  library (``quantization.checkpoint.write_base``, RTN), the model loaded once for all
  formats, so a stale base from another config can never slip in. The calibrated NVFP4
  path (awq/gptq) is the quantize pipeline's; compare refuses it rather than silently
  using RTN.
* Adapters go to ``<train.output_dir>/compare/<method>``, wiped first: compare runs are
  fresh runs, never a resume of an older one.
* Evaluation after all training, grouped by base format: one engine per base serves the
  base and every adapter trained on it (qerl and qerl_noaqn share the NVFP4 engine), which
  saves an engine start per extra method. Each method's run gets its ``trained`` rows and
  the shared ``base`` rows.
* ``compare.reuse_runs``: no training; the runs are read from MLflow (one compare group, or
  the newest finished evaluated run of each method).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
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
    """(client, compare run id or None, experiment id) of the active kedro-mlflow run."""
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


# ------------------------------------------------------------------------- bases
def write_bases(cfg: QerlConfig, methods: list[str], root: Path) -> dict[str, Path]:
    """``{format: base_dir}`` for the methods' formats, written fresh under ``root``."""
    from qerl_pipeline.models import load_base_model
    from qerl_pipeline.quantization.checkpoint import write_base

    if cfg.quantize.nvfp4_algorithm != "rtn" and any(METHOD_FORMAT[m] == "nvfp4" for m in methods):
        raise ValueError(
            f"compare writes RTN bases; quantize.nvfp4_algorithm={cfg.quantize.nvfp4_algorithm!r} needs the "
            "quantize pipeline (run it per method, then compare with compare.reuse_runs after train+evaluate)"
        )
    formats = list(dict.fromkeys(METHOD_FORMAT[m] for m in methods))
    root.mkdir(parents=True, exist_ok=True)
    model, tok = load_base_model(cfg.model)
    out = {}
    for fmt in formats:
        target = root / f"base_{fmt}"
        tmp = Path(tempfile.mkdtemp(prefix=f".base_{fmt}.", dir=root))
        shutil.rmtree(tmp)  # write_base wants a fresh folder
        t0 = time.perf_counter()
        write_base(model, tok, fmt, tmp, ignore=cfg.quantize.ignore, nf4_blocksize=cfg.quantize.nf4_blocksize)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        log.info("compare: base_%s written in %.1f s", fmt, time.perf_counter() - t0)
        out[fmt] = target
    del model
    return out


# ---------------------------------------------------------------------- evaluate
def _log_eval(run_id: str, method: str, rows: list[dict], records: list[dict], timings: dict[str, float], base_dir: Path) -> None:
    from qerl_pipeline.pipelines.evaluate.nodes import base_weight_mib
    from qerl_pipeline.tracking import MlflowLogger

    logger = MlflowLogger(run_id=run_id)
    metrics = M.metric_dict(rows)
    metrics["base/weight_mib"] = base_weight_mib(base_dir)
    metrics.update({f"eval/{k}": v for k, v in timings.items()})
    logger.log_metrics(metrics, step=0)
    logger.log_table(rows, "eval/accuracy.json")
    logger.log_table(records, "eval/records.json")


def evaluate_methods(cfg: QerlConfig, adapters: dict[str, Path], bases: dict[str, Path], run_ids: dict[str, str], eval_records: list[dict]) -> None:
    """Evaluate every method's adapter (and each base once), logging into each method's run."""
    from qerl_pipeline.evaluation.evaluator import evaluate_policies
    from qerl_pipeline.pipelines.evaluate.nodes import served_dir

    by_format: dict[str, list[str]] = {}
    for method in adapters:
        by_format.setdefault(METHOD_FORMAT[method], []).append(method)
    for fmt, methods in by_format.items():
        policies: dict[str, Path | None] = {m: adapters[m] for m in methods}
        if cfg.evaluate.include_base:
            policies["base"] = None
        result = evaluate_policies(
            served_dir(bases[fmt]), eval_records, cfg.evaluate, cfg.reward, policies,
            max_model_len=cfg.model.max_seq_len, rollout_cfg=cfg.rollout,
        )
        base_records = [r for r in result.records if r["policy"] == "base"]
        for m in methods:
            mine = [{**r, "policy": "trained"} for r in result.records if r["policy"] == m] + base_records
            rows = M.aggregate(mine, keys=("policy", "source"))
            timings = {"engine_start_s": result.timings.get("engine_start_s", 0.0)}
            timings.update({f"trained/{k.split('/', 1)[1]}": v for k, v in result.timings.items() if k.startswith(f"{m}/")})
            _log_eval(run_ids[m], m, rows, mine, timings, bases[fmt])


# --------------------------------------------------------------------------- nodes
def run_methods(train_prompts: list[dict], eval_prompts: dict[str, list[dict]], parameters: dict[str, Any]) -> dict[str, str]:
    """Train and evaluate each of ``compare.methods`` (one MLflow run each); ``{method: run_id}``.

    With ``compare.reuse_runs`` nothing is trained: the runs are looked up in MLflow.
    """
    from qerl_pipeline.pipelines.evaluate.nodes import flatten_prompts
    from qerl_pipeline.rl.trainer import train
    from qerl_pipeline.tracking import MlflowLogger

    base_cfg: QerlConfig = validate(dict(parameters), QerlConfig)
    cc: CompareConfig = base_cfg.compare
    client, parent_id, experiment_id = _tracking()
    client.set_tag(parent_id, R.ROLE_TAG, "compare")
    if cc.reuse_runs:
        exp = client.get_experiment(experiment_id)
        runs = R.load_runs(exp.name, cc.methods, client=client, group=cc.reuse_group, require_eval=True, finished_only=True)
        return {r.method: r.run_id for r in runs}

    workspace = Path(base_cfg.train.output_dir) / "compare"
    t0 = time.perf_counter()
    bases = write_bases(base_cfg, list(cc.methods), workspace / "bases")
    t_bases = time.perf_counter() - t0
    eval_records = flatten_prompts(eval_prompts)
    run_ids: dict[str, str] = {}
    adapters: dict[str, Path] = {}
    timings: dict[str, float] = {"compare/bases_s": t_bases}
    for method in cc.methods:
        cfg = validate({**base_cfg.model_dump(mode="json"), "method": method}, QerlConfig)
        run_id = _new_method_run(client, experiment_id, parent_id, method, cfg)
        run_ids[method] = run_id
        shutil.rmtree(workspace / method, ignore_errors=True)
        log.info("compare: training %s (MLflow run %s)", method, run_id)
        t1 = time.perf_counter()
        try:
            result = train(
                cfg, bases[METHOD_FORMAT[method]], train_prompts, output_dir=workspace,
                make_logger=lambda stored, rid=run_id: MlflowLogger(run_id=stored or rid),
            )
        except BaseException:
            client.set_terminated(run_id, "FAILED")
            raise
        adapters[method] = result.adapter_dir
        timings[f"compare/{method}/train_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    try:
        evaluate_methods(base_cfg, adapters, bases, run_ids, eval_records)
    except BaseException:
        for rid in run_ids.values():
            client.set_terminated(rid, "FAILED")
        raise
    timings["compare/evaluate_s"] = time.perf_counter() - t2
    for rid in run_ids.values():
        client.set_terminated(rid, "FINISHED")
    timings["compare/total_s"] = time.perf_counter() - t0
    MlflowLogger(run_id=parent_id).log_metrics(timings, step=0)
    log.info("compare: %s", ", ".join(f"{k}={v:.1f}" for k, v in timings.items()))
    return run_ids


def build_report(run_ids: dict[str, str], compare: dict[str, Any]) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Write the report from the runs (``compare.report_dir``) and log it to the compare run.

    Returns the long accuracy table (every method, policy, benchmark) and a summary
    (run ids, written paths, system numbers) for the catalog.
    """
    from mlflow.tracking import MlflowClient

    from qerl_pipeline.tracking import MlflowLogger

    cc: CompareConfig = parse(CompareConfig, compare, "compare")
    methods = [m for m in cc.methods if m in run_ids]
    runs = R.load_runs("", methods, run_ids=[run_ids[m] for m in methods], client=MlflowClient())
    paths = R.build_report(runs, cc.report_dir, title=f"QeRL comparison: {', '.join(methods)}")
    R.log_report(paths, MlflowLogger())
    system = R.system_table(runs).reset_index().to_dict(orient="records")
    summary = {"runs": run_ids, "files": {k: str(p) for k, p in paths.items()}, "system": system}
    log.info("compare report: %s", paths["html"])
    return R.accuracy_frame(runs), summary
