"""The bases the benchmark measures: one folder per base format, written once and reused.

Which formats: those of the compared methods (``config.METHOD_FORMAT``: qerl / qerl_noaqn
-> nvfp4, qlora -> nf4, lora -> bf16), plus bf16 for the TRL peer when
``benchmark.include_trl`` is on; each once, in the order the methods name them.

Where and when: ``<benchmark.bases_dir>/base_<format>``, through the base store
(``quantization.store.ensure_base``, the one home of fingerprints and reuse): a folder is
reused while its stamp's fingerprint matches the model and the quantize settings that
decide that format's bytes, else written into a staging folder and swapped in atomically
(``quantize.force`` rewrites it). The benchmark always writes RTN NVFP4
(``quantize.nvfp4_algorithm`` is overridden to ``rtn``): how the codes were chosen does not
change their speed, and no calibration data is needed.
"""

from __future__ import annotations

from pathlib import Path

from qerl_pipeline.config import METHOD_FORMAT, BenchmarkConfig, ModelConfig, QuantizeConfig
from qerl_pipeline.quantization.store import ensure_base


def method_formats(bcfg: BenchmarkConfig) -> list[str]:
    """Base formats of the compared methods, each once, in the order of ``benchmark.methods``."""
    return list(dict.fromkeys(METHOD_FORMAT[m] for m in bcfg.methods))


def needed_formats(bcfg: BenchmarkConfig) -> list[str]:
    """Base formats needed: the compared methods', plus bf16 for the TRL peer."""
    return list(dict.fromkeys(method_formats(bcfg) + (["bf16"] if bcfg.include_trl else [])))


def base_folder(bcfg: BenchmarkConfig, fmt: str) -> Path:
    """Where the benchmark keeps its ``fmt`` base."""
    return Path(bcfg.bases_dir) / f"base_{fmt}"


def prepare_bases(mcfg: ModelConfig, qcfg: QuantizeConfig, bcfg: BenchmarkConfig) -> dict[str, str]:
    """``{format: base folder}`` for every needed format, written (RTN) unless already there."""

    rtn = qcfg.model_copy(update={"nvfp4_algorithm": "rtn"})
    return {fmt: str(ensure_base(mcfg, rtn, fmt, base_folder(bcfg, fmt))[0]) for fmt in needed_formats(bcfg)}
