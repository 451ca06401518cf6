"""quantize pipeline: the method's base model in NVFP4, NF4 or BF16 (+ a dense serving copy)."""

from qerl_pipeline.pipelines.quantize.pipeline import create_pipeline

__all__ = ["create_pipeline"]
