"""compare nodes: open the compare run, then join the method branches into one report.

The experiment itself is declared in pipeline.py: one branch per method (the train and
evaluate pipelines' templates in Kedro namespace ``compare.<method>``), the bases shared per
format. These nodes only open the compare's MLflow run (``compare_group``, which every
branch's run is nested under) and build the report from the branches' runs, one per method
and seed (``evaluation/report.py`` does the work, ``evaluation/stats.py`` the statistics).
"""

from __future__ import annotations

import logging
from typing import Any

import pandas as pd

from qerl_pipeline.config import CompareConfig, parse
from qerl_pipeline.evaluation import report as R

log = logging.getLogger(__name__)


def open_compare(compare: dict[str, Any], model: dict[str, Any], train: dict[str, Any]) -> dict[str, str]:
    """Name and tag the active (kedro-mlflow) run as the compare run; return ``{"run_id", "experiment_id"}``.

    Each branch's training run is created as its child (``tracking.child_run``); a branch
    finished by an earlier, interrupted compare is re-nested under this run.
    """
    from qerl_pipeline.tracking import MlflowLogger, name_run, run_name

    parse(CompareConfig, compare, "compare")
    logger = MlflowLogger()
    run = logger.client.get_run(logger.run_id)
    name_run(logger.run_id, run_name("compare", None, model, train.get("seed")), "compare")
    return {"run_id": logger.run_id, "experiment_id": run.info.experiment_id}


def build_report(compare_group: dict[str, str], compare: dict[str, Any], **branches: Any) -> tuple[dict, pd.DataFrame, dict]:
    """The comparison report of the branches' runs (``compare.report_dir``, logged to the compare run).

    ``branches``: ``<method>_summary`` (each branch's ``train_summary``, which names its run) and
    ``<method>_accuracy`` (its ``eval_accuracy``, an input so the report comes after every
    evaluation). Returns ``({method: [{"run_id", "eval_run_id", "seed"}, ...]}, the long accuracy table (a
    ``seed`` column), a summary)``.
    """
    cc: CompareConfig = parse(CompareConfig, compare, "compare")
    selection = {}
    for method in cc.methods:
        summary = branches.get(f"{method}_summary")
        if summary is None:
            raise ValueError(f"compare.methods: no branch for {method!r} in the compare pipeline")
        runs = summary.get("runs", [summary])  # one entry per seed (train/nodes.py)
        selection[method] = [{"run_id": r["mlflow_run_id"], "eval_run_id": None, "seed": r.get("seed")} for r in runs]
    return R.report_for(selection, cc, compare_group["run_id"])


def report_from_mlflow(report_run: dict[str, str], compare: dict[str, Any]) -> tuple[dict, pd.DataFrame, dict]:
    """``compare_report`` pipeline: the report of runs already in MLflow (nothing is trained).

    ``compare.reuse_group``: the runs of that compare run; None: for each of ``compare.methods``
    its newest finished training run paired with its newest evaluation run (``report.load_runs``).
    """
    from mlflow.tracking import MlflowClient

    cc: CompareConfig = parse(CompareConfig, compare, "compare")
    client = MlflowClient()
    exp = client.get_experiment(report_run["experiment_id"])
    runs = R.load_runs(exp.name, cc.methods, client=client, group=cc.reuse_group, require_eval=True, finished_only=True)
    log.info("compare report from MLflow runs %s", R.selection(runs))
    return R.report_for(R.selection(runs), cc, report_run["run_id"])
