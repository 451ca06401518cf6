"""benchmarking.hardware: the limit arithmetic on fixed numbers, and the measurements' sanity."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

from qerl_pipeline.benchmarking import hardware

CONFIG = {  # a tiny Llama: hidden 128, 2 layers, 2 heads of 64, 1 KV head, MLP 256, vocab 1000
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 256,
    "vocab_size": 1000,
}
LAYER = 128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 256  # q + k,v + o + gate,up,down = 147456
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_rollout_limit_is_batch_times_bandwidth_over_bytes():
    assert hardware.rollout_limit_tokens_per_s(100.0, 1e9, 1) == pytest.approx(100.0)
    assert hardware.rollout_limit_tokens_per_s(100.0, 1e9, 8) == pytest.approx(800.0)
    # the compute bound caps it: 1e12 FLOP/s / 2e9 FLOP per token = 500 tokens/s
    assert hardware.rollout_limit_tokens_per_s(100.0, 1e9, 8, matmul_flops=1e12, flops_per_token=2e9) == pytest.approx(
        500.0
    )
    assert hardware.rollout_limit_tokens_per_s(100.0, 1e9, 2, matmul_flops=1e12, flops_per_token=2e9) == pytest.approx(
        200.0
    )


@pytest.mark.parametrize("args", [(0.0, 1e9, 1), (10.0, 0, 1), (10.0, 1e9, 0)])
def test_rollout_limit_rejects_non_positive_inputs(args):
    with pytest.raises(ValueError, match="positive"):
        hardware.rollout_limit_tokens_per_s(*args)


def test_training_limit_and_fraction():
    lim = hardware.training_limit(step_flops=1e12, matmul_flops=1e11, tokens_per_step=1000)
    assert lim == {"min_step_time_s": pytest.approx(10.0), "max_tokens_per_s": pytest.approx(100.0)}
    assert hardware.fraction_of_limit(25.0, lim["max_tokens_per_s"]) == pytest.approx(0.25)
    assert math.isnan(hardware.fraction_of_limit(0.0, 100.0))
    assert math.isnan(hardware.fraction_of_limit(None, 100.0))
    with pytest.raises(ValueError):
        hardware.training_limit(0.0, 1e11, 10)


def test_parameter_counts():
    assert hardware.model_shape(CONFIG)["head_dim"] == 64
    assert hardware.matmul_params(CONFIG, include_lm_head=False) == 2 * LAYER
    assert hardware.matmul_params(CONFIG) == 2 * LAYER + 128 * 1000
    # rank 4 on q (128->128) and k (128->64): 2 layers x 4 x (256 + 192)
    assert hardware.lora_params(CONFIG, 4, ["q_proj", "k_proj"]) == 2 * 4 * (256 + 192)
    with pytest.raises(ValueError, match="unknown module"):
        hardware.lora_params(CONFIG, 4, ["qkv"])


def test_decode_flops_per_token():
    assert hardware.decode_flops_per_token(CONFIG) == 2 * (2 * LAYER + 128 * 1000)
    # attention over 10 context tokens: 4 * layers * heads * head_dim * context
    assert hardware.decode_flops_per_token(CONFIG, 10) == 2 * (2 * LAYER + 128 * 1000) + 4 * 2 * 2 * 64 * 10


def test_training_step_flops_by_hand():
    n_seq, seq, t_logit, rank = 3, 20, 5, 4
    body, head = 2 * LAYER, 128 * 1000
    lora = hardware.lora_params(CONFIG, rank, ALL)
    tokens = n_seq * seq
    attn = n_seq * 2 * 2.0 * 2 * 64 * seq**2
    fwd = 2 * (body + lora) * tokens + 2 * head * n_seq * t_logit + attn
    bwd = 2 * body * tokens + 4 * lora * tokens + 2 * head * n_seq * t_logit + 2 * attn
    got = hardware.training_step_flops(CONFIG, n_seq, seq, rank, ALL, logit_positions=t_logit)
    assert got == pytest.approx(fwd + bwd)
    # gradient checkpointing adds one forward; default logits on every position
    assert hardware.training_step_flops(
        CONFIG, n_seq, seq, rank, ALL, logit_positions=t_logit, gradient_checkpointing=True
    ) == pytest.approx(2 * fwd + bwd)
    full = hardware.training_step_flops(CONFIG, n_seq, seq, rank, ALL)
    assert full - got == pytest.approx(4 * head * n_seq * (seq - t_logit))


def test_served_weight_bytes_counts_what_a_decode_step_reads(tmp_path):
    untied = tmp_path / "untied"
    untied.mkdir()
    save_file(
        {
            "model.embed_tokens.weight": torch.zeros(100, 8),  # 3200 bytes: only gathered rows, not counted
            "lm_head.weight": torch.zeros(100, 8),  # 3200
            "model.layers.0.self_attn.q_proj.weight_packed": torch.zeros(8, 4, dtype=torch.uint8),  # 32
            "model.layers.0.self_attn.q_proj.weight_scale": torch.zeros(8, 1, dtype=torch.float8_e4m3fn),  # 8
            "model.norm.weight": torch.zeros(8, dtype=torch.bfloat16),  # 16
        },
        str(untied / "model.safetensors"),
    )
    got = hardware.served_weight_bytes(untied)
    assert got == {"total": 3200 + 32 + 8 + 16, "linear": 3200 + 40, "embedding": 0, "other": 16}
    tied = tmp_path / "tied"
    tied.mkdir()
    save_file(
        {"model.embed_tokens.weight": torch.zeros(100, 8), "model.norm.weight": torch.zeros(8)},
        str(tied / "model.safetensors"),
    )
    assert hardware.served_weight_bytes(tied) == {"total": 3232, "linear": 0, "embedding": 3200, "other": 32}
    with pytest.raises(FileNotFoundError):
        hardware.served_weight_bytes(tmp_path)


def test_measurements_are_positive_and_finite():
    bw = hardware.measure_memory_bandwidth(nbytes=8 << 20, repeats=2)
    rate = hardware.measure_matmul_rate(n=128, repeats=2)
    for value in (bw, rate):
        assert isinstance(value, float) and math.isfinite(value) and value > 0
    hw = hardware.measure_hardware(repeats=1)
    assert hw["device"] == "cpu" and hw["matmul_dtype"] == "float32"
    assert hw["bandwidth_gbs"] > 0 and hw["matmul_flops"] > 0 and hw["cpu_cores"] >= 1
