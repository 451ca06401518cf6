"""Which GPUs a rollout engine spans: one engine per training rank, or one over several GPUs.

By default every data-parallel rank opens its own engine on its own GPU (``rollout.engines:
per_rank``; ``EnginePlan.devices`` becomes the engine process's ``CUDA_VISIBLE_DEVICES``,
``rollout/engine.py``'s ``visible_devices``); a model whose served weights and KV cache do not
fit one GPU uses one engine over ``rollout.tensor_parallel_size`` GPUs (vLLM's own tensor
parallelism, ``vllm.LLM(tensor_parallel_size=...)``; the engine-process design stays: one
server, one ``vllm.LLM``, vLLM's workers under it). ``engines: shared`` opens that one engine
on rank 0 only. CUDA only: on CPU vLLM's EngineCore and worker run inside the server process
(one worker), so ``tensor_parallel_size > 1`` is refused there before any engine starts. Under
tensor parallelism the in-place weight path (rollout/worker_ext.py) writes replicated tensors
(norms) and refuses sharded ones; handing rank 0's rollouts to the other ranks under
``shared`` is not built.

What the engine serves is ``rollout/serving.py``; this module only places it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qerl_pipeline.platform import check as check_platform


def tensor_parallel_args(rollout: Any, platform: str) -> dict[str, Any]:
    """Extra ``vllm.LLM`` arguments for ``rollout.tensor_parallel_size`` on ``platform``.

    ``{}`` for 1 (vLLM's default, one GPU); ``{"tensor_parallel_size": n}`` on CUDA for n > 1
    (vLLM then starts one worker per GPU with its multiprocessing executor: the engine-process
    design stays, the server still owns one ``vllm.LLM``). Refused on CPU: there the engine
    runs vLLM's EngineCore and worker inside the server process (``distributed_executor_backend
    ="uni"``, rollout/server.py), one worker by construction, and a CPU engine has host RAM,
    not a GPU's memory, to outgrow.
    """
    check_platform(platform)
    size = int(getattr(rollout, "tensor_parallel_size", 1) or 1)
    if size == 1:
        return {}
    if platform != "cuda":
        raise ValueError(
            f"rollout.tensor_parallel_size {size}: tensor parallel engines are CUDA only; on {platform} the vLLM "
            "engine runs in one process on the host (set rollout.tensor_parallel_size: 1)"
        )
    return {"tensor_parallel_size": size}


@dataclass(frozen=True)
class EnginePlan:
    """Which engine one training rank uses (``engine_plan``).

    ``opens_engine``: this rank starts an engine (else it gets rollouts from rank 0);
    ``devices``: the GPU indices the engine sees (``CUDA_VISIBLE_DEVICES`` of its process,
    counted in this process's visible devices; None: inherit, e.g. on CPU);
    ``engine_args``: extra ``vllm.LLM`` arguments (``tensor_parallel_args``); ``colocated``:
    the engine shares the GPU this rank trains on (what ``rollout.sleep.sleep_plan`` needs);
    ``why``: one line for the log.
    """

    opens_engine: bool
    tensor_parallel_size: int
    devices: tuple[int, ...] | None
    engine_args: dict[str, Any]
    colocated: bool
    why: str


def engine_plan(
    rollout: Any,
    platform: str,
    *,
    world_size: int = 1,
    rank: int = 0,
    local_rank: int | None = None,
    gpus: int | None = None,
) -> EnginePlan:
    """The rollout engine of rank ``rank`` of ``world_size`` (``rollout.engines``, ``rollout.tensor_parallel_size``).

    Pure (``gpus``: the GPUs this process sees, checked when given). The table, with t =
    tensor_parallel_size and l = local_rank (default: rank)::

        platform  engines   ranks  t    opens engine     devices             colocated
        cpu       any       any    1    per_rank: all    None (host)         no (host RAM)
                                        shared: rank 0
        cpu       any       any    >1   refused (tensor_parallel_args)
        cuda      per_rank  1      t    yes              l*t .. l*t+t-1      yes (the trainer's GPU l is in it)
        cuda      per_rank  >1     1    yes              l                   yes
        cuda      per_rank  >1     >1   refused: rank l's engine would span GPUs other ranks train on
        cuda      shared    any    t    rank 0 only      0 .. t-1            rank 0: yes; others: no engine

    ``colocated`` on CUDA means the engine and this rank's update share a GPU, so sleeping the
    engine during the update frees memory the update can use (``rollout/sleep.py``). With
    ``shared``, rank 0 sleeps the engine for every rank whose GPU it spans; the ranks must
    wait for it (a barrier after ``before_update``) before their own updates allocate.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world_size {world_size}: expected 0 <= rank < world_size >= 1")
    args = tensor_parallel_args(rollout, platform)
    t = int(getattr(rollout, "tensor_parallel_size", 1) or 1)
    mode = getattr(rollout, "engines", "per_rank")
    if mode not in ("per_rank", "shared"):
        raise ValueError(f"rollout.engines {mode!r}: expected per_rank or shared")
    local = rank if local_rank is None else int(local_rank)
    opens = mode == "per_rank" or rank == 0
    if platform == "cpu":
        why = (f"{mode} engine on the host" if opens else "shared engine: rank 0's") + (
            "" if world_size == 1 else f" (rank {rank}/{world_size})"
        )
        return EnginePlan(opens, 1, None, {}, False, why)
    if mode == "per_rank":
        if world_size > 1 and t > 1:
            raise ValueError(
                f"rollout.engines per_rank with rollout.tensor_parallel_size {t} and {world_size} training ranks: "
                f"rank {rank}'s engine would span GPUs other ranks train on; use tensor_parallel_size: 1 (one engine "
                f"per rank; a shared engine over {t} GPUs is not built yet for more than one rank)"
            )
        devices = tuple(range(local * t, local * t + t))
    else:
        devices = tuple(range(t)) if opens else ()
    if gpus is not None and devices and max(devices) >= gpus:
        raise ValueError(
            f"rollout.engines {mode}, tensor_parallel_size {t}: rank {rank} (local {local}) needs GPUs "
            f"{list(devices)} but this process sees {gpus}"
        )
    colocated = opens and local in devices
    why = (
        (f"{mode} engine on GPU(s) {list(devices)}" if opens else "shared engine: rank 0's")
        + (f", rank {rank}/{world_size}" if world_size > 1 else "")
        + ("" if colocated or not opens else ", not on this rank's GPU")
    )
    return EnginePlan(opens, t, devices if opens else None, args, colocated, why)
