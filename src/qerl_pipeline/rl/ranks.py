"""The data-parallel rank's view and the collectives the trainer uses (torch.distributed).

A leaf: the trainer, the step and the GPU acceptance check use it; the launcher that starts
the ranks is ``rl/launch.py``. Why two backends on CUDA and what each rank computes:
that module's docstring.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Dist:
    """This process's place in the job and the collectives the trainer uses (one process: no-ops)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    #: run the collectives with one rank too (the GPU acceptance check joins an NCCL group of world size 1)
    always_collect: bool = False

    @property
    def active(self) -> bool:
        return self.world_size > 1 or self.always_collect

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.active:
            return obj
        box = [obj if self.rank == src else None]
        torch.distributed.broadcast_object_list(box, src=src)
        return box[0]

    def sum(self, value: float) -> float:
        """The sum of a float over the ranks (float64 on the wire)."""
        if not self.active:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return float(t)

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        if self.active:
            torch.distributed.all_reduce(t)
        return t

    def all_reduce_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum the gradients of ``params`` over the ranks, in one flat buffer (one collective).

        Every rank joins, also one whose share of the batch was empty (no gradients): a missing
        gradient counts as zeros, and a flag per parameter travels in the same buffer, so a
        parameter gets the sum where any rank has a gradient for it and keeps ``None`` where none
        has (as in one process: the optimiser skips it).
        """
        if not self.active or not params:
            return
        device = params[0].device
        parts = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(device, torch.float32)
            for p in params
        ]
        flags = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=device)
        flat = torch.cat([*parts, flags])
        torch.distributed.all_reduce(flat)
        anyone = (flat[-len(params) :] > 0).tolist()
        offset = 0
        for p, part, has in zip(params, parts, anyone, strict=True):
            n = part.numel()
            summed = flat[offset : offset + n].view_as(p)
            if p.grad is not None:
                p.grad.copy_(summed.to(p.grad.dtype))
            elif has:
                p.grad = summed.to(p.device, p.dtype).clone()
            offset += n


SINGLE = Dist()


def from_env(env: dict[str, str] | None = None) -> Dist:
    """The ``Dist`` torchrun's variables describe (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``);
    one process without them."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    if world <= 1:
        return SINGLE
    return Dist(int(env["RANK"]), world, int(env.get("LOCAL_RANK", env["RANK"])))


def backend_for(platform: str) -> str:
    """gloo on CPU; on CUDA NCCL for CUDA tensors and gloo for CPU ones (module docstring)."""
    return "cpu:gloo,cuda:nccl" if platform == "cuda" else "gloo"


def rank_device(platform: str, local_rank: int) -> str:
    """The trainer's device of a rank: ``cuda:<local_rank>`` on CUDA (one GPU per rank), ``cpu`` otherwise."""
    return f"cuda:{local_rank}" if platform == "cuda" else "cpu"


def init(platform: str) -> Dist:
    """Join the process group torchrun set up (no-op in a single process)."""
    d = from_env()
    if d.active and not torch.distributed.is_initialized():
        if platform == "cuda":
            torch.cuda.set_device(d.local_rank)
        torch.distributed.init_process_group(backend_for(platform))
    return d


def shard_bounds(n: int, rank: int, world_size: int, *, balanced: bool = False) -> tuple[int, int]:
    """``[lo, hi)`` of the ``n`` items rank ``rank`` takes: contiguous shares in rank order, equal
    (``n % world_size == 0``, else ``ValueError``), or with ``balanced`` any ``n``: the first
    ``n % world_size`` ranks take one more (a share may be empty)."""
    if n % world_size and not balanced:
        raise ValueError(f"{n} prompt groups do not split evenly over {world_size} ranks")
    share, extra = divmod(n, world_size)
    lo = rank * share + min(rank, extra)
    return lo, lo + share + (rank < extra)
