"""FP8 (E4M3 weights, one scale per output channel, weight-only "W8A16") codec in plain torch, bit-exact
with llmcompressor.

Format (as compressed-tensors' ``naive-quantized`` stores a float 8-bit, channel-strategy scheme):

* each weight is an FP8-E4M3 value (``weight``, float8_e4m3fn ``[out, in]``);
* one scale per output row (``weight_scale``, in the weight's dtype, bf16, ``[out, 1]``); the dense
  weight is ``weight * weight_scale``.

The rules below reproduce what llmcompressor 0.14 (``QuantizationModifier`` with ``num_bits=8,
type=float, symmetric=True, strategy=channel`` weights and no activation quantization; its
weights are those of the ``FP8_DYNAMIC`` preset) and compressed-tensors 0.19 compute, dtype
behaviour included (tests/test_fp8.py checks them against ``../shared/golden/fp8`` and against
compressed-tensors' own functions):

1. Per row, ``amax = max(|min(w, 0)|, max(w, 0))`` in the weight's dtype (bf16).
2. ``scale = amax / 448`` divided in that dtype (bf16-rounded); a zero scale becomes bf16's
   machine epsilon ``2^-7`` (compressed-tensors' eps for the scale's dtype).
3. ``x = w / scale`` in that dtype (so bf16-rounded before the FP8 rounding), clamped to +-448 and
   rounded to FP8-E4M3 (round to nearest even, ``Tensor.to(torch.float8_e4m3fn)``).
4. Decode: ``fp8 * scale`` in float32 (exact: 4 x 8 significant bits), then the requested dtype;
   ``dtype=torch.bfloat16`` equals compressed-tensors' decompression bit for bit.

The master precision of every base is bf16 (``checkpoint.BASE_DTYPE``), so ``encode`` takes bf16
weights only: its scales are stored in bf16 as the golden checkpoint's are.

Served on CUDA by vLLM 0.32's ``CompressedTensorsW8A16Fp8`` scheme (weights FP8, activations
16-bit; Humming or Marlin FP8 kernels, from compute capability 7.5); on CPU the dense decoded copy.
"""

from __future__ import annotations

import torch

from qerl_pipeline.quantization.codec import CompressedTensorsCodec, Served, check_matrix, register, signed_absmax

FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


def encode(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"weight", "weight_scale"}`` of one bf16 weight (rules 1-3)."""
    check_matrix(weight, "FP8")
    if weight.dtype != torch.bfloat16:
        raise ValueError(f"FP8 quantizes the bf16 master weights (its scales are bf16), got {weight.dtype}")
    with torch.no_grad():
        scale = signed_absmax(weight, dim=-1, keepdim=True) / torch.tensor(FP8_E4M3_MAX, dtype=weight.dtype)
        scale = torch.where(scale == 0, torch.tensor(torch.finfo(weight.dtype).eps, dtype=weight.dtype), scale)
        codes = torch.clamp(weight / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale": scale}


def decode(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense weight ``fp8 * scale`` in float32, then ``dtype`` (rule 4)."""
    if codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 codes are float8_e4m3fn, got {codes.dtype}")
    return (codes.to(torch.float32) * scale.to(torch.float32)).to(dtype)


# ----------------------------------------------------------------------------- the codec
CT_FORMAT = "naive-quantized"
CT_WEIGHTS = {
    "actorder": None,
    "block_structure": None,
    "dynamic": False,
    "group_size": None,
    "num_bits": 8,
    "observer": "memoryless_minmax",
    "observer_kwargs": {},
    "scale_dtype": None,
    "strategy": "channel",
    "symmetric": True,
    "type": "float",
    "zp_dtype": None,
}


class FP8Codec(CompressedTensorsCodec):
    """FP8 W8A16 (per-channel scales) as the project stores, trains on and serves it (module docstring)."""

    name = "fp8"
    label = "FP8"
    suffixes = ("weight", "weight_scale")
    buffers = {"weight": "codes", "weight_scale": "scale_bits"}
    settings = ("ignore",)
    max_rel_error = 0.05
    decode_bytes_per_weight = 8  # the codes widened to float32, and the float32 product
    ct_format, ct_weights = CT_FORMAT, CT_WEIGHTS
    cuda = Served(
        ".",
        "fp8",
        False,
        {"quantization": "compressed-tensors"},
        activations_16bit=True,
        scheme="CompressedTensorsW8A16Fp8",
    )

    def encode(self, weight, settings):
        return encode(weight)

    def decode(self, tensors, shape, dtype, params):
        return decode(tensors["weight"], tensors["weight_scale"], dtype=dtype)

    def tensor_specs(self, n_out, n_in, params):
        return {"weight": ((n_out, n_in), torch.float8_e4m3fn), "weight_scale": ((n_out, 1), torch.bfloat16)}


CODEC = register(FP8Codec())
