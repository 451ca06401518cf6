"""compare_report: ``open_compare_run`` + ``report_from_mlflow``: the report of finished runs in MLflow.

``compare.reuse_group``: the branch runs of that compare run; None: per method of
``compare.methods`` its newest finished training run paired with its newest evaluation run
(separate ``kedro run``s). The nodes live with compare's (pipelines/compare/nodes.py).
"""

from kedro.pipeline import Pipeline

from qerl_pipeline.pipelines.compare.pipeline import create_report_pipeline


def create_pipeline(**kwargs) -> Pipeline:
    return create_report_pipeline()
