"""benchmark pipeline: rollout and training speed, memory, the TRL peer and the hardware limits."""

from qerl_pipeline.pipelines.benchmark.pipeline import create_pipeline

__all__ = ["create_pipeline"]
