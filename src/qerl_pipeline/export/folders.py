"""One training's export folder: what is in it, how each part is made, and how it is found.

Layout of ``<export>/`` (``write_export``; ``export.json`` says the same with a load command per folder)::

    adapter/        PEFT LoRA folder: adapter_config.json + adapter_model.safetensors. With trained norms
                    (lora.train_norms) their weights are in adapter_model.safetensors under PEFT's names
                    (base_model.model.<HF name>) and their modules are listed in modules_to_save, the way PEFT
                    carries trainable non-LoRA modules: PeftModel.from_pretrained puts them over base/'s.
    base/           the dense base PEFT wraps: every weight decoded from the base folder's codes the training
                    read (NVFP4 / NF4 through the project's decoders, float32 math, then export.dtype), norms
                    as quantized (clean). The compressed folder itself cannot be wrapped (PEFT needs a dense
                    `weight` on each Linear), so it is decoded once here rather than by every user.
    merged/         dense HF folder: W + scale * B @ A (adapter.lora_delta, float32, the same formula the
                    engine's merge uses) on those decoded weights, trained norms in place, then export.dtype.
    merged_nvfp4/   merged/ quantized again (quantized.requantize): compressed-tensors nvfp4-pack-quantized,
                    the tensors and config llmcompressor's NVFP4A16 preset writes for merged/ loaded in bf16.
    merged_<fmt>/   a training on another quantized base also gets merged/ in its own format (qlora:
                    merged_nf4/ in bitsandbytes' pre-quantized NF4 layout; mxfp4, fp8 as llmcompressor).
    vllm_lora/      only with trained norms: base/ with the trained norms written in (base/) and the LoRA
                    without them (adapter/); vLLM's LoRA loader refuses norm weights in an adapter, so this
                    pair is what `vllm serve --enable-lora` serves without losing the norms.
    export.json     method, seed, training run, dtype, each folder with what it is and how to load it, the
                    4-bit weight error against merged/, sizes.

Everything is built in a stage (``atomic.staged_dir``) that takes the folder's place only when
complete: an interrupted export leaves no half folder, and an earlier export stays intact until
then. The catalog then moves the finished folder into ``data/06_models/exports`` the same way.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from qerl_pipeline.adapter import NORMS_FILE, PEFT_PREFIX, adapter_meta, lora_delta, lora_factors
from qerl_pipeline.atomic import staged_dir, write_atomic
from qerl_pipeline.evaluation.report_runs import DEPLOYED_4BIT
from qerl_pipeline.export import ExportInputError
from qerl_pipeline.export.quantized import requantize
from qerl_pipeline.quantization import checkpoint, formats

log = logging.getLogger(__name__)

ADAPTER, BASE, MERGED, VLLM_LORA = "adapter", "base", "merged", "vllm_lora"
#: The format every training is exported to (QeRL's deployment format): ``DEPLOYED_4BIT``.
DEPLOY_FORMAT = "nvfp4"
MANIFEST = "export.json"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: Files of a base folder besides config and weights that a model folder carries (tokenizer, generation).
_SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


def formats_for(base_format: str) -> list[str]:
    """The formats a training on ``base_format`` is exported to: NVFP4 always, and the base's own when it
    quantizes (the format the training's rollouts were served in)."""
    own = formats.get(base_format)
    return [DEPLOY_FORMAT] + ([base_format] if own.quantizes and base_format != DEPLOY_FORMAT else [])


def merged_name(fmt: str) -> str:
    """The folder of the merged policy quantized to ``fmt``: ``merged_<fmt>``."""
    return f"merged_{fmt}"


def base_folder(base: Path, method: str) -> Path:
    """The base folder of ``method``: ``base`` itself when it is one, else ``<base>/base_<format>``; an
    ``ExportInputError`` naming the quantize command when it is missing."""
    base = Path(base)
    folder = base if (base / "config.json").is_file() else checkpoint.base_dir_for(base, method)
    if not (folder / "config.json").is_file():
        raise ExportInputError(
            f"the base of method {method!r} is missing at {folder}; run `kedro run --pipelines=quantize "
            f"--params method={method}` (same --env and quantize settings as the training)"
        )
    return folder


def _dense_model(config, tensors: dict[str, torch.Tensor], dtype: torch.dtype):
    """A Hugging Face model of ``config`` holding ``tensors`` (HF names) in ``dtype``, tied weights tied."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    result = model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False, assign=True)
    if result.unexpected_keys:
        raise ValueError(f"tensors with no place in the model: {result.unexpected_keys[:5]}")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise ValueError(f"weights missing for {left[:5]}")
    return model.eval()


def _side_files(base_dir: Path, out: Path) -> None:
    """The base folder's tokenizer and generation files, copied as they are."""
    for name in _SIDE_FILES:
        if (base_dir / name).is_file():
            shutil.copy2(base_dir / name, out / name)


def _save_dense(config, tensors: dict[str, torch.Tensor], dtype: torch.dtype, out: Path, base_dir: Path):
    model = _dense_model(config, tensors, dtype)
    model.save_pretrained(out, safe_serialization=True)
    _side_files(base_dir, out)
    return model


def write_peft_adapter(adapter_dir: Path, out: Path, *, norms: dict[str, torch.Tensor] | None, base_name: str) -> Path:
    """A standard PEFT folder from a trained adapter: LoRA tensors as trained, plus ``norms`` (HF names) as
    ``modules_to_save`` (their weights under ``base_model.model.<name>``, what ``save_pretrained`` writes for
    such modules). ``base_name`` becomes ``base_model_name_or_path``."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    tensors = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    cfg["base_model_name_or_path"] = base_name
    cfg["inference_mode"] = True
    if norms:
        owners = sorted(n.removesuffix(".weight") for n in norms)
        cfg["modules_to_save"] = sorted(set(cfg.get("modules_to_save") or []) | set(owners))
        tensors.update({PEFT_PREFIX + name: t.contiguous() for name, t in norms.items()})
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


def decoded_base(base_dir: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(config, {HF name: float32 tensor})`` of a base folder: every weight decoded from its codes by the
    training policy's own loader and decoder (``quantization.policy``), the config without quantization
    (``load_base`` builds the model from the config stripped of it)."""
    from qerl_pipeline.quantization.policy import dense_state_dict, load_base

    fmt = checkpoint.base_format(base_dir)
    packed = load_base(Path(base_dir), fmt, dtype=torch.float32)
    return copy.deepcopy(packed.config), {
        k: v.detach().clone() for k, v in dense_state_dict(packed, torch.float32).items()
    }


def merged_weights(
    decoded: dict[str, torch.Tensor], adapter_dir: Path, norms: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``decoded`` with every LoRA merged (``W + scale * B @ A`` in float32) and the trained ``norms`` in place."""
    factors = lora_factors(adapter_dir)
    foreign = sorted(set(factors) - set(decoded)) + sorted(set(norms) - set(decoded))
    if foreign:
        raise ValueError(f"{adapter_dir}: adapter tensors for weights the base does not have: {foreign[:5]}")
    out = {}
    for name, weight in decoded.items():
        if name in factors:
            out[name] = weight.float() + lora_delta(*factors[name])
        elif name in norms:
            out[name] = norms[name].float()
        else:
            out[name] = weight
    return out


def _ignored(base_dir: Path, default: list[str]) -> list[str]:
    """The linears the base left unquantized (its config), else ``default`` (``quantize.ignore``; a bf16 base)."""
    cfg = json.loads((Path(base_dir) / "config.json").read_text())
    stored = (cfg.get("quantization_config") or {}).get("ignore", (cfg.get("qerl_quantization") or {}).get("ignore"))
    return list(stored) if stored is not None else list(default)


def _settings(base_dir: Path, quantize: dict[str, Any]) -> dict[str, Any]:
    """The quantize settings to write a format with: ``quantize``'s, with the base's recorded NF4 blocksize
    (a base records its own; ``quantize`` may have changed since)."""
    cfg = json.loads((Path(base_dir) / "config.json").read_text())
    recorded = (cfg.get("qerl_quantization") or {}).get("blocksize")
    return {**quantize, **({"nf4_blocksize": int(recorded)} if recorded is not None else {})}


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def load_commands(trained_norms: bool) -> dict[str, str]:
    """How each folder loads with the outside library alone (paths relative to the export folder)."""
    out = {
        ADAPTER: "PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained('base'), 'adapter')"
        + ("  # trained norms: modules_to_save" if trained_norms else ""),
        BASE: "AutoModelForCausalLM.from_pretrained('base')  # the dense base the adapter wraps",
        MERGED: "AutoModelForCausalLM.from_pretrained('merged') | vllm.LLM(model='merged') | vllm serve merged",
        DEPLOYED_4BIT: "vllm serve merged_nvfp4  # CUDA: compressed-tensors NVFP4 (W4A16); "
        "AutoModelForCausalLM.from_pretrained('merged_nvfp4') decompresses it",
        merged_name("nf4"): "AutoModelForCausalLM.from_pretrained('merged_nf4')  # bitsandbytes NF4 (CUDA)",
        merged_name("mxfp4"): "vllm serve merged_mxfp4  # CUDA: compressed-tensors MXFP4",
        merged_name("fp8"): "vllm serve merged_fp8  # CUDA: compressed-tensors FP8 weights (W8A16)",
    }
    if trained_norms:
        out[VLLM_LORA] = "vllm serve vllm_lora/base --enable-lora --lora-modules policy=vllm_lora/adapter"
    else:
        out[VLLM_LORA] = (
            "vllm serve base --enable-lora --lora-modules policy=adapter  # no trained norms: adapter/ as is"
        )
    return out


def write_export(
    adapter_dir: Path,
    base_dir: Path,
    out_dir: Path,
    *,
    dtype: str = "bfloat16",
    ignore: list[str] | tuple[str, ...] = ("lm_head",),
    quantize: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the export of the trained adapter ``adapter_dir`` over ``base_dir`` to ``out_dir`` (module docstring).

    ``dtype``: ``export.dtype``; ``ignore`` / ``quantize`` (the section's values): used where the base does
    not record its own (a bf16 base has none). Returns the manifest (``export.json``).
    """
    from safetensors.torch import load_file

    adapter_dir, base_dir, out_dir = Path(adapter_dir), Path(base_dir), Path(out_dir)
    if dtype not in DTYPES:
        raise ValueError(f"export.dtype {dtype!r} unknown; allowed: {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    meta = adapter_meta(adapter_dir)
    fmt = checkpoint.base_format(base_dir)
    norms_file = adapter_dir / NORMS_FILE
    norms = load_file(str(norms_file)) if norms_file.is_file() else {}
    log.info("export %s (seed %s): decoding the %s base %s", meta.get("method", "?"), meta.get("seed"), fmt, base_dir)
    config, decoded = decoded_base(base_dir)
    merged = merged_weights(decoded, adapter_dir, norms)
    folders: dict[str, Any] = {}
    with staged_dir(out_dir, what="export") as stage:
        _save_dense(config, decoded, torch_dtype, stage / BASE, base_dir)
        write_peft_adapter(adapter_dir, stage / ADAPTER, norms=norms, base_name=str(meta.get("model") or base_dir))
        merged_model = _save_dense(config, merged, torch_dtype, stage / MERGED, base_dir)
        errors = {}
        for q in formats_for(fmt):
            name = merged_name(q)
            errors[name] = requantize(
                merged_model,
                q,
                stage / name,
                ignore=_ignored(base_dir, list(ignore)),
                settings=_settings(base_dir, dict(quantize or {})),
            )
            _side_files(base_dir, stage / name)
        del merged_model
        if norms:
            _save_dense(
                config,
                {**decoded, **{k: v.float() for k, v in norms.items()}},
                torch_dtype,
                stage / VLLM_LORA / BASE,
                base_dir,
            )
            write_peft_adapter(
                adapter_dir, stage / VLLM_LORA / ADAPTER, norms=None, base_name=str(meta.get("model") or base_dir)
            )
        commands = load_commands(bool(norms))
        for child in sorted(p.name for p in stage.iterdir() if p.is_dir()):
            folders[child] = {"load": commands.get(child, ""), "bytes": _folder_bytes(stage / child)}
        manifest = {
            "method": meta.get("method"),
            "seed": meta.get("seed"),
            "model": meta.get("model"),
            "training_run_id": meta.get("mlflow_run_id"),
            "steps": meta.get("steps"),
            "base_format": fmt,
            "base_dir": str(base_dir),
            "adapter_dir": str(adapter_dir),
            "dtype": dtype,
            "trained_norms": sorted(n.removesuffix(".weight") for n in norms),
            "peft_base": "base/: dense, decoded from the training's base codes (float32 math, then dtype)",
            "folders": folders,
            "weight_error": {name: {k: v for k, v in e.items() if k != "layers"} for name, e in errors.items()},
            "layers": {name: e["layers"] for name, e in errors.items()},
        }
        write_atomic(stage / MANIFEST, manifest, as_json=True)
    return manifest


def read_manifest(export_dir: Path) -> dict[str, Any]:
    """``export.json`` of an export folder ({} when there is none)."""
    path = Path(export_dir) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {}
