"""The benchmark table: every measured figure as one row beside its limit.

A row is ``(section, subject, metric, value, unit, limit, fraction_of_limit, note)``
(:data:`COLUMNS`); sections are ``hardware``, ``rollout``, ``sync``, ``training`` and
``peer``. ``build_table`` is pure: it turns the measurements (``hardware.measure_hardware``,
``rollout.rollout_benchmark``, ``training.measure_methods``, ``peer_trl.measure_peer``)
into rows, with the limits of ``hardware`` (rollout: bytes of the folder the engine
served, and the format's own bytes as a second limit; training: step FLOPs over the
matmul rate). Ours vs TRL is ``our step time / TRL step time``, our step being the
rollout of the training batch + the sync the run would use (``rollout.sync``, or the
recommended one under ``auto``) + the training step; TRL's step includes its generation.

``headline`` is the per-method summary; ``metric_name`` the MLflow name of a row's
figure, ``bench.<section>.<subject>.<metric>[.limit|.fraction_of_limit]`` (``@`` -> ``.``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qerl_pipeline.benchmarking import hardware
from qerl_pipeline.config import BenchmarkConfig

#: The table's columns, in order (CSV header, markdown and HTML tables).
COLUMNS = ["section", "subject", "metric", "value", "unit", "limit", "fraction_of_limit", "note"]


def row(section: str, subject: str, metric: str, value: float | None, unit: str, limit: float | None = None,
        note: str = "") -> dict[str, Any]:
    """One table row; ``fraction_of_limit`` is ``value / limit`` when a limit is given."""
    fraction = hardware.fraction_of_limit(value, limit) if limit is not None else None
    return {"section": section, "subject": subject, "metric": metric, "value": value, "unit": unit,
            "limit": limit, "fraction_of_limit": fraction, "note": note}


def build_table(hardware_figures: dict[str, Any], bases: dict[str, str], rollout: dict[str, Any],
                training: list[dict[str, Any]], trl: dict[str, Any], bcfg: BenchmarkConfig) -> dict[str, Any]:
    """Every figure as a row ``(section, subject, metric, value, unit, limit, fraction_of_limit, note)``.

    The bytes a decode step reads are those of the folder the engine served
    (``rollout["served"][fmt]["path"]``; the dense ``serving/`` copy for results without it).
    """
    from qerl_pipeline.quantization.checkpoint import serving_dir

    bw, rate = hardware_figures["bandwidth_gbs"], hardware_figures["matmul_flops"]
    rows = [
        row("hardware", hardware_figures["device"], "copy_bandwidth", bw, "GB/s"),
        row("hardware", hardware_figures["device"], "matmul_rate", rate / 1e9, "GFLOP/s",
            note=f"{hardware_figures['matmul_dtype']} square matmul"),
    ]
    context = bcfg.prompt_len + bcfg.completion_len / 2
    for fmt in dict.fromkeys(r["format"] for r in rollout["rows"]):
        base = Path(bases[fmt])
        info = rollout.get("served", {}).get(fmt) or {"path": str(serving_dir(base)), "served_format": f"dense-decoded-{fmt}",
                                                      "dtype": ""}
        served = hardware.served_weight_bytes(Path(info["path"]))["total"]
        packed = hardware.served_weight_bytes(base)["total"]
        config = json.loads((base / "config.json").read_text())
        fpt = hardware.decode_flops_per_token(config, int(context))
        rows.append(row("rollout", fmt, "served_format", None, "", note=f"{info['served_format']} {info.get('dtype', '')}".strip()))
        rows.append(row("rollout", fmt, "weight_bytes_read_per_decode_step", served, "bytes",
                        note=f"as served here ({info['served_format']})"))
        rows.append(row("rollout", fmt, "weight_bytes_in_format", packed, "bytes", note="the format's own bytes"))
        for r in (r for r in rollout["rows"] if r["format"] == fmt):
            b = int(r["batch_size"])
            limit = hardware.rollout_limit_tokens_per_s(bw, served, b, rate, fpt)
            kind = "lora" if r["lora"] else "no_lora"
            note = ("LoRA adapter attached" if r["lora"] else "no adapter (as after a merge sync)") + (
                "; training batch" if r.get("is_train_batch") else "")
            rows.append(row("rollout", fmt, f"tokens_per_s_{kind}@batch{b}", r["tokens_per_s"], "tokens/s", limit, note))
            if r["lora"]:
                rows.append(row("rollout", fmt, f"tokens_per_s_limit_if_packed@batch{b}",
                                hardware.rollout_limit_tokens_per_s(bw, packed, b, rate, fpt), "tokens/s",
                                note="limit if the engine read the format's own bytes (FP4 kernels on GPU)"))
        s = rollout["sync"].get(fmt, {})
        for key, value in s.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                rows.append(row("sync", fmt, key, value, "s" if key.endswith("_s") else ""))
            elif isinstance(value, str):
                rows.append(row("sync", fmt, key, None, "", note=value))
    for t in training:
        lim = hardware.training_limit(t["flops_per_step"], rate, t["tokens_per_step"])
        m = t["method"]
        rows += [
            row("training", m, "step_time_s", t["step_time_s"], "s", note=f"{t['sequences']} sequences, {t['step_impl']}"),
            row("training", m, "tokens_per_s", t["tokens_per_s"], "tokens/s", lim["max_tokens_per_s"]),
            row("training", m, "peak_memory", t["peak_memory_bytes"] / 2**20, "MiB", note="process peak (own process)"),
            row("training", m, "param_bytes_packed_base", t["param_bytes_packed_base"] / 2**20, "MiB"),
            row("training", m, "param_bytes_lora", t["param_bytes_lora"] / 2**20, "MiB"),
            row("training", m, "param_bytes_other", t["param_bytes_other"] / 2**20, "MiB", note="embeddings, norms, lm_head"),
            row("training", m, "optimizer_state_bytes", t["optimizer_state_bytes"] / 2**20, "MiB"),
        ]
    by_key = {(r["format"], int(r["batch_size"]), bool(r["lora"])): r for r in rollout["rows"]}
    has_trl = not trl.get("skipped")
    if has_trl:
        rows += [
            row("peer", "trl", "step_time_s", trl["step_time_s"], "s",
                note=f"TRL {trl['trl_version']}, {trl['generation']} generation. {trl.get('generation_note', '')}".strip()),
            row("peer", "trl", "generation_s", trl["generation_s"], "s"),
            row("peer", "trl", "update_s", trl["update_s"], "s"),
            row("peer", "trl", "peak_memory", trl["peak_memory_bytes"] / 2**20, "MiB", note="process peak (own process)"),
        ]
    else:
        rows.append(row("peer", "trl", "skipped", None, "", note=trl.get("reason", "")))
    for t in training:
        sync = rollout["sync"].get(t["format"], {})
        mode = sync.get("recommended", "adapter") if sync.get("configured") == "auto" else sync.get("configured", "adapter")
        roll = by_key.get((t["format"], rollout["train_batch"], mode == "adapter"))
        if roll is None:
            continue
        sync_s = sync.get(f"{mode}_sync_s") or 0.0
        ours = roll["seconds"] + sync_s + t["step_time_s"]
        m = t["method"]
        rows.append(row("peer", m, "our_step_time_s", ours, "s",
                        note=f"rollout of the batch + {mode} sync + training step (rollout.sync: {sync.get('configured')})"))
        if has_trl:
            rows += [
                row("peer", m, "our_over_trl_step_time", ours / trl["step_time_s"], "ratio", note="< 1: ours is faster"),
                row("peer", m, "our_over_trl_generation", roll["seconds"] / trl["generation_s"], "ratio"),
                row("peer", m, "our_over_trl_update", t["step_time_s"] / trl["update_s"], "ratio"),
                row("peer", m, "our_over_trl_peak_memory", t["peak_memory_bytes"] / trl["peak_memory_bytes"], "ratio"),
            ]
    return {"rows": rows, "hardware": hardware_figures, "rollout": rollout, "training": training, "trl": trl,
            "settings": bcfg.model_dump(mode="json")}


def headline(table: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method: rollout and training speed as fractions of their limits, ours vs TRL."""
    got = {(r["section"], r["subject"], r["metric"]): r for r in table["rows"]}
    b = table["rollout"]["train_batch"]
    out = []
    for t in table["training"]:
        m, fmt = t["method"], t["format"]
        roll = got.get(("rollout", fmt, f"tokens_per_s_lora@batch{b}"), {})
        train = got.get(("training", m, "tokens_per_s"), {})
        out.append({
            "method": m, "format": fmt,
            "served_format": (table["rollout"].get("served", {}).get(fmt) or {}).get("served_format"),
            f"rollout_tok_s@batch{b}": roll.get("value"), "rollout_fraction_of_limit": roll.get("fraction_of_limit"),
            "train_step_s": t["step_time_s"], "train_fraction_of_limit": train.get("fraction_of_limit"),
            "peak_mem_MiB": t["peak_memory_bytes"] / 2**20,
            "our_step_s": got.get(("peer", m, "our_step_time_s"), {}).get("value"),
            "trl_step_s": got.get(("peer", "trl", "step_time_s"), {}).get("value"),
            "ours_over_trl": got.get(("peer", m, "our_over_trl_step_time"), {}).get("value"),
        })
    return out


def metric_name(r: dict[str, Any], field: str = "value") -> str:
    """MLflow metric name of a table row: ``bench.<section>.<subject>.<metric>[.limit|.fraction]``."""
    metric = r["metric"].replace("@", ".")
    suffix = {"value": "", "limit": ".limit", "fraction_of_limit": ".fraction_of_limit"}[field]
    return f"bench.{r['section']}.{r['subject']}.{metric}{suffix}"
