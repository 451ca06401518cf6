"""What a base-weight format is to the project: the ``Codec`` interface and the one registry of formats.

A format is one module (``quantization/nvfp4.py``, ``nf4.py``, ``bf16.py``, ``mxfp4.py``,
``fp8.py``) that defines a ``Codec`` subclass and registers one instance with ``register``;
``quantization/formats.py`` imports the built-in ones and is where the rest of the project
looks them up. Everything that depends on the format asks its codec, and nothing else:

* the checkpoint writer (``quantization/checkpoint.py``): which linears it quantizes
  (``skip_reason``), their codes (``encode_linears``: ``{suffix: tensor}`` per linear, written
  as ``<linear>.<suffix>``), the config.json entries (``checkpoint_config``), how a config.json
  is recognised (``reads``) and the decode parameters it records (``params``);
* the packed policy (``quantization/policy.py``): the buffers a ``PackedLinear`` holds
  (``buffers``: suffix -> buffer name) and ``decode``;
* the base store (``quantization/store.py``): ``version`` (bumped when the same inputs give
  different bytes), ``settings`` (the ``quantize.*`` fields that decide the bytes: the
  fingerprint), ``check_settings`` (settings refused), ``algorithm`` (RTN, or a calibrated
  llmcompressor recipe named by ``calibration_scheme``);
* serving (``rollout/serving.py``): ``served(platform, features)``, a ``Served`` row: the
  folder a vLLM engine loads, its tag, whether its linears are dense, the ``vllm.LLM``
  arguments; on CPU always the dense copy decoded from the same codes (``serving/``), on CUDA
  the format's vLLM scheme where there is one;
* the memory planner (``planner/sizing.py``): ``linear_bytes`` (from ``tensor_specs``, the
  tensors' shapes and dtypes) and ``decode_bytes_per_weight``.

``settings`` are the ``quantize`` section as a plain mapping (``QuantizeConfig.model_dump()``;
a missing key takes the codec's default), so a codec module imports torch and this module
only, and ``config.py`` can derive its method and format choices from the registry.

Registration refuses a codec that does not hold its own promises: on a fixed probe weight (a
bf16 ``[64, 128]`` Gaussian with rows scaled over four decades, the master precision bases are
written in) ``encode`` must give exactly ``suffixes`` with the shapes and dtypes of
``tensor_specs`` (what the planner counts), and ``decode(encode(w))`` must be finite with a
relative error ``||w - decode(encode(w))||_F / ||w||_F`` within the codec's ``max_rel_error``;
a failing codec raises ``CodecError`` at ``register``, before any config names it. A name
registered twice is refused too.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

#: Platforms a served row is decided for (``platform.current_platform``'s values).
PLATFORMS = ("cpu", "cuda")
#: The dense copy decoded from the codes, inside each base folder (what engines without the format's kernel serve).
SERVING_SUBDIR = "serving"
#: Integer dtypes float tensors are held as in a ``PackedLinear`` (a stray ``model.to(dtype)`` cannot round them).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class CodecError(ValueError):
    """A codec refused at registration (its round trip, its tensor specs, a taken name)."""


@dataclass(frozen=True)
class Served:
    """What a vLLM engine serves for a base of a format on one platform.

    ``path``: the folder given to ``vllm.LLM`` relative to the base folder (``"."``: the base
    itself; ``"serving"``: the dense decoded copy; another name: a layout written on demand from
    the base, e.g. NF4's ``bnb``); ``tag``: the ``rollout.served_format`` tag; ``dense``: plain
    dense linears (in-place dense writes possible); ``engine_args``: extra ``vllm.LLM`` keyword
    arguments; ``activations_16bit``: the kernel takes 16-bit activations only (a float32 engine is
    refused); ``scheme``: the vLLM scheme that serves it (documentation); ``note``: said at WARNING
    when the engine starts (a fallback the user should know about).
    """

    path: str
    tag: str
    dense: bool
    engine_args: Mapping[str, Any] = field(default_factory=dict)
    activations_16bit: bool = False
    scheme: str = ""
    note: str = ""


class Codec:
    """One base-weight format (see the module docstring). Subclasses set the class attributes and
    implement ``encode`` and ``decode`` (and ``tensor_specs`` when they quantize)."""

    #: the format's name: ``MethodSpec.format``, ``base_<name>``, ``quantize_<name>``
    name: str = ""
    #: how the report and messages name it
    label: str = ""
    #: version of the bytes its writer produces for given inputs (part of the base fingerprint)
    version: int = 1
    #: tensor names written per quantized linear (``<linear>.<suffix>``); () = nothing quantized (the identity)
    suffixes: tuple[str, ...] = ()
    #: inputs per scale along a row: a linear whose in_features it does not divide stays dense
    group_size: int = 1
    #: ``PackedLinear`` buffer name per suffix (float tensors are held as integer bit patterns)
    buffers: Mapping[str, str] = {}
    #: the ``quantize.*`` fields that decide this format's bytes (the fingerprint)
    settings: tuple[str, ...] = ()
    #: the stated round-trip bound on the registration probe (relative Frobenius error)
    max_rel_error: float = 0.0
    #: bytes per weight alive at once while the torch path decodes one linear (the planner's estimate)
    decode_bytes_per_weight: int = 13
    #: llmcompressor's preset for the calibrated (awq/gptq) path; None: RTN only
    calibration_scheme: str | None = None
    #: what vLLM serves on CUDA (None: the dense decoded copy, as on CPU)
    cuda: Served | None = None
    #: a vLLM capability ``cuda`` needs (``rollout.serving.vllm_features``); without it the dense copy is served
    cuda_needs: str | None = None
    #: how to get that capability (said in the warning when it is missing)
    cuda_needs_hint: str = ""

    # ------------------------------------------------------------------ what is quantized
    @property
    def quantizes(self) -> bool:
        """Whether the format quantizes linears at all (False for the identity, bf16)."""
        return bool(self.suffixes)

    def skip_reason(self, n_in: int, n_out: int) -> str | None:
        """Why a linear ``[n_out, n_in]`` stays dense in this format (None: it is quantized)."""
        return f"in_features {n_in} not a multiple of {self.group_size}" if n_in % self.group_size else None

    # ------------------------------------------------------------------ codes
    def encode(self, weight: torch.Tensor, settings: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The tensors of one linear's weight, by suffix."""
        raise NotImplementedError(f"{type(self).__name__}.encode")

    def encode_linears(
        self, weights: Mapping[str, torch.Tensor], settings: Mapping[str, Any], progress: bool = False
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Several linears (module name -> weight); a format whose linears share scales overrides this."""
        names: Iterable[str] = list(weights)
        if progress:
            from rich.progress import track

            names = track(list(names), description=f"{self.label or self.name} encode")
        return {n: self.encode(weights[n], settings) for n in names}

    def decode(
        self,
        tensors: Mapping[str, torch.Tensor],
        shape: tuple[int, int],
        dtype: torch.dtype,
        params: Mapping[str, Any],
    ) -> torch.Tensor:
        """The dense ``[out, in]`` weight (float32 arithmetic, then ``dtype``); ``params`` from ``params(config)``."""
        raise NotImplementedError(f"{type(self).__name__}.decode")

    def tensor_specs(
        self, n_out: int, n_in: int, params: Mapping[str, Any]
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each tensor of a quantized ``[n_out, n_in]`` linear, by suffix."""
        return {}

    def linear_bytes(self, n_out: int, n_in: int, params: Mapping[str, Any]) -> int:
        """Bytes of one quantized linear's tensors, as written and as a ``PackedLinear`` holds them."""
        return sum(
            math.prod(shape) * torch.empty((), dtype=dt).element_size()
            for shape, dt in self.tensor_specs(n_out, n_in, params).values()
        )

    def check_tensors(
        self, tensors: Mapping[str, torch.Tensor], n_out: int, n_in: int, params: Mapping[str, Any]
    ) -> None:
        """Refuse tensors that are not this format's for a ``[n_out, n_in]`` linear (missing, shape, dtype)."""
        for suffix, (shape, dtype) in self.tensor_specs(n_out, n_in, params).items():
            t = tensors.get(suffix)
            if t is None:
                raise ValueError(f"{self.name}: {suffix} missing for a {n_out}x{n_in} linear")
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(
                    f"{self.name}: {suffix} is {t.dtype} {tuple(t.shape)}, expected {dtype} {tuple(shape)} "
                    f"for a {n_out}x{n_in} linear"
                )

    # ------------------------------------------------------------------ checkpoint
    def checkpoint_config(self, ignore: Iterable[str], settings: Mapping[str, Any]) -> dict[str, Any]:
        """config.json entries of a base of this format (``ignore``: the linears left dense, full names).

        Default: ``qerl_quantization: {format, <params>, ignore}``, the project's own layout."""
        if not self.quantizes:
            return {}
        return {"qerl_quantization": {"format": self.name, **self.layout(settings), "ignore": sorted(ignore)}}

    def layout(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """The decode parameters a checkpoint of these settings records (``params`` reads them back)."""
        return {}

    def reads(self, config: Mapping[str, Any]) -> bool:
        """Whether a base's config.json (as a dict) is this format's."""
        if not self.quantizes:
            return "quantization_config" not in config and "qerl_quantization" not in config
        return (config.get("qerl_quantization") or {}).get("format") == self.name

    def params(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The decode parameters recorded in a base's config.json."""
        entry = config.get("qerl_quantization") or {}
        return {k: v for k, v in entry.items() if k not in ("format", "ignore")}

    # ------------------------------------------------------------------ settings
    def check_settings(self, settings: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` naming the ``quantize.*`` field this format cannot honour."""

    def algorithm(self, settings: Mapping[str, Any]) -> str:
        """How the codes are chosen: ``rtn``, or a calibrated llmcompressor algorithm (``calibration_scheme``)."""
        return "rtn"

    # ------------------------------------------------------------------ serving
    def served(self, platform: str, features: Collection[str] = ()) -> Served:
        """What an engine serves on ``platform``; ``features``: the optional vLLM capabilities installed."""
        if platform not in PLATFORMS:
            raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
        dense = Served(SERVING_SUBDIR, f"dense-decoded-{self.name}" if self.quantizes else self.name, True)
        if platform == "cpu" or self.cuda is None:
            return dense
        if self.cuda_needs is not None and self.cuda_needs not in features:
            return Served(
                dense.path,
                dense.tag,
                True,
                note=(
                    f"{self.label or self.name} base served dense on CUDA ({dense.tag}): this vLLM has no "
                    f"{self.cuda_needs} support{self.cuda_needs_hint}; its rollouts then run at BF16 speed"
                ),
            )
        return self.cuda


class CompressedTensorsCodec(Codec):
    """A weight-only format stored as compressed-tensors writes it (``compressed_tensors_config``): the format name
    ``ct_format`` and the weights' ``QuantizationArgs`` ``ct_weights``; no decode parameters of its own."""

    ct_format: str = ""
    ct_weights: Mapping[str, Any] = {}

    def checkpoint_config(self, ignore: Iterable[str], settings: Mapping[str, Any]) -> dict[str, Any]:
        return {"quantization_config": compressed_tensors_config(self.ct_format, self.ct_weights, ignore)}

    def reads(self, config: Mapping[str, Any]) -> bool:
        fmt, weights = compressed_tensors_format(config)
        return fmt == self.ct_format and all(weights.get(k) == self.ct_weights[k] for k in ("type", "num_bits"))

    def params(self, config: Mapping[str, Any]) -> dict[str, Any]:
        return {}


# ----------------------------------------------------------------------------- helpers for codec modules
def as_bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bytes as the integer dtype of its width (integers unchanged); ``view`` back to read it."""
    return t.view(_BITS[t.element_size()]) if t.is_floating_point() else t


def check_matrix(weight: torch.Tensor, fmt: str, group: int = 1) -> None:
    """Refuse what a per-row-group format cannot quantize: not 2-D, not float, ``in % group``."""
    if weight.ndim != 2:
        raise ValueError(f"{fmt} quantizes 2-D weights, got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"{fmt} quantizes floating weights, got {weight.dtype}")
    if weight.shape[1] % group:
        raise ValueError(
            f"{fmt} needs in_features divisible by {group}, got shape {tuple(weight.shape)}; "
            "add the module to quantize.ignore"
        )


def signed_absmax(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """``max(|min(x, 0)|, max(x, 0))`` along ``dim`` in ``x``'s dtype (exact): the observers' symmetric range."""
    lo = torch.clamp(x.amin(dim=dim, keepdim=keepdim), max=0)
    hi = torch.clamp(x.amax(dim=dim, keepdim=keepdim), min=0)
    return torch.maximum(lo.abs(), hi)


def compressed_tensors_config(fmt: str, weights: Mapping[str, Any], ignore: Iterable[str]) -> dict[str, Any]:
    """``quantization_config`` of a weight-only compressed-tensors checkpoint in format ``fmt``, as
    llmcompressor's ``save_pretrained(save_compressed=True)`` writes it for ``targets: Linear``
    (``weights``: the ``QuantizationArgs`` as a dict; ``ignore``: the linears left dense)."""
    try:
        from compressed_tensors import __version__ as ct_version
    except Exception:  # compressed-tensors is optional for writing
        ct_version = "0.19.0"
    return {
        "config_groups": {
            "group_0": {
                "format": fmt,
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": dict(weights),
            }
        },
        "format": fmt,
        "global_compression_ratio": None,
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": ct_version,
    }


def compressed_tensors_format(config: Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """``(format, weights args of group_0)`` of a config.json's compressed-tensors ``quantization_config``
    (``(None, {})`` when it has none)."""
    qc = config.get("quantization_config") or {}
    groups = qc.get("config_groups") or {}
    weights = next(iter(groups.values()), {}).get("weights") or {}
    return qc.get("format"), weights


# ----------------------------------------------------------------------------- the registry
#: Every registered codec by name, in registration order (``quantization/formats.py`` reads it).
REGISTRY: dict[str, Codec] = {}


def probe_weight() -> torch.Tensor:
    """The registration probe: bf16 ``[64, 128]``, N(0, 1) rows scaled from 1e-3 to 10."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=gen) * torch.logspace(-3, 1, 64).unsqueeze(-1)
    return w.to(torch.bfloat16)


def round_trip_problem(codec: Codec) -> str | None:
    """Why ``codec`` does not hold its promises on the probe (module docstring), or None."""
    w = probe_weight()
    if not codec.quantizes:
        return None
    try:
        settings: dict[str, Any] = {}
        params = codec.params(codec.checkpoint_config([], settings))
        tensors = codec.encode(w, settings)
        if set(tensors) != set(codec.suffixes):
            return f"encode gives {sorted(tensors)}, its suffixes are {sorted(codec.suffixes)}"
        if set(codec.buffers) != set(codec.suffixes):
            return f"buffers name {sorted(codec.buffers)}, its suffixes are {sorted(codec.suffixes)}"
        codec.check_tensors(tensors, w.shape[0], w.shape[1], params)
        dense = codec.decode(tensors, (w.shape[0], w.shape[1]), torch.float32, params)
    except Exception as err:  # any failure of the codec's own code is the reason to refuse it
        return f"its round trip raised {type(err).__name__}: {err}"
    if tuple(dense.shape) != tuple(w.shape) or dense.dtype != torch.float32:
        return f"decode gives {dense.dtype} {tuple(dense.shape)}, expected float32 {tuple(w.shape)}"
    if not torch.isfinite(dense).all():
        return "decode(encode(w)) is not finite"
    ref = w.to(torch.float64)
    err = float(torch.linalg.vector_norm(ref - dense.to(torch.float64)) / torch.linalg.vector_norm(ref))
    if not err <= codec.max_rel_error:
        return f"decode(encode(w)) is {err:.4g} off (relative), beyond its stated bound {codec.max_rel_error}"
    return None


def register(codec: Codec) -> Codec:
    """Add ``codec`` to the registry, after the checks of the module docstring; returns it."""
    if not codec.name or not codec.name.isidentifier():
        raise CodecError(f"codec name {codec.name!r}: a Python identifier is needed (it names datasets and nodes)")
    if codec.name in REGISTRY:
        raise CodecError(f"codec {codec.name!r} is registered already ({type(REGISTRY[codec.name]).__name__})")
    problem = round_trip_problem(codec)
    if problem is not None:
        raise CodecError(f"codec {codec.name!r} refused: {problem}")
    REGISTRY[codec.name] = codec
    return codec
