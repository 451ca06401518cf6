"""NVFP4 codec: bit-exact against llmcompressor's golden output, plus properties on random weights."""

from __future__ import annotations

import pytest
import torch

from qerl_pipeline.quantization import checkpoint, nvfp4

SUFFIXES = nvfp4.CODEC.suffixes


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Compare tensors bit for bit (fp8 through its bytes; -0.0 != 0.0)."""
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t


def _assert_bit_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    diff = (_bits(a) != _bits(b)).sum().item()
    assert diff == 0, f"{what}: {diff} elements differ"


# ----------------------------------------------------------------------------- golden
@pytest.fixture(scope="module")
def golden(golden_dir):
    base = checkpoint.read_tensors(golden_dir / "base-bf16")
    ref = checkpoint.read_tensors(golden_dir / "llmcompressor-NVFP4A16")
    return base, ref


def test_golden_encode_is_bit_exact(golden):
    base, ref = golden
    # The golden recipe loads the model with dtype=torch.bfloat16 before quantizing.
    linears = {k.removesuffix(".weight"): v.to(torch.bfloat16) for k, v in base.items() if k.endswith("_proj.weight")}
    encoded = nvfp4.encode_linears(linears)
    assert len(encoded) == 14
    for name, code in encoded.items():
        for key, tensor in code.state_dict(name + ".").items():
            _assert_bit_equal(tensor, ref[key], key)


def test_golden_fused_groups_share_global_scale(golden):
    _, ref = golden
    for layer in range(2):
        p = f"model.layers.{layer}."
        qkv = [ref[f"{p}self_attn.{m}_proj.weight_global_scale"] for m in "qkv"]
        gu = [ref[f"{p}mlp.{m}_proj.weight_global_scale"] for m in ("gate", "up")]
        assert all(torch.equal(qkv[0], g) for g in qkv) and torch.equal(gu[0], gu[1])
    names = ["a.q_proj", "a.k_proj", "a.v_proj", "a.o_proj", "a.mlp.gate_proj", "a.mlp.up_proj", "b.q_proj"]
    assert nvfp4.fused_group_of("a.k_proj", names) == ("a.q_proj", "a.k_proj", "a.v_proj")
    assert nvfp4.fused_group_of("a.o_proj", names) == ("a.o_proj",)
    assert nvfp4.fused_group_of("b.q_proj", names) == ("b.q_proj",)  # no k/v siblings: alone


def test_golden_whole_checkpoint_is_bit_exact(golden_dir, golden, tmp_path):
    from transformers import AutoModelForCausalLM

    _, ref = golden
    model = AutoModelForCausalLM.from_pretrained(golden_dir / "base-bf16", dtype=torch.bfloat16)
    checkpoint.write_base(model, None, "nvfp4", tmp_path / "ours")
    ours = checkpoint.read_tensors(tmp_path / "ours")
    assert ours.keys() == ref.keys()
    for key in ref:
        _assert_bit_equal(ours[key], ref[key], key)
    import json

    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())["quantization_config"]
    gold = json.loads((golden_dir / "llmcompressor-NVFP4A16" / "config.json").read_text())["quantization_config"]
    assert cfg == gold


def test_golden_decode_equals_compressed_tensors(golden):
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    _, ref = golden
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    owners = [k.removesuffix(".weight_packed") for k in ref if k.endswith(".weight_packed")]
    assert len(owners) == 14
    for owner in owners:
        sd = {s: ref[f"{owner}.{s}"] for s in SUFFIXES}
        theirs = NVFP4PackedCompressor.decompress(sd, scheme)["weight"]
        ours = nvfp4.decode(*sd.values(), dtype=torch.bfloat16)
        _assert_bit_equal(ours, theirs, owner)
        # our float32 decode is the unrounded value of the same product
        _assert_bit_equal(nvfp4.decode(*sd.values(), dtype=torch.float32).to(torch.bfloat16), theirs, owner)


# ----------------------------------------------------------------------------- random vs compressed-tensors
def _ct_reference(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' own qparams + compressor on one (unfused) weight, as llmcompressor calls them."""
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    groups = weight.unflatten(-1, (weight.shape[-1] // 16, 16))
    mins, maxs = groups.amin(-1), groups.amax(-1)
    absmax = torch.maximum(-mins.min(), maxs.max())
    gs = generate_gparam(-absmax.reshape(1), absmax.reshape(1))
    scale, _ = calculate_qparams(mins, maxs, scheme.weights, global_scale=gs)
    state = {"weight": weight, "weight_scale": scale.to(weight.dtype), "weight_global_scale": gs}
    return NVFP4PackedCompressor.compress(state, scheme)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 16), (3, 48), (32, 64), (17, 256)])
def test_random_weights_match_compressed_tensors(shape, dtype):
    gen = torch.Generator().manual_seed(hash((shape, str(dtype))) % 2**31)
    w = torch.randn(shape, generator=gen) * torch.logspace(-3, 1, shape[0]).unsqueeze(-1)
    w[0, :16] = 0  # an all-zero block
    w = w.to(dtype)
    ref = _ct_reference(w)
    ours = nvfp4.encode(w).state_dict()
    for key in SUFFIXES:
        _assert_bit_equal(ours[key], ref[key], key)


# ----------------------------------------------------------------------------- properties
@pytest.mark.parametrize("shape", [(1, 16), (5, 32), (64, 128), (7, 512)])
def test_round_trip_error_is_within_one_step(shape):
    gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    w = torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen) * 3
    code = nvfp4.encode(w)
    dense = code.decode()
    eff = nvfp4.effective_scale(code.scale, code.global_scale).repeat_interleave(16, dim=-1)
    # The widest gap between E2M1 levels is 2 (4 -> 6): rounding moves a value by at most one
    # unit of its block's scale; clamping after FP8 scale rounding moves it by < 0.375 units.
    assert torch.all((w - dense).abs() <= eff * (1 + 1e-6))
    assert not torch.any((dense * w) < 0), "decoding never flips a sign"
    assert nvfp4.relative_error(w, dense) < 0.15


def test_every_code_is_reachable():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    codes = nvfp4.unpack(nvfp4.encode(w).packed)
    assert set(codes.unique().tolist()) == set(range(16))  # incl. 8: a small negative rounded to "-0"


def test_rounding_boundaries_follow_ties_to_even():
    one = torch.tensor([1.0]).to(torch.float8_e4m3fn).reshape(1, 1)
    gs = torch.tensor([1.0])
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.26, 1.75, 2.5, 2.51, 3.5, 5.0, 5.01, 7.0, -0.1, -0.0, 0.0, -5.0])
    want = [0, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7, 7, 8, 0, 0, 14]
    assert nvfp4.quantize_codes(x.reshape(1, 16), one, gs).reshape(-1).tolist() == want


def test_pack_unpack_round_trip_low_nibble_first():
    codes = torch.randint(0, 16, (9, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    packed = nvfp4.pack(codes)
    assert packed.shape == (9, 16)
    assert int(packed[0, 0]) == int(codes[0, 0]) | (int(codes[0, 1]) << 4)
    assert torch.equal(nvfp4.unpack(packed), codes)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.zeros(4, 32), id="all-zero"),
        pytest.param(lambda: torch.full((2, 16), 1e-40), id="subnormal"),
        pytest.param(lambda: torch.randn(4, 32) * 1e30, id="huge-fp32"),
        pytest.param(lambda: (torch.randn(4, 32).clamp(-3, 3) * 1e38).to(torch.bfloat16), id="huge-bf16"),
        pytest.param(lambda: torch.cat([torch.zeros(2, 32), torch.randn(2, 32) * 1e4]), id="zero-and-large-blocks"),
        pytest.param(lambda: torch.cat([torch.full((1, 32), 1e-12), torch.randn(1, 32)]), id="tiny-next-to-normal"),
    ],
)
def test_no_nan_on_degenerate_blocks(make):
    w = make()
    code = nvfp4.encode(w)
    dense = code.decode()
    assert torch.isfinite(code.global_scale).all() and code.global_scale.item() > 0
    assert torch.isfinite(code.scale.float()).all() and (code.scale.float() > 0).all()
    assert torch.isfinite(dense).all()
    w32 = w.float()
    zero_rows = (w32 == 0).all(dim=-1)
    assert torch.all(dense[zero_rows] == 0)
    if w32.abs().max() > 1:
        normal = w32.abs().amax(dim=-1) > 1
        assert nvfp4.relative_error(w32[normal], dense[normal]) < 0.15


def test_all_zero_tensor_uses_unit_global_scale_and_eps_scale():
    code = nvfp4.encode(torch.zeros(2, 16))
    assert code.global_scale.item() == 1.0
    assert torch.all(code.scale.float() == nvfp4.ZERO_SCALE_REPLACEMENT)


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="divisible by 16"):
        nvfp4.encode(torch.randn(4, 24))
    with pytest.raises(ValueError, match="2-D"):
        nvfp4.encode(torch.randn(16))


@pytest.mark.parametrize("shape", [(1536, 576), (64, 32), (3, 16)])
def test_byte_table_decode_is_the_code_by_code_decode(shape):
    """decode's byte table (both nibbles per lookup) gives exactly unpack -> code_values -> scales."""
    torch.manual_seed(1)
    q = nvfp4.encode(torch.randn(*shape) * 0.05)
    ref = (
        nvfp4.code_values(nvfp4.unpack(q.packed)).unflatten(-1, (q.scale.shape[-1], nvfp4.GROUP_SIZE))
        * nvfp4.effective_scale(q.scale, q.global_scale).unsqueeze(-1)
    ).reshape(shape[0], -1)
    assert torch.equal(nvfp4.decode(q.packed, q.scale, q.global_scale), ref)
    every_byte = torch.arange(256, dtype=torch.uint8)
    table = nvfp4.byte_table()
    assert torch.equal(table[:, 0], nvfp4.code_values(every_byte & 0x0F))
    assert torch.equal(table[:, 1], nvfp4.code_values(every_byte >> 4))
