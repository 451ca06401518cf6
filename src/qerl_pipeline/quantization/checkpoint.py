"""Writing and reading each method's base checkpoint (NVFP4, NF4, BF16), and its dense serving copy.

Layout of ``data/06_models/base_<format>/`` (a Hugging Face model folder):

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
* ``bf16``: plain weights.
* ``nf4/bnb/`` (written on demand by ``quantization/bnb.py``, for serving on CUDA; see
  rollout/serving.py): the same NF4 bytes in bitsandbytes' pre-quantized 4-bit layout
  (``<linear>.weight`` packed uint8 ``[numel/2, 1]``, ``weight.absmax``, ``weight.quant_map``,
  ``weight.quant_state.bitsandbytes__nf4``; ``quantization_config`` with ``quant_method:
  bitsandbytes``), which transformers + bitsandbytes and vLLM's bitsandbytes loader read.
  Not written by ``write_base``: on CPU nothing serves it, and it would double the NF4
  base on disk for nothing.

Design choices:

* The base's master precision is bfloat16 for all three formats: non-quantized tensors
  (embeddings, norms, lm_head) are stored in bf16, NVFP4/NF4 encode the bf16-rounded weights
  (exactly what llmcompressor does with a model loaded in bf16, the golden files' recipe),
  and the ``lora`` baseline's base is the bf16 model. The three methods therefore start
  from the same numbers, and the only difference between them is the 4-bit format.
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
  text) and takes its compressed checkpoint as the base; we then add the statistics exactly
  as for RTN. RTN (default) is our own codec, bit-exact with llmcompressor.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qerl_pipeline.atomic import staged_dir
from qerl_pipeline.config import METHOD_FORMAT
from qerl_pipeline.quantization import nf4, nvfp4

log = logging.getLogger(__name__)

FORMATS = ("nvfp4", "nf4", "bf16")
BASE_DTYPE = torch.bfloat16
MAX_SHARD_BYTES = 2 * 1024**3
SERVING_SUBDIR = "serving"
BNB_SUBDIR = "bnb"
NVFP4_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")
NF4_SUFFIXES = ("weight_nf4", "weight_absmax")


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
    ignore = list(ignore)
    quantized, skipped = [], []
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    emb_ptr = emb.weight.data_ptr() if emb is not None else None
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        if fmt == "bf16" or is_ignored(name, ignore):
            skipped.append(name)
        elif mod.weight.data_ptr() == emb_ptr:
            log.warning("%s: tied to the input embeddings, left unquantized", name)
            skipped.append(name)
        elif fmt == "nvfp4" and mod.in_features % nvfp4.GROUP_SIZE:
            log.warning("%s: in_features %d not a multiple of 16, left in bf16", name, mod.in_features)
            skipped.append(name)
        else:
            quantized.append(name)
    return quantized, skipped


# ----------------------------------------------------------------------------- io helpers
def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_safetensors(tensors: Iterable[tuple[str, torch.Tensor]], out_dir: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> int:
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
    for part, final in zip(files, names):
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


def base_format(folder: Path) -> str:
    """The format of a base folder, read from its config.json."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    if "quantization_config" in cfg:
        fmt = cfg["quantization_config"].get("format")
        if fmt != "nvfp4-pack-quantized":
            raise ValueError(f"{folder}: unsupported quantization format {fmt!r}")
        return "nvfp4"
    if "qerl_quantization" in cfg:
        return cfg["qerl_quantization"]["format"]
    return "bf16"


def serving_dir(base_dir: Path) -> Path:
    """The dense folder decoded from the base's codes (what vLLM on CPU serves; written on first use)."""
    return Path(base_dir) / SERVING_SUBDIR


def base_dir_for(root: Path, method_or_format: str) -> Path:
    """``<root>/base_<format>`` for a method (qerl, qlora, ...) or a format name."""
    fmt = METHOD_FORMAT.get(method_or_format, method_or_format)
    if fmt not in FORMATS:
        raise ValueError(f"unknown method or format {method_or_format!r}")
    return Path(root) / f"base_{fmt}"


# ----------------------------------------------------------------------------- configs
def nvfp4_quantization_config(ignore: list[str]) -> dict:
    """compressed-tensors' config for NVFP4A16 (weights only, group 16, FP8 scales)."""
    try:
        from compressed_tensors import __version__ as ct_version
    except Exception:  # compressed-tensors is optional for writing
        ct_version = "0.19.0"
    weights = {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": nvfp4.GROUP_SIZE,
        "num_bits": 4,
        "observer": "memoryless_minmax",
        "observer_kwargs": {},
        "scale_dtype": "torch.float8_e4m3fn",
        "strategy": "tensor_group",
        "symmetric": True,
        "type": "float",
        "zp_dtype": None,
    }
    return {
        "config_groups": {
            "group_0": {
                "format": "nvfp4-pack-quantized",
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": weights,
            }
        },
        "format": "nvfp4-pack-quantized",
        "global_compression_ratio": None,
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": ct_version,
    }


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
def _encode_all(model, fmt: str, quantized: list[str], blocksize: int, progress: bool) -> dict[str, object]:
    mods = dict(model.named_modules())
    weights = {n: mods[n].weight.detach().to(BASE_DTYPE) for n in quantized}
    if fmt == "nvfp4":
        return dict(nvfp4.encode_linears(weights, progress=progress))
    return {n: nf4.encode(w, blocksize) for n, w in weights.items()}


def write_base(
    model,
    tokenizer,
    fmt: str,
    out_dir: Path,
    *,
    ignore: Iterable[str] = ("lm_head",),
    nf4_blocksize: int = nf4.DEFAULT_BLOCKSIZE,
    progress: bool = False,
) -> dict:
    """Quantize ``model`` to ``fmt`` (RTN) and write ``out_dir`` (no ``serving/``: ``write_serving``); statistics.

    ``out_dir`` must not exist yet (callers write to a fresh temporary folder and move it).
    The statistics: per-layer relative reconstruction error vs the given model's weights,
    bytes of the quantized linears vs their bf16 bytes, file sizes.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown base format {fmt!r}; expected one of {FORMATS}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True)
    quantized, skipped = quantizable_linears(model, fmt, ignore)
    codes = _encode_all(model, fmt, quantized, nf4_blocksize, progress) if fmt != "bf16" else {}
    tied = _tied_names(model)
    mods = dict(model.named_modules())

    def base_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in model.state_dict().items():
            if name in tied:
                continue
            owner = name.rpartition(".")[0]
            if owner in codes and name.endswith(".weight"):
                yield from codes[owner].state_dict(owner + ".").items()
            else:
                yield name, tensor.detach().to(BASE_DTYPE) if tensor.is_floating_point() else tensor

    write_safetensors(base_tensors(), out_dir)
    if fmt == "nvfp4":
        extra = {"quantization_config": nvfp4_quantization_config(skipped)}
    elif fmt == "nf4":
        extra = {"qerl_quantization": {"format": "nf4", "blocksize": nf4_blocksize, "ignore": sorted(skipped)}}
    else:
        extra = {}
    _save_config(model, out_dir, BASE_DTYPE, extra)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)

    layers = []
    for name, tensor in model.state_dict().items():
        owner = name.rpartition(".")[0]
        if name in tied or not name.endswith(".weight") or not isinstance(mods.get(owner), torch.nn.Linear):
            continue
        dense = codes[owner].decode(torch.float32) if owner in codes else tensor.detach().to(BASE_DTYPE).to(torch.float32)
        layers.append(_layer_stats(owner, tensor, dense, codes.get(owner)))
    return summarize(fmt, layers, out_dir)


def _layer_stats(name: str, original: torch.Tensor, dense: torch.Tensor, code) -> dict:
    numel = original.numel()
    quantized = code is not None
    return {
        "name": name,
        "quantized": quantized,
        "numel": numel,
        "bytes": code.nbytes() if quantized else numel * 2,
        "bf16_bytes": numel * 2,
        "rel_error": nvfp4.relative_error(original.detach(), dense),
    }


def summarize(fmt: str, layers: list[dict], out_dir: Path) -> dict:
    """Totals over the quantized linears (or all linears for bf16) and file sizes."""
    counted = [r for r in layers if r["quantized"]] if fmt != "bf16" else layers
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
def calibrated_nvfp4_base(model, tokenizer, out_dir: Path, *, algorithm: str, texts: list[str], ignore: list[str],
                          max_seq_len: int = 512) -> dict:
    """NVFP4 through llmcompressor's AWQ or GPTQ with ``texts`` as calibration data.

    llmcompressor modifies ``model`` in place (AWQ smooths and rescales weights), so the
    caller passes a model it no longer needs. Per-layer errors are measured against a copy
    of the weights taken before calibration.
    """
    if algorithm not in ("awq", "gptq"):
        raise ValueError(f"quantize.nvfp4_algorithm: calibrated path needs awq or gptq, got {algorithm!r}")
    if not texts:
        raise ValueError("quantize: calibrated NVFP4 needs calibration texts (calibration_path is empty)")
    from datasets import Dataset
    from llmcompressor import oneshot

    if algorithm == "gptq":
        from llmcompressor.modifiers.gptq import GPTQModifier

        recipe = [GPTQModifier(targets="Linear", scheme="NVFP4A16", ignore=list(ignore))]
    else:
        from llmcompressor.modifiers.awq import AWQModifier

        recipe = [AWQModifier(targets="Linear", scheme="NVFP4A16", ignore=list(ignore))]
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
        oneshot(model=model, processor=tokenizer, dataset=ds, recipe=recipe, num_calibration_samples=len(texts),
                max_seq_length=max_seq_len)
    finally:
        model.config.name_or_path = old_name
        shutil.rmtree(cfg_dir, ignore_errors=True)
    with staged_dir(out_dir) as stage:
        model.save_pretrained(stage, save_compressed=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(stage)
        # Statistics from the codes llmcompressor wrote.
        layers = [_layer_stats(owner, original[owner], code.decode(torch.float32), code)
                  for owner, code in iter_codes(stage) if isinstance(code, nvfp4.NVFP4Weight)]
        return summarize("nvfp4", layers, stage)


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


def iter_codes(base_dir: Path) -> Iterator[tuple[str, torch.Tensor | nvfp4.NVFP4Weight | nf4.NF4Weight]]:
    """The base folder's tensors one at a time, each quantized linear as one code object.

    Yields ``(tensor name, tensor)`` for every stored tensor that is not part of a code, and
    ``(linear name, NVFP4Weight | NF4Weight)`` once all of a linear's code tensors were read (the
    shape of an NF4 linear, which its flat codes do not hold, from ``empty_model``)."""
    base_dir = Path(base_dir)
    fmt = base_format(base_dir)
    suffixes = {"nvfp4": NVFP4_SUFFIXES, "nf4": NF4_SUFFIXES}.get(fmt, ())
    shapes: dict[str, tuple[int, ...]] = {}
    blocksize = nf4.DEFAULT_BLOCKSIZE
    if fmt == "nf4":
        blocksize = int(json.loads((base_dir / "config.json").read_text())["qerl_quantization"].get("blocksize", blocksize))
        shapes = {n: tuple(m.weight.shape) for n, m in empty_model(base_dir, BASE_DTYPE).named_modules()
                  if isinstance(m, torch.nn.Linear)}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in iter_tensors(base_dir):
        owner, _, leaf = name.rpartition(".")
        if leaf not in suffixes:
            yield name, tensor
            continue
        parts = pending.setdefault(owner, {})
        parts[leaf] = tensor
        if len(parts) < len(suffixes):
            continue
        del pending[owner]
        if fmt == "nvfp4":
            yield owner, nvfp4.NVFP4Weight(*(parts[s] for s in NVFP4_SUFFIXES))
        elif owner not in shapes:
            raise KeyError(f"{base_dir}: NF4 codes for {owner}, which the model of its config.json has no linear for")
        else:
            yield owner, nf4.NF4Weight(parts["weight_nf4"], parts["weight_absmax"], shapes[owner], blocksize)
    if pending:
        raise ValueError(f"{base_dir}: incomplete {fmt} tensors for {sorted(pending)[:5]}")


def write_serving(base_dir: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> None:
    """Write the dense HF folder of the base ``base_dir`` to ``out_dir`` (must not exist) in ``dtype``.

    Every quantized linear is its codes decoded in float32 (``iter_codes``; what the training
    policy computes with), every other tensor the stored bf16 value; both then cast to
    ``dtype``. config.json is the base's without its quantization entries; the tokenizer and
    generation files are copied (not our own ``qerl_*`` records).
    """
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    out_dir.mkdir(parents=True)

    def dense() -> Iterator[tuple[str, torch.Tensor]]:
        for name, value in iter_codes(base_dir):
            if isinstance(value, torch.Tensor):
                yield name, value.to(torch.float32).to(dtype) if value.is_floating_point() else value
            else:
                yield f"{name}.weight", value.decode(torch.float32).to(dtype)

    write_safetensors(dense(), out_dir)
    cfg = json.loads((base_dir / "config.json").read_text())
    for key in ("quantization_config", "qerl_quantization"):
        cfg.pop(key, None)
    for key in ("dtype", "torch_dtype"):  # transformers 5 writes the first, older writers the second
        if key in cfg or key == "dtype":
            cfg[key] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for p in base_dir.iterdir():
        if p.is_file() and not p.name.startswith("qerl_") and not p.name.endswith(".safetensors") \
                and p.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(p, out_dir / p.name)
