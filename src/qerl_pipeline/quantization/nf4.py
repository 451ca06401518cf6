"""NF4 codec (the QLoRA baseline's base format) in plain torch, code-compatible with bitsandbytes.

NF4 (Dettmers et al., QLoRA) maps each weight, divided by the absolute maximum of its
block, to the nearest of 16 "normal float" levels (quantiles of N(0, 1) rescaled to
[-1, 1], with an exact zero). The rules below are those of bitsandbytes' ``quantize_4bit``
reference path (the one its CPU backend runs), so our codes are byte-identical to
``bitsandbytes.functional.quantize_4bit(w, blocksize, quant_type="nf4")``; tests/test_nf4.py
checks this when bitsandbytes is importable:

* the tensor is flattened row-major and cut into blocks of ``blocksize`` (64 by default);
  a trailing partial block gets its own absmax;
* ``absmax`` per block in float32; the block is multiplied by ``1 / max(absmax, 1e-38)``
  (a trailing partial block is divided instead, as bitsandbytes does) and clamped to [-1, 1];
* the code is the index of the nearest level, a value exactly on a midpoint between two
  levels taking the lower one (``torch.bucketize`` over the float32 midpoints);
* two codes per byte, the FIRST element in the HIGH nibble (bitsandbytes' order; NVFP4 is
  the other way round);
* dequantization is ``NF4[code] * absmax`` in float32.

Double quantization of the absmax values (QLoRA's second level) is not implemented: with
blocksize 64 it saves 0.37 bits a weight, which only matters for the memory comparison, and
its output would have to match bitsandbytes' 8-bit dynamic code to be comparable.
``quantize.nf4_double_quant: true`` is therefore rejected with a clear error.

``CODEC`` is the format as the rest of the project sees it (``quantization/codec.py``): our own
checkpoint layout (``<linear>.weight_nf4``, ``<linear>.weight_absmax``, ``qerl_quantization:
{format: nf4, blocksize, ignore}`` in config.json), and on CUDA the same bytes re-laid out for
bitsandbytes (``bnb/``, ``quantization/bnb.py``) where vLLM has bitsandbytes support
(``vllm-bnb-plugin``), else the dense decoded copy with a warning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qerl_pipeline.quantization.codec import Codec, Served, register

#: The 16 NF4 levels, as float32 (the QLoRA paper's table, as bitsandbytes stores it).
NF4_LEVELS = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=torch.float32,
)
_MIDPOINTS = (NF4_LEVELS[:-1] + NF4_LEVELS[1:]) / 2
DEFAULT_BLOCKSIZE = 64


@dataclass
class NF4Weight:
    """One NF4 tensor: packed codes (flat uint8), float32 absmax per block, original shape."""

    packed: torch.Tensor  # uint8 [ceil(numel / 2)]
    absmax: torch.Tensor  # float32 [ceil(numel / blocksize)]
    shape: tuple[int, ...]
    blocksize: int = DEFAULT_BLOCKSIZE

    def decode(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return decode(self.packed, self.absmax, self.shape, self.blocksize, dtype=dtype)

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.absmax.numel() * self.absmax.element_size()

    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Tensor names of our NF4 checkpoint format: ``weight_nf4``, ``weight_absmax``."""
        return {f"{prefix}weight_nf4": self.packed, f"{prefix}weight_absmax": self.absmax}


def _check_blocksize(blocksize: int) -> None:
    if blocksize <= 0 or blocksize % 2:
        raise ValueError(f"quantize.nf4_blocksize must be a positive even number, got {blocksize}")


def encode(weight: torch.Tensor, blocksize: int = DEFAULT_BLOCKSIZE) -> NF4Weight:
    """Quantize ``weight`` (any shape, any float dtype) to NF4."""
    _check_blocksize(blocksize)
    if not weight.is_floating_point():
        raise ValueError(f"NF4 quantizes floating weights, got {weight.dtype}")
    with torch.no_grad():
        flat = weight.reshape(-1).to(torch.float32)
        n = flat.numel()
        full = n - n % blocksize
        body = flat[:full].reshape(-1, blocksize)
        absmax = body.abs().amax(dim=-1)
        scaled = torch.clamp(body * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(-1), -1, 1).reshape(-1)
        if full < n:
            tail_max = flat[full:].abs().max().clamp(min=1e-38)
            absmax = torch.cat([absmax, tail_max.reshape(1)])
            scaled = torch.cat([scaled, torch.clamp(flat[full:] / tail_max, -1, 1)])
        if scaled.numel() % 2:
            scaled = torch.nn.functional.pad(scaled, (0, 1))
        codes = torch.bucketize(scaled, _MIDPOINTS.to(scaled.device)).to(torch.uint8)
        packed = (codes[0::2] << 4) | codes[1::2]
    return NF4Weight(packed=packed, absmax=absmax, shape=tuple(weight.shape), blocksize=blocksize)


def unpack(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Codes (uint8 in [0, 15]) of the first ``numel`` elements."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed NF4 codes must be uint8, got {packed.dtype}")
    flat = packed.reshape(-1)
    return torch.stack((flat >> 4, flat & 0x0F), dim=-1).reshape(-1)[:numel]


_BYTE_TABLES: dict[torch.device, torch.Tensor] = {}


def _byte_table(device: torch.device) -> torch.Tensor:
    """``[256, 2]`` float32: the NF4 levels of a packed byte's high and low nibble (``unpack``'s order)."""
    table = _BYTE_TABLES.get(torch.device(device))
    if table is None:
        table = (
            torch.stack([NF4_LEVELS.repeat_interleave(16), NF4_LEVELS.repeat(16)], dim=-1).to(torch.float32).to(device)
        )
        _BYTE_TABLES[torch.device(device)] = table
    return table


def decode(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    shape: tuple[int, ...],
    blocksize: int = DEFAULT_BLOCKSIZE,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dense tensor ``NF4[code] * absmax`` (float32 arithmetic), cast to ``dtype``."""
    n = 1
    for s in shape:
        n *= int(s)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed NF4 codes must be uint8, got {packed.dtype}")
    # both nibbles of a byte per lookup (high nibble first, as ``unpack``): each byte is read once
    vals = torch.nn.functional.embedding(packed.reshape(-1).long(), _byte_table(packed.device)).reshape(-1)[:n]
    full = n - n % blocksize
    absmax = absmax.to(torch.float32)
    out = torch.empty(n, dtype=torch.float32, device=packed.device)
    out[:full] = (vals[:full].reshape(-1, blocksize) * absmax[: full // blocksize].unsqueeze(-1)).reshape(-1)
    if full < n:
        out[full:] = vals[full:] * absmax[-1]
    return out.reshape(shape).to(dtype)


def bits_per_weight(blocksize: int = DEFAULT_BLOCKSIZE) -> float:
    """4 bits + one float32 absmax per block."""
    return 4.0 + 32.0 / blocksize


# ----------------------------------------------------------------------------- the codec
class NF4Codec(Codec):
    """NF4 as the project stores, trains on and serves it (module docstring)."""

    name = "nf4"
    label = "NF4"
    suffixes = ("weight_nf4", "weight_absmax")
    buffers = {"weight_nf4": "packed", "weight_absmax": "absmax_bits"}
    settings = ("ignore", "nf4_blocksize", "nf4_double_quant")
    max_rel_error = 0.15
    cuda = Served(
        "bnb",
        "nf4-bnb",
        False,
        {"quantization": "bitsandbytes", "load_format": "bitsandbytes"},
        scheme="bitsandbytes 4-bit NF4 (vllm-bnb-plugin)",
    )
    cuda_needs = "bitsandbytes"
    cuda_needs_hint = " (vLLM >= 0.32 has none in-tree: `pip install vllm-bnb-plugin`)"

    def encode(self, weight, settings):
        return encode(weight, int(settings.get("nf4_blocksize", DEFAULT_BLOCKSIZE))).state_dict()

    def decode(self, tensors, shape, dtype, params):
        return decode(
            tensors["weight_nf4"],
            tensors["weight_absmax"],
            shape,
            int(params.get("blocksize", DEFAULT_BLOCKSIZE)),
            dtype=dtype,
        )

    def tensor_specs(self, n_out, n_in, params):
        n, bs = n_out * n_in, int(params.get("blocksize", DEFAULT_BLOCKSIZE))
        return {
            "weight_nf4": ((math.ceil(n / 2),), torch.uint8),
            "weight_absmax": ((math.ceil(n / bs),), torch.float32),
        }

    def layout(self, settings):
        return {"blocksize": int(settings.get("nf4_blocksize", DEFAULT_BLOCKSIZE))}

    def check_settings(self, settings):
        if settings.get("nf4_double_quant"):
            raise ValueError(
                "quantize.nf4_double_quant: double quantization is not implemented (see quantization/nf4.py)"
            )


CODEC = register(NF4Codec())
