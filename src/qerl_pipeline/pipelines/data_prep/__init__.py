"""data_prep pipeline: prompt records for training and evaluation (see pipeline.py)."""

from qerl_pipeline.pipelines.data_prep.pipeline import create_pipeline

__all__ = ["create_pipeline"]
