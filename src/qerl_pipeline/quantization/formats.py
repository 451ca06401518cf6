"""The registered base-weight formats: where the project looks a codec up.

Importing this module registers the built-in codecs (``nvfp4``, ``nf4``, ``bf16``, ``mxfp4``,
``fp8``); a codec registered later with ``codec.register`` (a format of one's own, one module)
is found the same way. ``config.py`` derives its method and format choices from here,
so a registered format is accepted by validation without touching any other file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qerl_pipeline.quantization import bf16, fp8, mxfp4, nf4, nvfp4  # noqa: F401 - the built-in formats register themselves
from qerl_pipeline.quantization.codec import REGISTRY, Codec


def names() -> tuple[str, ...]:
    """Every registered format, in registration order."""
    return tuple(REGISTRY)


def get(fmt: str) -> Codec:
    """The codec of ``fmt``; ``ValueError`` naming the registered formats when there is none."""
    codec = REGISTRY.get(fmt)
    if codec is None:
        raise ValueError(f"unknown base format {fmt!r}; registered formats: {', '.join(REGISTRY)}")
    return codec


def format_of(config: Mapping[str, Any], where: object = "config.json") -> str:
    """The format whose codec reads this base config.json (``where`` names it in the error)."""
    found = [name for name, codec in REGISTRY.items() if codec.reads(config)]
    if len(found) == 1:
        return found[0]
    qc = config.get("quantization_config") or config.get("qerl_quantization") or {}
    what = qc.get("format") or qc.get("quant_method") or "?"
    if not found:
        raise ValueError(
            f"{where}: unsupported quantization format {what!r}; registered formats: {', '.join(REGISTRY)}"
        )
    raise ValueError(f"{where}: quantization format {what!r} is read by several codecs: {', '.join(found)}")
