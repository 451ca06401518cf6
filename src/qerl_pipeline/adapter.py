"""Trained adapters: the one home for what an adapter folder is and for PEFT <-> HF names.

An adapter folder (``final_adapter/``, each ``adapters/step-*``, the ``trained_adapters``
dataset's ``<method>/``) is PEFT's ``save_pretrained`` output (``adapter_config.json``,
``adapter_model.safetensors``) plus, when ``lora.train_norms`` is on, ``norms.safetensors``
(the trained RMSNorm weights under HF names), plus for a final adapter ``qerl_adapter.json``
(method, model, seed, steps, the training's MLflow run id, base and run folders), which is
how the evaluate pipeline and compare's report find the training run that made it.
``trained_adapter`` finds the one a reader (evaluate, export) asks for in the ``trained_adapters``
dataset, or says in one line what is missing and the command that trains it (``MissingTraining``).

PEFT names a parameter ``base_model.model.<HF name>``; ``hf_name`` strips that (and PEFT's
wrappers), so the engine, AQN and the trainer speak the HF names vLLM loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from qerl_pipeline.atomic import staged_dir, write_atomic

#: Trainable norm weights (``lora.train_norms``) next to the PEFT files, under HF names.
NORMS_FILE = "norms.safetensors"
#: What a final adapter is (method, model, seed, steps, its MLflow run, base and run folders).
ADAPTER_META = "qerl_adapter.json"
PEFT_PREFIX = "base_model.model."


def hf_name(peft_name: str, *, unwrap: bool = False) -> str:
    """A PEFT parameter name as the HF model names it (``base_model.model.`` stripped).

    ``unwrap``: also drop PEFT's wrapper parts (``.original_module``,
    ``.modules_to_save.default``, ``.base_layer``) of trainable or adapted modules.
    """
    name = peft_name[len(PEFT_PREFIX) :] if peft_name.startswith(PEFT_PREFIX) else peft_name
    if unwrap:
        name = name.replace(".original_module", "").replace(".modules_to_save.default", "").replace(".base_layer", "")
    return name


def lora_factors(folder: str | Path) -> dict[str, tuple[Any, Any, float]]:
    """``{HF weight name: (A, B, scale)}`` of a PEFT LoRA folder: ``W + scale * B @ A`` is the adapted weight.

    ``scale`` is ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA). The one reader of LoRA factors: the
    engine's merge (rollout/worker_ext.py), ``rollout.engine.lora_deltas`` and the benchmark use it.
    Per-module ranks or alphas (``rank_pattern`` / ``alpha_pattern``) are refused.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise NotImplementedError(f"{folder}: rank_pattern/alpha_pattern adapters cannot be merged")
    r = cfg["r"]
    scale = cfg["lora_alpha"] / (r**0.5 if cfg.get("use_rslora") else r)
    weights = load_file(str(folder / "adapter_model.safetensors"))
    out = {}
    for key, a in weights.items():
        if ".lora_A." not in key:
            continue
        b = weights[key.replace(".lora_A.", ".lora_B.")]
        out[hf_name(key.replace(".lora_A", ""))] = (a, b, float(scale))
    if not out:
        raise ValueError(f"{folder}: no lora_A/lora_B tensors found")
    return out


def lora_delta(a: Any, b: Any, scale: float) -> Any:
    """``scale * B @ A`` in float32: what a LoRA adds to its base weight (``W.float() + delta``, then W's dtype).

    The one formula of a merge: the engine's (rollout/worker_ext.py) and the client-side reference
    (``rollout.engine.merged_weights``, the tests' oracle) both call it, so they agree bit for bit."""
    return (b.float() @ a.float()) * scale


def trained_norms(policy) -> dict[str, Any]:
    """Trainable non-LoRA tensors (the norms with ``lora.train_norms``) under HF names, CPU copies."""
    return {
        hf_name(name): p.detach().cpu().contiguous()
        for name, p in policy.named_parameters()
        if p.requires_grad and "lora_" not in name
    }


def save_adapter(policy, folder: str | Path, meta: dict[str, Any] | None = None) -> Path:
    """PEFT ``save_pretrained`` (+ ``norms.safetensors`` when norms train, + ``meta``) into ``folder``, atomically."""
    from safetensors.torch import save_file

    folder = Path(folder)
    with staged_dir(folder) as stage:
        policy.save_pretrained(str(stage))
        norms = trained_norms(policy)
        if norms:
            save_file(norms, str(stage / NORMS_FILE))
        if meta is not None:
            write_atomic(stage / ADAPTER_META, meta, as_json=True)
    return folder


def adapter_meta(folder: str | Path) -> dict[str, Any]:
    """``qerl_adapter.json`` of an adapter folder ({} for one written before it existed)."""
    path = Path(folder) / ADAPTER_META
    return json.loads(path.read_text()) if path.is_file() else {}


def is_adapter(folder: str | Path) -> bool:
    """Whether ``folder`` holds a complete PEFT adapter."""
    return (Path(folder) / "adapter_config.json").is_file()


class MissingTraining(click.ClickException, FileNotFoundError):
    """No trained adapter where a reader looks: one line naming it and the command that trains it;
    ``kedro run`` prints it as ``Error: ...`` (exit code 1, no traceback)."""


def trained_adapter(root: str | Path, method: str, seed: int | None = None, *, want_seed: int | None = None) -> Path:
    """The adapter of ``method`` in the ``trained_adapters`` folder ``root``, or ``MissingTraining``.

    ``seed`` None: a standalone training, ``<root>/<method>``, whose recorded seed must be
    ``want_seed`` when given (``train.seed``); else a compare branch's ``<root>/seed-<seed>``.
    """
    root = Path(root)
    if seed is not None:
        path = root / f"seed-{seed}"
        if not is_adapter(path):
            raise MissingTraining(
                f"no trained adapter for method {method!r} seed {seed} at {path}; run "
                f"`kedro run --pipelines=compare --namespaces=compare.{method}` first (same --env, "
                f"compare.seeds listing {seed})"
            )
        return path
    path = root / method
    if not is_adapter(path):
        raise MissingTraining(
            f"no trained adapter for method {method!r} at {path}; run "
            f"`kedro run --pipelines=train --params method={method}` first (same --env)"
        )
    got = adapter_meta(path).get("seed")
    if want_seed is not None and got is not None and int(got) != int(want_seed):
        raise MissingTraining(
            f"the trained adapter of method {method!r} at {path} is seed {got}, not train.seed "
            f"{want_seed}: run `kedro run --pipelines=train --params method={method},"
            f"train.seed={want_seed}` first (same --env), or set train.seed={got}"
        )
    return path
