"""FP8 (E4M3, per-channel) codec: bit-exact against llmcompressor's golden FP8 W8A16 output and compressed-tensors'
own functions; the folder it writes reaches vLLM's W8A16 FP8 scheme (integration tier)."""

from __future__ import annotations

import pytest
import torch

from qerl_pipeline.quantization import checkpoint, fp8, nvfp4
from tests.helpers.golden import (
    assert_bit_equal,
    assert_whole_checkpoint_is_golden,
    golden_linears,
    golden_reference,
    vllm_cpu_scheme_log,
)

SUFFIXES = fp8.CODEC.suffixes


def _scheme():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
    )


@pytest.fixture(scope="module")
def golden(golden_dir):
    return golden_reference(golden_dir, "fp8/llmcompressor-FP8-W8A16-channel")


# ----------------------------------------------------------------------------- golden
def test_golden_encode_is_bit_exact(golden):
    base, ref, _ = golden
    for name, w in golden_linears(base).items():
        for suffix, tensor in fp8.encode(w).items():
            assert_bit_equal(tensor, ref[f"{name}.{suffix}"], f"{name}.{suffix}")


def test_golden_whole_checkpoint_is_bit_exact(golden_dir, golden, tmp_path):
    """Every tensor, the quantized ``weight``s and the bf16 ones alike, and the quantization config."""
    stats = assert_whole_checkpoint_is_golden(golden_dir, golden[2], "fp8", tmp_path / "ours")
    assert 8 < stats["bits_per_weight"] < 8.5  # + a bf16 scale per row
    # a quantized linear is one holding every FP8 tensor: a norm's lone `weight` is not
    ours = checkpoint.read_tensors(tmp_path / "ours")
    assert checkpoint.quantized_owners(ours, fp8.CODEC) == {
        k.removesuffix(".weight_scale") for k in ours if k.endswith(".weight_scale")
    }


def test_golden_decode_equals_compressed_tensors(golden):
    from compressed_tensors.compressors.naive_quantized import NaiveQuantizationCompressor

    _, ref, _ = golden
    owners = [k.removesuffix(".weight_scale") for k in ref if k.endswith(".weight_scale")]
    assert len(owners) == 14
    for owner in owners:
        sd = {s: ref[f"{owner}.{s}"] for s in SUFFIXES}
        theirs = NaiveQuantizationCompressor.decompress(sd, _scheme())["weight"]
        assert_bit_equal(fp8.decode(*sd.values(), dtype=torch.bfloat16), theirs, owner)
        assert_bit_equal(fp8.decode(*sd.values(), dtype=torch.float32).to(torch.bfloat16), theirs, owner)


# ----------------------------------------------------------------------------- random vs compressed-tensors
@pytest.mark.parametrize("shape", [(1, 16), (8, 48), (32, 128), (17, 200)])
def test_random_weights_match_compressed_tensors(shape):
    from compressed_tensors.compressors.naive_quantized import NaiveQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    w = torch.randn(shape, generator=gen) * torch.logspace(-3, 2, shape[0]).unsqueeze(-1)
    w[0] = 0  # an all-zero row: scale bf16's epsilon
    if shape[0] > 4:
        w[1], w[1, 3] = -0.0, -1e-9
        w[2] = 1e-40  # subnormal
        w[3] = 3e38  # near bf16's maximum
        w[4] = torch.randn(shape[1], generator=gen) * 1e-30
    w = w.to(torch.bfloat16)
    scale, _ = calculate_qparams(w.amin(-1, keepdim=True), w.amax(-1, keepdim=True), _scheme().weights)
    ref = NaiveQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, _scheme())
    ours = fp8.encode(w)
    for key in SUFFIXES:
        assert_bit_equal(ours[key], ref[key], key)


# ----------------------------------------------------------------------------- properties
def test_round_trip_is_within_half_an_fp8_step():
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 256, generator=gen) * torch.rand(64, 1, generator=gen) * 3).to(torch.bfloat16)
    code = fp8.encode(w)
    dense = fp8.decode(code["weight"], code["weight_scale"])
    # E4M3 has 3 mantissa bits: rounding is off by at most 2^-4 relative (plus w / scale's bf16 rounding, 2^-9)
    err = (w.float() - dense).abs() / w.float().abs().clamp(min=1e-30)
    normal = w.float().abs() >= code["weight_scale"].float() * 2.0**-6  # E4M3's smallest normal is 2^-6
    assert (err[normal] <= 2.0**-4 + 2.0**-8).all()
    assert nvfp4.relative_error(w.float(), dense) < fp8.CODEC.max_rel_error


def test_only_bf16_master_weights_are_encoded():
    with pytest.raises(ValueError, match="bf16 master weights"):
        fp8.encode(torch.randn(4, 16))
    with pytest.raises(ValueError, match="2-D"):
        fp8.encode(torch.randn(16).to(torch.bfloat16))


# ----------------------------------------------------------------------------- vLLM (slow)
@pytest.mark.vllm
def test_vllm_cpu_parses_the_fp8_folder_into_the_w8a16_scheme(tiny_model_dir, tmp_path):
    """vLLM-CPU on the FP8 folder, as the CUDA decision serves it, gets as far as kernel selection.

    What the message proves: vLLM 0.32 builds ``CompressedTensorsW8A16Fp8`` for a ``naive-quantized``
    config whose weights are static, symmetric, float 8-bit per channel and whose activations are
    not quantized (``_is_fp8_w8a16``); its ``init_wfp8_a16_linear_kernel`` then chooses among the
    platform's W8A16 FP8 kernels (Humming and Marlin on CUDA) and a CPU has none: "Failed to find a
    kernel that can implement the ScaledMM linear layer" from ``choose_scaled_mm_linear_kernel``,
    raised inside that scheme's ``create_weights`` (the traceback names its file and line).
    """
    pytest.importorskip("vllm")
    text = vllm_cpu_scheme_log(tiny_model_dir, "fp8", tmp_path)
    assert "schemes/compressed_tensors_w8a16_fp8.py" in text
    assert "self.linear_kernel = init_wfp8_a16_linear_kernel(" in text
    assert "Failed to find a kernel that can implement the ScaledMM linear layer" in text
