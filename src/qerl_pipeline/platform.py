"""Which platform this process computes on: the one place that asks torch whether CUDA is there.

``current_platform()`` is ``"cuda"`` when a CUDA GPU is visible, else ``"cpu"``; the trainer,
the engines, evaluation and the benchmark all take that answer (the installed vLLM build
follows the same rule: ``install.sh``). ``gpu_memory_bytes()`` is the memory of the smallest
GPU the process may use, as CUDA counts it, read through NVML, which creates no CUDA context:
validation plans the run on it before any engine forks (hooks.py).

The question must not leave a process that vLLM then forks with an initialised CUDA driver
(CUDA does not survive a fork: "Cannot re-initialize CUDA in forked subprocess").
``torch.cuda.is_available()`` calls ``cudaGetDeviceCount`` (which runs ``cuInit``) unless
``PYTORCH_NVML_BASED_CUDA_CHECK=1``, and vLLM switches its EngineCore and workers to spawn
only when ``torch.cuda.is_initialized()`` (vllm/utils/system_utils.py ``_maybe_force_spawn``),
which that runtime query does not set. So ``cuda_present``:

* sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` before asking (vLLM's own value, which vLLM sets
  itself only when it is imported: vllm/env_override.py): torch counts the GPUs through NVML
  and leaves the driver alone;
* asks NVML's count first (``torch.cuda._device_count_nvml``): where NVML cannot count
  (-1: ``CUDA_VISIBLE_DEVICES`` naming MIG slices, which torch does not parse, or NVML
  failing to start), torch's check falls back to the runtime query and poisons fork; then
  it sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` before the question, so every vLLM process
  started from this one is spawned (a fresh interpreter, which re-imports vLLM and torch).
  Where NVML counts, vLLM keeps its own choice (fork).
"""

from __future__ import annotations

import os
import re

#: The platforms the project runs on.
PLATFORMS = ("cuda", "cpu")
#: torch's switch for asking NVML, not the CUDA runtime, whether a GPU is there (torch/cuda/__init__.py).
NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
#: vLLM's start method for its EngineCore and worker processes (fork by default).
VLLM_START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


def check(platform: str) -> str:
    """``platform`` itself when it is one of ``PLATFORMS``, else a ValueError naming the allowed ones."""
    if platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}; expected one of {', '.join(PLATFORMS)}")
    return platform


def _nvml_cannot_count(cuda) -> bool:
    """Whether torch's NVML-based check would fall back to the CUDA runtime query (``cuda``: ``torch.cuda``)."""
    if not cuda._is_compiled() or cuda.is_initialized():
        return False  # no CUDA build: nothing is queried; initialised already: vLLM spawns by itself
    count_nvml = getattr(cuda, "_device_count_nvml", None)
    return count_nvml is None or count_nvml() < 0


def cuda_present(environ=os.environ) -> bool:
    """Whether this process sees a CUDA GPU, asked without leaving vLLM a driver to fork (module docstring)."""
    environ[NVML_CHECK_ENV] = "1"
    import torch  # here, not at the top: the Kedro CLI imports this module (hooks) and should not pay for torch

    if _nvml_cannot_count(torch.cuda):
        environ[VLLM_START_METHOD_ENV] = "spawn"
    return torch.cuda.is_available()


def current_platform() -> str:
    """``cuda`` when this process sees a CUDA GPU, else ``cpu``."""
    return "cuda" if cuda_present() else "cpu"


def gpu_memory_bytes(environ=os.environ) -> int | None:
    """Total memory of the smallest GPU this process may use, in bytes as CUDA reports it; None when NVML cannot say.

    The GPUs are those of ``CUDA_VISIBLE_DEVICES`` (indices, ``GPU-``/``MIG-`` UUIDs, read up to the
    first entry CUDA would not take), or every GPU when it is unset. NVML's memory info (v2)
    gives the installed total and what the driver reserves; CUDA's total (``cudaMemGetInfo``,
    which vLLM multiplies by ``gpu_memory_utilization``) is the difference. A GPU in MIG mode
    named by index is not resolved (CUDA would enumerate its instances): None.
    """
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no nvidia-ml-py, no driver library, no GPU: NVML cannot say
        return None
    try:
        totals = [_cuda_total(pynvml, h) for h in _visible_handles(pynvml, environ.get("CUDA_VISIBLE_DEVICES"))]
        return min(totals) if totals and None not in totals else None
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def _visible_handles(pynvml, spec: str | None) -> list:
    count = pynvml.nvmlDeviceGetCount()
    if spec is None:
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    handles = []
    for item in (s.strip() for s in spec.split(",")):
        if item.startswith(("GPU-", "MIG-")):
            handles.append(pynvml.nvmlDeviceGetHandleByUUID(item))
        elif re.fullmatch(r"\d+", item) and int(item) < count:
            handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(item)))
        else:  # CUDA ignores this entry and every one after it
            break
    return handles


def _cuda_total(pynvml, handle) -> int | None:
    """CUDA's total of one NVML device: installed memory less the driver's reservation (None: a MIG-mode parent)."""
    try:
        if pynvml.nvmlDeviceGetMigMode(handle)[0]:
            return None
    except pynvml.NVMLError:  # not MIG-capable, or a MIG instance itself
        pass
    try:
        info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        return int(info.total - info.reserved)
    except pynvml.NVMLError:  # a driver without the v2 call: the installed total, a little above CUDA's
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
