"""Writing and reading each method's base checkpoint, in any registered format, and its dense serving copy.

What is written per format is its codec's (``quantization/codec.py``: which linears it quantizes,
the tensors per linear, the config.json entries); this module writes the folder around them.
Layout of ``data/06_models/base_<format>/`` (a Hugging Face model folder), for the built-in formats:

* ``nvfp4``: a compressed-tensors ``nvfp4-pack-quantized`` checkpoint, the layout that
  llmcompressor's ``save_pretrained(save_compressed=True)`` writes and that vLLM (CUDA) and
  compressed-tensors load: every quantized Linear as ``weight_packed`` / ``weight_scale`` /
  ``weight_global_scale``, ``quantization_config`` in config.json. Every Linear that is not
  quantized (``quantize.ignore``, and any whose in_features is not a multiple of 16) is
  listed in ``ignore`` by full name.
* ``nf4``: our own names for bitsandbytes' NF4 codes (the layout the training policy reads):
  ``<linear>.weight_nf4`` (uint8, bitsandbytes packing) and ``<linear>.weight_absmax``
  (float32 per block), with ``qerl_quantization: {format: nf4, blocksize, ignore}`` in
  config.json.
* ``mxfp4``: compressed-tensors ``mxfp4-pack-quantized`` (``weight_packed``, ``weight_scale``
  holding E8M0 exponents; a linear whose in_features is not a multiple of 32 stays dense);
  ``fp8``: compressed-tensors ``naive-quantized`` (``weight`` in FP8-E4M3, ``weight_scale`` per
  row); both as llmcompressor writes them, bit for bit (tests/test_mxfp4.py, tests/test_fp8.py).
* ``bf16``: plain weights.
* ``nf4/bnb/`` (written on demand by ``quantization/bnb.py``, for serving on CUDA; see
  rollout/serving.py): the same NF4 bytes in bitsandbytes' pre-quantized 4-bit layout
  (``<linear>.weight`` packed uint8 ``[numel/2, 1]``, ``weight.absmax``, ``weight.quant_map``,
  ``weight.quant_state.bitsandbytes__nf4``; ``quantization_config`` with ``quant_method:
  bitsandbytes``), which transformers + bitsandbytes and vLLM's bitsandbytes loader read.
  Not written by ``write_base``: on CPU nothing serves it, and it would double the NF4
  base on disk for nothing.

Design choices:

* The base's master precision is bfloat16 for every format: non-quantized tensors
  (embeddings, norms, lm_head) are stored in bf16, the codecs encode the bf16-rounded weights
  (exactly what llmcompressor does with a model loaded in bf16, the golden files' recipe),
  and the ``lora`` baseline's base is the bf16 model. The methods therefore start from the
  same numbers, and the only difference between them is the format.
* ``serving/`` (``write_serving``) is a plain dense HF folder decoded from the base folder's
  own codes (float32 on CPU), for engines without a kernel for the format (vLLM on CPU). The
  base writers do not write it: where the base is served packed (NVFP4, bitsandbytes NF4 on
  CUDA) it would be a second, dense copy of the model (61 GiB in bf16 at 32B) that nothing
  reads; ``quantization.store.ensure_serving`` writes it on first use (rollout/serving.py).
  The training policy decodes the same codes the same way, so rollouts and training see
  numerically the same base.
* Safetensors are written in shards of at most ``MAX_SHARD_BYTES`` while iterating over
  the weights, so a large model never needs a second full copy in memory; the calibrated
  base is built in a stage and swapped in (``atomic.staged_dir``), and ``write_base`` writes
  into a folder its caller stages.
* ``nvfp4_algorithm: awq | gptq`` runs llmcompressor's calibrated quantization (the paper's
  text) with the codec's preset (``Codec.calibration_scheme``: NVFP4A16) and takes its
  compressed checkpoint as the base; we then add the statistics exactly as for RTN. RTN
  (default) is our own codec, bit-exact with llmcompressor.
* A quantized linear is a module with every one of its codec's ``suffixes`` in the checkpoint
  (FP8's ``weight`` alone is no marker: a norm has one too).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qerl_pipeline.atomic import staged_dir
from qerl_pipeline.config import METHOD_FORMAT
from qerl_pipeline.quantization import formats, nvfp4
from qerl_pipeline.quantization.codec import SERVING_SUBDIR, Codec

log = logging.getLogger(__name__)

BASE_DTYPE = torch.bfloat16
MAX_SHARD_BYTES = 2 * 1024**3
BNB_SUBDIR = "bnb"


# ----------------------------------------------------------------------------- selection
def is_ignored(name: str, ignore: Iterable[str]) -> bool:
    """compressed-tensors' matching: full name, trailing component(s), or ``re:<regex>``."""
    for pat in ignore:
        if pat.startswith("re:"):
            if re.match(pat[3:], name):
                return True
        elif name == pat or name.endswith("." + pat):
            return True
    return False


def quantizable_linears(model: torch.nn.Module, fmt: str, ignore: Iterable[str]) -> tuple[list[str], list[str]]:
    """``(quantized, skipped)`` full names of the model's nn.Linear modules for ``fmt``."""
    codec = formats.get(fmt)
    ignore = list(ignore)
    quantized, skipped = [], []
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    emb_ptr = emb.weight.data_ptr() if emb is not None else None
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        if not codec.quantizes or is_ignored(name, ignore):
            skipped.append(name)
        elif mod.weight.data_ptr() == emb_ptr:
            log.warning("%s: tied to the input embeddings, left unquantized", name)
            skipped.append(name)
        elif (why := codec.skip_reason(mod.in_features, mod.out_features)) is not None:
            log.warning("%s: %s, left in bf16", name, why)
            skipped.append(name)
        else:
            quantized.append(name)
    return quantized, skipped


# ----------------------------------------------------------------------------- io helpers
def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_safetensors(
    tensors: Iterable[tuple[str, torch.Tensor]], out_dir: Path, max_shard_bytes: int = MAX_SHARD_BYTES
) -> int:
    """Write ``(name, tensor)`` pairs as HF safetensors shards (+ index when > 1); returns bytes."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    files: list[str] = []
    total = 0

    def flush(final: bool) -> None:
        if not shards[-1]:
            return
        idx = len(files)
        name = f"model-{idx:05d}.safetensors.part"
        save_file({k: v.contiguous() for k, v in shards[-1].items()}, str(out_dir / name), metadata={"format": "pt"})
        files.append(name)
        if not final:
            shards.append({})
            sizes.append(0)

    weight_map: dict[str, int] = {}
    for key, tensor in tensors:
        b = _nbytes(tensor)
        if sizes[-1] and sizes[-1] + b > max_shard_bytes:
            flush(final=False)
        shards[-1][key] = tensor.detach().cpu()
        sizes[-1] += b
        total += b
        weight_map[key] = len(files)
    flush(final=True)
    n = len(files)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for part, final in zip(files, names, strict=True):
        os.replace(out_dir / part, out_dir / final)
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for k, i in weight_map.items()}}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def safetensor_files(folder: Path) -> list[Path]:
    """The safetensors files of an HF folder (sharded or not)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no safetensors files")
    return files


def tensor_names(folder: Path) -> list[str]:
    """The tensor names of an HF folder (headers only)."""
    names: list[str] = []
    for f in safetensor_files(folder):
        with safe_open(str(f), framework="pt") as handle:
            names.extend(handle.keys())
    return names


def quantized_owners(names: Iterable[str], codec: Codec) -> set[str]:
    """The modules that hold every one of ``codec``'s suffixes among tensor ``names`` (its quantized linears)."""
    leaves: dict[str, set[str]] = {}
    for name in names:
        owner, _, leaf = name.rpartition(".")
        leaves.setdefault(owner, set()).add(leaf)
    need = set(codec.suffixes)
    return {owner for owner, have in leaves.items() if need and need <= have}


def iter_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of an HF folder, one at a time."""
    for f in safetensor_files(folder):
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                yield key, handle.get_tensor(key)


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return dict(iter_tensors(folder))


def folder_bytes(folder: Path, exclude: tuple[str, ...] = (SERVING_SUBDIR, BNB_SUBDIR)) -> int:
    """Size of the files in ``folder`` (recursively), leaving out top-level ``exclude`` entries."""
    folder = Path(folder)
    total = 0
    for p in folder.rglob("*"):
        rel = p.relative_to(folder)
        if rel.parts and rel.parts[0] in exclude:
            continue
        if p.is_file():
            total += p.stat().st_size
    return total


def base_config(folder: Path) -> dict:
    """A base folder's config.json as a dict."""
    return json.loads((Path(folder) / "config.json").read_text())


def base_format(folder: Path) -> str:
    """The format of a base folder: the registered codec that reads its config.json."""
    return formats.format_of(base_config(folder), folder)


def serving_dir(base_dir: Path) -> Path:
    """The dense folder decoded from the base's codes (what vLLM on CPU serves)."""
    return Path(base_dir) / SERVING_SUBDIR


def base_dir_for(root: Path, method_or_format: str) -> Path:
    """``<root>/base_<format>`` for a method (qerl, qlora, ...) or a format name."""
    fmt = METHOD_FORMAT.get(method_or_format, method_or_format)
    if fmt not in formats.names():
        raise ValueError(
            f"unknown method or format {method_or_format!r}; registered methods: {', '.join(METHOD_FORMAT)}; "
            f"formats: {', '.join(formats.names())}"
        )
    return Path(root) / f"base_{fmt}"


# ----------------------------------------------------------------------------- configs
def _save_config(model, out_dir: Path, dtype: torch.dtype, extra: dict | None = None) -> None:
    cfg = copy.deepcopy(model.config)
    for attr in ("quantization_config", "qerl_quantization"):
        if hasattr(cfg, attr):
            delattr(cfg, attr)
    cfg.dtype = str(dtype).removeprefix("torch.")
    for key, value in (extra or {}).items():
        setattr(cfg, key, value)
    cfg.save_pretrained(out_dir)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(out_dir)


def _tied_names(model) -> set[str]:
    """State-dict names that alias an earlier tensor (tied lm_head): not written."""
    seen: dict[int, str] = {}
    tied = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        ptr = tensor.data_ptr()
        if ptr in seen and tensor.numel():
            tied.add(name)
        else:
            seen[ptr] = name
    return tied


# ----------------------------------------------------------------------------- writing
def write_base(
    model,
    tokenizer,
    fmt: str,
    out_dir: Path,
    *,
    ignore: Iterable[str] = ("lm_head",),
    settings: Mapping[str, Any] | None = None,
    progress: bool = False,
) -> dict:
    """Quantize ``model`` to ``fmt`` (RTN) and write ``out_dir`` (no ``serving/``: ``write_serving``); statistics.

    ``settings``: the ``quantize`` section as a mapping (``QuantizeConfig.model_dump()``; missing keys
    take the codec's defaults, e.g. ``{"nf4_blocksize": 32}``). ``out_dir`` must not exist yet
    (callers write to a fresh temporary folder and move it). The statistics: per-layer relative
    reconstruction error vs the given model's weights, bytes of the quantized linears vs their bf16
    bytes, file sizes.
    """
    codec = formats.get(fmt)
    settings = dict(settings or {})
    codec.check_settings(settings)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True)
    quantized, skipped = quantizable_linears(model, fmt, ignore)
    mods = dict(model.named_modules())
    weights = {n: mods[n].weight.detach().to(BASE_DTYPE) for n in quantized}
    codes = codec.encode_linears(weights, settings, progress=progress) if quantized else {}
    del weights
    extra = codec.checkpoint_config(skipped, settings)
    params = codec.params(extra)
    tied = _tied_names(model)

    def base_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in model.state_dict().items():
            if name in tied:
                continue
            owner = name.rpartition(".")[0]
            if owner in codes and name.endswith(".weight"):
                yield from ((f"{owner}.{suffix}", t) for suffix, t in codes[owner].items())
            else:
                yield name, tensor.detach().to(BASE_DTYPE) if tensor.is_floating_point() else tensor

    write_safetensors(base_tensors(), out_dir)
    _save_config(model, out_dir, BASE_DTYPE, extra)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)

    layers = []
    for name, tensor in model.state_dict().items():
        owner = name.rpartition(".")[0]
        if name in tied or not name.endswith(".weight") or not isinstance(mods.get(owner), torch.nn.Linear):
            continue
        if owner in codes:
            dense = codec.decode(codes[owner], tuple(tensor.shape), torch.float32, params)
        else:
            dense = tensor.detach().to(BASE_DTYPE).to(torch.float32)
        layers.append(_layer_stats(owner, tensor, dense, codes.get(owner)))
    return summarize(fmt, layers, out_dir)


def _layer_stats(
    name: str, original: torch.Tensor, dense: torch.Tensor, code: Mapping[str, torch.Tensor] | None
) -> dict:
    numel = original.numel()
    quantized = code is not None
    return {
        "name": name,
        "quantized": quantized,
        "numel": numel,
        "bytes": sum(_nbytes(t) for t in code.values()) if quantized else numel * 2,
        "bf16_bytes": numel * 2,
        "rel_error": nvfp4.relative_error(original.detach(), dense),
    }


def summarize(fmt: str, layers: list[dict], out_dir: Path) -> dict:
    """Totals over the quantized linears (or all linears for a format that quantizes none, bf16) and file sizes."""
    counted = [r for r in layers if r["quantized"]] if formats.get(fmt).quantizes else layers
    q_bytes = sum(r["bytes"] for r in counted)
    bf16_bytes = sum(r["bf16_bytes"] for r in counted)
    errors = [r["rel_error"] for r in counted] or [0.0]
    numel = sum(r["numel"] for r in counted)
    return {
        "format": fmt,
        "layers": layers,
        "n_quantized_linears": sum(r["quantized"] for r in layers),
        "quantized_linear_bytes": q_bytes,
        "quantized_linear_bf16_bytes": bf16_bytes,
        "linear_bytes_ratio": q_bytes / bf16_bytes if bf16_bytes else 1.0,
        "bits_per_weight": 8.0 * q_bytes / numel if numel else 16.0,
        "rel_error_mean": sum(errors) / len(errors),
        "rel_error_max": max(errors),
        "checkpoint_bytes": folder_bytes(out_dir),
    }


# ----------------------------------------------------------------------------- calibrated
def calibrated_base(
    model,
    tokenizer,
    fmt: str,
    out_dir: Path,
    *,
    algorithm: str,
    texts: list[str],
    ignore: list[str],
    max_seq_len: int = 512,
) -> dict:
    """A ``fmt`` base through llmcompressor's AWQ or GPTQ (its codec's ``calibration_scheme`` preset) with ``texts``
    as calibration data.

    llmcompressor modifies ``model`` in place (AWQ smooths and rescales weights), so the
    caller passes a model it no longer needs. Per-layer errors are measured against a copy
    of the weights taken before calibration.
    """
    codec = formats.get(fmt)
    if codec.calibration_scheme is None:
        raise ValueError(f"quantize: {fmt} has no calibrated (awq/gptq) path; it is quantized round-to-nearest only")
    if algorithm not in ("awq", "gptq"):
        raise ValueError(f"quantize.nvfp4_algorithm: calibrated path needs awq or gptq, got {algorithm!r}")
    if not texts:
        raise ValueError(f"quantize: calibrated {codec.label} needs calibration texts (calibration_path is empty)")
    from datasets import Dataset
    from llmcompressor import oneshot

    if algorithm == "gptq":
        from llmcompressor.modifiers.gptq import GPTQModifier

        recipe = [GPTQModifier(targets="Linear", scheme=codec.calibration_scheme, ignore=list(ignore))]
    else:
        from llmcompressor.modifiers.awq import AWQModifier

        recipe = [AWQModifier(targets="Linear", scheme=codec.calibration_scheme, ignore=list(ignore))]
    original = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    enc = tokenizer(texts, truncation=True, max_length=max_seq_len)
    ds = Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    model = model.to(BASE_DTYPE)
    # llmcompressor re-reads the model's config from ``config.name_or_path`` (to refuse
    # already-quantized checkpoints); a GGUF- or randomly-built model has no such folder,
    # so point it at a copy of the in-memory config for the duration of the call.
    cfg_dir = Path(tempfile.mkdtemp(prefix=".calib-config."))
    old_name = model.config.name_or_path
    try:
        model.config.save_pretrained(cfg_dir)
        model.config.name_or_path = str(cfg_dir)
        oneshot(
            model=model,
            processor=tokenizer,
            dataset=ds,
            recipe=recipe,
            num_calibration_samples=len(texts),
            max_seq_length=max_seq_len,
        )
    finally:
        model.config.name_or_path = old_name
        shutil.rmtree(cfg_dir, ignore_errors=True)
    with staged_dir(out_dir) as stage:
        model.save_pretrained(stage, save_compressed=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(stage)
        # Statistics from the codes llmcompressor wrote.
        params = codec.params(base_config(stage))
        layers = [
            _layer_stats(
                owner, original[owner], codec.decode(code, tuple(original[owner].shape), torch.float32, params), code
            )
            for owner, code in iter_codes(stage)
            if isinstance(code, dict)
        ]
        return summarize(fmt, layers, stage)


# ----------------------------------------------------------------------------- reading codes, the serving copy
def empty_model(base_dir: Path, dtype: torch.dtype):
    """The model class of the base folder ``base_dir`` built from its config.json on the meta device (no memory,
    no weights; its quantization entries left out): the shapes of every module."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_dir)
    for attr in ("quantization_config", "qerl_quantization"):
        if hasattr(config, attr):
            delattr(config, attr)
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def linear_shapes(base_dir: Path) -> dict[str, tuple[int, ...]]:
    """``[out, in]`` of every linear of the base folder's model (``empty_model``): what a code decodes to."""
    return {
        n: tuple(m.weight.shape)
        for n, m in empty_model(base_dir, BASE_DTYPE).named_modules()
        if isinstance(m, torch.nn.Linear)
    }


def iter_codes(base_dir: Path) -> Iterator[tuple[str, torch.Tensor | dict[str, torch.Tensor]]]:
    """The base folder's tensors one at a time, each quantized linear as one code.

    Yields ``(tensor name, tensor)`` for every stored tensor that is not part of a code, and
    ``(linear name, {suffix: tensor})`` (its codec's ``suffixes``) once all of a linear's code
    tensors were read."""
    base_dir = Path(base_dir)
    codec = formats.get(base_format(base_dir))
    owners = quantized_owners(tensor_names(base_dir), codec)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in iter_tensors(base_dir):
        owner, _, leaf = name.rpartition(".")
        if owner not in owners or leaf not in codec.suffixes:
            yield name, tensor
            continue
        parts = pending.setdefault(owner, {})
        parts[leaf] = tensor
        if len(parts) == len(codec.suffixes):
            del pending[owner]
            yield owner, parts
    if pending:
        raise ValueError(f"{base_dir}: incomplete {codec.name} tensors for {sorted(pending)[:5]}")


def write_serving(base_dir: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> None:
    """Write the dense HF folder of the base ``base_dir`` to ``out_dir`` (must not exist) in ``dtype``.

    Every quantized linear is its codes decoded in float32 by its codec (what the training
    policy computes with), every other tensor the stored bf16 value; both then cast to
    ``dtype``. config.json is the base's without its quantization entries; the tokenizer and
    generation files are copied (not our own ``qerl_*`` records).
    """
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    out_dir.mkdir(parents=True)
    codec = formats.get(base_format(base_dir))
    params = codec.params(base_config(base_dir))
    shapes = linear_shapes(base_dir) if codec.quantizes else {}

    def dense() -> Iterator[tuple[str, torch.Tensor]]:
        for name, value in iter_codes(base_dir):
            if isinstance(value, dict):
                yield f"{name}.weight", codec.decode(value, shapes[name], torch.float32, params).to(dtype)
            else:
                yield name, value.to(torch.float32).to(dtype) if value.is_floating_point() else value

    write_safetensors(dense(), out_dir)
    cfg = base_config(base_dir)
    for key in ("quantization_config", "qerl_quantization"):
        cfg.pop(key, None)
    for key in ("dtype", "torch_dtype"):  # transformers 5 writes the first, older writers the second
        if key in cfg or key == "dtype":
            cfg[key] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for p in base_dir.iterdir():
        if (
            p.is_file()
            and not p.name.startswith("qerl_")
            and not p.name.endswith(".safetensors")
            and p.name not in ("config.json", "model.safetensors.index.json")
        ):
            shutil.copy2(p, out_dir / p.name)
