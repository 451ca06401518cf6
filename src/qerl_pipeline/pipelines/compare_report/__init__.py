"""compare_report: the comparison report of runs already in MLflow (nothing is trained)."""

from qerl_pipeline.pipelines.compare_report.pipeline import create_pipeline

__all__ = ["create_pipeline"]
