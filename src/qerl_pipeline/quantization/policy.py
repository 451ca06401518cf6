"""The trainable policy: a packed base (any registered format that quantizes) or a plain one, with PEFT LoRA adapters.

``build_policy(base_dir, fmt, lora, dtype=..., device=...)`` reads a base folder written by
``checkpoint.write_base`` and returns a ``PeftModel`` whose quantized linears are
``PackedLinear`` modules:

* A ``PackedLinear`` keeps only the tensors its format's codec writes (``quantization/codec.py``:
  ``buffers`` names them; NVFP4: uint8 codes, FP8 block scales, FP32 global scale, 4.5 bits a
  weight; NF4: uint8 codes and FP32 absmax, 4.5 bits a weight; MXFP4: uint8 codes and E8M0
  exponents, 4.25; FP8: E4M3 codes and a bf16 scale per row, ~8) and decodes through the
  codec. Its forward runs a custom autograd function that decodes the dense weight,
  multiplies, and drops it; backward decodes again to compute ``grad_out @ W``. The base is
  frozen, so no weight gradient exists and nothing weight-sized is saved for backward: at
  any moment at most one layer's dense weight is alive (two with the fused LoRA below: W and
  W + sBA). ``DENSE_TRACKER`` counts the live decoded bytes so that this is measured, not assumed.
* Decoding is done in float32 and then cast to the compute dtype (float32 on CPU, bf16 on
  GPU): the same numbers as the ``serving/`` copy that vLLM on CPU serves.
* Float scales are held as integer bit patterns (``view``), so a stray ``model.to(dtype)``
  cannot round them.
* NF4 uses the same ``PackedLinear`` on CPU and CUDA (our codes are byte-identical to
  bitsandbytes'). bitsandbytes' ``Linear4bit`` kernel would be faster on CUDA but cannot be
  trained through on CPU, and one code path keeps the three methods comparable.
* A base whose format quantizes nothing (``bf16``) keeps ordinary ``nn.Linear`` layers (weights in the compute dtype,
  frozen); PEFT wraps them natively.
* LoRA comes from PEFT: ``PackedLinear`` is registered through ``LoraConfig``'s custom-module
  mapping with ``PackedLoraLinear`` (PEFT's LoRA ``Linear`` minus merging, which has no
  meaning on packed codes; merge LoRA into ``dense_state_dict`` instead). In fp32 with one
  plain adapter (no dropout) its forward is ``_PackedLoraMatmul``: the adapter folded into
  the decoded weight, one matmul each way instead of PEFT's activation-sized rank-r products
  (deviation from PEFT's order of operations, same function; bf16 and everything else take
  PEFT's forward). Adapters stay
  float32 (PEFT's default) whatever the compute dtype.
* ``decoded_weights(policy)``: a context in which each ``PackedLinear`` decodes once and
  reuses that weight in every forward and backward until the context ends (the trainer
  opens it around one update when ``train.keep_decoded_weights`` resolves to on: CPU, see
  :func:`keeps_decoded_weights`). Outside it, nothing decoded outlives its matmul. Inside
  it, the whole base is alive dense (``DENSE_TRACKER`` counts it): a step's decodes drop
  from one per linear per pass (prefix and suffix forwards, their backwards) to one per
  linear per update, for the dense model's bytes during the update.
* ``lora.train_norms`` makes every RMSNorm weight trainable (the paper's ``ln=True``);
  PEFT's ``save_pretrained`` does not store them, so the trainer saves
  ``trainable_state_dict(policy)``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qerl_pipeline.adapter import hf_name
from qerl_pipeline.config import LoraConfig
from qerl_pipeline.quantization import checkpoint, formats, nvfp4, triton_nvfp4
from qerl_pipeline.quantization.codec import Codec, as_bits
from qerl_pipeline.quantization.norms import keep_norm_weights_fp32


class _DenseTracker:
    """Bytes of decoded dense weights alive right now, and the peak since ``reset``."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.baseline = 0

    def reset(self) -> None:
        """Start a measurement: later ``transient_peak`` counts only what is decoded from now on."""
        self.baseline = self.peak = self.live

    @property
    def transient_peak(self) -> int:
        return self.peak - self.baseline

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._release, nbytes)
        return tensor

    def _release(self, nbytes: int) -> None:
        self.live -= nbytes


DENSE_TRACKER = _DenseTracker()


class _PackedMatmul(torch.autograd.Function):
    """``x @ W.T`` with W decoded in forward and again in backward, never saved.

    Each direction goes through the fused Triton kernel (``triton_nvfp4``: it reads the
    codes and scales directly, no dense W at all) when ``layer.uses_triton`` says so for
    that op and shape, else through the torch codec (decode, multiply, drop).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: PackedLinear) -> torch.Tensor:
        ctx.layer = layer
        x2 = x.reshape(-1, x.shape[-1])
        if layer.uses_triton("fwd", x2):
            y = triton_nvfp4.matmul("fwd", x2, layer.nvfp4_weight())
            return y.reshape(*x.shape[:-1], y.shape[-1])
        weight = layer.dense_weight(x.dtype)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        layer = ctx.layer
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        if layer.uses_triton("dx", g2):
            dx = triton_nvfp4.matmul("dx", g2, layer.nvfp4_weight())
            return dx.reshape(*grad_out.shape[:-1], dx.shape[-1]), None
        weight = layer.dense_weight(grad_out.dtype)
        return grad_out @ weight, None


class PackedLinear(nn.Module):
    """A frozen linear layer stored as its format's codes, decoded on the fly.

    ``tensors``: the codec's tensors by suffix (as the checkpoint holds them); ``params``: its decode
    parameters (``Codec.params`` of the base's config.json, e.g. NF4's block size).
    ``kernel`` picks how an NVFP4 layer multiplies (other formats always use the torch codec):
    ``"torch"`` decodes with the torch codec; ``"triton"`` always runs the fused Triton
    kernels (CPU tensors: Triton's interpreter, for tests); ``"auto"`` (default) follows
    ``triton_nvfp4.kernel_mode()`` (``QERL_NVFP4_KERNEL`` / ``triton_nvfp4.force_kernel``),
    whose own ``"auto"`` is the one-time per-shape check of ``triton_nvfp4.DISPATCHER``:
    Triton only on CUDA, after it agreed with the torch path and timed faster.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fmt: str,
        tensors: dict[str, torch.Tensor],
        *,
        compute_dtype: torch.dtype = torch.float32,
        bias: torch.Tensor | None = None,
        params: dict[str, Any] | None = None,
        kernel: str = "auto",
    ) -> None:
        super().__init__()
        if kernel not in triton_nvfp4.MODES:
            raise ValueError(f"PackedLinear: kernel must be one of {triton_nvfp4.MODES}, got {kernel!r}")
        codec = formats.get(fmt)
        if not codec.quantizes:
            raise ValueError(f"PackedLinear: format {fmt!r} quantizes nothing (its base keeps nn.Linear layers)")
        self.in_features, self.out_features = in_features, out_features
        self.fmt, self.params = fmt, dict(params or {})
        self.kernel = kernel
        self.compute_dtype = compute_dtype
        codec.check_tensors(tensors, out_features, in_features, self.params)
        self._dtypes: dict[str, torch.dtype] = {}  # buffer name -> the dtype its bits are read as
        for suffix, name in codec.buffers.items():
            t = tensors[suffix].contiguous()
            self._dtypes[name] = t.dtype
            self.register_buffer(name, as_bits(t))
        if bias is not None:
            self.register_buffer("bias", bias.detach().to(compute_dtype))
        else:
            self.bias = None
        self._kept: dict[torch.dtype, torch.Tensor] | None = None  # decoded_weights(): dtype -> weight

    def dense_weight(self, dtype: torch.dtype | None = None, *, track: bool = True) -> torch.Tensor:
        """The decoded ``[out, in]`` weight (float32 math, then ``dtype``); tracked while alive.

        Inside ``decoded_weights`` the first decode per dtype is kept and returned again."""
        dtype = dtype or self.compute_dtype
        if self._kept is not None and track:
            w = self._kept.get(dtype)
            if w is None:
                w = self._kept[dtype] = self._decode(dtype, track=True)
            return w
        return self._decode(dtype, track=track)

    @property
    def codec(self) -> Codec:
        """The layer's format (looked up by name, so a copied layer keeps the registry's codec)."""
        return formats.get(self.fmt)

    def code_tensors(self) -> dict[str, torch.Tensor]:
        """The codec's tensors by suffix: views of the buffers in their own dtypes, no copy."""
        return {s: getattr(self, n).view(self._dtypes[n]) for s, n in self.codec.buffers.items()}

    def _decode(self, dtype: torch.dtype, *, track: bool) -> torch.Tensor:
        with torch.no_grad():
            w = self.codec.decode(self.code_tensors(), (self.out_features, self.in_features), dtype, self.params)
        return DENSE_TRACKER.track(w) if track else w

    def nvfp4_weight(self) -> nvfp4.NVFP4Weight:
        """Views of the NVFP4 buffers (codes, FP8 scales, FP32 global scale), no copy."""
        if self.codec is not nvfp4.CODEC:
            raise ValueError(f"nvfp4_weight: this layer holds {self.fmt!r} codes")
        return nvfp4.NVFP4Weight(*(self.code_tensors()[s] for s in nvfp4.CODEC.suffixes))

    def uses_triton(self, op: str, a: torch.Tensor) -> bool:
        """Whether the 2-D operand ``a`` goes through the fused kernel (``op``: "fwd" or "dx"; NVFP4 only)."""
        if self.codec is not nvfp4.CODEC or a.dtype not in triton_nvfp4.DTYPES:
            return False
        return triton_nvfp4.use_triton(op, a, self.nvfp4_weight(), self.kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _PackedMatmul.apply(x, self)
        return out + self.bias.to(out.dtype) if self.bias is not None else out

    @property
    def qweight(self) -> torch.Tensor:
        """The packed codes; PEFT looks for ``qweight`` to find a quantized layer's device."""
        return getattr(self, next(iter(self.codec.buffers.values())))

    def packed_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for name, b in self.named_buffers() if name != "bias")

    def extra_repr(self) -> str:
        extra = f", kernel={self.kernel}" if self.kernel != "auto" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}{extra}"


def _packed_lora_class():
    from peft.tuners.lora.layer import Linear as LoraLinear

    class PackedLoraLinear(LoraLinear):
        """PEFT's LoRA Linear over a PackedLinear base (merging is not supported on codes)."""

        def _get_in_out_features(self, module):
            return module.in_features, module.out_features

        def merge(self, *args, **kwargs):
            raise NotImplementedError("cannot merge LoRA into packed codes; merge into dense_state_dict()")

        def get_delta_weight(self, adapter):  # used by merge/unmerge only
            raise NotImplementedError("packed base: use the adapters' lora_A/lora_B weights directly")

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            adapter = self._fused_adapter(x, args, kwargs)
            if adapter is None:
                return super().forward(x, *args, **kwargs)
            base = self.base_layer
            out = _PackedLoraMatmul.apply(
                x, base, self.lora_A[adapter].weight, self.lora_B[adapter].weight, float(self.scaling[adapter])
            )
            return out + base.bias.to(out.dtype) if base.bias is not None else out

        def _fused_adapter(self, x, args, kwargs) -> str | None:
            """The one plain LoRA adapter ``_PackedLoraMatmul`` can run, or None (PEFT's own forward)."""
            if args or kwargs or self.disable_adapters or self.merged or x.dtype != torch.float32:
                return None
            active = [a for a in self.active_adapters if a in self.lora_A]
            if len(active) != 1 or active[0] in self.lora_variant:
                return None
            a = active[0]
            if not isinstance(self.lora_dropout[a], nn.Identity) or self.lora_A[a].weight.dtype != torch.float32:
                return None
            x2 = x.reshape(-1, x.shape[-1])
            if self.base_layer.uses_triton("fwd", x2):
                return None
            return a

    return PackedLoraLinear


class _PackedLoraMatmul(torch.autograd.Function):
    """``x @ (W + s B A).T`` for a packed W and one plain fp32 LoRA adapter, in one matmul each way.

    PEFT's LoRA forward is ``x W.T + s (x A.T) B.T``: two rank-r products whose outputs are
    activation-sized (``[N, out]``, and ``[N, in]`` in backward), a scale and an add, per
    adapted linear. Their inner dimension is r = 16, so they run far below the matmul rate
    and cost as much as the elementwise passes around them. Here the adapter is folded into
    the (decoded) weight first, ``W_eff = W + s B A`` (a weight-sized product, ``out x in x r``),
    and the activations see one matmul: ``y = x W_eff.T``, ``dx = dy W_eff``. The adapter's
    gradients come from rank-r products with rank-r outputs: ``dB = s dy.T (x A.T)``,
    ``dA = s (dy B).T x``. The same function as PEFT's; the rounding differs (the delta is added
    to W before the product). fp32 only: in bf16 ``W + s B A`` would round a small delta into
    the weight (PEFT's path keeps it in fp32), so bf16 compute takes PEFT's forward. ``W_eff`` is
    rebuilt in backward, never saved; ``x A.T`` (``[N, r]``) is. ``W_eff`` is weight-sized and
    counted by ``DENSE_TRACKER``: outside ``decoded_weights`` a decoded W and its ``W_eff`` are
    alive together for an instant (two layers' bytes at most, not one).
    """

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, layer: PackedLinear, a: torch.Tensor, b: torch.Tensor, scale: float
    ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        w_eff = DENSE_TRACKER.track(torch.addmm(layer.dense_weight(x.dtype), b, a, alpha=scale))
        y = x2 @ w_eff.t()
        xa = x2 @ a.t()
        ctx.save_for_backward(x, a, b, xa)
        ctx.layer, ctx.scale = layer, scale
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, a, b, xa = ctx.saved_tensors
        layer, scale = ctx.layer, ctx.scale
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        dx = da = db = None
        if ctx.needs_input_grad[0]:
            w_eff = DENSE_TRACKER.track(torch.addmm(layer.dense_weight(grad_out.dtype), b, a, alpha=scale))
            dx = (g2 @ w_eff).reshape(x.shape)
        if ctx.needs_input_grad[2]:
            da = (g2 @ b).t() @ x.reshape(-1, x.shape[-1])
            da.mul_(scale)
        if ctx.needs_input_grad[3]:
            db = g2.t() @ xa
            db.mul_(scale)
        return dx, None, da, db, None


KEEP_DECODED_MODES = ("auto", True, False)


def keeps_decoded_weights(setting: str | bool, device_type: str) -> bool:
    """``train.keep_decoded_weights`` for a policy on ``device_type`` (pure).

    ``auto``: on on CPU, where decoding is a torch codec pass per linear per use (the
    update's largest non-matmul cost after the elementwise ops) and the dense copy of a
    CPU-sized model is small; off on CUDA, where the NVFP4 forward and ``dx`` go through
    the fused Triton kernel (no decode at all) and a dense copy of a 7B-32B base would undo
    the packed base's memory saving.
    """
    if setting not in KEEP_DECODED_MODES:
        raise ValueError(f"train.keep_decoded_weights {setting!r} unknown; allowed: auto, true, false")
    if setting == "auto":
        return device_type == "cpu"
    return bool(setting)


@contextmanager
def decoded_weights(policy: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the block every ``PackedLinear`` of ``policy`` decodes once and reuses it (module docstring).

    The base is frozen, so a kept weight is the one a fresh decode would give. Nested use
    keeps the outer context's weights; they are dropped when the outermost block ends.
    """
    layers = [m for m in policy.modules() if isinstance(m, PackedLinear) and m._kept is None] if enabled else []
    for m in layers:
        m._kept = {}
    try:
        yield
    finally:
        for m in layers:
            m._kept = None


# ----------------------------------------------------------------------------- loading
def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    mod = model.get_submodule(owner) if owner else model
    if leaf in mod._parameters:
        mod._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    elif leaf in mod._buffers:
        mod._buffers[leaf] = value
    else:
        raise KeyError(f"checkpoint tensor {name!r} has no place in the model")


def load_base(base_dir: Path, fmt: str, *, dtype: torch.dtype, device: str = "cpu") -> nn.Module:
    """The base model of ``base_dir`` with packed linears (no LoRA yet), frozen, on ``device``."""
    from transformers import AutoModelForCausalLM

    base_dir = Path(base_dir)
    actual = checkpoint.base_format(base_dir)
    if actual != fmt:
        raise ValueError(f"{base_dir} holds a {actual!r} base, not {fmt!r}")
    codec = formats.get(fmt)
    if not codec.quantizes:
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).to(device)
        model.requires_grad_(False)
        return model
    params = codec.params(checkpoint.base_config(base_dir))
    model = checkpoint.empty_model(base_dir, dtype)
    owners = checkpoint.quantized_owners(checkpoint.tensor_names(base_dir), codec)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in checkpoint.iter_tensors(base_dir):
        owner, _, leaf = name.rpartition(".")
        if owner in owners and leaf in codec.suffixes:
            groups.setdefault(owner, {})[leaf] = tensor.to(device)
        else:
            _set_tensor(
                model, name, tensor.to(device=device, dtype=dtype) if tensor.is_floating_point() else tensor.to(device)
            )
    for owner, tensors in groups.items():
        lin = model.get_submodule(owner)
        if not isinstance(lin, nn.Linear):
            raise ValueError(f"{owner}: quantized tensors for a {type(lin).__name__}, expected Linear")
        bias = lin.bias if lin.bias is not None and lin.bias.device.type != "meta" else None
        packed = PackedLinear(
            lin.in_features, lin.out_features, fmt, tensors, compute_dtype=dtype, bias=bias, params=params
        )
        parent, _, leaf = owner.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, packed)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if missing:
        raise ValueError(
            f"{base_dir}: tensors missing from the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )
    model.requires_grad_(False)
    return model.to(device).eval()


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm")


def build_policy(
    base_dir: Path, fmt: str, lora: LoraConfig, *, dtype: torch.dtype, device: str = "cpu", norm_dtype: str = "float32"
) -> nn.Module:
    """Base (packed per ``fmt``) + PEFT LoRA (+ trainable norms, gradient checkpointing).

    ``norm_dtype`` (``model.norm_dtype``): ``float32`` keeps the RMSNorm weights in fp32 when
    ``dtype`` is not (``quantization/norms.py``: AQN noise and norm updates survive bf16); ``model``
    leaves them in ``dtype``.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    model = load_base(base_dir, fmt, dtype=dtype, device=device)
    if norm_dtype == "float32":
        keep_norm_weights_fp32(model, dtype)
    targets = list(lora.target_modules)
    found = {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, (nn.Linear, PackedLinear))}
    unknown = [t for t in targets if t not in found]
    if unknown:
        raise ValueError(f"lora.target_modules: {unknown} not found among the model's linears {sorted(found)}")
    peft_cfg = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_cfg._register_custom_module({PackedLinear: _packed_lora_class()})
    if lora.gradient_checkpointing:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = get_peft_model(model, peft_cfg)
    if lora.train_norms:
        for mod in policy.modules():
            if _is_norm(mod):
                mod.weight.requires_grad_(True)
    return policy.to(device)


def load_adapter_weights(policy: nn.Module, adapter_dir: Path) -> None:
    """Load a saved adapter (``adapter_model.safetensors``) into a policy built by ``build_policy``."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(policy, state)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"{adapter_dir}: adapter keys not in the policy: {result.unexpected_keys[:5]}")


# ----------------------------------------------------------------------------- views
def _base_model(policy: nn.Module) -> nn.Module:
    return policy.get_base_model() if hasattr(policy, "get_base_model") else policy


def _hf_name(name: str) -> str:
    """A base-model module name as HF names it (PEFT's ``.base_layer`` dropped; ``adapter.hf_name``)."""

    return hf_name(name, unwrap=True)


def dense_state_dict(policy: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Dense base weights under Hugging Face names (no LoRA), decoded from the packed codes.

    Plain tensors are returned as detached views (norms carry whatever the trainer set,
    e.g. AQN noise); packed linears are decoded (float32 math, then ``dtype`` or the compute
    dtype). A tied lm_head appears only as the embedding, as in HF checkpoints.
    """
    model = _base_model(policy)
    out: dict[str, torch.Tensor] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, PackedLinear):
            w = mod.dense_weight(dtype, track=False)
            out[_hf_name(name) + ".weight"] = w
            if mod.bias is not None:
                out[_hf_name(name) + ".bias"] = mod.bias.detach()
    for name, p in model.named_parameters():
        if "lora_" in name:
            continue
        t = p.detach()
        out[_hf_name(name)] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def trainable_state_dict(policy: nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable tensor (LoRA and, with train_norms, the norms) by its policy name."""
    return {n: p.detach() for n, p in policy.named_parameters() if p.requires_grad}


def _base_linear_ids(model: nn.Module) -> set[int]:
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    ids = set()
    for name, mod in model.named_modules():
        if "lora_" in name or mod is out_emb:
            continue
        if isinstance(mod, PackedLinear):
            ids.update(id(b) for b in mod.buffers())
        elif isinstance(mod, nn.Linear):
            ids.add(id(mod.weight))
    return ids


def parameter_bytes(policy: nn.Module) -> dict[str, int]:
    """Resident bytes: ``packed_base`` (base linears as held: codes+scales, or plain weights),
    ``lora`` (adapters), ``other`` (embeddings, norms, lm_head, biases), ``total``."""
    model = _base_model(policy)
    base_ids = _base_linear_ids(model)
    seen: set[int] = set()
    out = {"packed_base": 0, "lora": 0, "other": 0}
    tensors: Iterable[tuple[str, torch.Tensor]] = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in tensors:
        key = t.data_ptr() if t.numel() else id(t)
        if key in seen:
            continue
        seen.add(key)
        nbytes = t.numel() * t.element_size()
        if "lora_" in name:
            out["lora"] += nbytes
        elif id(t) in base_ids:
            out["packed_base"] += nbytes
        else:
            out["other"] += nbytes
    out["total"] = sum(out.values())
    return out


def measure_training_memory(policy: nn.Module, input_ids: torch.Tensor) -> dict[str, int]:
    """One forward+backward on ``input_ids``: resident bytes and the peak of live decoded weights.

    ``peak_param_bytes`` = resident parameters/buffers + the largest amount of decoded dense
    weight alive at once (one layer for a packed base). Gradients are cleared afterwards.
    """
    DENSE_TRACKER.reset()
    out = policy(input_ids=input_ids)
    out.logits.float().mean().backward()
    policy.zero_grad(set_to_none=True)
    resident = parameter_bytes(policy)
    peak = DENSE_TRACKER.transient_peak
    return {
        **{f"resident_{k}": v for k, v in resident.items()},
        "peak_dense_transient": peak,
        "peak_param_bytes": resident["total"] + peak,
    }
