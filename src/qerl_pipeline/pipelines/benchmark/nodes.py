"""benchmark nodes: speed and memory of ours, the TRL peer, and the hardware limit, side by side.

Thin nodes: each takes the measurements before it and its typed sections (the three measuring nodes the
``benchmark_config`` the pipeline gathers, ``config.gather``), calls the library in
``qerl_pipeline.benchmarking`` and returns what the next node needs. The logic, and its
design, lives there:

* ``measure_hardware_limits``: copy bandwidth and matmul rate (``benchmarking.hardware``);
* ``prepare_bases``: the NVFP4 / NF4 / BF16 bases of the compared methods, written once
  under ``benchmark.bases_dir`` and reused while the settings match (``benchmarking.bases``);
* ``benchmark_rollout``: output tokens/s per base format and batch size, with and without
  the LoRA adapter, and the sync time per step, through our vLLM engine
  (``benchmarking.rollout``); the run is tagged with what each engine served;
* ``benchmark_training``: time per optimizer step, tokens/s, peak memory and parameter
  bytes per method, each in its own process (``benchmarking.training``);
* ``benchmark_trl``: TRL's ``GRPOTrainer`` step on the same model and batch
  (``benchmarking.peer_trl``), skipped with a logged reason when TRL is absent;
* ``build_table`` (pure): every figure as a row with its limit and fraction of limit, ours
  vs TRL (``benchmarking.table``);
* ``write_report``: the table as CSV, markdown and HTML under ``benchmark.report_dir`` and
  every figure as an MLflow metric of the run (``benchmarking.report``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from qerl_pipeline.benchmarking import bases as bench_bases
from qerl_pipeline.benchmarking import hardware, report, table
from qerl_pipeline.benchmarking.peer_trl import measure_peer
from qerl_pipeline.benchmarking.rollout import rollout_benchmark
from qerl_pipeline.benchmarking.training import measure_methods
from qerl_pipeline.config import BenchmarkConfig, ModelConfig, QerlConfig, QuantizeConfig
from qerl_pipeline.platform import current_platform

log = logging.getLogger(__name__)


def measure_hardware_limits() -> dict[str, Any]:
    """Measured copy bandwidth (GB/s) and matmul rate (FLOP/s) of this machine."""
    hw = hardware.measure_hardware(current_platform())
    log.info(
        "hardware: %.1f GB/s copy bandwidth, %.1f GFLOP/s %s matmul",
        hw["bandwidth_gbs"],
        hw["matmul_flops"] / 1e9,
        hw["matmul_dtype"],
    )
    return hw


def prepare_bases(model: ModelConfig, quantize: QuantizeConfig, benchmark: BenchmarkConfig) -> dict[str, str]:
    """``{format: base folder}`` for every needed format, written (RTN) unless already there."""
    return bench_bases.prepare_bases(model, quantize, benchmark)


def benchmark_rollout(bases: dict[str, str], cfg: QerlConfig) -> dict[str, Any]:
    """Rollout tokens/s per format and batch size, with and without LoRA; sync time per step; the reward's time
    (the run's own scorer: ``reward``, ``train.reward_fn``, ``data.system_prompt`` as training has them)."""
    return rollout_benchmark(bases, cfg, cfg.benchmark)


def benchmark_training(bases: dict[str, str], cfg: QerlConfig) -> list[dict[str, Any]]:
    """Training step time, tokens/s, peak memory and parameter bytes per method (own process each)."""
    return measure_methods(bases, cfg, cfg.benchmark)


def benchmark_trl(bases: dict[str, str], cfg: QerlConfig) -> dict[str, Any]:
    """One TRL GRPOTrainer step (after a warm-up) on the bf16 base, or the reason it was skipped."""
    return measure_peer(bases, cfg, cfg.benchmark)


def build_table(
    hardware_figures: dict[str, Any],
    bases: dict[str, str],
    rollout: dict[str, Any],
    training: list[dict[str, Any]],
    trl: dict[str, Any],
    benchmark: BenchmarkConfig,
) -> dict[str, Any]:
    """Every figure as a row ``(section, subject, metric, value, unit, limit, fraction_of_limit, note)``."""
    return table.build_table(hardware_figures, bases, rollout, training, trl, benchmark)


def write_report(benchmark_table: dict[str, Any], benchmark: BenchmarkConfig) -> dict[str, Any]:
    """CSV + markdown + HTML + raw JSON under ``benchmark.report_dir`` (atomic), all figures to MLflow."""
    paths = report.write_report_files(benchmark_table, benchmark.report_dir)
    metrics = report.report_metrics(benchmark_table["rows"])
    run_id = report.log_report(benchmark_table, paths, metrics)
    out = Path(benchmark.report_dir)
    log.info("benchmark report: %s (%d figures logged to MLflow run %s)", out, len(metrics), run_id)
    return {
        "report_dir": str(out),
        "files": {k: str(v) for k, v in paths.items()},
        "mlflow_run_id": run_id,
        "n_metrics": len(metrics),
        "metrics": metrics,
    }
