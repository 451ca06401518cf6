"""The memory model: per-GPU bytes of the trainer and the vLLM engine for a config and a model shape.

``plan(cfg, shape, gpu_gib)`` is the library call; ``planner/inputs.py`` builds its inputs
and ``planner/cli.py`` prints it. The model, and what it takes from the code:

One GPU holds two processes: the trainer (``rl/run_setup.py`` builds the policy on the GPU
before it starts the engine) and the vLLM engine (``rollout/server.py``), which co-reside for
the whole run. Two phases alternate:

* rollout: trainer resident + engine held (``gpu_memory_utilization x GPU``) + the trainer's
  cached activation memory: PyTorch's caching allocator keeps the update's peak reserved after
  the tensors are freed, so the next rollout (and an engine waking from sleep) finds it still
  taken, unless the trainer empties its cache: ``rollout/sleep.py``'s ``EngineSleeper`` calls
  ``torch.cuda.empty_cache()`` before it wakes the engine, i.e. exactly when the engine sleeps.
  ``plan(..., empty_cache=None)`` (the default) follows the code: emptied when
  ``rollout.sleep_between_steps``, kept otherwise; ``True``/``False`` (``--empty-cache`` /
  ``--keep-cache``) plan either case;
* update:  trainer resident + trainer activation peak + (engine held, or only its residue when
  ``rollout.sleep_between_steps`` puts it to sleep during the update).

So sleeping the engine lowers the peak only together with an emptied trainer cache (which the
sleeper does).

``peak = max(rollout, update) + one CUDA context per process``; it fits when ``peak <= GPU``
and the engine can start (its budget holds its weights, its workspace and the KV cache of at
least one ``max_seq_len`` sequence; vLLM refuses to start otherwise). Notation: hidden ``h``,
layers ``n_l``, heads ``n_h``, KV heads ``n_kv``, head dim ``d``, MLP width ``I``, vocab ``V``,
LoRA rank ``r``; ``c`` = bytes of the compute dtype (``model.dtype``; ``auto`` is bf16 on
CUDA, so ``c = 2``), ``f = 4`` (fp32). Per decoder layer the linears are q ``h -> n_h d``,
k and v ``h -> n_kv d``, o ``n_h d -> h``, gate and up ``h -> I``, down ``I -> h``; lm_head
``h -> V`` (none when tied to the embeddings).

Trainer, resident (what ``quantization/policy.py`` holds; tests/test_planner.py checks it to
the byte on tiny models against the policy's parameters and buffers, ``PackedLinear.packed_bytes``):

* quantized linear ``[out, in]`` (``PackedLinear`` buffers): the bytes of the tensors its
  format's codec declares (``Codec.linear_bytes`` from ``Codec.tensor_specs``, checked against
  ``encode`` when the codec registers): NVFP4 ``out*in/2`` (E2M1 codes) ``+ out*in/16`` (one
  FP8-E4M3 scale per 16) ``+ 4`` (FP32 global scale); NF4 ``ceil(out*in/2) + 4*ceil(out*in/B)``
  (codes + FP32 absmax per block, ``B = quantize.nf4_blocksize``); MXFP4 ``out*in/2 +
  out*in/32`` (codes + one E8M0 byte per 32); FP8 ``out*in + 2*out`` (E4M3 codes + a bf16 scale
  per row). BF16 base: ``c*out*in`` (frozen ``nn.Linear``). Which linears are quantized follows
  ``checkpoint.quantizable_linears``: all but ``quantize.ignore`` (default ``lm_head``), a head
  tied to the embeddings, and those the codec leaves dense (``Codec.skip_reason``: NVFP4 ``in %
  16 != 0``, MXFP4 ``in % 32 != 0``).
* biases (Qwen2's q/k/v, ``attention_bias``/``mlp_bias``): ``c`` bytes each.
* embeddings ``c*V*h``; an untied, unquantized lm_head ``c*V*h`` (``load_base`` casts every
  non-quantized tensor to the compute dtype).
* RMSNorm weights ``(2 n_l + 1) h``, fp32 (``model.norm_dtype: float32``, ``quantization/norms.py``) or
  ``c`` bytes (``model``); rotary ``inv_freq`` and ``original_inv_freq``: ``2 * f * d/2``.
* LoRA: ``f * r * (in + out)`` per target linear per layer (PEFT keeps adapters fp32).
* trainable = LoRA (+ the norms with ``lora.train_norms``); their gradients: same bytes.
* AdamW (torch): two moments in the parameter's dtype, ``2 x`` trainable bytes, plus one
  fp32 ``step`` scalar per tensor (on the host: not counted on the GPU). ``optim.name:
  adamw_8bit`` (bitsandbytes ``AdamW8bit``, CUDA): tensors of at least 4096 elements get two
  uint8 moments and an FP32 absmax per 256 elements each (``2 n + 8 ceil(n/256)``), smaller
  ones fp32 moments (``min_8bit_size``), plus its two 256-entry FP32 quantization maps once.

Trainer, activations of one micro-batch of ``b`` rows padded to ``L = model.max_seq_len``
(the worst case: the longest prompt plus ``T = rollout.max_new_tokens``), ``N = b L``, ``P =
b T``. What autograd saves (exact: the test counts the saved tensors of a forward through
``update.completion_logprobs`` with ``torch.autograd.graph.saved_tensors_hooks``), per layer:

* LoRA: PEFT casts each target's input to the adapter dtype (fp32) before ``lora_A``, a new
  tensor per target (q, k, v each cast the same input): ``f N (in + r)`` per target, i.e.
  ``f N (5h + n_h d + I + 7r)`` for the 7 default targets (fp32 compute: no casts, so one ``f N``
  per distinct input, o_proj's being SDPA's saved output). The packed base saves nothing (its
  autograd function decodes the weight again in backward), nor does a frozen bf16 linear.
* RMSNorm (fp32 weight): ``f N h`` (input cast to fp32) ``+ f N`` (rsqrt), not for layer 0's
  first norm (its input, the frozen embedding, needs no gradient); ``+ f N h`` (the normalised
  input) per norm when the norms train (``c N h`` with ``norm_dtype: model``).
* attention (SDPA, flash kernel, no mask, GQA without repeating K/V): ``c N (n_h d + 2 n_kv d)``
  (q, k, v after rotary) ``+ c N n_h d`` (output) ``+ f b n_h L`` (logsumexp).
* MLP: ``3 c N I`` (gate output, SiLU output, up output).
* once: rotary cos/sin ``2 c L d``; final norm as above; the head (``rl/logprobs.py``, never
  ``[n, T, V]``): the gathered hidden states ``c P h``, targets and gather indices ``16 P + 8 b``,
  the per-row max and log-sum ``2 f P``.

With ``lora.gradient_checkpointing`` (Hugging Face's per-layer, non-reentrant) only each
layer's input ``c N h`` is kept, plus the final norm and head; in backward one layer at a time
is recomputed, so one layer's full saved set comes on top.

Transient working set (an estimate, not a bound): in backward the gradients of one layer's
saved tensors (taken as one layer's saved set again); the head's chunk buffers,
``chunk (2f + c) V`` with ``chunk = min(512, P)`` rows, plus the gradient of the hidden states ``c N h``
(head and layers do not overlap: the larger counts); the decoded dense weight of the largest
quantized linear on the torch decode path, ``Codec.decode_bytes_per_weight * out*in`` (13 for the
byte-table decodes of NVFP4, NF4 and MXFP4: uint8 codes, int64 indices, fp32 values; 8 for FP8;
zero for BF16, and zero where the fused Triton NVFP4 kernel is chosen), or, where larger,
the fused kernel's one-time ``auto`` check (NVFP4 with 16-bit compute: a random probe of the
micro-batch's ``N`` tokens, the kernel's and the torch path's outputs and the torch decode,
``triton_nvfp4.check_bytes``, the largest linear and product; it runs inside the first step's
forward and backward), plus the whole
dense base ``c * sum(out*in)`` with ``train.keep_decoded_weights: true`` (``auto`` is off on
CUDA); the head's softmax chunks kept for backward, whole chunks up to 256 MiB
(``kept_softmax``; with V = 152k not even one 512-row chunk fits). Peak =
saved + transient. A no-grad reference forward (``grpo.log_kl_to_base``) keeps less.

Engine (vLLM, ``rollout/serving.py``: what CUDA serves):

* served weights: the trainer's bytes (NVFP4, MXFP4 and FP8 packed through their
  compressed-tensors schemes; qkv and gate/up fused share one NVFP4 global scale per group), NF4
  through bitsandbytes (``nf4-bnb``: the same codes and FP32 absmax; assumes ``vllm-bnb-plugin``
  is installed, else it is served dense), BF16 dense; a format without a vLLM scheme dense;
  embeddings, lm_head and biases in ``c``; norms fp32 (the project's vLLM plugin).
* LoRA slots: ``max_loras = 1`` at ``max_lora_rank = rollout.serving.vllm_lora_rank(r)``, every
  one of the 7 projection types, ``c r_v (in + out)`` each (vLLM wraps all supported linears).
* workspace (estimate): the profiling forward of ``max_num_batched_tokens = 16384`` tokens
  (vLLM's default for the ``LLM`` class on >= 70 GiB GPUs; the project sets it only on CPU),
  ``c 16384 (2h + 3I)``, plus sampler logits for ``max_num_seqs = 1024`` rows, ``2 f 1024 V``;
  CUDA graphs 0.5 GiB unless ``rollout.enforce_eager``.
* KV cache: ``2 n_l n_kv d c`` bytes per token (``rollout/kv.py``), in blocks of 16 tokens.
  vLLM gives it everything of ``gpu_memory_utilization x GPU`` that weights, LoRA slots and
  workspace leave. A sequence needs ``ceil16(T)`` completion tokens plus its share of the
  prompt, ``ceil16(L - T) / G`` (prefix caching is on, ``rollout/server.py``, and the ``G``
  samples of a prompt share its full prompt blocks). The rollout batch is
  ``train.prompts_per_step x grpo.num_generations``; vLLM runs what does not fit concurrently
  in waves (slower, not an error), so the table gives the largest concurrent rollout batch.
* asleep (``rollout.sleep_level`` 1: weights to host RAM, KV cache freed; 2: both discarded,
  weights reloaded on wake; the GPU side is the same for both): CUDA graphs stay.
* CUDA context: 0.5 GiB per process (trainer, engine), outside vLLM's budget.

Deviations and assumptions, in one place:

* ``gpu_gib`` is GiB (2^30 bytes) as CUDA counts the GPU (what vLLM multiplies by
  ``gpu_memory_utilization``): NVML's installed total (an "80 GB" H100's 81559 MiB = 79.6 GiB)
  less what the driver reserves (``platform.gpu_memory_bytes``).
* the Llama/Qwen2 layer layout above (no q/k norms, no MoE); ``source: random`` models are
  Llama with tied embeddings over the SmolLM2 tokenizer (V = 49152).
* settings a format refuses (``Codec.check_settings``: NF4 double quantization) are refused by
  the planner too rather than plan a base the trainer cannot build.
* ``optim.name: adamw_8bit`` is planned as bitsandbytes' AdamW8bit (what CUDA runs; on CPU the
  trainer falls back to torch AdamW).
* engine workspace, CUDA graphs, contexts and the asleep residue are estimates; the
  trainer's resident bytes and saved activations are exact for the project's code.
* the engine is planned on the trainer's GPU (one GPU, no tensor parallelism) and asleep during
  the update exactly when ``rollout.sleep_between_steps`` is true (``rollout/sleep.py`` decides
  this on CUDA for a co-located engine).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from qerl_pipeline.config import METHOD_FORMAT, QerlConfig
from qerl_pipeline.planner.model_shape import ModelShape
from qerl_pipeline.quantization import formats, nvfp4, triton_nvfp4
from qerl_pipeline.quantization.checkpoint import is_ignored
from qerl_pipeline.rollout.kv import dtype_bytes, kv_bytes_per_token
from qerl_pipeline.rollout.serving import vllm_lora_rank

GIB = 1024**3
F32 = 4
#: Rows of the lm_head processed at a time by ``rl/logprobs.py`` (its ``DEFAULT_CHUNK_TOKENS``).
HEAD_CHUNK = 512
#: Softmax bytes ``rl/logprobs.py`` keeps for backward instead of recomputing (its ``DEFAULT_KEEP_BYTES``).
KEEP_SOFTMAX_BYTES = 256 * 2**20
#: bitsandbytes AdamW8bit: tensors below this many elements keep fp32 moments; absmax block; map entries.
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCK = 256
BNB_QMAP_ENTRIES = 256
#: vLLM defaults for the ``LLM`` class on GPUs with >= 70 GiB (not set by the project on CUDA).
VLLM_MAX_BATCHED_TOKENS = 16384
VLLM_MAX_NUM_SEQS = 1024
VLLM_BLOCK = 16
CUDA_GRAPHS_BYTES = GIB // 2
CUDA_CONTEXT_BYTES = GIB // 2


# ----------------------------------------------------------------------------- pieces
def _dtype_bytes(cfg: QerlConfig) -> int:
    """Compute dtype bytes on the GPU: ``auto`` and ``bfloat16`` are bf16 there."""
    return dtype_bytes(cfg.model.dtype)


def _norm_bytes(cfg: QerlConfig) -> int:
    return F32 if cfg.model.norm_dtype == "float32" else _dtype_bytes(cfg)


def quantized_linear_bytes(fmt: str, n_in: int, n_out: int, settings: dict[str, Any] | None = None) -> int:
    """Bytes of one linear's codes and scales as ``PackedLinear`` holds them (the codec's ``linear_bytes``;
    ``settings``: the ``quantize`` section as a dict)."""
    codec = formats.get(fmt)
    if not codec.quantizes:
        raise ValueError(f"not a packed format: {fmt!r}")
    return codec.linear_bytes(n_out, n_in, codec.layout(settings or {}))


def _quantized(fmt: str, name: str, n_in: int, n_out: int, ignore: list[str]) -> bool:
    """Whether ``checkpoint.quantizable_linears`` quantizes this linear (a tied head is handled by the caller)."""
    codec = formats.get(fmt)
    if not codec.quantizes or is_ignored(name, ignore):
        return False
    return codec.skip_reason(n_in, n_out) is None


def weight_bytes(cfg: QerlConfig, shape: ModelShape) -> dict[str, int]:
    """The base as the trainer holds it: ``base_linears`` (packed codes+scales, or dense), ``biases``,
    ``embeddings``, ``lm_head``, ``norms``, ``rotary``."""
    fmt, c = METHOD_FORMAT[cfg.method], _dtype_bytes(cfg)
    ignore, settings = list(cfg.quantize.ignore), cfg.quantize.model_dump()
    nb = _norm_bytes(cfg)
    out = {"base_linears": 0, "biases": 0}
    for i in range(shape.num_hidden_layers):
        for name, (n_in, n_out, bias) in shape.linears().items():
            full = f"model.layers.{i}.{'self_attn' if name[0] in 'qkvo' else 'mlp'}.{name}"
            q = _quantized(fmt, full, n_in, n_out, ignore)
            out["base_linears"] += quantized_linear_bytes(fmt, n_in, n_out, settings) if q else c * n_in * n_out
            out["biases"] += c * n_out if bias else 0
    out["embeddings"] = c * shape.vocab_size * shape.hidden_size
    if shape.tie_word_embeddings:
        out["lm_head"] = 0
    elif _quantized(fmt, "lm_head", shape.hidden_size, shape.vocab_size, ignore):
        out["lm_head"] = quantized_linear_bytes(fmt, shape.hidden_size, shape.vocab_size, settings)
    else:
        out["lm_head"] = c * shape.vocab_size * shape.hidden_size
    out["norms"] = nb * (2 * shape.num_hidden_layers + 1) * shape.hidden_size
    out["rotary"] = 2 * F32 * (shape.d // 2)
    return out


def _targets(cfg: QerlConfig, shape: ModelShape) -> dict[str, tuple[int, int, bool]]:
    lin = shape.linears()
    unknown = [t for t in cfg.lora.target_modules if t not in lin]
    if unknown:
        raise ValueError(f"lora.target_modules: {unknown} are not among the planner's linears {list(lin)}")
    return {t: lin[t] for t in cfg.lora.target_modules}


def trainable_tensors(cfg: QerlConfig, shape: ModelShape) -> list[tuple[int, int]]:
    """``(numel, element bytes)`` of each trainable tensor: lora_A, lora_B per target per layer (+ norms)."""
    r = cfg.lora.rank
    out = []
    for _ in range(shape.num_hidden_layers):
        for n_in, n_out, _bias in _targets(cfg, shape).values():
            out += [(r * n_in, F32), (n_out * r, F32)]
    if cfg.lora.train_norms:
        out += [(shape.hidden_size, _norm_bytes(cfg))] * (2 * shape.num_hidden_layers + 1)
    return out


def optimizer_bytes(cfg: QerlConfig, tensors: list[tuple[int, int]]) -> dict[str, int]:
    """``gpu``: moments (and 8-bit absmax/maps) on the device; ``host``: torch AdamW's fp32 step scalars."""
    if cfg.optim.name == "adamw_8bit":
        gpu, any8 = 0, False
        for n, _nb in tensors:
            if n >= BNB_MIN_8BIT_SIZE:
                gpu += 2 * n + 2 * F32 * math.ceil(n / BNB_BLOCK)
                any8 = True
            else:
                gpu += 2 * F32 * n
        return {"gpu": gpu + (2 * F32 * BNB_QMAP_ENTRIES if any8 else 0), "host": 0}
    return {"gpu": sum(2 * n * nb for n, nb in tensors), "host": F32 * len(tensors)}


def activation_bytes(
    cfg: QerlConfig, shape: ModelShape, b: int, seq_len: int | None = None, completion_len: int | None = None
) -> dict[str, int]:
    """Saved activations and the transient working set of one micro-batch of ``b`` rows (see the docstring)."""
    L = seq_len or cfg.model.max_seq_len
    T = min(completion_len or cfg.rollout.max_new_tokens, L)
    c, f, nb = _dtype_bytes(cfg), F32, _norm_bytes(cfg)
    h, d, nh, nkv, i = (
        shape.hidden_size,
        shape.d,
        shape.num_attention_heads,
        shape.num_key_value_heads,
        shape.intermediate_size,
    )
    N, P, r = b * L, b * T, cfg.lora.rank
    tn = cfg.lora.train_norms
    targets = _targets(cfg, shape)
    # LoRA inputs: a fresh fp32 cast per target in bf16; in fp32 the cast is the input itself (one per source).
    if c == f:  # o_proj's input is the attention output SDPA saves already (flash kernels lay it out [b, L, n_h, d])
        sources = {"attn_in": h, "o_in": 0, "mlp_in": h, "down_in": i}
        src_of = {
            "q_proj": "attn_in",
            "k_proj": "attn_in",
            "v_proj": "attn_in",
            "o_proj": "o_in",
            "gate_proj": "mlp_in",
            "up_proj": "mlp_in",
            "down_proj": "down_in",
        }
        lora = f * N * sum(sources[s] for s in {src_of[t] for t in targets}) + f * N * r * len(targets)
    else:
        lora = sum(f * N * (n_in + r) for n_in, _o, _b in targets.values())
    normed = (nb if nb == f else c) * N * h if tn else 0
    norm_full = f * N * h + f * N + normed
    norm_first = normed  # layer 0's first norm: its input (the frozen embedding) needs no gradient
    attn = c * N * (nh * d + 2 * nkv * d) + c * N * nh * d + f * b * nh * L
    mlp = 3 * c * N * i
    layer = lora + 2 * norm_full + attn + mlp
    layer0 = layer - norm_full + norm_first
    rotary = 2 * c * L * d
    # the head: its norm, its input, targets and mask, and rl/logprobs.py's per-token max and log-sum (and entropy for
    # an entropy bonus)
    head = norm_full + c * P * h + 16 * P + 8 * b + (3 if cfg.grpo.entropy_coef != 0 else 2) * f * P
    n_l = shape.num_hidden_layers
    if cfg.lora.gradient_checkpointing:
        saved = n_l * c * N * h + head
        recompute = layer + rotary
    else:
        saved = layer0 + (n_l - 1) * layer + rotary + head
        recompute = 0
    head_work = min(HEAD_CHUNK, P) * (2 * f + c) * shape.vocab_size + c * N * h
    # the head's softmax chunks kept for backward while they fit in rl/logprobs.py's DEFAULT_KEEP_BYTES
    kept, left = 0, KEEP_SOFTMAX_BYTES
    for start in range(0, P, HEAD_CHUNK):
        one = min(HEAD_CHUNK, P - start) * f * shape.vocab_size
        if one > left:
            break
        kept, left = kept + one, left - one
    codec = formats.get(METHOD_FORMAT[cfg.method])
    biggest = max(n_in * n_out for n_in, n_out, _b in shape.linears().values())
    decode = codec.decode_bytes_per_weight * biggest if codec.quantizes else 0
    decode = max(decode, kernel_check_bytes(cfg, shape, N))
    if codec.quantizes and cfg.train.keep_decoded_weights is True:  # the dense base alive through the update
        decode += (
            c
            * shape.num_hidden_layers
            * sum(
                n_in * n_out
                for name, (n_in, n_out, _b) in shape.linears().items()
                if _quantized(codec.name, name, n_in, n_out, cfg.quantize.ignore)
            )
        )
    transient = max(head_work, layer) + decode
    return {
        "saved": saved,
        "recompute": recompute,
        "transient": transient + kept,
        "peak": saved + recompute + transient + kept,
        "per_layer": layer,
        "layer0": layer0,
        "head": head,
        "rotary": rotary,
        "kept_softmax": kept,
    }


def kernel_check_bytes(cfg: QerlConfig, shape: ModelShape, tokens: int) -> int:
    """The fused NVFP4 kernel's one-time ``auto`` check at ``tokens`` rows: the largest over the
    quantized linears and both products (``triton_nvfp4.check_bytes``); 0 where ``auto`` never
    considers the kernel (other formats, float32 compute)."""
    if formats.get(METHOD_FORMAT[cfg.method]) is not nvfp4.CODEC or _dtype_bytes(cfg) == F32:  # as PackedLinear asks
        return 0
    c = _dtype_bytes(cfg)
    return max(
        (
            triton_nvfp4.check_bytes(op, tokens, n_out, n_in, c)
            for name, (n_in, n_out, _b) in shape.linears().items()
            if _quantized(
                "nvfp4",
                f"model.layers.0.{'self_attn' if name[0] in 'qkvo' else 'mlp'}.{name}",
                n_in,
                n_out,
                list(cfg.quantize.ignore),
            )
            for op in triton_nvfp4.OPS
        ),
        default=0,
    )


def _ceil_block(n: int) -> int:
    """``n`` tokens rounded up to whole blocks of vLLM's CUDA KV cache."""
    return VLLM_BLOCK * math.ceil(n / VLLM_BLOCK)


def engine_bytes(cfg: QerlConfig, shape: ModelShape) -> dict[str, int]:
    """What the engine needs besides its KV cache: served weights, LoRA slots, workspace, CUDA graphs."""
    c = _dtype_bytes(cfg)
    w = weight_bytes(cfg, shape)  # the same tensors; norms fp32 there too (rollout/vllm_plugin.py)
    served = w["base_linears"] + w["biases"] + w["embeddings"] + w["lm_head"] + w["norms"]
    rv = vllm_lora_rank(cfg.lora.rank)
    lora = shape.num_hidden_layers * sum(c * rv * (n_in + n_out) for n_in, n_out, _b in shape.linears().values())
    work = (
        c * VLLM_MAX_BATCHED_TOKENS * (2 * shape.hidden_size + 3 * shape.intermediate_size)
        + 2 * F32 * VLLM_MAX_NUM_SEQS * shape.vocab_size
    )
    graphs = 0 if cfg.rollout.enforce_eager else CUDA_GRAPHS_BYTES
    return {"served_weights": served, "lora_slots": lora, "workspace": work, "cuda_graphs": graphs}


# ----------------------------------------------------------------------------- the plan
@dataclass
class Plan:
    """Every figure of one plan, bytes unless named otherwise (``rows`` gives the table)."""

    method: str
    fmt: str
    model: str
    gpu_bytes: int
    micro_batch: int
    rollout_batch: int
    seq_len: int
    completion_len: int
    gradient_checkpointing: bool
    sleep: bool
    gpu_memory_utilization: float
    trainer: dict[str, int]
    activations: dict[str, int]
    engine: dict[str, int]
    kv_per_token: int
    kv_capacity: int
    kv_needed: int
    engine_reserved: int
    engine_asleep: int
    contexts: int
    rollout_phase: int
    update_phase: int
    peak: int
    empty_cache: bool
    engine_starts: bool
    fits: bool
    max_micro_batch: int
    max_concurrent_rollouts: int
    min_gpu_memory_utilization: float
    max_gpu_memory_utilization: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _trainer_resident(cfg: QerlConfig, shape: ModelShape) -> dict[str, int]:
    w = weight_bytes(cfg, shape)
    tensors = trainable_tensors(cfg, shape)
    lora = cfg.lora.rank * F32 * shape.num_hidden_layers * sum(a + b for a, b, _bias in _targets(cfg, shape).values())
    trainable = sum(n * nb for n, nb in tensors)
    opt = optimizer_bytes(cfg, tensors)
    return {**w, "lora": lora, "grads": trainable, "optimizer": opt["gpu"], "optimizer_host": opt["host"]}


def plan(
    cfg: QerlConfig,
    shape: ModelShape,
    gpu_gib: float,
    *,
    micro_batch: int | None = None,
    empty_cache: bool | None = None,
) -> Plan:
    """The memory plan of ``cfg`` for ``shape`` on one GPU of ``gpu_gib`` GiB (see the module docstring).

    ``empty_cache``: whether the trainer returns its cached activation memory
    (``torch.cuda.empty_cache()``) after each update; None = as the code does: when the engine
    sleeps during the update (``EngineSleeper``, before its wake), not otherwise.
    """
    if gpu_gib <= 0:
        raise ValueError(f"gpu size must be > 0 GiB, got {gpu_gib}")
    fmt = METHOD_FORMAT[cfg.method]
    formats.get(fmt).check_settings(cfg.quantize.model_dump())  # a base the trainer cannot build is not planned
    gpu = int(gpu_gib * GIB)
    mb = micro_batch or cfg.train.micro_batch_size
    n_rows = cfg.train.prompts_per_step * cfg.grpo.num_generations
    L, T, G = cfg.model.max_seq_len, min(cfg.rollout.max_new_tokens, cfg.model.max_seq_len), cfg.grpo.num_generations
    trainer = _trainer_resident(cfg, shape)
    resident = sum(v for k, v in trainer.items() if k != "optimizer_host")
    acts = activation_bytes(cfg, shape, mb)
    eng = engine_bytes(cfg, shape)
    fixed = sum(eng.values())
    reserved = int(cfg.rollout.gpu_memory_utilization * gpu)
    kv_tok = kv_bytes_per_token(asdict(shape), cfg.model.dtype)  # the engine's dtype is the compute dtype
    kv_capacity = max(0, reserved - fixed)
    per_seq_tokens = _ceil_block(T) + _ceil_block(L - T) / G  # prompt blocks shared by a group (prefix caching)
    kv_needed = int(math.ceil(n_rows * per_seq_tokens * kv_tok))
    concurrent = int(kv_capacity // (per_seq_tokens * kv_tok))
    starts = kv_capacity >= _ceil_block(L) * kv_tok  # vLLM refuses a cache smaller than one max_model_len sequence
    sleep = cfg.rollout.sleep_between_steps
    if empty_cache is None:
        empty_cache = sleep  # EngineSleeper empties the trainer's cache before waking the engine
    asleep = eng["cuda_graphs"]
    contexts = 2 * CUDA_CONTEXT_BYTES
    engine_in_update = asleep if sleep else reserved
    # The trainer's caching allocator keeps the update's peak reserved into the next rollout unless emptied.
    cached = 0 if empty_cache else acts["peak"]
    rollout_phase = contexts + resident + cached + reserved
    update_phase = contexts + resident + acts["peak"] + engine_in_update
    peak = max(rollout_phase, update_phase)
    room = gpu - (contexts + resident + (engine_in_update if empty_cache else max(engine_in_update, reserved)))
    max_mb = 0
    while max_mb < n_rows and activation_bytes(cfg, shape, max_mb + 1)["peak"] <= room:
        max_mb += 1
    min_util = (fixed + _ceil_block(L) * kv_tok) / gpu
    # Largest fraction vLLM may reserve: the rollout phase (and, awake during the update, the update phase) must fit.
    max_util = max(0.0, (gpu - contexts - resident - (0 if sleep and empty_cache else acts["peak"])) / gpu)
    if update_phase - engine_in_update > gpu:
        max_util = 0.0
    notes = []
    if not starts:
        notes.append(
            f"engine cannot start: gpu_memory_utilization {cfg.rollout.gpu_memory_utilization} x GPU = "
            f"{reserved / GIB:.1f} GiB does not hold its weights, workspace and one {L}-token sequence "
            f"(needs >= {min_util:.3f})"
        )
    if starts and concurrent < n_rows:
        notes.append(f"rollout batch {n_rows} runs in waves: the KV cache holds {concurrent} sequences at once")
    codec = formats.get(fmt)
    if codec.cuda_needs is not None:
        notes.append(
            f"{codec.label} served as {codec.served('cuda', {codec.cuda_needs}).tag} through vLLM's "
            f"{codec.cuda_needs} support{codec.cuda_needs_hint}; without it vLLM serves it dense"
        )
    return Plan(
        method=cfg.method,
        fmt=fmt,
        model=shape.name,
        gpu_bytes=gpu,
        micro_batch=mb,
        rollout_batch=n_rows,
        seq_len=L,
        completion_len=T,
        gradient_checkpointing=cfg.lora.gradient_checkpointing,
        sleep=sleep,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        trainer=trainer,
        activations=acts,
        engine=eng,
        kv_per_token=kv_tok,
        kv_capacity=kv_capacity,
        kv_needed=kv_needed,
        engine_reserved=reserved,
        engine_asleep=asleep,
        contexts=contexts,
        rollout_phase=rollout_phase,
        update_phase=update_phase,
        peak=peak,
        empty_cache=empty_cache,
        engine_starts=starts,
        fits=starts and peak <= gpu,
        max_micro_batch=max_mb,
        max_concurrent_rollouts=concurrent,
        min_gpu_memory_utilization=min_util,
        max_gpu_memory_utilization=max_util,
        notes=notes,
    )
