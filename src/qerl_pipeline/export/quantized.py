"""The merged policy in 4 bits again, and a dense copy of such a folder: the export's two codec steps.

``requantize(model, fmt, out)`` is the one place the export quantizes: the linears chosen by the
rule the base used (``checkpoint.quantizable_linears``: ``ignore``, tied to the embeddings, NVFP4's
in_features % 16), their weights rounded to bf16 first (the master precision every base is
quantized from, ``checkpoint.BASE_DTYPE``), encoded with the project's codecs:

* ``nvfp4``: ``nvfp4.encode_linears`` (fused q/k/v and gate/up share a global scale, as
  llmcompressor does), written as compressed-tensors ``nvfp4-pack-quantized`` with
  ``checkpoint.nvfp4_quantization_config``; every other tensor in bf16. The same bytes as
  llmcompressor's ``oneshot`` with ``QuantizationModifier(scheme="NVFP4A16")`` on the folder loaded in
  bf16 (tests/test_export_pipeline.py runs it), which vLLM serves with its FP4 kernels on CUDA.
* ``nf4``: ``nf4.encode`` in bitsandbytes' pre-quantized layout (``bnb.bnb_nf4_tensors``,
  ``bnb_nf4_quantization_config``): transformers + bitsandbytes and vLLM's bitsandbytes loader read it.
  Our own NF4 base layout (``weight_nf4``) would need this project to load, so it is not used here.

``decode_folder(folder, out)`` writes the dense copy of such a folder (float32 by default): what an
engine on CPU serves, where vLLM has neither FP4 nor bitsandbytes kernels (``serve.served_export``).
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from qerl_pipeline.quantization import checkpoint, nf4, nvfp4
from qerl_pipeline.quantization.bnb import BNB_QUANT_STATE_KEY, bnb_nf4_quantization_config, bnb_nf4_tensors

#: ``config.json`` of a folder in each format: what ``packed_format`` reads.
NVFP4_FORMAT = "nvfp4-pack-quantized"


def _unaliased_state(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state dict without names that alias an earlier tensor (a tied lm_head), as HF writes it."""
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.numel() and tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        yield name, tensor.detach()


def requantize(model, fmt: str, out: Path, *, ignore: list[str], nf4_blocksize: int = nf4.DEFAULT_BLOCKSIZE) -> dict[str, Any]:
    """Quantize the dense ``model`` to ``fmt`` (``nvfp4`` or ``nf4``) into the new folder ``out`` (module docstring).

    Returns the weight error against ``model``'s weights: ``rel_error_mean``, ``rel_error_max``
    (``||W - decode(encode(W))|| / ||W||`` per quantized linear), ``quantized_linears``, ``bits_per_weight``
    and one ``{"name", "rel_error"}`` per linear under ``layers``.
    """
    if fmt not in ("nvfp4", "nf4"):
        raise ValueError(f"requantize: format {fmt!r} unknown; allowed: nvfp4, nf4")
    out = Path(out)
    out.mkdir(parents=True)
    quantized, skipped = checkpoint.quantizable_linears(model, fmt, ignore)
    mods = dict(model.named_modules())
    weights = {n: mods[n].weight.detach().to(checkpoint.BASE_DTYPE) for n in quantized}
    if fmt == "nvfp4":
        codes: dict[str, Any] = nvfp4.encode_linears(weights)
        config = checkpoint.nvfp4_quantization_config(skipped)
    else:
        head = [n for n in quantized if n == "lm_head" or n.endswith(".lm_head")]
        if head:
            raise ValueError(f"requantize nf4: {head[0]} would be quantized; bitsandbytes keeps the output head dense "
                             "(leave lm_head in quantize.ignore)")
        codes = {n: nf4.encode(w, nf4_blocksize) for n, w in weights.items()}
        config = bnb_nf4_quantization_config(skipped)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in _unaliased_state(model):
            owner = name.rpartition(".")[0]
            if owner in codes and name.endswith(".weight"):
                parts = codes[owner].state_dict(owner + ".") if fmt == "nvfp4" else bnb_nf4_tensors(owner, codes[owner])
                yield from parts.items()
            else:
                yield name, tensor.to(checkpoint.BASE_DTYPE) if tensor.is_floating_point() else tensor

    checkpoint.write_safetensors(tensors(), out)
    cfg = copy.deepcopy(model.config)
    cfg.dtype = str(checkpoint.BASE_DTYPE).removeprefix("torch.")
    cfg.quantization_config = config
    cfg.save_pretrained(out)
    layers = [{"name": n, "rel_error": nvfp4.relative_error(mods[n].weight.detach(), codes[n].decode(torch.float32))}
              for n in quantized]
    errors = [r["rel_error"] for r in layers] or [0.0]
    numel = sum(mods[n].weight.numel() for n in quantized)
    return {"format": fmt, "quantized_linears": len(quantized), "rel_error_mean": sum(errors) / len(errors),
            "rel_error_max": max(errors), "bits_per_weight": 8.0 * sum(c.nbytes() for c in codes.values()) / numel
            if numel else 16.0, "layers": layers}


def packed_format(folder: Path) -> str | None:
    """``nvfp4`` (compressed-tensors NVFP4), ``nf4`` (bitsandbytes 4-bit NF4) or None (dense) for a model folder."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    qc = cfg.get("quantization_config")
    if not qc:
        return None
    if qc.get("quant_method") == "compressed-tensors" and qc.get("format") == NVFP4_FORMAT:
        return "nvfp4"
    if qc.get("quant_method") == "bitsandbytes" and qc.get("bnb_4bit_quant_type") == "nf4" and qc.get("load_in_4bit",
                                                                                                       qc.get("_load_in_4bit")):
        return "nf4"
    raise ValueError(f"{folder}: quantization {qc.get('quant_method')!r} / {qc.get('format') or qc.get('bnb_4bit_quant_type')!r} "
                     "is not one the export writes (compressed-tensors NVFP4, bitsandbytes NF4)")


def _dense_tensors(folder: Path, fmt: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a packed folder with each quantized weight decoded (float32 math, then ``dtype``)."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    suffixes = checkpoint.NVFP4_SUFFIXES if fmt == "nvfp4" else ("weight", "weight.absmax", "weight.quant_map",
                                                                   f"weight.{BNB_QUANT_STATE_KEY}")
    for name, tensor in checkpoint.iter_tensors(folder):
        owner, leaf = _split(name, suffixes)
        if leaf is None or (fmt == "nf4" and leaf == "weight" and tensor.dtype != torch.uint8):
            yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor
            continue
        got = parts.setdefault(owner, {})
        got[leaf] = tensor
        if len(got) < len(suffixes):
            continue
        del parts[owner]
        if fmt == "nvfp4":
            dense = nvfp4.NVFP4Weight(*(got[s] for s in checkpoint.NVFP4_SUFFIXES)).decode(torch.float32)
        else:
            state = json.loads(bytes(got[f"weight.{BNB_QUANT_STATE_KEY}"].tolist()).decode("utf-8"))
            dense = nf4.decode(got["weight"].reshape(-1), got["weight.absmax"], tuple(state["shape"]),
                               int(state["blocksize"]), torch.float32)
        yield f"{owner}.weight", dense.to(dtype)
    if parts:
        raise ValueError(f"{folder}: incomplete quantized tensors for {sorted(parts)[:5]}")


def _split(name: str, suffixes: tuple[str, ...]) -> tuple[str, str | None]:
    for suffix in sorted(suffixes, key=len, reverse=True):
        if name.endswith("." + suffix):
            return name[: -len(suffix) - 1], suffix
    return name, None


def decode_folder(folder: Path, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """The dense copy of the packed model folder ``folder`` (``packed_format``) in the new folder ``out``."""
    folder, out = Path(folder), Path(out)
    fmt = packed_format(folder)
    if fmt is None:
        raise ValueError(f"{folder}: already dense (no quantization_config)")
    out.mkdir(parents=True)
    checkpoint.write_safetensors(_dense_tensors(folder, fmt, dtype), out)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("quantization_config")
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for p in folder.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(p, out / p.name)
    return out
