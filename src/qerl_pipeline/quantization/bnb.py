"""The bitsandbytes 4-bit layout of an NF4 base: the same NF4 bytes, laid out for bitsandbytes' loaders.

``<base_nf4>/bnb/`` (``checkpoint.BNB_SUBDIR``) is written on demand by ``ensure_bnb_nf4``,
for serving on CUDA (rollout/serving.py decides when): ``<linear>.weight`` packed uint8
``[numel/2, 1]``, ``weight.absmax``, ``weight.quant_map``, ``weight.quant_state.bitsandbytes__nf4``,
and ``quantization_config`` with ``quant_method: bitsandbytes``, which transformers +
bitsandbytes and vLLM's bitsandbytes loader read. ``checkpoint.write_base`` does not write
it: on CPU nothing serves it, and it would double the NF4 base on disk for nothing.
Nothing is re-quantized, so the served base has exactly the codes the policy trains on.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from qerl_pipeline.atomic import staged_dir
from qerl_pipeline.quantization import nf4
from qerl_pipeline.quantization.checkpoint import (
    BASE_DTYPE,
    BNB_SUBDIR,
    base_format,
    iter_codes,
    iter_tensors,
    linear_shapes,
    write_safetensors,
)

log = logging.getLogger(__name__)


def bnb_dir(base_dir: Path) -> Path:
    """The bitsandbytes 4-bit layout of an NF4 base (what vLLM with bitsandbytes serves on CUDA)."""
    return Path(base_dir) / BNB_SUBDIR


#: Block sizes bitsandbytes' 4-bit kernels accept (``bitsandbytes.functional.quantize_4bit``).
BNB_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
BNB_QUANT_STATE_KEY = "quant_state.bitsandbytes__nf4"


def bnb_nf4_quantization_config(skip_modules: Iterable[str], compute_dtype: str = "bfloat16") -> dict:
    """``quantization_config`` of a pre-quantized bitsandbytes 4-bit NF4 checkpoint.

    The keys and values are those transformers 5.17's ``BitsAndBytesConfig.to_dict()``
    writes for ``load_in_4bit=True, bnb_4bit_quant_type="nf4"`` without double quantization
    (tests/test_serving.py compares them with a real save); vLLM's bitsandbytes config
    (``vllm-bnb-plugin``, and vLLM's in-tree one before 0.32) reads the same keys.
    ``llm_int8_skip_modules``: full names of the linears left unquantized (kept dense in bf16).
    """
    return {
        "_load_in_4bit": True,
        "_load_in_8bit": False,
        "bnb_4bit_compute_dtype": compute_dtype,
        "bnb_4bit_quant_storage": "uint8",
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": False,
        "llm_int8_enable_fp32_cpu_offload": False,
        "llm_int8_has_fp16_weight": False,
        "llm_int8_skip_modules": sorted(skip_modules),
        "llm_int8_threshold": 6.0,
        "load_in_4bit": True,
        "load_in_8bit": False,
        "quant_method": "bitsandbytes",
    }


def bnb_nf4_tensors(owner: str, code: nf4.NF4Weight, dtype: torch.dtype = BASE_DTYPE) -> dict[str, torch.Tensor]:
    """One NF4 linear in bitsandbytes' serialized ``Linear4bit`` layout (the same bytes as our codes).

    bitsandbytes 0.50 saves a 4-bit weight as ``<owner>.weight`` (the packed codes, uint8,
    shape ``[ceil(numel / 2), 1]``, first element in the high nibble: our packing) plus its
    ``QuantState.as_dict(packed=True)``: ``weight.absmax`` (float32 per block),
    ``weight.quant_map`` (the 16 NF4 levels, float32) and
    ``weight.quant_state.bitsandbytes__nf4`` (the JSON of ``quant_type``, ``blocksize``,
    ``dtype`` (what dequantization returns) and ``shape``, as uint8 bytes).
    """
    if code.blocksize not in BNB_BLOCKSIZES:
        raise ValueError(
            f"{owner}: NF4 blocksize {code.blocksize} has no bitsandbytes kernel; allowed: {BNB_BLOCKSIZES}"
        )
    state = {
        "quant_type": "nf4",
        "blocksize": int(code.blocksize),
        "dtype": str(dtype).removeprefix("torch."),
        "shape": [int(s) for s in code.shape],
    }
    prefix = f"{owner}.weight"
    return {
        prefix: code.packed.reshape(-1, 1),
        f"{prefix}.absmax": code.absmax.to(torch.float32),
        f"{prefix}.quant_map": nf4.NF4_LEVELS.clone(),
        f"{prefix}.{BNB_QUANT_STATE_KEY}": torch.tensor(list(json.dumps(state).encode("utf-8")), dtype=torch.uint8),
    }


def is_bnb_nf4_config(quantization_config: dict | None) -> bool:
    """Whether a ``quantization_config`` is a pre-quantized bitsandbytes 4-bit NF4 checkpoint's."""
    qc = quantization_config or {}
    return (
        qc.get("quant_method") == "bitsandbytes"
        and qc.get("bnb_4bit_quant_type") == "nf4"
        and bool(qc.get("load_in_4bit", qc.get("_load_in_4bit")))
    )


def iter_bnb_nf4_decoded(folder: Path, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a bitsandbytes NF4 folder, each 4-bit weight decoded (float32 math, then ``dtype``) from
    its packed codes, absmax and quant state (``bnb_nf4_tensors``'s layout), every other tensor cast to ``dtype``."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    leaves = ("weight", "weight.absmax", "weight.quant_map", f"weight.{BNB_QUANT_STATE_KEY}")
    for name, tensor in iter_tensors(folder):
        leaf = next((s for s in sorted(leaves, key=len, reverse=True) if name.endswith("." + s)), None)
        if leaf is None or (leaf == "weight" and tensor.dtype != torch.uint8):
            yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor
            continue
        owner = name[: -len(leaf) - 1]
        got = parts.setdefault(owner, {})
        got[leaf] = tensor
        if len(got) < len(leaves):
            continue
        del parts[owner]
        state = json.loads(bytes(got[f"weight.{BNB_QUANT_STATE_KEY}"].tolist()).decode("utf-8"))
        dense = nf4.decode(
            got["weight"].reshape(-1),
            got["weight.absmax"],
            tuple(state["shape"]),
            int(state["blocksize"]),
            torch.float32,
        )
        yield f"{owner}.weight", dense.to(dtype)
    if parts:
        raise ValueError(f"{folder}: incomplete bitsandbytes NF4 tensors for {sorted(parts)[:5]}")


def write_bnb_nf4(base_dir: Path, out_dir: Path | None = None) -> Path:
    """Write the bitsandbytes 4-bit layout of the NF4 base ``base_dir`` to ``out_dir`` (default ``<base>/bnb``).

    Nothing is re-quantized: each linear's NF4 codes and absmax are the base's own bytes
    (``bnb_nf4_tensors``), every other tensor is copied as stored (bf16, the master
    precision), the weight shapes come from the model of the base's config.json
    (``checkpoint.linear_shapes``). The config is the
    base's with ``qerl_quantization`` replaced by ``bnb_nf4_quantization_config``; tokenizer
    and generation files are copied. Built in a stage (``atomic.staged_dir``) that never
    replaces an existing ``out_dir``: one that another process finished meanwhile is kept,
    since its readers (an engine) may already be loading it.
    """
    base_dir = Path(base_dir)
    out_dir = Path(out_dir) if out_dir is not None else bnb_dir(base_dir)
    if base_format(base_dir) != nf4.CODEC.name:
        raise ValueError(f"{base_dir}: not an NF4 base (format {base_format(base_dir)!r})")
    cfg = json.loads((base_dir / "config.json").read_text())
    meta = cfg.pop("qerl_quantization")
    blocksize = int(meta.get("blocksize", nf4.DEFAULT_BLOCKSIZE))
    shapes = linear_shapes(base_dir)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, value in iter_codes(base_dir):
            if isinstance(value, torch.Tensor):
                yield name, value
                continue
            if name == "lm_head" or name.endswith(".lm_head"):
                raise ValueError(
                    f"{base_dir}: {name} is NF4-quantized; bitsandbytes checkpoints (and vLLM's loader) "
                    "keep the output head dense: quantize with lm_head in quantize.ignore"
                )
            code = nf4.NF4Weight(value["weight_nf4"], value["weight_absmax"], shapes[name], blocksize)
            yield from bnb_nf4_tensors(name, code).items()

    try:
        with staged_dir(out_dir, replace=False) as stage:
            write_safetensors(tensors(), stage)
            cfg["quantization_config"] = bnb_nf4_quantization_config(meta.get("ignore", []))
            (stage / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
            for p in base_dir.iterdir():
                if (
                    p.is_file()
                    and not p.name.endswith(".safetensors")
                    and p.name not in ("config.json", "model.safetensors.index.json")
                ):
                    shutil.copy2(p, stage / p.name)
    except FileExistsError:
        if not (out_dir / "config.json").is_file():
            raise
        log.info("%s: written meanwhile by another process; keeping it", out_dir)
    return out_dir


def ensure_bnb_nf4(base_dir: Path) -> Path:
    """``<base>/bnb``, written first if it is not there yet (``write_bnb_nf4``)."""
    out = bnb_dir(base_dir)
    if not (out / "config.json").is_file():
        log.info("writing the bitsandbytes layout of %s to %s", base_dir, out)
        write_bnb_nf4(Path(base_dir), out)
    return out
