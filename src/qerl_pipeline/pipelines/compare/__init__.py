"""compare pipeline: QeRL vs QLoRA vs BF16 LoRA side by side (see pipeline.py)."""

from qerl_pipeline.pipelines.compare.pipeline import create_pipeline

__all__ = ["create_pipeline"]
