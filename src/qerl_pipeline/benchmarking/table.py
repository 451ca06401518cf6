"""The benchmark table: every measured figure as one row beside its limit.

A row is ``(section, subject, metric, value, unit, limit, fraction_of_limit, note)``
(:data:`COLUMNS`); sections are ``hardware``, ``rollout``, ``sync``, ``training`` and
``peer``. ``build_table`` is pure: it turns the measurements (``hardware.measure_hardware``,
``rollout.rollout_benchmark``, ``training.measure_methods``, ``peer_trl.measure_peer``)
into rows, with the limits of ``hardware`` (rollout: bytes of the folder the engine
served, and the format's own bytes as a second limit; training: step FLOPs over the
matmul rate).

Ours vs TRL (section ``peer``, per method). Our step is our full training step, phase by
phase: ``our_rollout_s`` (rollout of the training batch on the path of the sync training
uses, ``sync[fmt]["used"]`` = ``resolve_sync(rollout.sync, served)``: the LoRA rows under
``adapter``, the no-LoRA rows under ``merge``) + ``our_reward_s`` (our scorer on those
completions) + ``our_sync_s`` (that sync's seconds per step) + ``our_update_s`` (the
training step, ``step_time_s``) = ``our_step_time_s``; ``our_over_trl_step_time`` is it over
TRL's step. ``our_over_trl_generation`` is (rollout + sync) over TRL's ``generation_s``: TRL's
generate call includes its weight sync to vLLM, and its reward (a hash, ``peer_trl``) falls in
its update part; ``our_over_trl_update`` is our training step over TRL's ``update_s``. Our
reward is the real math-verify scorer, so the full-step ratio charges us for work TRL's
cheap reward skips.

Memory: ``our_peak_memory`` = the trainer process's peak (``memory.peak_memory_bytes``) +
the rollout engine's (its process tree's host RSS high-water mark, measured on the
benchmark's engine of that format, KV cache sized like a training engine's): the two
processes a training run holds at once. ``our_over_trl_peak_memory`` is that over TRL's
process peak (its generation runs in its own process). Results without the engine figure
fall back to the trainer alone, and the rows' notes say so. On CUDA the trainer's figure is
CUDA max allocated and the engine's is host RSS (its GPU share is
``rollout.gpu_memory_utilization``'s), so there the sum is not one memory's peak.

``headline`` is the per-method summary; ``metric_name`` the MLflow name of a row's
figure, ``bench.<section>.<subject>.<metric>[.limit|.fraction_of_limit]`` (``@`` -> ``.``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qerl_pipeline.benchmarking import hardware
from qerl_pipeline.config import BenchmarkConfig
from qerl_pipeline.quantization.checkpoint import serving_dir

#: The table's columns, in order (CSV header, markdown and HTML tables).
COLUMNS = ["section", "subject", "metric", "value", "unit", "limit", "fraction_of_limit", "note"]


def row(
    section: str, subject: str, metric: str, value: float | None, unit: str, limit: float | None = None, note: str = ""
) -> dict[str, Any]:
    """One table row; ``fraction_of_limit`` is ``value / limit`` when a limit is given."""
    fraction = hardware.fraction_of_limit(value, limit) if limit is not None else None
    return {
        "section": section,
        "subject": subject,
        "metric": metric,
        "value": value,
        "unit": unit,
        "limit": limit,
        "fraction_of_limit": fraction,
        "note": note,
    }


def build_table(
    hardware_figures: dict[str, Any],
    bases: dict[str, str],
    rollout: dict[str, Any],
    training: list[dict[str, Any]],
    trl: dict[str, Any],
    bcfg: BenchmarkConfig,
) -> dict[str, Any]:
    """Every figure as a row ``(section, subject, metric, value, unit, limit, fraction_of_limit, note)``.

    The bytes a decode step reads are those of the folder the engine served
    (``rollout["served"][fmt]["path"]``; the dense ``serving/`` copy for results without it).
    """

    bw, rate = hardware_figures["bandwidth_gbs"], hardware_figures["matmul_flops"]
    rows = [
        row("hardware", hardware_figures["device"], "copy_bandwidth", bw, "GB/s"),
        row(
            "hardware",
            hardware_figures["device"],
            "matmul_rate",
            rate / 1e9,
            "GFLOP/s",
            note=f"{hardware_figures['matmul_dtype']} square matmul",
        ),
    ]
    context = bcfg.prompt_len + bcfg.completion_len / 2
    for fmt in dict.fromkeys(r["format"] for r in rollout["rows"]):
        base = Path(bases[fmt])
        info = rollout.get("served", {}).get(fmt) or {
            "path": str(serving_dir(base)),
            "served_format": f"dense-decoded-{fmt}",
            "dtype": "",
        }
        served = hardware.served_weight_bytes(Path(info["path"]))["total"]
        packed = hardware.served_weight_bytes(base)["total"]
        config = json.loads((base / "config.json").read_text())
        fpt = hardware.decode_flops_per_token(config, int(context))
        rows.append(
            row(
                "rollout",
                fmt,
                "served_format",
                None,
                "",
                note=f"{info['served_format']} {info.get('dtype', '')}".strip(),
            )
        )
        rows.append(
            row(
                "rollout",
                fmt,
                "weight_bytes_read_per_decode_step",
                served,
                "bytes",
                note=f"as served here ({info['served_format']})",
            )
        )
        rows.append(row("rollout", fmt, "weight_bytes_in_format", packed, "bytes", note="the format's own bytes"))
        for r in (r for r in rollout["rows"] if r["format"] == fmt):
            b = int(r["batch_size"])
            limit = hardware.rollout_limit_tokens_per_s(bw, served, b, rate, fpt)
            kind = "lora" if r["lora"] else "no_lora"
            note = ("LoRA adapter attached" if r["lora"] else "no adapter (as after a merge sync)") + (
                "; training batch" if r.get("is_train_batch") else ""
            )
            rows.append(
                row("rollout", fmt, f"tokens_per_s_{kind}@batch{b}", r["tokens_per_s"], "tokens/s", limit, note)
            )
            if r["lora"]:
                rows.append(
                    row(
                        "rollout",
                        fmt,
                        f"tokens_per_s_limit_if_packed@batch{b}",
                        hardware.rollout_limit_tokens_per_s(bw, packed, b, rate, fpt),
                        "tokens/s",
                        note="limit if the engine read the format's own bytes (FP4 kernels on GPU)",
                    )
                )
        s = rollout["sync"].get(fmt, {})
        for key, value in s.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                rows.append(row("sync", fmt, key, value, "s" if key.endswith("_s") else ""))
            elif isinstance(value, str):
                rows.append(row("sync", fmt, key, None, "", note=value))
        rew = rollout.get("reward", {}).get(fmt)
        if rew:
            rows.append(
                row(
                    "rollout",
                    fmt,
                    "reward_s",
                    rew["reward_s"],
                    "s",
                    note=f"{rew['sequences']} completions of the training batch, {rew['scorer']}; warm-up excluded",
                )
            )
        if info.get("engine_peak_memory_bytes") is not None:
            rows.append(
                row(
                    "rollout",
                    fmt,
                    "engine_peak_memory",
                    info["engine_peak_memory_bytes"] / 2**20,
                    "MiB",
                    note="engine process tree, host RSS high-water mark",
                )
            )
    for t in training:
        lim = hardware.training_limit(t["flops_per_step"], rate, t["tokens_per_step"])
        m = t["method"]
        rows += [
            row(
                "training",
                m,
                "step_time_s",
                t["step_time_s"],
                "s",
                note=f"{t['sequences']} sequences, {t['step_impl']}",
            ),
            row("training", m, "tokens_per_s", t["tokens_per_s"], "tokens/s", lim["max_tokens_per_s"]),
            row(
                "training", m, "peak_memory", t["peak_memory_bytes"] / 2**20, "MiB", note="process peak (own process)"
            ),
            row("training", m, "param_bytes_packed_base", t["param_bytes_packed_base"] / 2**20, "MiB"),
            row("training", m, "param_bytes_lora", t["param_bytes_lora"] / 2**20, "MiB"),
            row(
                "training",
                m,
                "param_bytes_other",
                t["param_bytes_other"] / 2**20,
                "MiB",
                note="embeddings, norms, lm_head",
            ),
            row("training", m, "optimizer_state_bytes", t["optimizer_state_bytes"] / 2**20, "MiB"),
        ]
    has_trl = not trl.get("skipped")
    if has_trl:
        rows += [
            row(
                "peer",
                "trl",
                "step_time_s",
                trl["step_time_s"],
                "s",
                note=(
                    f"TRL {trl['trl_version']}, {trl['generation']} generation. {trl.get('generation_note', '')}"
                ).strip(),
            ),
            row("peer", "trl", "generation_s", trl["generation_s"], "s"),
            row("peer", "trl", "update_s", trl["update_s"], "s"),
            row(
                "peer",
                "trl",
                "peak_memory",
                trl["peak_memory_bytes"] / 2**20,
                "MiB",
                note="process peak (own process)",
            ),
        ]
    else:
        rows.append(row("peer", "trl", "skipped", None, "", note=trl.get("reason", "")))
    for t in training:
        rows += _our_step_rows(t, rollout, trl if has_trl else None)
    return {
        "rows": rows,
        "hardware": hardware_figures,
        "rollout": rollout,
        "training": training,
        "trl": trl,
        "settings": bcfg.model_dump(mode="json"),
    }


def _our_step_rows(t: dict[str, Any], rollout: dict[str, Any], trl: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Section ``peer`` for one method: our step phase by phase, our memory,
    and the ratios to TRL (module docstring)."""
    m, fmt = t["method"], t["format"]
    sync = rollout["sync"].get(fmt, {})
    mode = sync.get("used")
    if mode is None and "used" not in sync:  # results from before "used" was recorded
        mode = (
            sync.get("recommended", "adapter")
            if sync.get("configured") == "auto"
            else sync.get("configured", "adapter")
        )
    if mode is None:
        return [row("peer", m, "our_step_time_s", None, "s", note=sync.get("used_error", "no usable sync mode"))]
    roll = next(
        (
            r
            for r in rollout["rows"]
            if r["format"] == fmt
            and int(r["batch_size"]) == rollout["train_batch"]
            and bool(r["lora"]) == (mode == "adapter")
        ),
        None,
    )
    if roll is None:
        return []
    rollout_s = roll["seconds"]
    reward_s = (rollout.get("reward", {}).get(fmt) or {}).get("reward_s")
    sync_s = sync.get(f"{mode}_sync_s") or 0.0
    update_s = t["step_time_s"]
    ours = rollout_s + (reward_s or 0.0) + sync_s + update_s
    how = f"{mode} sync (rollout.sync: {sync.get('configured')})"
    reward_note = (
        "our reward scorer, training batch" if reward_s is not None else "not measured (older results): counted as 0"
    )
    rows = [
        row(
            "peer",
            m,
            "our_rollout_s",
            rollout_s,
            "s",
            note=f"training batch, {'LoRA adapter attached' if mode == 'adapter' else 'no adapter (merged)'}: {how}",
        ),
        row("peer", m, "our_reward_s", reward_s, "s", note=reward_note),
        row("peer", m, "our_sync_s", sync_s, "s", note=f"{how}, per step"),
        row("peer", m, "our_update_s", update_s, "s", note="training step"),
        row("peer", m, "our_step_time_s", ours, "s", note=f"rollout + reward + {how} + training step"),
    ]
    trainer_mem = t["peak_memory_bytes"]
    engine_mem = (rollout.get("served", {}).get(fmt) or {}).get("engine_peak_memory_bytes")
    ours_mem = trainer_mem + (engine_mem or 0)
    mem_note = (
        "trainer + engine processes"
        if engine_mem is not None
        else "TRAINER ONLY: no engine memory in these results (older results)"
    )
    rows += [
        row("peer", m, "our_trainer_peak_memory", trainer_mem / 2**20, "MiB", note="trainer process peak"),
        row(
            "peer",
            m,
            "our_engine_peak_memory",
            None if engine_mem is None else engine_mem / 2**20,
            "MiB",
            note="engine process tree, host RSS high-water mark" if engine_mem is not None else "not measured",
        ),
        row("peer", m, "our_peak_memory", ours_mem / 2**20, "MiB", note=mem_note),
    ]
    if trl is not None:
        rows += [
            row(
                "peer",
                m,
                "our_over_trl_step_time",
                ours / trl["step_time_s"],
                "ratio",
                note="full step (rollout + reward + sync + update) over TRL's step; < 1: ours is faster",
            ),
            row(
                "peer",
                m,
                "our_over_trl_generation",
                (rollout_s + sync_s) / trl["generation_s"],
                "ratio",
                note="(rollout + sync) over TRL's generation_s, which includes its weight sync",
            ),
            row(
                "peer",
                m,
                "our_over_trl_update",
                update_s / trl["update_s"],
                "ratio",
                note="training step over TRL's update_s (its step minus generation)",
            ),
            row(
                "peer",
                m,
                "our_over_trl_peak_memory",
                ours_mem / trl["peak_memory_bytes"],
                "ratio",
                note=f"{mem_note} over TRL's process peak",
            ),
        ]
    return rows


def headline(table: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method: rollout and training speed as fractions of their limits, our step per phase, ours vs TRL."""
    got = {(r["section"], r["subject"], r["metric"]): r for r in table["rows"]}
    b = table["rollout"]["train_batch"]
    out = []
    for t in table["training"]:
        m, fmt = t["method"], t["format"]
        roll = got.get(("rollout", fmt, f"tokens_per_s_lora@batch{b}"), {})
        train = got.get(("training", m, "tokens_per_s"), {})
        out.append(
            {
                "method": m,
                "format": fmt,
                "served_format": (table["rollout"].get("served", {}).get(fmt) or {}).get("served_format"),
                f"rollout_tok_s@batch{b}": roll.get("value"),
                "rollout_fraction_of_limit": roll.get("fraction_of_limit"),
                "train_step_s": t["step_time_s"],
                "train_fraction_of_limit": train.get("fraction_of_limit"),
                "peak_mem_MiB": t["peak_memory_bytes"] / 2**20,
                "our_step_s": got.get(("peer", m, "our_step_time_s"), {}).get("value"),
                "trl_step_s": got.get(("peer", "trl", "step_time_s"), {}).get("value"),
                "ours_over_trl": got.get(("peer", m, "our_over_trl_step_time"), {}).get("value"),
                **{
                    f"our_{phase}_s": got.get(("peer", m, f"our_{phase}_s"), {}).get("value")
                    for phase in ("rollout", "reward", "sync", "update")
                },
                "our_peak_mem_MiB": got.get(("peer", m, "our_peak_memory"), {}).get("value"),
                "ours_over_trl_memory": got.get(("peer", m, "our_over_trl_peak_memory"), {}).get("value"),
            }
        )
    return out


def metric_name(r: dict[str, Any], field: str = "value") -> str:
    """MLflow metric name of a table row: ``bench.<section>.<subject>.<metric>[.limit|.fraction]``."""
    metric = r["metric"].replace("@", ".")
    suffix = {"value": "", "limit": ".limit", "fraction_of_limit": ".fraction_of_limit"}[field]
    return f"bench.{r['section']}.{r['subject']}.{metric}{suffix}"
