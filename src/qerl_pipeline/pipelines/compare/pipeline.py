"""compare: train and evaluate ``compare.methods`` on one config, then the comparison report.

``kedro run --pipeline=compare`` = data_prep, then ``run_methods`` (bases, training and
evaluation of every method, one MLflow run each; or the existing runs with
``compare.reuse_runs``), then ``build_comparison_report`` (PNGs, CSVs and one HTML page in
``compare.report_dir``, also logged to the compare run). See nodes.py for the design.
"""

from kedro.pipeline import Node, Pipeline

from qerl_pipeline.pipelines.compare.nodes import build_report, run_methods


def create_pipeline(**kwargs) -> Pipeline:
    """data_prep + the two compare nodes."""
    from qerl_pipeline.pipelines.data_prep.pipeline import create_pipeline as data_prep

    compare = Pipeline(
        [
            Node(run_methods, ["train_prompts", "eval_prompts", "parameters"], "compare_runs", name="run_methods"),
            Node(build_report, ["compare_runs", "params:compare"], ["compare_accuracy", "compare_summary"], name="build_comparison_report"),
        ],
        tags="compare",
    )
    return data_prep() + compare
