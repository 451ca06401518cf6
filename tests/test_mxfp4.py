"""MXFP4 codec: bit-exact against llmcompressor's golden MXFP4A16 output and compressed-tensors' own functions;
the folder it writes reaches vLLM's MXFP4 scheme (integration tier)."""

from __future__ import annotations

import pytest
import torch

from qerl_pipeline.quantization import mxfp4, nvfp4
from tests.helpers.golden import (
    assert_bit_equal,
    assert_whole_checkpoint_is_golden,
    golden_linears,
    golden_reference,
    vllm_cpu_scheme_log,
)

SUFFIXES = mxfp4.CODEC.suffixes


@pytest.fixture(scope="module")
def golden(golden_dir):
    return golden_reference(golden_dir, "mxfp4a16/llmcompressor-MXFP4A16")


# ----------------------------------------------------------------------------- golden
def test_golden_encode_is_bit_exact(golden):
    base, ref, _ = golden
    for name, w in golden_linears(base).items():
        for suffix, tensor in mxfp4.encode(w).items():
            assert_bit_equal(tensor, ref[f"{name}.{suffix}"], f"{name}.{suffix}")


def test_golden_whole_checkpoint_is_bit_exact(golden_dir, golden, tmp_path):
    stats = assert_whole_checkpoint_is_golden(golden_dir, golden[2], "mxfp4", tmp_path / "ours")
    assert stats["bits_per_weight"] == pytest.approx(4.25)  # 4 bits + one byte per 32 weights


def test_golden_decode_equals_compressed_tensors(golden):
    from compressed_tensors.compressors.mxfp4 import MXFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    _, ref, _ = golden
    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    owners = [k.removesuffix(".weight_packed") for k in ref if k.endswith(".weight_packed")]
    assert len(owners) == 14
    for owner in owners:
        sd = {s: ref[f"{owner}.{s}"] for s in SUFFIXES}
        theirs = MXFP4PackedCompressor.decompress(sd, scheme)["weight"]
        assert_bit_equal(mxfp4.decode(*sd.values(), dtype=torch.bfloat16), theirs, owner)
        # our float32 decode is exact: the same values before any rounding
        assert_bit_equal(mxfp4.decode(*sd.values(), dtype=torch.float32).to(torch.bfloat16), theirs, owner)


# ----------------------------------------------------------------------------- random vs compressed-tensors
def _ct_reference(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' own qparams + compressor on one weight, as llmcompressor calls them."""
    from compressed_tensors.compressors.mxfp4 import MXFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    groups = weight.unflatten(-1, (weight.shape[-1] // 32, 32))
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    return MXFP4PackedCompressor.compress({"weight": weight, "weight_scale": scale}, scheme)


def _degenerate(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * torch.logspace(-3, 2, shape[0]).unsqueeze(-1)
    w[0, :32] = 0  # an all-zero group
    if shape[0] > 3:
        w[1, :32] = -0.0  # negative zeros, and small negatives that round to zero
        w[1, 1], w[1, 2] = -1e-9, 1e-3
        w[2, :32] = 1e-40  # subnormal
        # rounding of the amax to a power of two: 1.75 rounds up, 1.74 (bf16: 1.7421875) down; clamping at +-6
        w[3, :32] = torch.tensor([1.75, 1.74, 7.0, -7.0] + [0.1] * 28)
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 32), (4, 64), (32, 128), (17, 256)])
def test_random_weights_match_compressed_tensors(shape, dtype):
    w = _degenerate(shape, dtype, shape[0] * 1000 + shape[1])
    ref, ours = _ct_reference(w), mxfp4.encode(w)
    for key in SUFFIXES:
        assert_bit_equal(ours[key], ref[key], key)


def test_an_amax_past_the_largest_float_keeps_a_finite_scale():
    """The one deliberate difference (module docstring): compressed-tensors' scale overflows to inf there."""
    w = torch.full((1, 32), -3.0e38).to(torch.bfloat16)
    code = mxfp4.encode(w)
    assert code["weight_scale"].tolist() == [[252]]  # the power 2^127, as a group with amax in [2^127, 1.75 * 2^127)
    dense = mxfp4.decode(code["weight_packed"], code["weight_scale"])
    assert (dense == -6 * 2.0**125).all()  # the largest finite MXFP4 magnitude
    assert _ct_reference(w)["weight_packed"].eq(0).all()  # theirs: every value coded as zero
    edge = torch.full((1, 32), 2.0**127).to(torch.bfloat16)  # below the overflow: the same bytes as theirs
    assert mxfp4.encode(edge)["weight_scale"].tolist() == [[252]] == _ct_reference(edge)["weight_scale"].tolist()


# ----------------------------------------------------------------------------- properties
def test_scales_are_powers_of_two_and_round_trip_within_a_step():
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 256, generator=gen) * torch.rand(64, 1, generator=gen) * 3).to(torch.bfloat16)
    code = mxfp4.encode(w)
    scale = mxfp4.scales(code["weight_scale"])
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))
    dense = mxfp4.decode(code["weight_packed"], code["weight_scale"])
    step = scale.repeat_interleave(32, dim=-1)
    # E2M1's widest gap is 2 (4 -> 6) scale units: rounding moves a value by at most one unit; an amax rounded down
    # to a power of two can exceed 6 units (up to 7): clamping costs at most one more
    assert torch.all((w.float() - dense).abs() <= step * (1 + 1e-6))
    assert not torch.any(dense * w.float() < 0), "decoding never flips a sign"
    assert nvfp4.relative_error(w.float(), dense) < mxfp4.CODEC.max_rel_error
    assert set(nvfp4.unpack(code["weight_packed"]).unique().tolist()) == set(range(16))


def test_bad_shapes_are_refused_and_left_dense():
    with pytest.raises(ValueError, match="divisible by 32"):
        mxfp4.encode(torch.randn(4, 48).to(torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        mxfp4.encode(torch.randn(4, 32).to(torch.float16))
    assert mxfp4.CODEC.skip_reason(48, 8) == "in_features 48 not a multiple of 32"
    assert mxfp4.CODEC.skip_reason(64, 8) is None


# ----------------------------------------------------------------------------- vLLM (slow)
@pytest.mark.vllm
def test_vllm_cpu_parses_the_mxfp4_folder_into_its_mxfp4_scheme(tiny_model_dir, tmp_path):
    """vLLM-CPU on the packed MXFP4 folder, as the CUDA decision serves it, gets as far as kernel selection.

    What the message proves: vLLM 0.32 builds ``CompressedTensorsW4A4Mxfp4`` only when our
    ``quantization_config`` parses as FP4 weights in groups of 32 (``_is_mxfp4``); its
    ``init_mxfp4_linear_kernel`` then looks for a kernel among the platform's (FlashInfer, Marlin,
    Humming, B12x, emulation on CUDA) and a CPU has none: "Failed to find a kernel that can implement
    the MXFP4 linear layer". A config parsed as anything else would fail elsewhere or start dense.
    """
    pytest.importorskip("vllm")
    text = vllm_cpu_scheme_log(tiny_model_dir, "mxfp4", tmp_path)
    assert "Failed to find a kernel that can implement the MXFP4 linear layer" in text
    assert "return CompressedTensorsW4A4Mxfp4()" in text  # raised while building that scheme (the traceback's line)
