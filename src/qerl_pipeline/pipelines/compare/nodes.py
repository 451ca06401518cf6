"""compare nodes: open the compare run, then join the method branches into one report.

The experiment itself is declared in pipeline.py: one branch per method (the train and
evaluate pipelines' templates in Kedro namespace ``compare.<method>``), the bases shared per
format. These nodes only open the compare's MLflow run (``compare_group``, which every
branch's run is nested under) and build the report from the branches' runs, one per method
and seed (``evaluation/report.py`` and its ``report_*`` modules do the work). The report's
files are returned, and the catalog writes them (``compare_report_*`` in catalog_compare.yml).
The report is built one way: from the runs the branches' persisted ``train_summary`` name, so
``--nodes=build_comparison_report`` after a compare builds it again without training.
"""

from __future__ import annotations

from typing import Any

from mlflow.tracking import MlflowClient

from qerl_pipeline.config import SKIPPED_BRANCH, CompareConfig, ModelConfig, TrackingConfig, TrainConfig
from qerl_pipeline.evaluation import report_runs
from qerl_pipeline.evaluation.report import report_artifacts
from qerl_pipeline.evaluation.report_claims import claim_metrics, claims
from qerl_pipeline.evaluation.report_tables import accuracy_frame, system_table
from qerl_pipeline.tracking import MlflowLogger, name_run, run_name
from qerl_pipeline.tracking_journal import await_server


def open_compare(model: ModelConfig, train: TrainConfig) -> dict[str, str]:
    """Name and tag the active (kedro-mlflow) run as the compare run; return ``{"run_id", "experiment_id"}``.

    Each branch's training run is created as its child (``tracking.child_run``); a branch
    finished by an earlier, interrupted compare is re-nested under this run.
    """
    logger = MlflowLogger()
    run = logger.client.get_run(logger.run_id)
    name_run(logger.run_id, run_name("compare", None, model, train.seed), "compare")
    return {"run_id": logger.run_id, "experiment_id": run.info.experiment_id}


def build_report(
    compare_group: dict[str, str], compare: CompareConfig, tracking: TrackingConfig, **branches: Any
) -> dict[str, Any]:
    """The comparison report of the branches' runs (the claims also logged to the compare run).

    A tracking server away is waited for up to ``tracking.outage_s``, then the node stops with one line
    (``TrackingOutage``): the compare run holds nothing but what the report derives from the branches' runs,
    so nothing of it waits in a journal; the same command run again reuses every branch and builds it.

    ``branches``: ``<method>_summary`` (each branch's ``train_summary``, which names its run),
    ``<method>_accuracy`` (its ``eval_accuracy``) and ``<method>_export`` (its ``export_report``), inputs
    so the report comes after every evaluation and export (an export's 4-bit policy is read from the
    runs like the rest). Only ``compare.methods`` are read; the others' branches were skipped. Returns
    ``report_outputs``'s dict.
    """
    selection = {}
    for method in compare.methods:
        summary = branches.get(f"{method}_summary")
        if summary is None:
            raise ValueError(f"compare.methods: no branch for {method!r} in the compare pipeline")
        if summary.get(SKIPPED_BRANCH):  # only when this node runs alone after a compare with other methods
            raise ValueError(
                f"compare.methods lists {method!r}, but its branch's train_summary says "
                f"{summary[SKIPPED_BRANCH]!r}: run the compare (or its branch, --namespaces=compare.{method}) "
                f"with {method} in compare.methods first"
            )
        runs = summary.get("runs", [summary])  # one entry per seed (train/nodes.py)
        selection[method] = [{"run_id": r["mlflow_run_id"], "eval_run_id": None, "seed": r.get("seed")} for r in runs]
    client = MlflowClient()
    await_server(client.tracking_uri, tracking.outage_s)
    return report_outputs(
        report_runs.load_selected(selection, client=client), compare_group["run_id"], compare.methods
    )


def report_outputs(runs: list[report_runs.RunData], compare_run_id: str, methods: list[str]) -> dict[str, Any]:
    """The report of ``runs`` as the report nodes' outputs; the claims about ``methods`` (``compare.methods``)
    go to the compare run as metrics ``claims/<id>/...`` and tags ``claims.<id>``.

    Keys: ``runs`` (``{method: [{"run_id", "eval_run_id", "seed"}, ...]}``), ``accuracy_table`` (the
    long accuracy table, a ``seed`` column), ``summary`` (run ids, the report's files, the system
    numbers per method, the claims' sentences) and every file of ``report_artifacts`` by name.
    """
    found = claims(runs, methods)
    metrics, tags = claim_metrics(found)
    logger = MlflowLogger(run_id=compare_run_id)
    logger.log_metrics(metrics, step=0)
    logger.set_tags(tags)
    selection = report_runs.selection(runs)
    files = report_artifacts(runs, title=f"QeRL comparison: {', '.join(report_runs.by_method(runs))}", found=found)
    summary = {
        "compare_run_id": compare_run_id,
        "runs": selection,
        "files": list(files),
        "system": system_table(runs).reset_index().to_dict(orient="records"),
        "claims": {c.id: c.text for c in found},
    }
    return {"runs": selection, "accuracy_table": accuracy_frame(runs), "summary": summary, **files}
