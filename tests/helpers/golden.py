"""Checks of a codec against llmcompressor's golden checkpoints (``../shared/golden``) and vLLM's scheme selection.

``../shared/golden/README.md`` says how each reference was made: ``nvfp4a16/base-bf16`` quantized
by llmcompressor 0.14 with each format's recipe. A correct encoder fed ``base-bf16`` in bf16
reproduces the reference's tensors bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qerl_pipeline.quantization import checkpoint

#: Projections of the golden base (2 layers x q, k, v, o, gate, up, down), each quantized.
GOLDEN_LINEARS = 14


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bit patterns (floats as integers of their width: -0.0 != 0.0), integers as they are."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]) if t.is_floating_point() else t


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    diff = (bits(a) != bits(b)).sum().item()
    assert diff == 0, f"{what}: {diff} elements differ"


def assert_nvfp4_decodes_like_compressed_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Every NVFP4 linear of a compressed-tensors checkpoint's ``tensors`` decoded by our decoder and by
    compressed-tensors' own (``NVFP4PackedCompressor`` under the NVFP4A16 preset), bit for bit; their names."""
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    from qerl_pipeline.quantization import nvfp4

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    owners = [k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed")]
    for owner in owners:
        sd = {s: tensors[f"{owner}.{s}"] for s in nvfp4.CODEC.suffixes}
        theirs = NVFP4PackedCompressor.decompress(sd, scheme)["weight"]
        assert_bit_equal(nvfp4.decode(*sd.values(), dtype=theirs.dtype), theirs, owner)
    return owners


def golden_reference(golden_dir: Path, reference: str) -> tuple[dict, dict, Path]:
    """``(base tensors, reference tensors, reference folder)``; ``reference`` relative to ``../shared/golden``."""
    ref_dir = golden_dir.parent / reference
    if not ref_dir.is_dir():
        pytest.skip(f"golden files not found at {ref_dir}")
    return checkpoint.read_tensors(golden_dir / "base-bf16"), checkpoint.read_tensors(ref_dir), ref_dir


def golden_linears(base: dict) -> dict[str, torch.Tensor]:
    """The golden base's projections by module name, in bf16 (the recipe loads the model with dtype=bfloat16)."""
    out = {k.removesuffix(".weight"): v.to(torch.bfloat16) for k, v in base.items() if k.endswith("_proj.weight")}
    assert len(out) == GOLDEN_LINEARS
    return out


def assert_whole_checkpoint_is_golden(golden_dir: Path, ref_dir: Path, fmt: str, out: Path) -> dict:
    """``checkpoint.write_base`` of the golden base in ``fmt`` equals the reference: every tensor bit for bit,
    the ``quantization_config``, and the format read back from both folders; returns the write statistics."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(golden_dir / "base-bf16", dtype=torch.bfloat16)
    stats = checkpoint.write_base(model, None, fmt, out)
    ours, ref = checkpoint.read_tensors(out), checkpoint.read_tensors(ref_dir)
    assert ours.keys() == ref.keys()
    for key in ref:
        assert_bit_equal(ours[key], ref[key], key)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg == json.loads((ref_dir / "config.json").read_text())["quantization_config"]
    assert checkpoint.base_format(out) == checkpoint.base_format(ref_dir) == fmt
    assert stats["n_quantized_linears"] == GOLDEN_LINEARS
    return stats


def vllm_cpu_scheme_log(tiny_model_dir: Path, fmt: str, work: Path) -> str:
    """The engine log of vLLM-CPU started on a tiny ``fmt`` base as the CUDA decision serves it (packed, with
    compressed-tensors); it must fail, at kernel selection for the format's scheme where the config parses."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl_pipeline.rollout.engine import EngineError, RolloutEngine
    from qerl_pipeline.rollout.serving import served_model

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    checkpoint.write_base(model, AutoTokenizer.from_pretrained(tiny_model_dir), fmt, work / f"base_{fmt}")
    served = served_model(work / f"base_{fmt}", platform="cuda")
    assert (served.served_format, served.dense, served.engine_args) == (
        fmt,
        False,
        {"quantization": "compressed-tensors"},
    )
    log_file = work / "engine.log"
    with pytest.raises(EngineError):
        RolloutEngine(
            served.path,
            max_model_len=256,
            max_lora_rank=8,
            dtype="bfloat16",
            extra_engine_args=served.engine_args,
            log_file=log_file,
        )
    return log_file.read_text(errors="replace")
