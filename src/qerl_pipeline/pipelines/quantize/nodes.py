"""quantize nodes: base model -> the method's base folder (NVFP4 / NF4 / BF16 + serving copy) -> MLflow.

``params:method`` picks the format (``config.METHOD_FORMAT``: qerl, qerl_noaqn -> nvfp4;
qlora -> nf4; lora -> bf16). The quantize node writes the folder to a fresh temporary
directory and returns ``{"base_<format>": path}``; the ``base_models`` dataset
(``HFModelFolderDataset``) moves it atomically into ``data/06_models/base_<format>``.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from qerl_pipeline.config import METHOD_FORMAT, LoraConfig, ModelConfig, QuantizeConfig, parse

log = logging.getLogger(__name__)

CALIBRATION_FIELDS = ("text", "prompt", "question", "problem")


def method_format(method: str) -> str:
    """The base format a method trains on."""
    if method not in METHOD_FORMAT:
        raise ValueError(f"method: unknown {method!r}; allowed: {', '.join(METHOD_FORMAT)}")
    return METHOD_FORMAT[method]


def calibration_texts(path: str | Path, n: int) -> list[str]:
    """The first ``n`` texts of a JSONL file (field text / prompt / question / problem)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"quantize.calibration_path: {path} does not exist")
    texts = []
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            field = next((f for f in CALIBRATION_FIELDS if isinstance(row.get(f), str)), None)
            if field is None:
                raise ValueError(f"{path}:{lineno}: no text field (one of {CALIBRATION_FIELDS})")
            texts.append(row[field])
            if len(texts) >= n:
                break
    return texts


def quantize_base(model: dict[str, Any], quantize: dict[str, Any], method: str) -> tuple[dict[str, str], dict[str, Any]]:
    """Load the base, quantize it for ``method``, write it (+ ``serving/``) to a temporary folder.

    Returns ``({"base_<format>": folder}, report)``; the report holds the format, timings,
    the bytes of the quantized linears vs bf16, file sizes and one row per linear layer
    (relative reconstruction error ``||W - W_hat|| / ||W||`` against the bf16 weights, so
    0 for the bf16 base).
    """
    from qerl_pipeline.models import load_base_model, resolve_dtype
    from qerl_pipeline.quantization import checkpoint

    mcfg = parse(ModelConfig, model, "model")
    qcfg = parse(QuantizeConfig, quantize, "quantize")
    fmt = method_format(method)
    if fmt == "nf4" and qcfg.nf4_double_quant:
        raise ValueError("quantize.nf4_double_quant: double quantization is not implemented (see quantization/nf4.py)")
    t0 = time.perf_counter()
    # bf16 is the base's master precision (checkpoint.BASE_DTYPE): loading in it halves the
    # memory of a float32 load, and the reported errors are those of the 4-bit format alone.
    base, tokenizer = load_base_model(mcfg, dtype=checkpoint.BASE_DTYPE)
    t_load = time.perf_counter() - t0
    serving_dtype = resolve_dtype(mcfg)
    out = Path(tempfile.mkdtemp(prefix=f"qerl_base_{fmt}_")) / f"base_{fmt}"
    t1 = time.perf_counter()
    if fmt == "nvfp4" and qcfg.nvfp4_algorithm != "rtn":
        texts = calibration_texts(qcfg.calibration_path, qcfg.calibration_samples)
        report = checkpoint.calibrated_nvfp4_base(
            base, tokenizer, out, algorithm=qcfg.nvfp4_algorithm, texts=texts, ignore=list(qcfg.ignore),
            max_seq_len=mcfg.max_seq_len, serving_dtype=serving_dtype,
        )
    else:
        report = checkpoint.write_base(
            base, tokenizer, fmt, out, ignore=qcfg.ignore, nf4_blocksize=qcfg.nf4_blocksize,
            serving_dtype=serving_dtype, progress=True,
        )
    report.update(
        method=method,
        algorithm=qcfg.nvfp4_algorithm if fmt == "nvfp4" else "rtn",
        model=mcfg.name if mcfg.source != "random" else "random",
        load_seconds=t_load,
        quantize_seconds=time.perf_counter() - t1,
        serving_dtype=str(serving_dtype).removeprefix("torch."),
    )
    log.info(
        "base_%s: %d linears, ratio %.4f vs bf16, mean rel. error %.4f, %.1f s",
        fmt, report["n_quantized_linears"], report["linear_bytes_ratio"], report["rel_error_mean"], report["quantize_seconds"],
    )
    return {f"base_{fmt}": str(out)}, report


def select_base(base_models: Path, method: str) -> Path:
    """The folder of ``method``'s base inside the ``base_models`` folder."""
    from qerl_pipeline.quantization.checkpoint import base_dir_for

    path = base_dir_for(Path(base_models), method)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no base for method {method!r}; run `kedro run --pipeline=quantize --params method={method}`")
    return path


def measure_policy(base_model: Path, method: str, lora: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    """Build the training policy on the written base; measure resident and peak parameter memory.

    One forward+backward on a short sequence: ``peak_param_bytes`` is the resident
    parameters/buffers plus the most decoded dense weight alive at once.
    """
    from qerl_pipeline.models import resolve_dtype
    from qerl_pipeline.quantization.policy import build_policy, measure_training_memory

    lcfg = parse(LoraConfig, lora, "lora")
    mcfg = parse(ModelConfig, model, "model")
    fmt = method_format(method)
    t0 = time.perf_counter()
    policy = build_policy(Path(base_model), fmt, lcfg, dtype=resolve_dtype(mcfg), device="cpu")
    build_s = time.perf_counter() - t0
    policy.train()
    vocab = policy.get_base_model().config.vocab_size
    ids = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(0))
    t1 = time.perf_counter()
    mem = measure_training_memory(policy, ids)
    mem.update(format=fmt, build_seconds=build_s, step_seconds=time.perf_counter() - t1)
    return mem


def log_quantize(report: dict[str, Any], policy_memory: dict[str, Any]) -> dict[str, Any]:
    """Log the report and the policy memory to the active MLflow run; return the summary (no per-layer rows)."""
    from qerl_pipeline.tracking import MlflowLogger

    logger = MlflowLogger()
    numeric = {k: v for k, v in report.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    logger.log_metrics({f"quantize.{k}": v for k, v in numeric.items()})
    logger.log_metrics({f"policy.{k}": v for k, v in policy_memory.items() if isinstance(v, (int, float))})
    for i, row in enumerate(report["layers"]):
        logger.log_metrics({"quantize.layer_rel_error": row["rel_error"]}, step=i)
    logger.log_table(report["layers"], "quantize/layers.json")
    logger.set_tags({"quantize.format": report["format"], "quantize.algorithm": report["algorithm"]})
    summary = {k: v for k, v in report.items() if k != "layers"}
    summary["policy"] = policy_memory
    return summary
