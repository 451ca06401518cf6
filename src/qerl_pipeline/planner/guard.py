"""The planner's verdict on a run's settings: the utilization it picks, and the one line validation refuses with.

``plans(cfg, methods, shape, gpu_gib)`` plans each method of a run at its settings
(``planner/sizing.py``); a method fits when its engine starts and the trainer and engine
together stay within the GPU. Over the methods of one run (a training, or a compare's
branches, which share ``rollout.gpu_memory_utilization``) the utilizations that fit them all
are ``[max of their minimums, min of their maximums]``.

``pick_utilization`` is the value the planner recommends from that range: the largest multiple
of ``STEP`` that leaves ``HEADROOM`` of the GPU unplanned (the engine's workspace, CUDA graphs
and contexts and the backward transient are estimates worth a few GiB on an 80 GiB GPU,
docs/planner.md), re-planned to fit; where the range is narrower than that, its middle. A
larger utilization gives the engine more KV cache (fewer rollout waves); the trainer's own
room does not depend on it while the engine sleeps during the update.

``refusal`` is what ``hooks.ValidateConfigHook`` prints on a CUDA machine for settings that
cannot run (one line, "" when they can): the field to change, its value, the GPU's size and
the value that fits. Which field: ``rollout.gpu_memory_utilization`` when some utilization fits
every method; else ``train.micro_batch_size`` when a smaller micro-batch fits at this
utilization (an engine awake during the update, or a trainer cache kept, shares the GPU with
the activations); else the methods themselves (``method``, or ``compare.methods``), naming
those that fit this GPU and at what utilization.
"""

from __future__ import annotations

import math

from qerl_pipeline.config import METHODS, QerlConfig, validate
from qerl_pipeline.planner.model_shape import ModelShape
from qerl_pipeline.planner.sizing import GIB, Plan, plan

#: The grid the planner picks a utilization on.
STEP = 0.05
#: Fraction of the GPU the picked utilization leaves unplanned (the estimated terms' uncertainty).
HEADROOM = 0.05
#: Where the refusal sends the user, and how to run anyway.
SEE = "the memory planner, docs/planner.md; --params planner.check=false runs anyway"


def method_config(
    cfg: QerlConfig, method: str, utilization: float | None = None, micro_batch: int | None = None
) -> QerlConfig:
    """``cfg`` with ``method`` (a compare branch's config), optionally another utilization or micro-batch."""
    raw = cfg.model_dump()
    raw["method"] = method
    if utilization is not None:
        raw["rollout"] = {**raw["rollout"], "gpu_memory_utilization": utilization}
    if micro_batch is not None:
        raw["train"] = {**raw["train"], "micro_batch_size": micro_batch}
    return validate(raw)


def plans(
    cfg: QerlConfig,
    methods: list[str],
    shape: ModelShape,
    gpu_gib: float,
    utilization: float | None = None,
    empty_cache: bool | None = None,
) -> dict[str, Plan]:
    """One plan per method at ``cfg``'s settings (or at ``utilization``); ``empty_cache`` as ``sizing.plan``'s."""
    return {
        m: plan(method_config(cfg, m, utilization), shape, gpu_gib, empty_cache=empty_cache)
        for m in dict.fromkeys(methods)
    }


def utilization_range(planned: dict[str, Plan]) -> tuple[float, float]:
    """``(lo, hi)``: the utilizations at which every plan's engine starts and its run fits (empty when lo > hi)."""
    return (
        max(p.min_gpu_memory_utilization for p in planned.values()),
        min(p.max_gpu_memory_utilization for p in planned.values()),
    )


def pick_utilization(
    cfg: QerlConfig, methods: list[str], shape: ModelShape, gpu_gib: float, empty_cache: bool | None = None
) -> float | None:
    """The utilization the planner recommends for ``methods`` on this GPU (module docstring); None when none fits."""
    lo, hi = utilization_range(plans(cfg, methods, shape, gpu_gib, empty_cache=empty_cache))
    if lo > hi:
        return None
    grid = [k * STEP for k in range(math.floor((hi - HEADROOM) / STEP + 1e-9), 0, -1)]
    middle = math.floor((lo + hi) / 2 * 100) / 100
    for u in [round(u, 2) for u in grid if u >= lo] + [middle, round(lo + 5e-4, 3)]:
        if 0 < u <= 1 and all(p.fits for p in plans(cfg, methods, shape, gpu_gib, u, empty_cache).values()):
            return u
    return None


def _why(planned: dict[str, Plan], methods: list[str]) -> str:
    """Why these plans do not fit, methods with the same reason named together."""
    reasons: dict[str, list[str]] = {}
    for m in methods:
        p = planned[m]
        if not p.engine_starts:
            text = (
                f"the engine needs at least {p.min_gpu_memory_utilization:.2f} to start (its weights, workspace "
                f"and one {p.seq_len}-token sequence)"
            )
        else:
            text = f"trainer and engine need {p.peak / GIB:.1f} GiB"
        reasons.setdefault(text, []).append(m)
    return "; ".join(f"{', '.join(ms)}: {text}" for text, ms in reasons.items())


def refusal(
    cfg: QerlConfig,
    methods: list[str],
    shape: ModelShape,
    gpu_gib: float,
    *,
    methods_field: str = "method",
    engine_only: bool = False,
) -> str:
    """The one line validation refuses ``methods`` at ``cfg``'s settings with on a GPU of ``gpu_gib``
    GiB, or "" when each fits. ``engine_only``: a run that starts engines but trains nothing
    (evaluation), where only the engine's start is checked."""
    planned = plans(cfg, methods, shape, gpu_gib)
    ok = (lambda p: p.engine_starts) if engine_only else (lambda p: p.fits)
    bad = [m for m, p in planned.items() if not ok(p)]
    if not bad:
        return ""
    gpu = f"this {gpu_gib:.1f} GiB GPU"
    util = cfg.rollout.gpu_memory_utilization
    lo, hi = utilization_range(planned)
    if engine_only:
        return (
            f"rollout.gpu_memory_utilization: {util:g} cannot start the engine on {gpu} ({_why(planned, bad)}); "
            f"{lo:.2f} or more starts it ({SEE})"
        )
    if lo <= hi:
        pick = pick_utilization(cfg, methods, shape, gpu_gib)
        return (
            f"rollout.gpu_memory_utilization: {util:g} does not fit {gpu} ({_why(planned, bad)}); "
            f"{lo:.2f}-{hi:.2f} fits {', '.join(planned)}, the planner picks {pick:.2f} ({SEE})"
        )
    smaller = min(planned[m].max_micro_batch for m in bad)
    if (
        all(planned[m].engine_starts for m in bad)
        and smaller >= 1
        and all(plan(method_config(cfg, m, micro_batch=smaller), shape, gpu_gib).fits for m in planned)
    ):
        return (
            f"train.micro_batch_size: {cfg.train.micro_batch_size} does not fit {gpu} at "
            f"rollout.gpu_memory_utilization {util:g} ({_why(planned, bad)}); {smaller} fits ({SEE})"
        )
    alone = {m: utilization_range(plans(cfg, [m], shape, gpu_gib)) for m in METHODS}
    fitting = [m for m, (a, b) in alone.items() if a <= b]
    never = [m for m in planned if m not in fitting]
    limits = "; ".join(
        f"{m}: the engine needs at least {planned[m].min_gpu_memory_utilization:.2f}, the trainer "
        f"leaves at most {planned[m].max_gpu_memory_utilization:.2f}"
        for m in never
    )
    head = (
        f"{methods_field}: {', '.join(never)} fit{'s' if len(never) == 1 else ''} {gpu} at no "
        f"rollout.gpu_memory_utilization ({limits})"
    )
    if not fitting:
        return f"{head}; no method fits it at these settings ({SEE})"
    groups: dict[str, list[str]] = {}  # the methods that fit, by their own range and pick as said
    for m in fitting:
        pick = pick_utilization(cfg, [m], shape, gpu_gib)
        said = f"{alone[m][0]:.2f}-{alone[m][1]:.2f}" + (f", the planner picks {pick:.2f}" if pick is not None else "")
        groups.setdefault(said, []).append(m)
    where = "; ".join(f"{', '.join(ms)} fit{'s' if len(ms) == 1 else ''} at {said}" for said, ms in groups.items())
    return f"{head}; {where} ({SEE})"
