"""A model's sizes as the planner needs them, read from a transformers config (``ModelShape``).

The layer layout is Llama's and Qwen2's (no q/k norms, no MoE): per decoder layer q, k, v, o, gate, up and
down projections, RMSNorms before attention and MLP, an embedding and a head that may be tied to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """The sizes the planner needs, as a transformers config names them."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: Any, name: str | None = None) -> ModelShape:
        """From a transformers config (``PretrainedConfig`` or its dict / ``config.json``)."""
        raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        missing = [
            k
            for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
            if raw.get(k) is None
        ]
        if missing:
            raise ValueError(f"model config lacks {missing}: the planner needs a decoder-only (Llama/Qwen2) config")
        model_type = raw.get("model_type", "")
        return cls(
            name=name or raw.get("_name_or_path") or model_type or "model",
            hidden_size=int(raw["hidden_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            num_key_value_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            head_dim=raw.get("head_dim"),
            # Qwen2's q/k/v always carry a bias (its config has no switch); Llama's follow attention_bias.
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
        )

    def linears(self) -> dict[str, tuple[int, int, bool]]:
        """Per-layer linears: name -> (in, out, has bias)."""
        h, q, kv, i = (
            self.hidden_size,
            self.num_attention_heads * self.d,
            self.num_key_value_heads * self.d,
            self.intermediate_size,
        )
        ab, mb = self.attention_bias, self.mlp_bias
        return {
            "q_proj": (h, q, ab),
            "k_proj": (h, kv, ab),
            "v_proj": (h, kv, ab),
            "o_proj": (q, h, False),
            "gate_proj": (h, i, mb),
            "up_proj": (h, i, mb),
            "down_proj": (i, h, mb),
        }

    def parameters(self) -> int:
        per_layer = sum(a * b + (b if bias else 0) for a, b, bias in self.linears().values()) + 2 * self.hidden_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.num_hidden_layers * per_layer + self.vocab_size * self.hidden_size + head + self.hidden_size
