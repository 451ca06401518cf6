"""The merged policy quantized again, and a dense copy of such a folder: the export's two codec steps.

``requantize(model, fmt, out)`` is the one place the export quantizes: the base writer itself
(``checkpoint.write_base`` with the format's codec: the linears chosen by the rule the base used,
``ignore``, tied heads, the codec's own divisibility; weights rounded to bf16 first, the master
precision every base is quantized from), so ``merged_nvfp4/`` has the tensors and config
llmcompressor's NVFP4A16 preset writes for the same model loaded in bf16 (tests/test_export_pipeline.py
runs it), and likewise MXFP4 and FP8. A format whose CUDA engine serves a derived layout rather than
the base folder (NF4: bitsandbytes' pre-quantized layout, ``quantization/bnb.py``) is written in that
layout, the one an outside library reads: the project's own NF4 layout (``weight_nf4``) would need
this project to load.

``decode_folder(folder, out)`` writes the dense copy of such a folder (float32 by default): what an
engine on CPU serves, where vLLM has no kernel for the format (``serve.served_export``).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from qerl_pipeline.quantization import bnb, checkpoint, formats


def requantize(
    model, fmt: str, out: Path, *, ignore: list[str], settings: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Quantize the dense ``model`` to the registered format ``fmt`` into the new folder ``out`` (module docstring).

    ``settings``: the ``quantize`` section's values the codec reads (e.g. ``nf4_blocksize``). Returns the
    weight error against ``model``'s weights: ``rel_error_mean``, ``rel_error_max`` (``||W -
    decode(encode(W))|| / ||W||`` per quantized linear), ``quantized_linears``, ``bits_per_weight`` and one
    ``{"name", "rel_error"}`` per quantized linear under ``layers``.
    """
    codec = formats.get(fmt)
    if not codec.quantizes:
        raise ValueError(
            f"requantize: {fmt} does not quantize; formats that do: "
            f"{', '.join(n for n in formats.names() if formats.get(n).quantizes)}"
        )
    out = Path(out)
    if codec.cuda is not None and str(codec.cuda.path) == checkpoint.BNB_SUBDIR:
        with tempfile.TemporaryDirectory(prefix=f".{out.name}-", dir=out.parent) as tmp:
            stats = checkpoint.write_base(model, None, fmt, Path(tmp) / fmt, ignore=ignore, settings=settings)
            bnb.write_bnb_nf4(Path(tmp) / fmt, out)
    else:
        stats = checkpoint.write_base(model, None, fmt, out, ignore=ignore, settings=settings)
    return {
        "format": fmt,
        "quantized_linears": stats["n_quantized_linears"],
        "rel_error_mean": stats["rel_error_mean"],
        "rel_error_max": stats["rel_error_max"],
        "bits_per_weight": stats["bits_per_weight"],
        "layers": [{"name": r["name"], "rel_error": r["rel_error"]} for r in stats["layers"] if r["quantized"]],
    }


def packed_format(folder: Path) -> str | None:
    """The quantized format of a model folder: a registered format's name, ``nf4`` for bitsandbytes' NF4
    layout, None for a dense folder."""
    cfg = checkpoint.base_config(folder)
    if bnb.is_bnb_nf4_config(cfg.get("quantization_config")):
        return "nf4"
    fmt = formats.format_of(cfg, Path(folder) / "config.json")
    return fmt if formats.get(fmt).quantizes else None


def decode_folder(folder: Path, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """The dense copy of the packed model folder ``folder`` (``packed_format``) in the new folder ``out``."""
    folder, out = Path(folder), Path(out)
    fmt = packed_format(folder)
    if fmt is None:
        raise ValueError(f"{folder}: already dense (no quantization_config)")
    if not bnb.is_bnb_nf4_config(checkpoint.base_config(folder).get("quantization_config")):
        checkpoint.write_serving(folder, out, dtype)
        return out
    out.mkdir(parents=True)
    checkpoint.write_safetensors(bnb.iter_bnb_nf4_decoded(folder, dtype), out)
    cfg = checkpoint.base_config(folder)
    cfg.pop("quantization_config")
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for p in folder.iterdir():
        if (
            p.is_file()
            and not p.name.endswith(".safetensors")
            and p.name not in ("config.json", "model.safetensors.index.json")
        ):
            shutil.copy2(p, out / p.name)
    return out
