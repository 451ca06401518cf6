"""quantize nodes: base model -> the method's base folder (NVFP4 / NF4 / BF16) -> MLflow.

The dense ``serving/`` copy a CPU engine serves is not written here: the first engine start that
serves it writes it (``quantization.store.ensure_serving``), so a base served packed on CUDA never
gets one.

``params:method`` picks the format (``config.METHOD_FORMAT``: qerl, qerl_noaqn -> nvfp4;
qlora -> nf4; lora -> bf16). The base is made, or reused, by ``quantization.store.ensure_base``
in place: the node is given the existing folder of bases (``existing_base_models``: the same
path as its output ``base_models``, loaded with ``missing_ok``), so ``base_<format>`` there is
kept untouched when its fingerprint (model identity and revision, the settings that matter to
the format, codec version) matches, and else rewritten atomically (``quantize.force: true``
always rewrites). The node returns ``{"base_<format>": that folder}``; saving a folder onto
itself is a no-op of ``HFModelFolderDataset``, so a reuse writes no file.

``quantize_format`` is the same per format (no method), for pipelines that need several
formats (compare): its output is wired to a ``base_<format>`` dataset at
``<existing_base_models>/base_<format>``.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from qerl_pipeline.config import METHOD_FORMAT, LoraConfig, ModelConfig, QuantizeConfig
from qerl_pipeline.models import resolve_dtype
from qerl_pipeline.quantization.checkpoint import base_dir_for
from qerl_pipeline.quantization.policy import build_policy, measure_training_memory
from qerl_pipeline.quantization.store import calibration_texts, ensure_base
from qerl_pipeline.tracking import MlflowLogger, scalar_metrics

log = logging.getLogger(__name__)

__all__ = [
    "calibration_texts",
    "log_quantize",
    "measure_policy",
    "method_format",
    "quantize_base",
    "quantize_format",
    "select_base",
]


def method_format(method: str) -> str:
    """The base format a method trains on."""
    if method not in METHOD_FORMAT:
        raise ValueError(f"method: unknown {method!r}; allowed: {', '.join(METHOD_FORMAT)}")
    return METHOD_FORMAT[method]


def _ensure(
    model: ModelConfig, quantize: QuantizeConfig, fmt: str, existing_base_models: Any
) -> tuple[Path, dict[str, Any]]:
    """The ``fmt`` base under ``existing_base_models`` (reused or written); None: a fresh temporary root."""
    root = (
        Path(tempfile.mkdtemp(prefix=f"qerl_base_{fmt}_"))
        if existing_base_models is None
        else Path(existing_base_models)
    )
    folder, report, _ = ensure_base(model, quantize, fmt, base_dir_for(root, fmt), force=quantize.force)
    return folder, report


def quantize_base(
    model: ModelConfig, quantize: QuantizeConfig, method: str, existing_base_models: Path | str | None = None
) -> tuple[dict[str, str], dict[str, Any]]:
    """The method's base in ``existing_base_models/base_<format>``, reused when its fingerprint matches.

    Returns ``({"base_<format>": folder}, report)``; the report holds the format, timings,
    the bytes of the quantized linears vs bf16, file sizes and one row per linear layer
    (relative reconstruction error ``||W - W_hat|| / ||W||`` against the bf16 weights, so
    0 for the bf16 base), ``reused`` and the ``fingerprint`` digest; on reuse it is the
    report stored with the base. Without ``existing_base_models`` the base is written to a
    fresh temporary folder (callers outside Kedro that move it themselves).
    """
    fmt = method_format(method)
    folder, report = _ensure(model, quantize, fmt, existing_base_models)
    return {f"base_{fmt}": str(folder)}, {**report, "method": method}


def quantize_format(
    model: ModelConfig, quantize: QuantizeConfig, existing_base_models: Path | str, *, fmt: str
) -> tuple[str, dict[str, Any]]:
    """``(folder, report)`` of the ``fmt`` base in ``existing_base_models/base_<fmt>``, reused when it matches.

    For a ``base_<fmt>`` dataset at that same folder, e.g.
    ``Node(partial(quantize_format, fmt="nvfp4"), ["params:model", "params:quantize", "existing_base_models"],
    ["base_nvfp4", "quantize_report_nvfp4"])``.
    """
    if existing_base_models is None:
        raise ValueError("quantize_format: existing_base_models is None; wire the existing_base_models dataset")
    folder, report = _ensure(model, quantize, fmt, existing_base_models)
    return str(folder), report


def select_base(base_models: Path, method: str) -> str:
    """The folder of ``method``'s base inside the ``base_models`` folder (the ``base_model`` dataset, JSON)."""
    path = base_dir_for(Path(base_models), method)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path}: no base for method {method!r}; run `kedro run --pipeline=quantize --params method={method}`"
        )
    return str(path)


def measure_policy(base_model: Path, method: str, lora: LoraConfig, model: ModelConfig) -> dict[str, Any]:
    """Build the training policy on the written base; measure resident and peak parameter memory.

    One forward+backward on a short sequence: ``peak_param_bytes`` is the resident
    parameters/buffers plus the most decoded dense weight alive at once.
    """
    fmt = method_format(method)
    t0 = time.perf_counter()
    policy = build_policy(Path(base_model), fmt, lora, dtype=resolve_dtype(model), device="cpu")
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
    logger = MlflowLogger()
    logger.log_metrics(scalar_metrics(report, "quantize."))
    logger.log_metrics({f"policy.{k}": v for k, v in policy_memory.items() if isinstance(v, (int, float))})
    for i, row in enumerate(report["layers"]):
        logger.log_metrics({"quantize.layer_rel_error": row["rel_error"]}, step=i)
    logger.log_table(report["layers"], "quantize/layers.json")
    logger.set_tags(
        {
            "quantize.format": report["format"],
            "quantize.algorithm": report["algorithm"],
            "quantize.reused": str(bool(report.get("reused", False))).lower(),
        }
    )
    summary = {k: v for k, v in report.items() if k != "layers"}
    summary["policy"] = policy_memory
    return summary
