"""benchmark: ours vs TRL vs the hardware limit, in one run (nodes.py; logic in ``qerl_pipeline.benchmarking``).

Datasets (conf/base/catalog_benchmark.yml; the smoke env writes under ``.../smoke/``): each
node's measurement as JSON (``benchmark_hardware``, ``benchmark_bases``, ``benchmark_rollout``,
``benchmark_training``, ``benchmark_trl``, ``benchmark_table``), so a failing later node keeps
them, and ``benchmark_summary`` (where the report went, the MLflow run, every logged figure).
The table itself (CSV, markdown, HTML, raw JSON) is written atomically by ``write_report``
to ``benchmark.report_dir`` and logged to the run under ``benchmark/``.
"""

from kedro.pipeline import Node, Pipeline

from qerl_pipeline.config import gather
from qerl_pipeline.pipelines.benchmark.nodes import (
    benchmark_rollout,
    benchmark_training,
    benchmark_trl,
    build_table,
    measure_hardware_limits,
    prepare_bases,
    write_report,
)

#: The sections the measuring nodes read, gathered into one ``benchmark_config`` (``config.gather``).
SECTIONS = ("model", "lora", "rollout", "grpo", "optim", "train", "reward", "data", "benchmark")


def create_pipeline(**kwargs) -> Pipeline:
    """Wire the benchmark nodes."""
    return Pipeline(
        [
            Node(gather, {s: f"params:{s}" for s in SECTIONS}, "benchmark_config", name="benchmark_config"),
            Node(measure_hardware_limits, None, "benchmark_hardware", name="measure_hardware_limits"),
            Node(
                prepare_bases,
                ["params:model", "params:quantize", "params:benchmark"],
                "benchmark_bases",
                name="prepare_benchmark_bases",
            ),
            Node(
                benchmark_rollout,
                ["benchmark_bases", "benchmark_config"],
                "benchmark_rollout",
                name="benchmark_rollout",
            ),
            Node(
                benchmark_training,
                ["benchmark_bases", "benchmark_config"],
                "benchmark_training",
                name="benchmark_training",
            ),
            Node(benchmark_trl, ["benchmark_bases", "benchmark_config"], "benchmark_trl", name="benchmark_trl"),
            Node(
                build_table,
                [
                    "benchmark_hardware",
                    "benchmark_bases",
                    "benchmark_rollout",
                    "benchmark_training",
                    "benchmark_trl",
                    "params:benchmark",
                ],
                "benchmark_table",
                name="build_benchmark_table",
            ),
            Node(
                write_report,
                ["benchmark_table", "params:benchmark"],
                "benchmark_summary",
                name="write_benchmark_report",
            ),
        ],
        tags="benchmark",
    )
