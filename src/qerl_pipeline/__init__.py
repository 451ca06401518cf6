"""qerl-pipeline: QeRL (quantization-enhanced RL for LLMs) as a Kedro project."""

__version__ = "0.1.0"
