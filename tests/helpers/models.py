"""Model folders for tests: a tiny Llama and its packed NVFP4 base to train, a tiny model as a base with its
tokenizer, and a fake base to size."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from qerl_pipeline.quantization import checkpoint


def tiny_llama():
    """A random tiny Llama (hidden 64, 4 heads, 2 KV heads, 2 layers, vocab 256, untied head), seed 0; its
    norm weights drawn from [0.5, 1.5] so that a norm update or a noise on it is visible (all ones would
    hide a missing scale)."""
    # transformers' model classes take seconds to import: only the tests that build a base pay for them
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def packed_tiny_base(folder: Path) -> Path:
    """``tiny_llama()`` written as an NVFP4 base at ``folder``."""
    checkpoint.write_base(tiny_llama(), None, "nvfp4", folder)
    return folder


def tokenized_base(model_dir: Path, fmt: str, folder: Path) -> Path:
    """The model folder ``model_dir`` (``tiny_model_dir``: a random tiny Llama with the SmolLM2 tokenizer)
    written as a ``fmt`` base at ``folder``, its tokenizer with it (the trainer reads it from the base)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    checkpoint.write_base(model, AutoTokenizer.from_pretrained(model_dir), fmt, folder)
    return folder


def fake_base(folder: Path, dtype_bytes: int) -> None:
    """A base folder with config.json and a serving/ copy: one q_proj, a separate lm_head (zeros;
    for the benchmark's size and memory arithmetic, never loaded as a model)."""
    config = {
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "intermediate_size": 16,
        "vocab_size": 10,
    }
    for f, dt in ((folder, torch.uint8 if dtype_bytes == 1 else torch.float32), (folder / "serving", torch.float32)):
        f.mkdir(parents=True)
        (f / "config.json").write_text(json.dumps(config))
        save_file(
            {
                "lm_head.weight": torch.zeros(10, 16),
                "model.layers.0.self_attn.q_proj.weight": torch.zeros(16, 16, dtype=dt),
            },
            str(f / "model.safetensors"),
        )
