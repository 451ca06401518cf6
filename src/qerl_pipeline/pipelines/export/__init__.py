"""export pipeline: the trained policy as folders other tools load, its 4-bit cost,
a registered model (see pipeline.py)."""

from qerl_pipeline.pipelines.export.pipeline import create_pipeline

__all__ = ["create_pipeline"]
