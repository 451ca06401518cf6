"""Which platform this process computes on: the one place that asks torch whether CUDA is there.

``current_platform()`` is ``"cuda"`` when a CUDA GPU is visible, else ``"cpu"``; the trainer,
the engines, evaluation and the benchmark all take that answer (the installed vLLM build
follows the same rule: ``install.sh``).

The question is asked without initialising the CUDA driver (``cuda_present``):
``torch.cuda.is_available()`` calls ``cudaGetDeviceCount`` (which runs ``cuInit``) unless
``PYTORCH_NVML_BASED_CUDA_CHECK=1``. vLLM sets that variable itself, but only when it is
imported (vllm/env_override.py), and it switches its workers to spawn only when
``torch.cuda.is_initialized()``, which ``is_available()`` does not set: asking torch first
would make vLLM fork EngineCore from a process whose driver is initialised, and CUDA does
not survive a fork. So the variable is set here, before the question (vLLM's own value);
the alternative, forcing spawn (``VLLM_WORKER_MULTIPROC_METHOD=spawn``), would work too but
re-imports vLLM and torch in every engine process and overrides vLLM's own choice. When NVML
cannot answer, torch falls back to the runtime query (its documented weaker guarantee);
vLLM's spawn rule still sees an uninitialised torch then.
"""

from __future__ import annotations

import os

#: The platforms the project runs on.
PLATFORMS = ("cuda", "cpu")
#: torch's switch for asking NVML, not the CUDA runtime, whether a GPU is there (torch/cuda/__init__.py).
NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"


def check(platform: str) -> str:
    """``platform`` itself when it is one of ``PLATFORMS``, else a ValueError naming the allowed ones."""
    if platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}; expected one of {', '.join(PLATFORMS)}")
    return platform


def cuda_present(environ=os.environ) -> bool:
    """Whether this process sees a CUDA GPU, asked without initialising the CUDA driver (module docstring)."""
    environ[NVML_CHECK_ENV] = "1"
    import torch  # here, not at the top: the Kedro CLI imports this module (hooks) and should not pay for torch

    return torch.cuda.is_available()


def current_platform() -> str:
    """``cuda`` when this process sees a CUDA GPU, else ``cpu``."""
    return "cuda" if cuda_present() else "cpu"
