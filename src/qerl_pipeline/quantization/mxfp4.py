"""MXFP4 (OCP Microscaling, weight-only "MXFP4A16") codec in plain torch, bit-exact with llmcompressor.

Format (as compressed-tensors' ``mxfp4-pack-quantized`` stores it):

* each weight is an E2M1 code, packed as NVFP4's (two per uint8, the even column in the low
  nibble, bit 3 the sign): ``quantization/nvfp4.py``'s ``pack`` and ``byte_table`` serve both;
* one E8M0 scale per 32 consecutive inputs of a row (``weight_scale``, uint8 ``[out, in/32]``):
  a power of two ``2^(e - 127)``; there is no global scale. The dense weight is
  ``E2M1 * 2^(e - 127)``.

The rules below reproduce what llmcompressor 0.14 (``QuantizationModifier(scheme="MXFP4A16")``,
data-free, memoryless min-max observer) and compressed-tensors 0.19 compute, dtype behaviour
included (tests/test_mxfp4.py checks them against ``../shared/golden/mxfp4a16`` and against
compressed-tensors' own functions on random and degenerate weights):

1. Per group of 32, ``amax = max(|min(w, 0)|, max(w, 0))`` in the weight's dtype (bf16 for a
   bf16 model).
2. ``amax`` is rounded to a power of two on its bit pattern: add a quarter of the mantissa's
   range (``1 << (mantissa_bits - 2)``) and drop the mantissa, so ``[1, 1.75) * 2^k -> 2^k``
   and ``[1.75, 2) * 2^k -> 2^(k+1)``; zero stays zero.
3. The exponent is that power's minus 2 (``floor(log2(6))``, E2M1's largest value), biased by
   127 and clamped to ``[0, 255]``: ``e = clamp(biased_exponent_field - 2, 0, 255)``. A zero
   group gets ``e = 0`` (scale ``2^-127``). One deliberate difference: a group whose amax rounds
   up past the largest float (``>= 1.75 * 2^127``, within 12% of bf16's maximum) is given the
   power ``2^127`` (``e = 252``: its values clamp to +-6 * 2^125, the largest finite MXFP4 values),
   while compressed-tensors overflows there (an infinite scale, stored as the byte of an undefined
   float-to-int cast, and every code a zero).
4. Codes: ``x = w / 2^(e - 127)`` computed in the weight's dtype (exact: a power of two), clamped
   to +-6 and rounded to the nearest E2M1 value with NVFP4's ties-to-even rule and sign bit
   (``nvfp4.e2m1_codes``).
5. Decode: ``E2M1[code] * 2^(e - 127)`` in float32 (exact), then the requested dtype;
   ``dtype=torch.bfloat16`` equals compressed-tensors' decompression bit for bit.

Served on CUDA by vLLM 0.32's ``CompressedTensorsW4A4Mxfp4`` scheme (compressed-tensors picks
it for FP4 weights in groups of 32 with E8M0 scales): on Hopper its Marlin kernel runs the
weights at 4 bits with 16-bit activations (W4A16); on Blackwell with FlashInfer the scheme's
first choice, FlashInfer's CUTLASS kernel, quantizes the activations to MXFP4 as well (W4A4),
which the trainer does not (docs/gpu.md). On CPU the dense decoded copy is served.
"""

from __future__ import annotations

import torch

from qerl_pipeline.quantization import nvfp4
from qerl_pipeline.quantization.codec import CompressedTensorsCodec, Served, check_matrix, register, signed_absmax

GROUP_SIZE = 32
#: E8M0's exponent bias: a stored ``e`` is the scale ``2^(e - 127)``
E8M0_BIAS = 127
#: ``floor(log2(6))``: the exponent offset that maps a group's amax into E2M1's range
E2M1_EMAX = 2
#: Mantissa bits of the float dtypes the exponent is read from
_MANTISSA = {torch.bfloat16: 7, torch.float32: 23}
_INT = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def scale_exponents(weight: torch.Tensor) -> torch.Tensor:
    """The biased E8M0 exponent of each group of 32 inputs (uint8 ``[out, in/32]``), rules 1-3."""
    check_matrix(weight, "MXFP4", GROUP_SIZE)
    if weight.dtype not in _MANTISSA:
        raise ValueError(f"MXFP4 quantizes bfloat16 or float32 weights, got {weight.dtype}")
    mant = _MANTISSA[weight.dtype]
    amax = signed_absmax(weight.unflatten(-1, (weight.shape[-1] // GROUP_SIZE, GROUP_SIZE)))
    bits = amax.view(_INT[weight.dtype]).to(torch.int64) & ((1 << (8 + mant)) - 1)  # sign is 0: amax >= 0
    field = ((bits + (1 << (mant - 2))) >> mant) & 0xFF  # the exponent field after rounding to a power of two
    field = torch.clamp(field, max=254)  # 255 would be 2^128, past the largest float (rule 3's difference)
    return torch.clamp(field - E2M1_EMAX, 0, 255).to(torch.uint8)


def scales(exponents: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``2^(e - 127)`` per group, in ``dtype`` (exact for bf16 and float32: a power of two)."""
    return torch.exp2(exponents.to(torch.float32) - E8M0_BIAS).to(dtype)


def encode(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"weight_packed", "weight_scale"}`` of one weight (rules 1-4)."""
    with torch.no_grad():
        e = scale_exponents(weight)
        groups = weight.unflatten(-1, (weight.shape[-1] // GROUP_SIZE, GROUP_SIZE))
        x = groups / scales(e, weight.dtype).unsqueeze(-1)  # in the weight's dtype, as compressed-tensors divides
        codes = nvfp4.e2m1_codes(x).reshape(weight.shape)
        return {"weight_packed": nvfp4.pack(codes), "weight_scale": e}


def decode(packed: torch.Tensor, exponents: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense weight ``E2M1 * 2^(e - 127)`` in float32, then ``dtype`` (rule 5)."""
    if packed.dtype != torch.uint8 or exponents.dtype != torch.uint8:
        raise ValueError(f"MXFP4 codes and scales are uint8, got {packed.dtype} and {exponents.dtype}")
    out = packed.shape[0]
    pairs = torch.nn.functional.embedding(packed.long(), nvfp4.byte_table(packed.device))  # [out, in/2, 2]
    vals = pairs.reshape(out, exponents.shape[-1], GROUP_SIZE)
    return (vals * scales(exponents).to(vals.device).unsqueeze(-1)).reshape(out, -1).to(dtype)


# ----------------------------------------------------------------------------- the codec
CT_FORMAT = "mxfp4-pack-quantized"
CT_WEIGHTS = {
    "actorder": None,
    "block_structure": None,
    "dynamic": False,
    "group_size": GROUP_SIZE,
    "num_bits": 4,
    "observer": "memoryless_minmax",
    "observer_kwargs": {},
    "scale_dtype": "torch.uint8",
    "strategy": "group",
    "symmetric": True,
    "type": "float",
    "zp_dtype": None,
}


class MXFP4Codec(CompressedTensorsCodec):
    """MXFP4A16 as the project stores, trains on and serves it (module docstring)."""

    name = "mxfp4"
    label = "MXFP4"
    suffixes = ("weight_packed", "weight_scale")
    group_size = GROUP_SIZE
    buffers = {"weight_packed": "packed", "weight_scale": "scale_exponents"}
    settings = ("ignore",)
    max_rel_error = 0.2
    ct_format, ct_weights = CT_FORMAT, CT_WEIGHTS
    cuda = Served(
        ".",
        "mxfp4",
        False,
        {"quantization": "compressed-tensors"},
        activations_16bit=True,
        scheme="CompressedTensorsW4A4Mxfp4",
    )

    def encode(self, weight, settings):
        return encode(weight)

    def decode(self, tensors, shape, dtype, params):
        return decode(tensors["weight_packed"], tensors["weight_scale"], dtype=dtype)

    def tensor_specs(self, n_out, n_in, params):
        return {
            "weight_packed": ((n_out, n_in // 2), torch.uint8),
            "weight_scale": ((n_out, n_in // GROUP_SIZE), torch.uint8),
        }


CODEC = register(MXFP4Codec())
