"""NF4 codec: byte-identical to bitsandbytes (when importable), plus properties."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from qerl_pipeline.quantization import nf4

HAVE_BNB = importlib.util.find_spec("bitsandbytes") is not None
needs_bnb = pytest.mark.skipif(
    not HAVE_BNB, reason="bitsandbytes not installed (pip install bitsandbytes; its CPU path quantizes NF4)"
)


def _weights(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen)
    w.view(-1)[: min(64, w.numel())] = 0  # an all-zero block
    return w.to(dtype)


@needs_bnb
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape,blocksize", [((32, 128), 64), ((7, 9), 64), ((64, 64), 128), ((3, 70), 64), ((16, 48), 32)]
)
def test_codes_and_decode_match_bitsandbytes(shape, blocksize, dtype):
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    w = _weights(shape, dtype, seed=shape[0] * 31 + shape[1])
    packed, state = quantize_4bit(w, blocksize=blocksize, quant_type="nf4")
    ours = nf4.encode(w, blocksize)
    assert torch.equal(packed.reshape(-1), ours.packed)
    assert torch.equal(state.absmax, ours.absmax)
    if shape[-1] % blocksize == 0:
        # bitsandbytes' native CPU dequantizer indexes blocks within rows; where blocks span
        # rows it disagrees with its own quantizer (and with its CUDA and reference paths),
        # so the decoded values are compared only for row-aligned blocks, the usual case.
        theirs = dequantize_4bit(packed, state)  # in w's dtype
        assert torch.equal(theirs.view(torch.uint8), ours.decode(dtype).view(torch.uint8))
    flat = nf4.NF4_LEVELS[nf4.unpack(ours.packed, w.numel()).long()]
    expect = flat * ours.absmax.repeat_interleave(blocksize)[: w.numel()]
    assert torch.equal(ours.decode(torch.float32).reshape(-1), expect)


@needs_bnb
def test_codebook_is_bitsandbytes_nf4():
    from bitsandbytes.functional import quantize_4bit

    _, state = quantize_4bit(torch.randn(4, 64), blocksize=64, quant_type="nf4")
    assert torch.equal(state.code.float().cpu(), nf4.NF4_LEVELS)


def test_levels_sorted_symmetric_with_exact_zero():
    levels = nf4.NF4_LEVELS
    assert torch.all(levels[1:] > levels[:-1])
    assert levels[0] == -1 and levels[-1] == 1 and levels[7] == 0


def test_every_code_reachable_and_first_element_in_high_nibble():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    q = nf4.encode(w)
    codes = nf4.unpack(q.packed, w.numel())
    assert set(codes.unique().tolist()) == set(range(16))
    assert int(q.packed[0]) >> 4 == int(codes[0]) and int(q.packed[0]) & 0xF == int(codes[1])


@pytest.mark.parametrize("shape", [(4, 64), (5, 33), (128, 96)])
def test_round_trip_error_within_half_the_widest_gap(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(shape[1]))
    q = nf4.encode(w)
    dense = q.decode()
    half_gap = float((nf4.NF4_LEVELS[1:] - nf4.NF4_LEVELS[:-1]).max()) / 2
    flat, n = w.reshape(-1), w.numel()
    absmax = q.absmax.repeat_interleave(q.blocksize)[:n]
    assert torch.all((flat - dense.reshape(-1)).abs() <= absmax * half_gap * (1 + 1e-6))
    # each block's absmax is stored exactly (the level 1.0 or -1.0 reproduces it)
    assert torch.allclose(dense.reshape(-1).abs().max(), flat.abs().max())


def test_zero_and_huge_blocks_give_no_nan():
    w = torch.cat([torch.zeros(64), torch.randn(64) * 1e30, torch.full((64,), 1e-40)])
    dense = nf4.encode(w).decode()
    assert torch.isfinite(dense).all()
    assert torch.all(dense[:64] == 0)
    assert nf4.encode(torch.zeros(3, 64)).absmax.eq(0).all()


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="nf4_blocksize"):
        nf4.encode(torch.randn(4, 64), blocksize=63)
    with pytest.raises(ValueError, match="floating"):
        nf4.encode(torch.ones(4, 64, dtype=torch.int32))
    assert nf4.bits_per_weight(64) == 4.5
