"""NVFP4 (weight-only, "NVFP4A16") codec in plain torch, bit-exact with llmcompressor.

Format (as compressed-tensors' ``nvfp4-pack-quantized`` stores it):

* each weight is an E2M1 code: 1 sign bit + an index into ``E2M1_VALUES`` =
  {0, 0.5, 1, 1.5, 2, 3, 4, 6}; two codes per uint8, the even column in the low nibble;
* one FP8-E4M3 scale per 16 consecutive inputs of a row (``weight_scale``, shape
  ``[out, in/16]``);
* one FP32 global scale per tensor (``weight_global_scale``, shape ``[1]``); the dense
  weight is ``E2M1 * (scale / global_scale)``.

The rules below reproduce what llmcompressor 0.14 (memoryless min-max observer, data-free
``QuantizationModifier(scheme="NVFP4A16")``) and compressed-tensors 0.19 compute, including
their dtype behaviour, so that our codes equal theirs bit for bit
(tests/test_nvfp4.py checks this against ``../shared/golden/nvfp4a16``):

1. Statistics are taken in the weight's own dtype (bfloat16 for a bf16 model).
   ``amax = max(|min(w, 0)|, max(w, 0))``.
2. Global scale ``gs = 448 * 6 / max(amax, tiny)``, computed in the weight's dtype (so for
   a bf16 model it is bf16-rounded) and then stored as float32. NaN/inf (an all-zero or
   subnormal tensor) become 1.0. Fused layers share one ``gs`` from their joint amax:
   q/k/v, gate/up (``FUSED_GROUPS``), because vLLM runs them as one GEMM.
3. Block scale ``s = fp8(clamp(gs * (amax_block / 6), +-448))`` where ``amax_block / 6`` is
   in the weight dtype and the product in float32; fp8 rounding is round-to-nearest-even.
   A scale that rounds to 0 becomes 0.125 (compressed-tensors' eps for FP8 scales).
4. Codes: ``x = clamp(w / (s / gs), -6, 6)`` in float32, rounded to the nearest E2M1 value
   with ties to the even mantissa (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4,
   5->4). The sign bit is set when ``x < 0`` (so a small negative that rounds to zero
   keeps its sign: nibble 8, a "-0"), not for -0.0.
5. Decode: ``E2M1[code] * (s / gs)`` in float32. compressed-tensors' decompression is that
   value rounded to bfloat16 (``decode(..., dtype=torch.bfloat16)`` reproduces it exactly);
   training on CPU uses the float32 value itself (no extra rounding).

Everything is vectorised; no Triton, no CUDA needed. Nothing here is copied from
compressed-tensors: the rules are re-derived from its behaviour and the NVFP4 definition.

``CODEC`` is the format as the rest of the project sees it (``quantization/codec.py``): the
compressed-tensors ``nvfp4-pack-quantized`` checkpoint (``weight_packed``, ``weight_scale``,
``weight_global_scale`` per linear; a linear whose in_features is not a multiple of 16 stays
dense and is listed in ``ignore``), the calibrated path through llmcompressor's ``NVFP4A16``
preset (``quantize.nvfp4_algorithm: awq | gptq``), and on CUDA vLLM's
``CompressedTensorsW4A4Fp4(use_a16=True)`` scheme (rollout/serving.py says which kernel).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from qerl_pipeline.quantization.codec import CompressedTensorsCodec, Served, register

#: Magnitudes of the 8 E2M1 codes (index = low 3 bits of a nibble; bit 3 is the sign).
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
E2M1_MAX = 6.0
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
GROUP_SIZE = 16
#: compressed-tensors replaces a zero FP8 scale with this value (its FP8 "eps").
ZERO_SCALE_REPLACEMENT = 0.125
#: Sibling linears that share one global scale (llmcompressor's fused layer groups).
FUSED_GROUPS: tuple[tuple[str, ...], ...] = (
    ("gate_proj", "up_proj"),
    ("q_proj", "k_proj", "v_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
    ("w1", "w3"),
)
# Rounding boundaries of |x| to E2M1: strict ">" where the tie goes down, ">=" where up.
_UPPER_STRICT = torch.tensor([0.25, 1.25, 2.5, 5.0])  # ties round down (to even mantissa)
_UPPER_INCL = torch.tensor([0.75, 1.75, 3.5])  # ties round up (to even mantissa)


@dataclass
class NVFP4Weight:
    """One quantized weight: packed codes, FP8 block scales, FP32 global scale."""

    packed: torch.Tensor  # uint8 [out, in/2]
    scale: torch.Tensor  # float8_e4m3fn [out, in/16]
    global_scale: torch.Tensor  # float32 [1]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    def decode(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return decode(self.packed, self.scale, self.global_scale, dtype=dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.global_scale))

    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """compressed-tensors tensor names: ``weight_packed``, ``weight_scale``, ``weight_global_scale``."""
        return {
            f"{prefix}weight_packed": self.packed,
            f"{prefix}weight_scale": self.scale,
            f"{prefix}weight_global_scale": self.global_scale,
        }


def _check_weight(weight: torch.Tensor) -> None:
    if weight.ndim != 2:
        raise ValueError(f"NVFP4 quantizes 2-D weights, got shape {tuple(weight.shape)}")
    if weight.shape[1] % GROUP_SIZE:
        raise ValueError(
            f"NVFP4 needs in_features divisible by {GROUP_SIZE}, got shape {tuple(weight.shape)}; "
            "add the module to quantize.ignore"
        )
    if not weight.is_floating_point():
        raise ValueError(f"NVFP4 quantizes floating weights, got {weight.dtype}")


def absmax(weight: torch.Tensor) -> torch.Tensor:
    """``max(|min(w,0)|, max(w,0))`` as a 0-d tensor in the weight's dtype (exact)."""
    lo = torch.clamp(weight.min(), max=0)
    hi = torch.clamp(weight.max(), min=0)
    return torch.maximum(lo.abs(), hi)


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """``448 * 6 / amax`` in amax's dtype, NaN/inf -> 1.0, returned as float32 ``[1]``."""
    amax = amax.reshape(1)
    amax = torch.clamp(amax, min=torch.finfo(amax.dtype).tiny)
    gs = (FP8_E4M3_MAX * E2M1_MAX) / amax
    gs = torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0)
    return gs.to(torch.float32)


def global_scale(weights: Iterable[torch.Tensor]) -> torch.Tensor:
    """The shared global scale of one or more weights (a fused group)."""
    amaxes = [absmax(w) for w in weights]
    if not amaxes:
        raise ValueError("global_scale needs at least one weight")
    joint = amaxes[0]
    for a in amaxes[1:]:
        joint = torch.maximum(joint, a.to(joint.dtype))
    return global_scale_from_amax(joint)


def block_scales(weight: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """FP8-E4M3 scale per 16 inputs: ``fp8(gs * amax_block / 6)``, zeros replaced by 0.125."""
    _check_weight(weight)
    blocks = weight.unflatten(-1, (weight.shape[-1] // GROUP_SIZE, GROUP_SIZE))
    lo = torch.clamp(blocks.amin(dim=-1), max=0)
    hi = torch.clamp(blocks.amax(dim=-1), min=0)
    amax = torch.maximum(lo.abs(), hi)
    local = amax / torch.tensor(E2M1_MAX, dtype=amax.dtype)  # rounded in the weight dtype
    scaled = gs.to(torch.float32).reshape(1, 1) * local  # float32 (type promotion)
    fp8 = torch.clamp(scaled, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    zero = fp8.to(torch.float32) == 0
    if zero.any():
        fp8 = torch.where(zero, torch.tensor(ZERO_SCALE_REPLACEMENT), fp8.to(torch.float32)).to(torch.float8_e4m3fn)
    return fp8


def effective_scale(scale: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """Per-block multiplier ``scale / gs`` in float32 (how compressed-tensors divides)."""
    return scale.to(torch.float32) / gs.to(torch.float32).reshape(1, 1)


def quantize_codes(weight: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """Unpacked 4-bit codes (uint8 in [0, 15], bit 3 = sign) for given scales."""
    _check_weight(weight)
    out, inp = weight.shape
    eff = effective_scale(scale, gs).unsqueeze(-1)  # [out, groups, 1]
    x = weight.unflatten(-1, (inp // GROUP_SIZE, GROUP_SIZE)).to(torch.float32) / eff
    return e2m1_codes(x).reshape(out, inp)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8 in [0, 15], bit 3 = sign) of values already divided by their scale.

    ``x`` is clamped to +-6 and rounded to the nearest E2M1 value, ties to the even mantissa
    (rule 4 of the module docstring); the sign bit is set for ``x < 0``. MXFP4 codes the same way."""
    x = torch.clamp(x, -E2M1_MAX, E2M1_MAX)
    mag = x.abs()
    idx = torch.zeros_like(mag, dtype=torch.uint8)
    for t in _UPPER_STRICT.tolist():
        idx += (mag > t).to(torch.uint8)
    for t in _UPPER_INCL.tolist():
        idx += (mag >= t).to(torch.uint8)
    sign = (x < 0).to(torch.uint8) << 3
    return idx | sign


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte, even column in the low nibble: ``[out, in] -> [out, in/2]``."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack needs an even number of columns, got {tuple(codes.shape)}")
    pairs = codes.to(torch.uint8).unflatten(-1, (codes.shape[-1] // 2, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[out, in/2] uint8 -> [out, in]`` codes."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed NVFP4 codes must be uint8, got {packed.dtype}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def code_values(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E2M1 value of each code (with sign)."""
    table = torch.cat([E2M1_VALUES, -E2M1_VALUES]).to(device=codes.device, dtype=dtype)
    return table[codes.long()]


def encode(weight: torch.Tensor, gs: torch.Tensor | None = None) -> NVFP4Weight:
    """Quantize one weight; ``gs`` = its fused group's global scale (default: its own)."""
    _check_weight(weight)
    with torch.no_grad():
        gs = global_scale([weight]) if gs is None else gs.to(torch.float32).reshape(1)
        scale = block_scales(weight, gs)
        codes = quantize_codes(weight, scale, gs)
        return NVFP4Weight(packed=pack(codes), scale=scale, global_scale=gs.clone())


_BYTE_TABLES: dict[torch.device, torch.Tensor] = {}


def byte_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """``[256, 2]`` float32: the E2M1 values (with sign) of a packed byte's low and high nibble.

    Decoding through this table reads each byte once (one gather of two floats) instead of
    unpacking nibbles, widening them to int64 and indexing a 16-entry table per code, which
    makes decoding, a large part of the packed policy's update on CPU, several times faster
    (docs/performance.md). Same values, bit for bit (tests/test_nvfp4.py)."""
    device = torch.device(device)
    table = _BYTE_TABLES.get(device)
    if table is None:
        vals = torch.cat([E2M1_VALUES, -E2M1_VALUES])
        table = torch.stack([vals.repeat(16), vals.repeat_interleave(16)], dim=-1).to(device)
        _BYTE_TABLES[device] = table
    return table


#: Bytes per weight alive at once while :func:`decode` runs (the planner's estimate): the codes
#: widened to int64 indices (4 a weight), the looked-up float32 pairs (4), the scaled float32
#: values (4), plus about one for the cast result's share while the float32 copy is freed.
DECODE_BYTES_PER_WEIGHT = 13


def decode(
    packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dense weight ``E2M1 * (scale / gs)`` computed in float32, then cast to ``dtype``.

    ``dtype=torch.bfloat16`` equals compressed-tensors' decompression bit for bit. The codes go
    through ``byte_table`` (both nibbles of a byte per lookup); ``code_values(unpack(...))`` is
    the same function, one code at a time.
    """
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed NVFP4 codes must be uint8, got {packed.dtype}")
    out = packed.shape[0]
    pairs = torch.nn.functional.embedding(packed.long(), byte_table(packed.device))  # [out, in/2, 2]
    vals = pairs.reshape(out, scale.shape[-1], GROUP_SIZE)
    dense = (vals * effective_scale(scale, gs).to(vals.device).unsqueeze(-1)).reshape(out, -1)
    return dense.to(dtype)


def fused_group_of(name: str, names: Iterable[str]) -> tuple[str, ...]:
    """The full names sharing a global scale with ``name`` (itself alone when unfused).

    A group counts only when every member exists as a sibling (same parent module), as in
    llmcompressor: a lone ``q_proj`` without ``k_proj``/``v_proj`` keeps its own scale.
    """
    names = set(names)
    parent, _, leaf = name.rpartition(".")
    for group in FUSED_GROUPS:
        if leaf in group:
            members = tuple(f"{parent}.{g}" if parent else g for g in group)
            if all(m in names for m in members):
                return members
    return (name,)


def encode_linears(weights: Mapping[str, torch.Tensor], progress: bool = False) -> dict[str, NVFP4Weight]:
    """Quantize several linears (module name -> weight), fused groups sharing a global scale."""
    names = list(weights)
    shared: dict[str, torch.Tensor] = {}
    out: dict[str, NVFP4Weight] = {}
    iterator: Iterable[str] = names
    if progress:
        from rich.progress import track

        iterator = track(names, description="NVFP4 encode")
    for name in iterator:
        group = fused_group_of(name, names)
        key = group[0]
        if key not in shared:
            shared[key] = global_scale(weights[m] for m in group)
        out[name] = encode(weights[name], shared[key])
    return out


def relative_error(weight: torch.Tensor, dense: torch.Tensor) -> float:
    """``||w - w_hat||_F / ||w||_F`` in float64, so huge weights do not overflow (0/0 -> 0)."""
    w = weight.to(torch.float64)
    d = dense.to(torch.float64)
    denom = torch.linalg.vector_norm(w)
    if denom == 0:
        return float(torch.linalg.vector_norm(d))
    return float(torch.linalg.vector_norm(w - d) / denom)


# ----------------------------------------------------------------------------- the codec
#: compressed-tensors' format name and weight arguments of NVFP4A16 (weights only, group 16, FP8 scales)
CT_FORMAT = "nvfp4-pack-quantized"
CT_WEIGHTS = {
    "actorder": None,
    "block_structure": None,
    "dynamic": False,
    "group_size": GROUP_SIZE,
    "num_bits": 4,
    "observer": "memoryless_minmax",
    "observer_kwargs": {},
    "scale_dtype": "torch.float8_e4m3fn",
    "strategy": "tensor_group",
    "symmetric": True,
    "type": "float",
    "zp_dtype": None,
}


class NVFP4Codec(CompressedTensorsCodec):
    """NVFP4A16 as the project stores, trains on and serves it (module docstring)."""

    name = "nvfp4"
    label = "NVFP4"
    suffixes = ("weight_packed", "weight_scale", "weight_global_scale")
    group_size = GROUP_SIZE
    buffers = {"weight_packed": "packed", "weight_scale": "scale_bits", "weight_global_scale": "gs_bits"}
    settings = ("ignore", "nvfp4_algorithm")
    max_rel_error = 0.15
    decode_bytes_per_weight = DECODE_BYTES_PER_WEIGHT
    calibration_scheme = "NVFP4A16"
    ct_format, ct_weights = CT_FORMAT, CT_WEIGHTS
    cuda = Served(
        ".",
        "nvfp4",
        False,
        {"quantization": "compressed-tensors"},
        activations_16bit=True,
        scheme="CompressedTensorsW4A4Fp4(use_a16=True)",
    )

    def encode(self, weight, settings):
        return encode(weight).state_dict()

    def encode_linears(self, weights, settings, progress=False):
        return {n: code.state_dict() for n, code in encode_linears(weights, progress=progress).items()}

    def decode(self, tensors, shape, dtype, params):
        return decode(tensors["weight_packed"], tensors["weight_scale"], tensors["weight_global_scale"], dtype=dtype)

    def tensor_specs(self, n_out, n_in, params):
        return {
            "weight_packed": ((n_out, n_in // 2), torch.uint8),
            "weight_scale": ((n_out, n_in // GROUP_SIZE), torch.float8_e4m3fn),
            "weight_global_scale": ((1,), torch.float32),
        }

    def algorithm(self, settings):
        return settings.get("nvfp4_algorithm", "rtn")


CODEC = register(NVFP4Codec())
