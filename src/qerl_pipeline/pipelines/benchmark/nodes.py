"""benchmark nodes: speed and memory of ours, the TRL peer, and the hardware limit, side by side.

The pipeline measures, in one run on one machine:

* ``measure_hardware_limits``: copy bandwidth and matmul rate (``benchmarking.hardware``);
* ``prepare_bases``: the NVFP4 / NF4 / BF16 bases of the compared methods (written once
  under ``benchmark.bases_dir`` and reused while the model and quantize settings are the
  same; always RTN: how the codes were chosen does not change their speed);
* ``benchmark_rollout``: output tokens/s per base format at each ``benchmark.batch_sizes``
  (and at the training batch) through our vLLM engine with the LoRA adapter attached,
  fixed prompt and completion lengths, EOS ignored; LoRA sync time per step. The engine
  serves what ``rollout.serving.served_model`` decides (packed NVFP4 / bitsandbytes NF4 on
  CUDA, the dense decoded copy on CPU); every row carries ``served_format`` and
  ``served_dtype``, and the run is tagged ``rollout.served_format`` / ``rollout.served_dtype``;
* ``benchmark_training``: time per optimizer step, tokens/s, peak memory and resident
  parameter bytes per method, each in its own process (``benchmarking.training``);
* ``benchmark_trl``: TRL's ``GRPOTrainer`` step on the same model and batch
  (``benchmarking.peer_trl``), skipped with a logged reason when TRL is absent;
* ``build_table`` (pure): every figure as a row with its limit and fraction of limit;
  ours vs TRL as ``our step time / TRL step time``, our step being rollout of the batch +
  LoRA sync + the training step (TRL's step includes its generation);
* ``write_report``: the table as CSV, markdown and HTML under ``benchmark.report_dir``
  (atomic writes) and every figure as an MLflow metric of the run.
"""

from __future__ import annotations

import html
import json
import logging
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from qerl_pipeline.benchmarking import hardware
from qerl_pipeline.evaluation.report import write_atomic
from qerl_pipeline.config import (
    METHOD_FORMAT,
    BenchmarkConfig,
    GRPOConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    QerlConfig,
    QuantizeConfig,
    RolloutConfig,
    TrainConfig,
    parse,
)

log = logging.getLogger(__name__)

FINGERPRINT = "benchmark_fingerprint.json"


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _formats(bcfg: BenchmarkConfig) -> list[str]:
    """Base formats needed: the compared methods', plus bf16 for the TRL peer."""
    fmts = [METHOD_FORMAT[m] for m in bcfg.methods] + (["bf16"] if bcfg.include_trl else [])
    return list(dict.fromkeys(fmts))


def _config(model, lora, grpo, optim, rollout, train) -> QerlConfig:
    """The sections a training step needs, as one typed config."""
    return QerlConfig(
        model=parse(ModelConfig, model, "model"), lora=parse(LoraConfig, lora, "lora"),
        grpo=parse(GRPOConfig, grpo, "grpo"), optim=parse(OptimConfig, optim, "optim"),
        rollout=parse(RolloutConfig, rollout, "rollout"), train=parse(TrainConfig, train, "train"),
    )


# ------------------------------------------------------------------------------ measurements
def measure_hardware_limits(benchmark: dict[str, Any]) -> dict[str, Any]:
    """Measured copy bandwidth (GB/s) and matmul rate (FLOP/s) of this machine."""
    parse(BenchmarkConfig, benchmark, "benchmark")
    hw = hardware.measure_hardware(_device())
    log.info("hardware: %.1f GB/s copy bandwidth, %.1f GFLOP/s %s matmul", hw["bandwidth_gbs"],
             hw["matmul_flops"] / 1e9, hw["matmul_dtype"])
    return hw


def prepare_bases(model: dict[str, Any], quantize: dict[str, Any], benchmark: dict[str, Any]) -> dict[str, str]:
    """``{format: base folder}`` for every needed format, written (RTN) unless already there."""
    from qerl_pipeline.models import load_base_model, replace_dir, resolve_dtype
    from qerl_pipeline.quantization import checkpoint

    mcfg = parse(ModelConfig, model, "model")
    qcfg = parse(QuantizeConfig, quantize, "quantize")
    bcfg = parse(BenchmarkConfig, benchmark, "benchmark")
    root = Path(bcfg.bases_dir)
    serving_dtype = resolve_dtype(mcfg)
    key = {"model": mcfg.model_dump(mode="json"), "ignore": list(qcfg.ignore), "nf4_blocksize": qcfg.nf4_blocksize,
           "serving_dtype": str(serving_dtype)}
    out, loaded = {}, None
    for fmt in _formats(bcfg):
        folder = root / f"base_{fmt}"
        stamp = folder / FINGERPRINT
        if stamp.is_file() and json.loads(stamp.read_text()) == key:
            log.info("benchmark base %s: reusing %s", fmt, folder)
            out[fmt] = str(folder)
            continue
        if loaded is None:
            loaded = load_base_model(mcfg, dtype=torch.float32)
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".base_{fmt}.", dir=root))
        try:
            t0 = time.perf_counter()
            checkpoint.write_base(loaded[0], loaded[1], fmt, tmp / "base", ignore=qcfg.ignore,
                                  nf4_blocksize=qcfg.nf4_blocksize, serving_dtype=serving_dtype)
            (tmp / "base" / FINGERPRINT).write_text(json.dumps(key))
            replace_dir(tmp / "base", folder)
            log.info("benchmark base %s written to %s in %.1f s", fmt, folder, time.perf_counter() - t0)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        out[fmt] = str(folder)
    return out


def _adapters_for(base_dir: Path, fmt: str, lcfg: LoraConfig, out_dir: Path, count: int) -> list[Path]:
    """``count`` LoRA adapters of the configured shape with distinct weights (one per simulated step)."""
    from qerl_pipeline.quantization.policy import build_policy

    policy = build_policy(base_dir, fmt, lcfg, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(0)
    folders = []
    for k in range(count):
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:  # PEFT starts B at zero; a trained adapter is not
                    p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
        folder = out_dir / f"step-{k}"
        policy.save_pretrained(str(folder))
        folders.append(folder)
    return folders


def _folder_dtype(folder: Path) -> str:
    """``float32`` or ``bfloat16``: the dtype a served folder was written in (its config.json)."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    return "bfloat16" if str(cfg.get("dtype") or cfg.get("torch_dtype")) == "bfloat16" else "float32"


def benchmark_rollout(bases: dict[str, str], lora: dict[str, Any], rollout: dict[str, Any], grpo: dict[str, Any],
                      benchmark: dict[str, Any], model: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rollout tokens/s per format and batch size, with and without LoRA; LoRA sync time per step.

    Each format's engine serves ``served_model(base)`` at ``engine_dtype(model)``; without
    ``model`` (the node wired without ``params:model``) at the dtype the served folder was
    written in, which ``prepare_bases`` took from ``model.dtype`` as well. The result's
    ``served`` says, per format, what was served (path, tag, dense, the engine's dtype).
    """
    from qerl_pipeline.benchmarking.rollout import measure_rollout, measure_sync, recommend_sync
    from qerl_pipeline.rl.trainer import vllm_lora_rank
    from qerl_pipeline.rollout.engine import RolloutEngine
    from qerl_pipeline.rollout.serving import engine_dtype, served_model, served_tags

    bcfg = parse(BenchmarkConfig, benchmark, "benchmark")
    lcfg = parse(LoraConfig, lora, "lora")
    rcfg = parse(RolloutConfig, rollout, "rollout")
    gcfg = parse(GRPOConfig, grpo, "grpo")
    train_batch = bcfg.train_prompts * gcfg.num_generations
    sizes = sorted(set(bcfg.batch_sizes) | {train_batch})
    rows, sync, served_info = [], {}, {}
    for fmt in dict.fromkeys(METHOD_FORMAT[m] for m in bcfg.methods):
        base = Path(bases[fmt])
        served = served_model(base)
        dtype = engine_dtype(model, served.platform, served) if model is not None else _folder_dtype(served.path)
        with tempfile.TemporaryDirectory(prefix="qerl-bench-lora-") as tmp:
            adapters = _adapters_for(base, fmt, lcfg, Path(tmp), bcfg.sync_steps + 1)
            t0 = time.perf_counter()
            with RolloutEngine(served.path, max_model_len=bcfg.prompt_len + bcfg.completion_len + 16,
                               enable_lora=True, max_lora_rank=vllm_lora_rank(lcfg.rank), rollout=rcfg, dtype=dtype,
                               extra_engine_args=served.engine_args) as engine:
                start_s = time.perf_counter() - t0
                tags = served_tags(served, engine)
                served_info[fmt] = {"path": str(served.path), "served_format": served.served_format,
                                    "dense": served.dense, "dtype": tags["rollout.served_dtype"]}
                for lora_path in (adapters[0], None):
                    for row in measure_rollout(engine, sizes, bcfg.prompt_len, bcfg.completion_len, lora_path=lora_path):
                        rows.append({**row, "format": fmt, "engine_start_s": start_s,
                                     "is_train_batch": int(row["batch_size"]) == train_batch,
                                     "served_format": served.served_format, "served_dtype": tags["rollout.served_dtype"]})
                s = measure_sync(engine, adapters[1:])
                with_lora = {r["batch_size"]: r for r in rows if r["format"] == fmt and r["lora"]}
                merged = {r["batch_size"]: r for r in rows if r["format"] == fmt and not r["lora"]}
                rec = recommend_sync(s, with_lora[train_batch]["tokens_per_s"], merged[train_batch]["tokens_per_s"],
                                     train_batch * bcfg.completion_len)
                sync[fmt] = {**{k: v for k, v in s.items() if not isinstance(v, list)},
                             "configured": rcfg.sync, "recommended": rec["sync"],
                             "adapter_step_s": rec["adapter_step_s"], "merge_step_s": rec["merge_step_s"]}
        log.info("rollout %s: %s; adapter sync %.3f s", fmt, ", ".join(
            f"b{r['batch_size']}={r['tokens_per_s']:.0f}" for r in rows if r["format"] == fmt and r["lora"]),
            sync[fmt].get("adapter_sync_s") or float("nan"))
    return {"rows": rows, "sync": sync, "train_batch": train_batch, "served": served_info}


def benchmark_training(bases: dict[str, str], model: dict[str, Any], lora: dict[str, Any], grpo: dict[str, Any],
                       optim: dict[str, Any], rollout: dict[str, Any], train: dict[str, Any],
                       benchmark: dict[str, Any]) -> list[dict[str, Any]]:
    """Training step time, tokens/s, peak memory and parameter bytes per method (own process each)."""
    from qerl_pipeline.benchmarking.training import measure_training_isolated

    bcfg = parse(BenchmarkConfig, benchmark, "benchmark")
    cfg = _config(model, lora, grpo, optim, rollout, train)
    rows = []
    for method in bcfg.methods:
        row = measure_training_isolated(
            bases[METHOD_FORMAT[method]], method, cfg, timeout_s=bcfg.timeout_s, num_prompts=bcfg.train_prompts,
            prompt_len=bcfg.prompt_len, completion_len=bcfg.completion_len, steps=bcfg.train_steps,
        )
        log.info("training %s: %.2f s/step, %.0f tok/s, peak %.0f MiB", method, row["step_time_s"],
                 row["tokens_per_s"], row["peak_memory_bytes"] / 2**20)
        rows.append(row)
    return rows


def benchmark_trl(bases: dict[str, str], model: dict[str, Any], lora: dict[str, Any], grpo: dict[str, Any],
                  optim: dict[str, Any], rollout: dict[str, Any], train: dict[str, Any],
                  benchmark: dict[str, Any]) -> dict[str, Any]:
    """One TRL GRPOTrainer step (after a warm-up) on the bf16 base, or the reason it was skipped."""
    from qerl_pipeline.benchmarking.peer_trl import measure_trl_isolated

    bcfg = parse(BenchmarkConfig, benchmark, "benchmark")
    if not bcfg.include_trl:
        log.info("TRL peer skipped: benchmark.include_trl is false")
        return {"skipped": True, "reason": "benchmark.include_trl is false"}
    cfg = _config(model, lora, grpo, optim, rollout, train)
    result = measure_trl_isolated(
        bases["bf16"], cfg, generation=bcfg.trl_generation, timeout_s=bcfg.timeout_s, num_prompts=bcfg.train_prompts,
        prompt_len=bcfg.prompt_len, completion_len=bcfg.completion_len, steps=bcfg.train_steps,
    )
    if not result.get("skipped"):
        log.info("TRL %s step: %.2f s (generation %.2f s, %s)", result["trl_version"], result["step_time_s"],
                 result["generation_s"], result["generation"])
    return result


# ----------------------------------------------------------------------------------- the table
def _row(section: str, subject: str, metric: str, value: float | None, unit: str, limit: float | None = None,
         note: str = "") -> dict[str, Any]:
    fraction = hardware.fraction_of_limit(value, limit) if limit is not None else None
    return {"section": section, "subject": subject, "metric": metric, "value": value, "unit": unit,
            "limit": limit, "fraction_of_limit": fraction, "note": note}


def build_table(hardware_figures: dict[str, Any], bases: dict[str, str], rollout: dict[str, Any],
                training: list[dict[str, Any]], trl: dict[str, Any], benchmark: dict[str, Any]) -> dict[str, Any]:
    """Every figure as a row ``(section, subject, metric, value, unit, limit, fraction_of_limit, note)``.

    The bytes a decode step reads are those of the folder the engine served
    (``rollout["served"][fmt]["path"]``; the dense ``serving/`` copy for results without it).
    """
    from qerl_pipeline.quantization.checkpoint import serving_dir

    bcfg = parse(BenchmarkConfig, benchmark, "benchmark")
    bw, rate = hardware_figures["bandwidth_gbs"], hardware_figures["matmul_flops"]
    rows = [
        _row("hardware", hardware_figures["device"], "copy_bandwidth", bw, "GB/s"),
        _row("hardware", hardware_figures["device"], "matmul_rate", rate / 1e9, "GFLOP/s",
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
        rows.append(_row("rollout", fmt, "served_format", None, "", note=f"{info['served_format']} {info.get('dtype', '')}".strip()))
        rows.append(_row("rollout", fmt, "weight_bytes_read_per_decode_step", served, "bytes",
                         note=f"as served here ({info['served_format']})"))
        rows.append(_row("rollout", fmt, "weight_bytes_in_format", packed, "bytes", note="the format's own bytes"))
        for r in (r for r in rollout["rows"] if r["format"] == fmt):
            b = int(r["batch_size"])
            limit = hardware.rollout_limit_tokens_per_s(bw, served, b, rate, fpt)
            kind = "lora" if r["lora"] else "no_lora"
            note = ("LoRA adapter attached" if r["lora"] else "no adapter (as after a merge sync)") + (
                "; training batch" if r.get("is_train_batch") else "")
            rows.append(_row("rollout", fmt, f"tokens_per_s_{kind}@batch{b}", r["tokens_per_s"], "tokens/s", limit, note))
            if r["lora"]:
                rows.append(_row("rollout", fmt, f"tokens_per_s_limit_if_packed@batch{b}",
                                 hardware.rollout_limit_tokens_per_s(bw, packed, b, rate, fpt), "tokens/s",
                                 note="limit if the engine read the format's own bytes (FP4 kernels on GPU)"))
        s = rollout["sync"].get(fmt, {})
        for key, value in s.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                rows.append(_row("sync", fmt, key, value, "s" if key.endswith("_s") else ""))
            elif isinstance(value, str):
                rows.append(_row("sync", fmt, key, None, "", note=value))
    for t in training:
        lim = hardware.training_limit(t["flops_per_step"], rate, t["tokens_per_step"])
        m = t["method"]
        rows += [
            _row("training", m, "step_time_s", t["step_time_s"], "s", note=f"{t['sequences']} sequences, {t['step_impl']}"),
            _row("training", m, "tokens_per_s", t["tokens_per_s"], "tokens/s", lim["max_tokens_per_s"]),
            _row("training", m, "peak_memory", t["peak_memory_bytes"] / 2**20, "MiB", note="process peak (own process)"),
            _row("training", m, "param_bytes_packed_base", t["param_bytes_packed_base"] / 2**20, "MiB"),
            _row("training", m, "param_bytes_lora", t["param_bytes_lora"] / 2**20, "MiB"),
            _row("training", m, "param_bytes_other", t["param_bytes_other"] / 2**20, "MiB", note="embeddings, norms, lm_head"),
            _row("training", m, "optimizer_state_bytes", t["optimizer_state_bytes"] / 2**20, "MiB"),
        ]
    by_key = {(r["format"], int(r["batch_size"]), bool(r["lora"])): r for r in rollout["rows"]}
    has_trl = not trl.get("skipped")
    if has_trl:
        rows += [
            _row("peer", "trl", "step_time_s", trl["step_time_s"], "s",
                 note=f"TRL {trl['trl_version']}, {trl['generation']} generation. {trl.get('generation_note', '')}".strip()),
            _row("peer", "trl", "generation_s", trl["generation_s"], "s"),
            _row("peer", "trl", "update_s", trl["update_s"], "s"),
            _row("peer", "trl", "peak_memory", trl["peak_memory_bytes"] / 2**20, "MiB", note="process peak (own process)"),
        ]
    else:
        rows.append(_row("peer", "trl", "skipped", None, "", note=trl.get("reason", "")))
    for t in training:
        sync = rollout["sync"].get(t["format"], {})
        mode = sync.get("recommended", "adapter") if sync.get("configured") == "auto" else sync.get("configured", "adapter")
        roll = by_key.get((t["format"], rollout["train_batch"], mode == "adapter"))
        if roll is None:
            continue
        sync_s = sync.get(f"{mode}_sync_s") or 0.0
        ours = roll["seconds"] + sync_s + t["step_time_s"]
        m = t["method"]
        rows.append(_row("peer", m, "our_step_time_s", ours, "s",
                         note=f"rollout of the batch + {mode} sync + training step (rollout.sync: {sync.get('configured')})"))
        if has_trl:
            rows += [
                _row("peer", m, "our_over_trl_step_time", ours / trl["step_time_s"], "ratio", note="< 1: ours is faster"),
                _row("peer", m, "our_over_trl_generation", roll["seconds"] / trl["generation_s"], "ratio"),
                _row("peer", m, "our_over_trl_update", t["step_time_s"] / trl["update_s"], "ratio"),
                _row("peer", m, "our_over_trl_peak_memory", t["peak_memory_bytes"] / trl["peak_memory_bytes"], "ratio"),
            ]
    return {"rows": rows, "hardware": hardware_figures, "rollout": rollout, "training": training, "trl": trl,
            "settings": bcfg.model_dump(mode="json")}


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def to_markdown(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A markdown table (no tabulate dependency)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)).replace("|", "/") for c in columns) + " |")
    return "\n".join(lines)


def to_html(rows: list[dict[str, Any]], columns: list[str], title: str) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in columns) + "</tr>" for r in rows)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            "<style>body{font-family:sans-serif}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
            "padding:2px 6px;text-align:right}td:first-child,td:nth-child(2),td:nth-child(3){text-align:left}</style>"
            f"</head><body><h1>{html.escape(title)}</h1><table><tr>{head}</tr>{body}</table></body></html>")


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


def served_run_tags(served: dict[str, dict[str, Any]]) -> dict[str, str]:
    """``rollout.served_format`` / ``rollout.served_dtype`` of a run that served several bases.

    One format per base as ``<format>=<tag>`` (comma-separated), plus one tag per base
    (``rollout.served_format.<format>``); the dtype as one value when all engines agree.
    """
    if not served:
        return {}
    tags = {"rollout.served_format": ",".join(f"{fmt}={s['served_format']}" for fmt, s in served.items())}
    dtypes = list(dict.fromkeys(str(s.get("dtype", "")) for s in served.values()))
    tags["rollout.served_dtype"] = dtypes[0] if len(dtypes) == 1 else ",".join(f"{f}={s.get('dtype')}" for f, s in served.items())
    for fmt, s in served.items():
        tags[f"rollout.served_format.{fmt}"] = s["served_format"]
        tags[f"rollout.served_dtype.{fmt}"] = str(s.get("dtype", ""))
    return tags


def metric_name(row: dict[str, Any], field: str = "value") -> str:
    """MLflow metric name of a table row: ``bench.<section>.<subject>.<metric>[.limit|.fraction]``."""
    metric = row["metric"].replace("@", ".")
    suffix = {"value": "", "limit": ".limit", "fraction_of_limit": ".fraction_of_limit"}[field]
    return f"bench.{row['section']}.{row['subject']}.{metric}{suffix}"


def write_report(table: dict[str, Any], benchmark: dict[str, Any]) -> dict[str, Any]:
    """CSV + markdown + HTML + raw JSON under ``benchmark.report_dir`` (atomic), all figures to MLflow."""
    import pandas as pd

    from qerl_pipeline.tracking import MlflowLogger

    bcfg = parse(BenchmarkConfig, benchmark, "benchmark")
    rows = table["rows"]
    out = Path(bcfg.report_dir)
    columns = ["section", "subject", "metric", "value", "unit", "limit", "fraction_of_limit", "note"]
    hw = table["hardware"]
    title = f"qerl-pipeline benchmark ({hw['device']}: {hw.get('gpu') or hw['cpu']}, {hw['cpu_cores']} cores)"
    paths = {"csv": out / "benchmark.csv", "markdown": out / "benchmark.md", "html": out / "benchmark.html",
             "raw": out / "benchmark_raw.json"}
    write_atomic(paths["csv"], pd.DataFrame(rows, columns=columns).to_csv(index=False))
    head = headline(table)
    head_cols = list(head[0]) if head else []
    when = time.strftime("%Y-%m-%d %H:%M")
    write_atomic(paths["markdown"], f"# {title}\n\n{when}\n\n## Per method\n\n{to_markdown(head, head_cols)}\n\n"
                  f"## Every figure\n\n{to_markdown(rows, columns)}\n")
    write_atomic(paths["html"], to_html(head, head_cols, title).replace("</body></html>", "")
                  + to_html(rows, columns, "Every figure").split("<body>", 1)[1])
    write_atomic(paths["raw"], json.dumps({k: v for k, v in table.items() if k != "rows"}, indent=1, default=str))

    metrics = {}
    for r in rows:
        for field in ("value", "limit", "fraction_of_limit"):
            v = r.get(field)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                metrics[metric_name(r, field)] = float(v)
    logger = MlflowLogger()
    logger.log_metrics(metrics)
    logger.set_tags({"benchmark.device": hw["device"], "benchmark.trl": "skipped" if table["trl"].get("skipped") else
                     table["trl"].get("trl_version", ""), **served_run_tags(table["rollout"].get("served", {}))})
    for p in paths.values():
        logger.log_artifact(p, artifact_path="benchmark")
    log.info("benchmark report: %s (%d figures logged to MLflow run %s)", out, len(metrics), logger.run_id)
    return {"report_dir": str(out), "files": {k: str(v) for k, v in paths.items()}, "mlflow_run_id": logger.run_id,
            "n_metrics": len(metrics), "metrics": metrics}
