"""Memory planner: per-GPU bytes of a training run on one GPU, whether it fits, the largest batches that do.

``python -m qerl_pipeline.planner --env paper_bigmath_32b --gpu-gb 80`` reads the project's
parameters the way ``kedro run`` does and the model's shape (``planner/inputs.py``), plans
each method (``planner/sizing.py``, whose docstring is the memory model), with the utilization
it picks (``planner/guard.py``), and prints one table, markdown rows (the tables in
docs/planner.md) or JSON.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from qerl_pipeline.planner import guard
from qerl_pipeline.planner.guard import pick_utilization, utilization_range
from qerl_pipeline.planner.inputs import PRESETS, load_config, resolve_shape
from qerl_pipeline.planner.sizing import GIB, Plan


def _util(u: float | None) -> str:
    return "none" if u is None else f"{u:.2f}"


def rows(p: Plan, pick: float | None = None) -> list[tuple[str, str]]:
    """(component, GiB or value) rows of a plan (``pick``: the utilization the planner picks for it),
    in table order."""
    g = lambda n: f"{n / GIB:.2f}"  # noqa: E731
    t, a, e = p.trainer, p.activations, p.engine
    return [
        ("trainer: base linears", g(t["base_linears"])),
        (
            "trainer: embeddings + lm_head + norms + biases",
            g(t["embeddings"] + t["lm_head"] + t["norms"] + t["biases"] + t["rotary"]),
        ),
        ("trainer: LoRA + grads + optimizer", g(t["lora"] + t["grads"] + t["optimizer"])),
        (f"trainer: activations, micro-batch {p.micro_batch} x {p.seq_len}", g(a["peak"])),
        ("engine: served weights + LoRA slots", g(e["served_weights"] + e["lora_slots"])),
        ("engine: workspace + CUDA graphs", g(e["workspace"] + e["cuda_graphs"])),
        (f"engine: KV cache held / needed ({p.rollout_batch} seqs)", f"{g(p.kv_capacity)} / {g(p.kv_needed)}"),
        (f"engine: reserved ({p.gpu_memory_utilization} x GPU)", g(p.engine_reserved)),
        ("CUDA contexts (2 processes)", g(p.contexts)),
        ("trainer cache emptied after the update", "yes" if p.empty_cache else "no"),
        (
            "rollout phase / update phase" + (" (engine asleep)" if p.sleep else ""),
            f"{g(p.rollout_phase)} / {g(p.update_phase)}",
        ),
        ("peak / GPU", f"{g(p.peak)} / {g(p.gpu_bytes)}"),
        ("fits", "yes" if p.fits else "no"),
        ("largest micro-batch", str(p.max_micro_batch)),
        ("largest concurrent rollout batch", str(p.max_concurrent_rollouts)),
        (
            "gpu_memory_utilization: smallest that starts / largest that fits / picked",
            f"{p.min_gpu_memory_utilization:.3f} / {p.max_gpu_memory_utilization:.3f} / {_util(pick)}",
        ),
    ]


def render(plans: list[Plan], picks: list[float | None], title: str = "", together: str = "") -> None:
    """Print plans side by side (one column per plan) with rich,
    then ``together`` (the range and pick for them all)."""
    table = Table(title=title or None)
    table.add_column("component (GiB)")
    for p in plans:
        table.add_column(f"{p.method} ({p.fmt})", justify="right")
    cols = [rows(p, u) for p, u in zip(plans, picks, strict=True)]
    for i, (label, _v) in enumerate(cols[0]):
        table.add_row(label, *(c[i][1] for c in cols))
    console = Console(width=160)
    console.print(table)
    for p in plans:
        for note in p.notes:
            console.print(f"{p.method}: {note}", markup=False)
    if together:
        console.print(together, markup=False)


def markdown(plans: list[Plan], picks: list[float | None]) -> str:
    """One markdown row per plan (model, method, components in GiB, fits, largest batches, utilizations): the table in
    docs/planner.md."""
    g = lambda n: f"{n / GIB:.1f}"  # noqa: E731
    head = (
        "| model | method | grad. ckpt / sleep / empty cache | base linears | emb + head + norms "
        "| LoRA + grads + AdamW | activations (mb x L) | engine weights + LoRA | engine workspace "
        "| engine reserved (util) | KV held / needed | rollout / update phase | fits | largest micro-batch "
        "| concurrent rollouts | util: min to start / max to fit / picked |"
    )
    sep = "|---|---|---|" + "---:|" * 12 + "---|"
    out = [head, sep]
    for p, pick in zip(plans, picks, strict=True):
        t, a, e = p.trainer, p.activations, p.engine
        out.append(
            " | ".join(
                [
                    f"| {p.model.split('/')[-1]}",
                    f"{p.method} ({p.fmt})",
                    f"{'on' if p.gradient_checkpointing else 'off'} / {'on' if p.sleep else 'off'} / "
                    f"{'yes' if p.empty_cache else 'no'}",
                    g(t["base_linears"]),
                    g(t["embeddings"] + t["lm_head"] + t["norms"] + t["biases"] + t["rotary"]),
                    g(t["lora"] + t["grads"] + t["optimizer"]),
                    f"{g(a['peak'])} ({p.micro_batch} x {p.seq_len})",
                    g(e["served_weights"] + e["lora_slots"]),
                    g(e["workspace"] + e["cuda_graphs"]),
                    f"{g(p.engine_reserved)} ({p.gpu_memory_utilization:g})",
                    f"{g(p.kv_capacity)} / {g(p.kv_needed)}",
                    f"{g(p.rollout_phase)} / {g(p.update_phase)}",
                    "**yes**" if p.fits else "no",
                    str(p.max_micro_batch),
                    f"{p.max_concurrent_rollouts} of {p.rollout_batch}",
                    f"{p.min_gpu_memory_utilization:.2f} / {p.max_gpu_memory_utilization:.2f} / {_util(pick)} |",
                ]
            )
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qerl_pipeline.planner", description=__doc__.split("\n", 1)[0])
    ap.add_argument(
        "--env",
        default=None,
        help="Kedro environment(s) overlaid on conf/base, comma-separated "
        "(e.g. paper_bigmath_32b); one plan per env and method",
    )
    ap.add_argument("--params", default=None, help="Kedro-style overrides: key=value,key2=value2")
    ap.add_argument(
        "--gpu-gb",
        type=float,
        required=True,
        help="GPU memory in GiB as CUDA counts it: NVML's "
        "installed total less what the driver reserves (an '80 GB' GPU: about 79)",
    )
    ap.add_argument("--model-preset", default=None, choices=sorted(PRESETS), help="built-in model shape")
    ap.add_argument("--model-config", default=None, help="a config.json (or its folder) giving the model shape")
    ap.add_argument(
        "--methods", default=None, help="comma-separated methods to plan side by side (default: the config's)"
    )
    ap.add_argument("--conf-dir", default="conf", help="the project's conf folder")
    ap.add_argument("--format", choices=("table", "markdown", "json"), default="table")
    cache = ap.add_mutually_exclusive_group()
    cache.add_argument(
        "--empty-cache",
        dest="empty_cache",
        action="store_const",
        const=True,
        default=None,
        help="plan as if the trainer emptied its CUDA cache after every update (default: as the code "
        "does, i.e. when the engine sleeps during the update)",
    )
    cache.add_argument(
        "--keep-cache",
        dest="empty_cache",
        action="store_const",
        const=False,
        help="plan as if the trainer kept its cached activation memory into the rollout",
    )
    args = ap.parse_args(argv)
    envs = [e.strip() for e in args.env.split(",")] if args.env else [None]
    groups: list[tuple[str, list[Plan], list[float | None], str]] = []
    try:
        for env in envs:
            cfg = load_config(env, args.params, args.conf_dir)
            shape = resolve_shape(cfg, args.model_preset, args.model_config)
            methods = list(dict.fromkeys(m.strip() for m in args.methods.split(","))) if args.methods else [cfg.method]
            planned = guard.plans(cfg, methods, shape, args.gpu_gb, empty_cache=args.empty_cache)
            plans = list(planned.values())
            picks = [pick_utilization(cfg, [m], shape, args.gpu_gb, args.empty_cache) for m in methods]
            together = ""
            if len(methods) > 1:
                lo, hi = utilization_range(planned)
                both = pick_utilization(cfg, methods, shape, args.gpu_gb, args.empty_cache)
                together = f"{', '.join(methods)} together: rollout.gpu_memory_utilization " + (
                    f"{lo:.2f}-{hi:.2f} fits them all, the planner picks {_util(both)}"
                    if lo <= hi
                    else "none fits them all"
                )
            groups.append((f"{shape.name} on {args.gpu_gb:g} GiB, env {env or 'base'}", plans, picks, together))
    except (ValueError, FileNotFoundError, KeyError) as err:
        print(f"Error: {err}", file=sys.stderr)
        return 1
    if args.format == "json":
        print(
            json.dumps(
                [
                    {**p.to_dict(), "picked_gpu_memory_utilization": u}
                    for _t, plans, picks, _a in groups
                    for p, u in zip(plans, picks, strict=True)
                ],
                indent=2,
            )
        )
    elif args.format == "markdown":
        print(
            markdown(
                [p for _t, plans, _u, _a in groups for p in plans], [u for _t, _p, picks, _a in groups for u in picks]
            )
        )
    else:
        for title, plans, picks, together in groups:
            render(plans, picks, title, together)
    return 0
