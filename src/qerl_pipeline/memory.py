"""Process memory: the peak we report, and the allocator setting the trainer runs with.

``peak_memory_bytes``: CUDA's max allocated where CUDA is in use, else the RSS high-water
mark of this process (``VmHWM`` in ``/proc/self/status``; ``process_tree_peak_bytes`` reads
another process tree's, the engine's; ``getrusage``'s ``ru_maxrss``
survives ``fork`` + ``exec``, so a child started from a large process would report its
parent's size). The trainer's ``memory/peak_gb`` and the benchmark both read it.

``limit_heap_fragmentation``: without it an update's peak RSS is several times its live
data (the policy plus one micro-batch's saved activations). The rest is freed memory glibc
keeps: it raises its mmap threshold to the size of each large block freed (up to 32 MiB),
after which the 3-8 MiB activation tensors come from the brk heap, interleaved with
short-lived decode and backward temporaries, and the heap is only ever trimmed at its top,
so the peak grows with every micro-batch. Fixing the threshold at 128 KiB
(``mallopt(M_MMAP_THRESHOLD)``, which also switches off glibc's dynamic adjustment) gives
each large tensor its own mapping, returned to the OS when freed (figures in
docs/performance.md). ``malloc_trim(0)`` then returns what
earlier work (the quantize node in the same ``kedro run``) left in the heap. glibc on
Linux only; elsewhere nothing happens (and it says so).

``release_trainer_cache``: PyTorch's caching allocator keeps what the trainer freed reserved
on the GPU, invisible to any other process; a vLLM engine that starts or wakes on the same
GPU checks the GPU's free memory and would find it gone. It is called before every engine
wake (rollout/sleep.py) and every engine start (rollout/serving.py ``open_engine``: a
compare's next branch starts its engine where the previous branch trained), on CUDA only;
``collect`` first runs the garbage collector, so tensors held only by reference cycles (a
finished branch's policy and optimizer) are freed too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import resource
import sys
from pathlib import Path

log = logging.getLogger(__name__)

#: glibc's mallopt parameter number of M_MMAP_THRESHOLD (malloc.h).
_M_MMAP_THRESHOLD = -3
#: Allocations of at least this many bytes get their own mapping (glibc's initial default).
MMAP_THRESHOLD = 128 * 1024


def peak_memory_bytes() -> int:
    """Peak memory of this process: CUDA max allocated, else its RSS high-water mark (see above)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def release_trainer_cache(*, collect: bool = False) -> bool:
    """``torch.cuda.empty_cache()`` where CUDA is (after ``gc.collect()`` with ``collect``); False elsewhere.

    What the module docstring says: the trainer's cached GPU memory goes back before an engine takes its own
    (planner/sizing.py counts on it)."""
    from qerl_pipeline.platform import current_platform

    if current_platform() != "cuda":
        return False
    import torch

    if collect:
        gc.collect()
    torch.cuda.empty_cache()
    return True


def _vm_hwm(pid: int | str) -> int | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def process_tree_peak_bytes(pid: int) -> int | None:
    """RSS high-water mark of process ``pid`` plus its live descendants (Linux ``/proc``; None where unreadable).

    The engine's memory (``RolloutEngine.peak_memory_bytes``): on CPU vLLM's engine core and
    worker run inside the server process, elsewhere in its children; host RAM only (on CUDA
    the GPU memory is ``rollout.gpu_memory_utilization``'s). Summing high-water marks can
    overstate a peak the processes reached at different times, never understate it.
    """
    own = _vm_hwm(pid)
    if own is None:
        return None
    total = own
    try:
        import psutil

        for child in psutil.Process(pid).children(recursive=True):
            total += _vm_hwm(child.pid) or 0
    except Exception:  # psutil missing or the process gone: the parent's figure stands
        pass
    return total


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def limit_heap_fragmentation(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes and trim the heap; False where not glibc."""
    libc = _libc()
    if libc is None:
        log.info("not glibc: the allocator setting of qerl_pipeline.memory does not apply here")
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)))
    libc.malloc_trim(0)
    return ok
