"""Serving an exported folder (or any dense or compressed Hugging Face folder) on the project's engine.

``served_export(folder)`` is the ``rollout.serving.ServedModel`` of a model folder that is not a
base folder (no ``serving/`` copy beside it), following the table of ``rollout/serving.py``:

    folder                     cuda                                 cpu
    dense                      the folder (dense)                   the folder (dense)
    compressed-tensors NVFP4   the folder, packed (FP4 kernels)     a dense float32 copy decoded from its codes
    bitsandbytes NF4           the folder, packed (with the plugin) a dense float32 copy decoded from its codes

The dense copy (``quantized.decode_folder``) lives in a temporary folder for the block and is
removed after it: vLLM has read the weights by then. So ``merged_nvfp4/`` is scored from the very
codes a GPU would serve, on any machine.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qerl_pipeline.export import ExportInputError
from qerl_pipeline.export.quantized import decode_folder, packed_format
from qerl_pipeline.platform import current_platform
from qerl_pipeline.rollout.serving import BNB_ENGINE_ARGS, NVFP4_ENGINE_ARGS, ServedModel, vllm_has_bitsandbytes

log = logging.getLogger(__name__)


@contextmanager
def served_export(folder: str | Path, platform: str | None = None) -> Iterator[ServedModel]:
    """What an engine serves for the model folder ``folder`` within the block (module docstring)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ExportInputError(f"evaluate.model_path: {folder} is not a model folder (no config.json); export one with "
                               "`kedro run --pipelines=export --params method=<method>` (same --env)")
    platform = platform or current_platform()
    fmt = packed_format(folder)
    if fmt is None:
        yield ServedModel(folder.resolve(), "dense", True, {}, "bf16", platform)
        return
    if platform == "cuda" and (fmt == "nvfp4" or vllm_has_bitsandbytes()):
        args = NVFP4_ENGINE_ARGS if fmt == "nvfp4" else BNB_ENGINE_ARGS
        yield ServedModel(folder.resolve(), fmt if fmt == "nvfp4" else "nf4-bnb", False, dict(args), fmt, platform)
        return
    with tempfile.TemporaryDirectory(prefix=f"qerl-served-{folder.name}-") as tmp:
        log.info("serving %s as a dense copy decoded from its %s codes (no %s kernel on %s)", folder, fmt, fmt, platform)
        dense = decode_folder(folder, Path(tmp) / folder.name)
        yield ServedModel(dense.resolve(), f"dense-decoded-{fmt}", True, {}, fmt, platform)
