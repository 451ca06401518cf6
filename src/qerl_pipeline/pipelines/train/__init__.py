"""train pipeline: GRPO/DAPO on LoRA over the method's quantized base, with AQN (see pipeline.py)."""

from qerl_pipeline.pipelines.train.pipeline import create_pipeline

__all__ = ["create_pipeline"]
