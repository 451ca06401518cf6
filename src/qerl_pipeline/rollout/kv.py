"""KV-cache sizing: the bytes vLLM's cache takes per token of a model, in one place.

The engine launcher (``rollout/serving.py``, the CPU engine's cache budget) and the memory
planner (``planner/``, the GPU engine's cache) both size a KV cache from a model's
``config.json`` fields. vLLM keeps, for every cached token, one K and one V vector per layer
and per KV head, each ``head_dim`` elements in the engine's dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def dtype_bytes(dtype: str) -> int:
    """Bytes of one cache element: 4 for ``float32``; 2 for ``bfloat16``/``float16`` and for
    ``auto``, which vLLM serves in bf16."""
    return 4 if dtype == "float32" else 2


def kv_bytes_per_token(model_config: Mapping[str, Any], dtype: str) -> int:
    """K and V of every layer for one token (``config.json`` fields; ``dtype`` the engine's).

    ``num_key_value_heads`` missing or None means multi-head attention (as many KV heads as
    heads); ``head_dim`` missing or None means ``hidden_size / num_attention_heads``, as
    transformers' Llama and Qwen2 configs default them."""
    heads = model_config["num_attention_heads"]
    kv_heads = model_config.get("num_key_value_heads") or heads
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // heads
    return 2 * model_config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes(dtype)
