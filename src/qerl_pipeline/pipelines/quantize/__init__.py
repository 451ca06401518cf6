"""quantize pipeline: the method's base model in NVFP4, NF4 or BF16
(its dense serving copy is written on first use)."""

from qerl_pipeline.pipelines.quantize.pipeline import create_pipeline

__all__ = ["create_pipeline"]
