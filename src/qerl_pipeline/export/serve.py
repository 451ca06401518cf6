"""Serving an exported folder (or any dense or compressed Hugging Face folder) on the project's engine.

``served_export(folder)`` is the ``rollout.serving.ServedModel`` of a model folder that is not a
base folder, by the same table as a base (``rollout.serving.decide`` on the folder's format): where
the format's row serves it packed (NVFP4, MXFP4, FP8 on CUDA; NF4 on CUDA with bitsandbytes, the
export's NF4 folder being that layout already) the folder itself, elsewhere a dense float32 copy
decoded from its codes (``quantized.decode_folder``). That copy lives in a temporary folder for the
block and is removed after it: vLLM has read the weights by then. So ``merged_nvfp4/`` is scored from
the very codes a GPU would serve, on any machine.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qerl_pipeline.export import ExportInputError
from qerl_pipeline.export.quantized import decode_folder, packed_format
from qerl_pipeline.platform import current_platform
from qerl_pipeline.rollout.serving import ServedModel, decide, vllm_features

log = logging.getLogger(__name__)


@contextmanager
def served_export(folder: str | Path, platform: str | None = None) -> Iterator[ServedModel]:
    """What an engine serves for the model folder ``folder`` within the block (module docstring)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ExportInputError(
            f"evaluate.model_path: {folder} is not a model folder (no config.json); export one with "
            "`kedro run --pipelines=export --params method=<method>` (same --env)"
        )
    platform = platform or current_platform()
    fmt = packed_format(folder)
    if fmt is None:
        yield ServedModel(folder.resolve(), "dense", True, {}, "bf16", platform)
        return
    row = decide(fmt, platform, vllm_features=vllm_features() if platform == "cuda" else ())
    if not row.dense:
        yield dataclasses.replace(row, path=folder.resolve())
        return
    with tempfile.TemporaryDirectory(prefix=f"qerl-served-{folder.name}-") as tmp:
        log.info(
            "serving %s as a dense copy decoded from its %s codes (%s on %s)", folder, fmt, row.served_format, platform
        )
        yield dataclasses.replace(row, path=decode_folder(folder, Path(tmp) / folder.name).resolve())
