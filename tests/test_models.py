"""Base model resolution: bundled GGUF fallback, random tiny models, atomic folder saves."""

from __future__ import annotations

import json

import pytest
import torch

from qerl_pipeline.config import ModelConfig
from qerl_pipeline.models import (
    BUNDLED_MODEL,
    bundled_gguf_path,
    load_tokenizer,
    resolve_dtype,
    resolve_source,
)


def test_bundled_gguf_is_installed():
    path = bundled_gguf_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000


def test_auto_falls_back_to_bundled_gguf_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    kind, where = resolve_source(ModelConfig(name=BUNDLED_MODEL, source="auto"))
    assert kind == "gguf" and where.endswith(".gguf")


def test_unknown_model_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="model.name 'org/not-here'"):
        resolve_source(ModelConfig(name="org/not-here", source="auto"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_source(ModelConfig(name="/nope/model", source="local"))


def test_local_folder_wins(tiny_model_dir):
    assert resolve_source(ModelConfig(name=str(tiny_model_dir))) == ("local", str(tiny_model_dir))


def test_dtype_policy():
    assert resolve_dtype(ModelConfig()) == torch.float32
    assert resolve_dtype(ModelConfig(), device="cuda") == torch.bfloat16
    assert resolve_dtype(ModelConfig(dtype="bfloat16")) == torch.bfloat16


def test_tokenizer_stops_at_end_of_turn():
    tok = load_tokenizer(ModelConfig(source="random"))
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True)
    assert text.rstrip().endswith("<|im_start|>assistant")


def test_tiny_model_folder_is_vllm_shaped(tiny_model_dir):
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64  # vLLM on CPU rejects head_dim 16
    assert cfg["eos_token_id"] == 2
    assert (tiny_model_dir / "model.safetensors").is_file()
    assert (tiny_model_dir / "tokenizer.json").is_file()


def test_replace_dir_swaps_whole_folder(tmp_path):
    from qerl_pipeline.atomic import replace_dir  # the one home of folder swaps

    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    src = tmp_path / "new"
    src.mkdir()
    (src / "new.txt").write_text("new")
    replace_dir(src, dst)
    assert sorted(p.name for p in dst.iterdir()) == ["new.txt"]
    assert not src.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_the_bundled_fallback_is_said_once_per_process(monkeypatch, caplog):
    """A run resolves its base several times (tokenizer, model, fingerprint): the fallback's warning comes once."""
    from qerl_pipeline import models

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(models, "_said_bundled", set())
    with caplog.at_level("WARNING"):
        for _ in range(3):
            assert resolve_source(ModelConfig(name=BUNDLED_MODEL, source="auto"))[0] == "gguf"
    assert [r.getMessage() for r in caplog.records if r.name == models.__name__] == [
        f"Hub unreachable: using the bundled GGUF of {BUNDLED_MODEL} (Q4_1 weights, dequantized)"
    ]
