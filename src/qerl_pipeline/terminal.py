"""What a run shows on the terminal: the training's live progress line, and no known-harmless noise.

The progress line (``TrainProgress``) holds what a user watches a training for, and fits an
80-column terminal or log with every number whole::

    train ━━━━━━━━━━ 12/24 reward 0.411 acc 0.22 1234 tok/s ETA 0:01:02

A wider line would be cut by rich (``0:…``); entropy, AQN's sigma and the phase times are in
each step's log line and in MLflow.

``quiet_known_noise`` silences third-party messages this project knows to be harmless, each
where it arises and no other: a warning filter on one message of one module, or a logging
filter on one message of one logger (for a warning: of the one file that raises it, where
Kedro's logging receives warnings). Each is explained beside it. ``settings.py`` calls it when
Kedro imports the project, before Kedro loads its plugins, so it covers every ``kedro run``.
Messages that can be avoided are avoided instead: the catalog gives ``data_prep_metrics`` the
prefix kedro-mlflow would (no "Replacing dataset" warning), and the Hub is not called when it is
unreachable (``hub.py``: no retry warnings).
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable
from typing import Any

from qerl_pipeline import metric_names

#: The progress bar's width in characters: the line's numbers then fit 80 columns (``TrainProgress``).
BAR_WIDTH = 10


class TrainProgress:
    """The live progress line of a training: step, reward, accuracy, rollout tokens/s, ETA (module docstring).

    ``console``, ``get_time``: rich's (a console of a given width, a clock), for rendering it elsewhere.
    """

    def __init__(self, total: int, done: int, console: Any = None, get_time: Callable[[], float] | None = None):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(bar_width=BAR_WIDTH),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            get_time=get_time,
        )
        self.task = self.progress.add_task("train", total=total, completed=done, info="")
        self.progress.start()

    def advance(self, metrics: dict[str, float]) -> None:
        """One step done, with its metrics (the trainer's names)."""
        info = (
            f"reward {metrics[metric_names.REWARD_MEAN]:.3f} acc {metrics[metric_names.REWARD_ACCURACY]:.2f} "
            f"{metrics[metric_names.ROLLOUT_TOKENS_PER_S]:.0f} tok/s"
        )
        self.progress.update(self.task, advance=1, info=info)

    def close(self) -> None:
        self.progress.stop()


# ---------------------------------------------------------------------- known-harmless noise
#: The start of bitsandbytes' note that its optional CPU kernel could not be fetched.
BNB_CPU_KERNEL_NOTE = "Failed to load CPU gemm_4bit_forward from kernels-community"
BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
#: Where ``logging.captureWarnings`` (on under Kedro's logging) sends warnings, formatted as
#: ``<file>:<line>: <Category>: <message>``.
WARNINGS_LOGGER = "py.warnings"
#: MLflow's warning about a pyfunc model's predict() without type hints, as ``py.warnings`` logs it.
MLFLOW_TYPE_HINT_NOTE = re.compile(
    r".*mlflow[/\\]pyfunc[/\\]utils[/\\]data_validation\.py:\d+: UserWarning: (\x1b\[\d+m)?"
    r"Add type hints to the `predict` method"
)


def _not_bnb_cpu_kernel_note(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(BNB_CPU_KERNEL_NOTE)


def _not_mlflow_type_hint_note(record: logging.LogRecord) -> bool:
    return not MLFLOW_TYPE_HINT_NOTE.match(record.getMessage())


def quiet_known_noise() -> None:
    """Silence the known-harmless third-party messages below, each at its source only (idempotent)."""
    # omegaconf 2.4 deprecates register_new_resolver(); Kedro's OmegaConfigLoader and kedro-mlflow still
    # call it (their concern, not a user's): the new API is called underneath, same result. Five 13-line
    # blocks at every run start otherwise; only calls from those two packages are matched.
    warnings.filterwarnings(
        "ignore",
        message=r"register_new_resolver\(\) is deprecated",
        category=UserWarning,
        module=r"(kedro|kedro_mlflow)\.",
    )
    # MLflow warns when a pyfunc model class defines predict() without type hints, at the class's definition.
    # kedro-mlflow's CLI defines one (KedroPipelineModel, its pipeline_ml model flavour) when Kedro loads
    # the plugin, at every run start; this project never logs a pyfunc model, so there is nothing to infer.
    # MLflow raises it under its own warning filter (``simplefilter("once")``), so no warning filter of ours
    # applies: it is dropped where Kedro's logging receives warnings, the ``py.warnings`` logger.
    logging.getLogger(WARNINGS_LOGGER).addFilter(_not_mlflow_type_hint_note)
    # bitsandbytes, imported by PEFT, tries at import to fetch a fused 4-bit matmul for CPUs with AVX512-BF16
    # from the Hub (kernels-community; the `kernels` package is not installed, and the Hub is often out of
    # reach) and logs a warning when it cannot. The kernel would only speed up bitsandbytes' own 4-bit
    # matmuls on CPU, which this project never runs: its NF4 on CPU is quantization/nf4.py, vLLM on CPU
    # serves a dense decoded copy, bitsandbytes serves NF4 (and 8-bit AdamW) on CUDA only.
    logging.getLogger(BNB_CPU_LOGGER).addFilter(_not_bnb_cpu_kernel_note)
