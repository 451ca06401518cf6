"""vLLM worker extension: in-place weight updates by Hugging Face parameter name.

vLLM mixes this class into its worker (``LLM(worker_extension_cls=...)``) and the engine
process calls its methods with ``LLM.collective_rpc("qerl_...", args=...)``: the supported
way to touch served weights without patching vLLM or restarting the engine. The trainer
uses it for three things: AQN (RMSNorm weights set to ``clean + Z``), trainable norm
weights, and the ``merge`` sync (dense linear weights set to ``W + B A * alpha/r``).

Design choices:

* **Names are Hugging Face names** (``model.layers.0.self_attn.q_proj.weight``). vLLM
  fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``; the model class's own
  ``packed_modules_mapping`` says which HF modules a fused module holds, and the fused
  layer's ``output_sizes`` says how many rows each one takes. An HF name therefore maps
  to (module, row slice). We slice explicitly instead of calling the model's
  ``load_weights`` because we also need the reverse direction (``read_weights``) and a
  bit-exact check that what was sent is what is served. LoRA wrappers (``base_layer``)
  are unwrapped, so names are the same with and without ``enable_lora``.
* **Every write sets, nothing accumulates.** AQN noise is drawn by the trainer from the
  clean weights and sent whole; sending the clean weights back restores the engine
  bit-exactly (the paper's code added noise on top of noise and never reached vLLM's
  norm layers at all).
* **Kernel repacking.** vLLM-CPU packs dense linear weights into a oneDNN/SGL kernel
  object at load time and drops the dense tensor (``weight`` becomes empty). To update
  such a layer we rebuild the dense fused weight, reinstall it and rerun the layer's
  ``quant_method.process_weights_after_loading`` (which repacks). The dense copy is kept
  as a shadow so later partial updates (e.g. only ``q_proj``) and reads work; the shadow
  is seeded lazily from the served checkpoint's safetensors. That doubles the memory of
  linear layers that were ever merged into, on CPU only (CUDA keeps the dense weight
  live and is updated in place, preserving CUDA-graph pointers).
* **The merge sync** (``qerl_merge_adapter``): the worker reads the adapter's A and B itself
  (``adapter.lora_factors``; a few MB) and sets every adapted linear to
  ``W_checkpoint + scale * B @ A`` (fp32 sum, cast to the served dtype), the clean W read
  again from the served folder's safetensors each time. So a merge never accumulates (the
  previous step's delta is not subtracted, it is simply not there) and needs no dense shadow:
  on CPU each fused layer's dense weight exists only while its kernel is repacked, so the
  engine holds one copy of the linears, as before any merge. What the client sends per step
  is the adapter folder's path, not hundreds of MB of merged weights. Layers merged before
  and absent from the new adapter go back to the checkpoint; ``qerl_merge_adapter(None)``
  restores every merged layer. A later ``qerl_update_weights``/``qerl_read_weights`` of a
  merged linear sees the merged value (the shadow, if one is seeded, starts from it).
* Quantized served layers (NVFP4/compressed-tensors on CUDA) cannot take dense weights:
  a write or a merge fails with an error naming the layer and its quantization and pointing
  at ``sync: adapter``. Their parameters are indexed under the HF names of the modules they
  hold (``...q_proj.weight`` for the fused ``qkv_proj``), so a merge into them reaches that
  refusal; vLLM renames the checkpoint's ``weight_packed`` to ``weight`` and its kernel
  (Marlin on CUDA) repacks it at load, so the served bytes are not the checkpoint's and a
  read of them is refused too.
* Model runners: vLLM 0.32 on CUDA builds Model Runner V2 (``vllm/v1/worker/gpu/model_runner.py``)
  unless ``VLLM_USE_V2_MODEL_RUNNER=0`` or a feature V2 lacks (``VllmConfig.use_v2_model_runner``);
  vLLM-CPU without a Triton CPU backend builds the V1 ``CPUModelRunner``
  (``vllm/v1/worker/cpu_model_runner.py``, a subclass of V1's ``GPUModelRunner``). This class
  asks the runner for one thing, ``get_model()``: V1 unwraps its CUDA-graph wrapper there, V2
  returns its ``model`` as built (its CUDA graphs are captured beside the model, never around
  it); with LoRA both hold the model that ``LoRAModelRunnerMixin.load_lora_model`` wrapped
  (``base_layer``), and both runners' ``reload_weights`` end in the mixin's
  ``reset_lora_state``, which is why a level-2 wake drops the adapters (rollout/server.py).
  Norm writes copy into the live parameter's storage on CUDA, so graphs captured by either
  runner read the new values.
* Tensor parallelism: vLLM replicates RMSNorm weights on every tensor-parallel worker and
  shards the linears and the embedding. ``collective_rpc`` runs each method on every worker,
  so a norm write (AQN noise, trained norms) is the same whole write on each, and norm reads
  return worker 0's copy, equal to the others. Dense writes, merges and reads of sharded
  layers are refused (no worker holds the whole weight, and slicing the HF tensor per rank
  is not built): with ``tensor_parallel_size > 1`` the LoRA reaches the engine as a
  LoRARequest (``rollout.sync: adapter``, ``evaluate.adapter_mode: lora``).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qerl_pipeline.adapter import lora_delta, lora_factors


@dataclass
class _Target:
    """Where one HF parameter lives in the served model."""

    module: torch.nn.Module
    param: str  # attribute name on module ("weight", "bias")
    rows: slice | None  # row slice inside a fused parameter, None = whole
    shape: tuple[int, ...]  # logical shape of the HF tensor
    full_shape: tuple[int, ...]  # shape of the whole (fused, padded) vLLM parameter
    kind: str  # norm | linear | embedding | other
    fused_names: tuple[str, ...]  # HF names sharing the same vLLM parameter (for shadow seeding)
    users: tuple[torch.nn.Module, ...] = ()  # modules holding this tensor (tied weights), fixed at index time
    sharded: int = 1  # tensor-parallel workers this parameter is split over (1: whole here; norms are replicated)


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while "base_layer" in module._modules:
        module = module._modules["base_layer"]
    return module


def _refuse_unservable(name: str, target: _Target, action: str) -> None:
    """Raise when the served layer of ``target`` cannot take ``action`` (write, merge, read): it is quantized, or
    sharded over tensor-parallel workers (module docstring); return otherwise."""
    if target.kind == "quantized":
        quant = type(getattr(target.module, "quant_method", None)).__name__
        why = (
            "its served bytes are the kernel's repacked layout, not the checkpoint's"
            if action == "read"
            else "dense weights cannot be written there (use rollout.sync: adapter on a quantized base)"
        )
        raise NotImplementedError(f"{name}: served layer is quantized ({quant}); {action} refused: {why}")
    if target.sharded > 1:
        raise NotImplementedError(
            f"{name}: served layer is sharded over {target.sharded} tensor-parallel workers; {action} refused: no "
            "worker holds the whole weight (norm weights are replicated and can be written; with "
            "tensor_parallel_size > 1 use rollout.sync: adapter and evaluate.adapter_mode: lora)"
        )


class QerlWorkerExtension:
    """Methods mixed into the vLLM worker; all prefixed ``qerl_`` to avoid clashes."""

    # ------------------------------------------------------------------ index
    def _qerl_model(self) -> torch.nn.Module:
        """The served ``nn.Module``: ``get_model()`` of either model runner (module docstring, "Model runners")."""
        return self.model_runner.get_model()

    def qerl_model_runner(self) -> str:
        """The worker's model runner class as ``module.Class`` (which of vLLM's runners serves: V1 or V2)."""
        cls = type(self.model_runner)
        return f"{cls.__module__}.{cls.__qualname__}"

    def _qerl_index(self) -> dict[str, _Target]:
        index = getattr(self, "_qerl_index_cache", None)
        if index is not None:
            return index
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        tp = int(self.vllm_config.parallel_config.tensor_parallel_size)
        model = self._qerl_model()
        packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        index: dict[str, _Target] = {}
        seen: set[int] = set()
        seen_params: set[int] = set()
        sharers: dict[int, list[torch.nn.Module]] = {}  # param id -> modules using it (tied lm_head)
        for mod_name, module in model.named_modules():
            if "base_layer" in module._modules:
                continue  # the wrapper; its base_layer is visited under its own name
            own = dict(module.named_parameters(recurse=False))
            if not own or id(module) in seen:
                continue
            seen.add(id(module))
            clean = mod_name.replace(".base_layer", "")
            prefix, _, leaf = clean.rpartition(".")
            if isinstance(module, RMSNorm):
                kind = "norm"
            elif isinstance(module, LinearBase):
                quant = type(getattr(module, "quant_method", None)).__name__
                kind = "linear" if quant == "UnquantizedLinearMethod" else "quantized"
            elif isinstance(module, VocabParallelEmbedding):
                kind = "embedding"
            else:
                kind = "other"
            for pname, param in own.items():
                sharers.setdefault(id(param), []).append(module)
                if id(param) in seen_params:
                    continue  # tied weight (lm_head = embed_tokens): one name, the first one
                seen_params.add(id(param))
                full = tuple(param.shape)
                if kind == "linear" and pname == "weight":
                    # logical shape: on CPU the packed kernel leaves an empty `weight`
                    full = (sum(module.output_partition_sizes), module.input_size_per_partition)
                parts = packed.get(leaf)
                sizes = getattr(module, "output_sizes", None)
                if parts and kind == "quantized":
                    # one entry per HF module held (``q_proj.weight`` ...):
                    # writes, merges and reads name the quantization
                    names = tuple(f"{prefix}.{p}.{pname}" if prefix else f"{p}.{pname}" for p in parts)
                    for hf_name in names:
                        index[hf_name] = _Target(module, pname, None, full, full, kind, names)
                elif parts and kind == "linear" and sizes and len(sizes) == len(parts):
                    names = tuple(f"{prefix}.{p}.{pname}" if prefix else f"{p}.{pname}" for p in parts)
                    offset = 0
                    for hf_name, size in zip(names, sizes, strict=True):
                        rows = slice(offset, offset + size)
                        index[hf_name] = _Target(module, pname, rows, (size, *full[1:]), full, kind, names)
                        offset += size
                elif kind == "embedding" and pname == "weight" and module.org_vocab_size != full[0]:
                    # vLLM pads the vocabulary (to a multiple of 64); HF tensors hold the real rows
                    name = f"{clean}.{pname}"
                    rows = slice(0, module.org_vocab_size)
                    index[name] = _Target(module, pname, rows, (module.org_vocab_size, *full[1:]), full, kind, (name,))
                else:
                    name = f"{clean}.{pname}"
                    index[name] = _Target(module, pname, None, full, full, kind, (name,))
        for target in index.values():
            if tp > 1 and target.kind != "norm":
                target.sharded = tp  # vLLM replicates norms only (module docstring)
            # by module object, not by id(param): params replaced by an update are freed
            # and their ids reused, so an id-keyed map would go stale
            target.users = tuple(sharers.get(id(getattr(target.module, target.param)), [target.module]))
        self._qerl_index_cache = index
        self._qerl_shadow: dict[int, torch.Tensor] = {}
        return index

    def qerl_param_names(self) -> dict[str, str]:
        """HF parameter name -> kind (norm, linear, embedding, quantized, other) of the served model.

        Parameters of quantized layers are listed under the HF names of the modules they hold
        (``...q_proj.weight``); they can be neither written nor read (module docstring).
        """
        return {name: t.kind for name, t in self._qerl_index().items()}

    # ------------------------------------------------------------ dense access
    def _qerl_checkpoint_tensor(self, name: str) -> torch.Tensor:
        files = getattr(self, "_qerl_ckpt_files", None)
        if files is None:
            folder = self.vllm_config.model_config.model
            files = {}
            for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
                with safe_open(path, framework="pt") as f:
                    for key in f.keys():
                        files[key] = path
            self._qerl_ckpt_files = files
        if name not in files:
            raise KeyError(
                f"{name}: the served layer keeps no dense weight and the checkpoint has no tensor of that name; "
                "send all parts of the fused layer together"
            )
        with safe_open(files[name], framework="pt") as f:
            return f.get_tensor(name)

    def _qerl_clean_dense(self, target: _Target, dtype: torch.dtype, device) -> torch.Tensor:
        """The served checkpoint's value of ``target``'s whole (fused) parameter, plus the merged LoRA deltas."""

        merged = getattr(self, "_qerl_merged", {})
        parts = []
        for name in target.fused_names:
            value = self._qerl_checkpoint_tensor(name)
            if name in merged:
                value = value.float() + lora_delta(*merged[name])
            parts.append(value.to(dtype=dtype, device=device))
        return torch.cat(parts, 0).contiguous() if len(parts) > 1 else parts[0].contiguous()

    def _qerl_dense(self, target: _Target) -> torch.Tensor:
        """The full dense value of ``target``'s vLLM parameter (live tensor, shadow or checkpoint)."""
        module = target.module
        live = getattr(module, target.param)
        if tuple(live.shape) == target.full_shape:
            return live.data
        key = id(module)
        if key not in self._qerl_shadow:
            quant = type(getattr(module, "quant_method", None)).__name__
            if quant not in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"):
                raise NotImplementedError(
                    f"{target.fused_names[0]}: served layer is quantized ({quant}); dense weights cannot be "
                    "written or read there (use rollout.sync: adapter on a quantized base)"
                )
            self._qerl_shadow[key] = self._qerl_clean_dense(target, live.dtype, live.device)
        return self._qerl_shadow[key]

    # ---------------------------------------------------------------- updates
    def qerl_update_weights(self, path: str) -> list[str]:
        """Set served weights from the safetensors file ``path`` (HF names); returns the names set."""
        import torch.nn as nn
        from vllm.platforms import current_platform

        index = self._qerl_index()
        tensors = load_file(path)
        unknown = sorted(set(tensors) - set(index))
        if unknown:
            raise KeyError(f"unknown parameter name(s) {unknown[:5]}; the served model has e.g. {sorted(index)[:3]}")
        # all refusals before the first write (nothing half-applied); the layer's kind before the shape: a packed
        # layer's parameter has the kernel's shape, so a dense tensor never matches it and the shape says nothing
        for name in tensors:
            _refuse_unservable(name, index[name], "write")
        by_module: dict[tuple[int, str], list[tuple[_Target, torch.Tensor]]] = {}
        for name, value in tensors.items():
            target = index[name]
            if tuple(value.shape) != target.shape:
                raise ValueError(f"{name}: shape {tuple(value.shape)} does not match served {target.shape}")
            by_module.setdefault((id(target.module), target.param), []).append((target, value))
        is_cpu = current_platform.is_cpu()
        with torch.no_grad():
            for items in by_module.values():
                target = items[0][0]
                module = target.module
                if target.kind in ("norm", "other"):
                    param = getattr(module, target.param)
                    for t, value in items:
                        dst = param.data if t.rows is None else param.data[t.rows]
                        dst.copy_(value.to(dtype=param.dtype, device=param.device))
                    continue
                live = getattr(module, target.param)
                is_live = tuple(live.shape) == target.full_shape  # else: CPU-packed, dense is our shadow
                dense = self._qerl_dense(target)
                for t, value in items:
                    dst = dense if t.rows is None else dense[t.rows]
                    dst.copy_(value.to(dtype=dense.dtype, device=dense.device))
                if not is_cpu:
                    continue  # CUDA: the dense weight is live and was updated in place
                if not is_live:
                    # CPU linear: the kernel copy was packed from a weight vLLM then dropped
                    setattr(module, target.param, nn.Parameter(dense.clone(), requires_grad=False))
                for user in target.users:  # the module, plus a tied lm_head sharing the tensor
                    user.quant_method.process_weights_after_loading(user)
                if getattr(module, target.param).numel() != dense.numel():
                    self._qerl_shadow[id(module)] = dense
        return sorted(tensors)

    def qerl_merge_adapter(self, path: str | None) -> list[str]:
        """Serve ``W_checkpoint + scale * B @ A`` for every linear the PEFT folder ``path`` adapts (module docstring).

        Linears merged into before and not adapted by ``path`` get their checkpoint weight back;
        ``path=None`` restores every merged linear. Returns the HF names whose served value changed.
        """
        import torch.nn as nn
        from vllm.platforms import current_platform

        index = self._qerl_index()
        factors = lora_factors(path) if path is not None else {}
        unknown = sorted(set(factors) - set(index))
        if unknown:
            raise KeyError(f"{path}: adapts {unknown[:3]}, which the served model does not have")
        previous = getattr(self, "_qerl_merged", {})
        touched = sorted(set(factors) | set(previous))
        modules: dict[int, _Target] = {}
        for name in touched:
            target = index[name]
            _refuse_unservable(name, target, "merge")
            if target.kind != "linear":
                raise NotImplementedError(
                    f"{name}: served layer is {target.kind} "
                    f"({type(getattr(target.module, 'quant_method', None)).__name__}); LoRA cannot be merged into it "
                    "(use rollout.sync: adapter on a quantized base)"
                )
            modules.setdefault(id(target.module), target)
        self._qerl_merged = factors
        is_cpu = current_platform.is_cpu()
        with torch.no_grad():
            for target in modules.values():
                module = target.module
                live = getattr(module, target.param)
                dense = self._qerl_clean_dense(target, live.dtype, live.device)
                self._qerl_shadow.pop(id(module), None)  # a stale dense copy would undo the merge on a later update
                if tuple(live.shape) == target.full_shape and not is_cpu:
                    live.data.copy_(dense)  # CUDA: in place (CUDA-graph pointers stay valid)
                    continue
                setattr(module, target.param, nn.Parameter(dense, requires_grad=False))
                for user in target.users:
                    user.quant_method.process_weights_after_loading(user)  # CPU: repack (drops the dense weight)
        return touched

    def qerl_read_weights(self, names: list[str], path: str) -> str:
        """Write the served values of ``names`` (HF names) to the safetensors file ``path``."""
        index = self._qerl_index()
        out = {}
        for name in names:
            if name not in index:
                raise KeyError(f"unknown parameter name {name!r}")
            target = index[name]
            _refuse_unservable(name, target, "read")
            if target.kind in ("linear", "embedding"):
                value = self._qerl_dense(target)
            else:
                value = getattr(target.module, target.param).data
            if target.rows is not None:
                value = value[target.rows]
            out[name] = value.detach().to("cpu").clone().contiguous()
        save_file(out, path)
        return path
