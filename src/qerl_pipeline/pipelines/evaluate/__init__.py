"""evaluate pipeline: benchmark accuracy of base + adapter (see pipeline.py)."""

from qerl_pipeline.pipelines.evaluate.pipeline import create_pipeline

__all__ = ["create_pipeline"]
