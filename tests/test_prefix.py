"""Each GRPO group's prompt scored once (``rl/prefix.py``), decoded weights kept per update
(``quantization/policy.decoded_weights``), and the periodic KL reference: same numbers as
full rows and per-use decodes, fewer passes. Fast tier: tiny random models, no vLLM, no Kedro."""

from __future__ import annotations

import pytest
import torch

from qerl_pipeline.config import LoraConfig, QerlConfig
from qerl_pipeline.quantization import checkpoint, nvfp4
from qerl_pipeline.quantization.policy import (
    DENSE_TRACKER,
    PackedLinear,
    build_policy,
    decoded_weights,
    keeps_decoded_weights,
)
from qerl_pipeline.rl import prefix, update
from qerl_pipeline.rl.records import Batch

TEMP = 0.7
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(arch: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    else:  # q/k/v biases, tied head
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.eval()


def _grouped_batch(prompt_lens=(5, 9, 7), group=3, seed=0):
    """Rows of ``len(prompt_lens)`` prompts x ``group`` completions of different lengths, right-padded, shuffled."""
    g = torch.Generator().manual_seed(seed)
    rows, p_lens, c_lens = [], [], []
    for p in prompt_lens:
        prompt = torch.randint(3, 256, (p,), generator=g)
        for _ in range(group):
            c = int(torch.randint(1, 12, (1,), generator=g))
            rows.append(torch.cat([prompt, torch.randint(3, 256, (c,), generator=g)]))
            p_lens.append(p)
            c_lens.append(c)
    ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    perm = torch.randperm(len(rows), generator=g)  # a prompt's rows need not be adjacent
    c = torch.tensor(c_lens)[perm]
    t_max = int(c.max())
    return ids[perm], torch.tensor(p_lens)[perm], t_max, (torch.arange(t_max)[None] < c[:, None]).float()


def _peft(model, train_norms=True):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    policy = get_peft_model(model, PeftLoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    if train_norms:
        for name, p in policy.named_parameters():
            if "norm" in name:
                p.requires_grad_(True)
    return policy.train()


def _score(policy, ids, p_lens, t_max, mask, share):
    policy.zero_grad(set_to_none=True)
    logp, ent = update.completion_logprobs(policy, ids, p_lens, t_max, TEMP, share_prompts=share)
    (logp * mask * torch.linspace(0.5, 1.5, mask.numel()).view_as(mask)).sum().backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    return (logp.detach() * mask, ent * mask, grads)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_shared_prompt_scores_and_gradients_equal_full_rows(arch):
    policy = _peft(_model(arch))
    ids, p_lens, t_max, mask = _grouped_batch()
    calls = []
    real = policy.get_base_model().model.forward

    def spy(*args, **kwargs):
        calls.append(tuple(kwargs["input_ids"].shape))
        return real(*args, **kwargs)

    policy.get_base_model().model.forward = spy
    full = _score(policy, ids, p_lens, t_max, mask, share=False)
    assert calls == [tuple(ids.shape)]
    calls.clear()
    shared = _score(policy, ids, p_lens, t_max, mask, share=True)
    # the shared path really ran: 3 distinct prompts minus their last token, then every row's T suffix tokens
    assert calls == [(3, 8), (ids.shape[0], t_max)]
    torch.testing.assert_close(shared[0], full[0], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(shared[1], full[1], atol=2e-5, rtol=1e-5)
    assert (
        full[2].keys() == shared[2].keys()
        and any("norm" in k for k in full[2])
        and any("lora_A" in k for k in full[2])
    )
    for name, want in full[2].items():
        got = shared[2][name]
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()) + 1e-7, name


def test_prompt_groups_match_length_and_tokens():
    ids = torch.tensor([[5, 6, 7, 1], [5, 6, 9, 9], [5, 6, 7, 2], [5, 6, 7, 1]])
    p_lens = torch.tensor([3, 2, 3, 2])
    first, of_row = prefix.prompt_groups(ids, p_lens)
    # rows 0 and 2 share [5, 6, 7]; rows 1 and 3 share [5, 6] (same tokens, same length)
    assert first == [0, 1] and of_row.tolist() == [0, 1, 0, 1]


def test_shared_path_steps_aside_where_it_cannot_apply():
    model = _model("llama")
    decoder = model.model
    ids, p_lens, t_max, _ = _grouped_batch()
    assert prefix.shared_prompt_hidden(decoder, ids, p_lens, t_max) is not None
    # every prompt distinct: nothing to share
    distinct = torch.randint(3, 256, (4, 12), generator=torch.Generator().manual_seed(3))
    assert prefix.shared_prompt_hidden(decoder, distinct, torch.full((4,), 5), 6) is None
    # a one-token prompt: its prefix would be empty
    assert prefix.shared_prompt_hidden(decoder, ids, torch.where(p_lens == 5, 1, p_lens), t_max) is None
    # gradient checkpointing drops the cache inside Hugging Face's layers
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert prefix.shared_prompt_hidden(decoder, ids, p_lens, t_max) is None


def test_a_decoder_that_ignores_the_cache_falls_back_to_full_rows(caplog):
    class NoCache(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, **kwargs):
            kwargs.pop("past_key_values", None)
            # a fresh cache each call: the suffix never sees the prefix
            return self.inner(input_ids=input_ids, **kwargs)

    decoder = NoCache(_model("llama").model)
    ids, p_lens, t_max, _ = _grouped_batch()
    prefix._warned.clear()
    assert prefix.shared_prompt_hidden(decoder, ids, p_lens, t_max) is None
    assert "did not extend the KV cache" in caplog.text


# --------------------------------------------------------------- decoded weights kept per update
@pytest.fixture(scope="module")
def nvfp4_base(tmp_path_factory):
    out = tmp_path_factory.mktemp("prefix") / "nvfp4"
    checkpoint.write_base(_model("llama"), None, "nvfp4", out)
    return out


def test_keeps_decoded_weights_by_platform():
    assert keeps_decoded_weights("auto", "cpu") is True
    assert keeps_decoded_weights("auto", "cuda") is False
    assert keeps_decoded_weights(True, "cuda") is True and keeps_decoded_weights(False, "cpu") is False
    with pytest.raises(ValueError, match="train.keep_decoded_weights"):
        keeps_decoded_weights("always", "cpu")
    with pytest.raises(Exception, match="keep_decoded_weights"):
        QerlConfig.model_validate({"train": {"keep_decoded_weights": "always"}})


def test_decoded_weights_decode_once_and_change_nothing(nvfp4_base, monkeypatch):
    lora = LoraConfig(rank=4, alpha=8, target_modules=TARGETS, train_norms=True)
    policy = build_policy(nvfp4_base, "nvfp4", lora, dtype=torch.float32)
    policy.train()
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    packed = [m for m in policy.modules() if isinstance(m, PackedLinear)]
    decodes = []
    real = nvfp4.decode
    monkeypatch.setattr(nvfp4, "decode", lambda *a, **k: decodes.append(1) or real(*a, **k))
    ids, p_lens, t_max, mask = _grouped_batch()
    per_use = _score(policy, ids, p_lens, t_max, mask, share=True)
    n_per_use = len(decodes)
    # prefix + suffix forwards and their backwards: more than one decode per linear
    assert n_per_use > 2 * len(packed)
    decodes.clear()
    DENSE_TRACKER.reset()
    with decoded_weights(policy):
        kept = _score(policy, ids, p_lens, t_max, mask, share=True)
        assert len(decodes) == len(packed)  # once per linear
        dense_bytes = sum(m.out_features * m.in_features * 4 for m in packed)
        largest = max(m.out_features * m.in_features * 4 for m in packed)
        # the whole base alive dense, and counted (plus one W + sBA of the fused LoRA at a time)
        assert dense_bytes <= DENSE_TRACKER.transient_peak <= dense_bytes + largest
    assert all(m._kept is None for m in packed)
    torch.testing.assert_close(kept[0], per_use[0], atol=0, rtol=0)
    for name in per_use[2]:
        torch.testing.assert_close(kept[2][name], per_use[2][name], atol=0, rtol=0)


def test_policy_update_keeps_weights_on_cpu_by_default(nvfp4_base, monkeypatch):
    from qerl_pipeline.rl.optim import build_optimizer

    cfg = QerlConfig.model_validate(
        {
            "method": "qerl",
            "lora": {"rank": 4, "alpha": 8},
            "grpo": {"num_generations": 3, "kl_beta": 0.0},
            "rollout": {"temperature": TEMP},
            "train": {"micro_batch_size": 9},
        }
    )
    policy = build_policy(nvfp4_base, "nvfp4", cfg.lora, dtype=torch.float32)
    policy.train()
    params = [p for p in policy.parameters() if p.requires_grad]
    opt, _ = build_optimizer(params, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    packed = [m for m in policy.modules() if isinstance(m, PackedLinear)]
    decodes = []
    real = nvfp4.decode
    monkeypatch.setattr(nvfp4, "decode", lambda *a, **k: decodes.append(1) or real(*a, **k))
    ids, p_lens, t_max, mask = _grouped_batch()
    roll = torch.full(mask.shape, -2.0)
    adv = torch.linspace(-1, 1, ids.shape[0])
    refs = []
    real_cl = update.completion_logprobs

    def spy(*args, **kwargs):
        refs.append(torch.is_grad_enabled())
        return real_cl(*args, **kwargs)

    monkeypatch.setattr(update, "completion_logprobs", spy)
    # step 0: the KL diagnostic's reference forward (no grad) runs; decodes stay one per linear for the whole update
    out0 = update.policy_update(
        policy, update.Optim(opt, sched, params, {}), Batch(ids, p_lens, roll, mask, adv), cfg, 0
    )
    assert refs == [False, True] and "policy/kl_to_base" in out0
    assert len(decodes) == len(packed)
    # step 1 (log_kl_to_base_every 5): no reference forward, no KL logged
    refs.clear()
    out1 = update.policy_update(
        policy, update.Optim(opt, sched, params, {}), Batch(ids, p_lens, roll, mask, adv), cfg, 1
    )
    assert refs == [True] and "policy/kl_to_base" not in out1
    assert update.reference_every(cfg) == 5
    assert update.reference_every(cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"kl_beta": 0.1})})) == 1
    assert (
        update.reference_every(cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"log_kl_to_base": False})}))
        == 0
    )


def test_benchmark_batch_groups_share_their_prompt():
    from qerl_pipeline.benchmarking.training import make_batch

    b = make_batch(256, num_prompts=2, group=4, prompt_len=6, completion_len=5)
    first, of_row = prefix.prompt_groups(b.ids, b.p_lens)
    assert first == [0, 4] and of_row.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert len({tuple(r) for r in b.ids[:, 6:].tolist()}) == 8  # completions differ


def test_training_flops_count_the_shared_prompt_once():
    from qerl_pipeline.benchmarking import hardware as hw

    config = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
    }
    s = hw.model_shape(config)
    body, lora = hw.matmul_params(config, include_lm_head=False), hw.lora_params(config, 4, TARGETS)
    head = s["hidden"] * s["vocab"]

    def oracle(tokens, pairs, logit_tokens=80):
        attn = s["layers"] * 4.0 * s["heads"] * s["head_dim"] * pairs
        return (
            2 * (body + lora) * tokens
            + 2 * head * logit_tokens
            + attn
            + 2 * body * tokens
            + 4 * lora * tokens
            + 2 * head * logit_tokens
            + 2 * attn
        )

    # 8 rows of 10 prompt + 10 completion tokens: full rows are 160 tokens, 8 x 20^2 / 2 attention pairs
    full = hw.training_step_flops(config, 8, 20, 4, TARGETS, logit_positions=10)
    assert full == pytest.approx(oracle(160, 8 * 20**2 / 2))
    # 2 prompts of 4 rows: 2 x 9 prefix tokens + 8 x 10 suffix tokens; prefix squares once, suffix over prefix + itself
    shared = hw.training_step_flops(config, 8, 20, 4, TARGETS, logit_positions=10, shared_prompts=(2, 10))
    assert shared == pytest.approx(oracle(2 * 9 + 8 * 10, 2 * 9**2 / 2 + 8 * (10 * 9 + 10**2 / 2)))
    assert shared < full


def test_planner_counts_what_the_head_keeps():
    from qerl_pipeline.planner import sizing as planner
    from qerl_pipeline.planner.model_shape import ModelShape
    from qerl_pipeline.rl import logprobs

    assert (
        planner.KEEP_SOFTMAX_BYTES == logprobs.DEFAULT_KEEP_BYTES
        and planner.HEAD_CHUNK == logprobs.DEFAULT_CHUNK_TOKENS
    )
    cfg = QerlConfig.model_validate({"method": "qerl"})
    small = ModelShape.from_config(
        {
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 1000,
        }
    )
    # 2 rows x 100 completion positions = 200 rows of 1000 fp32 probabilities: all kept
    assert planner.activation_bytes(cfg, small, 2, 200, 100)["kept_softmax"] == 200 * 1000 * 4
    big = ModelShape.from_config(
        {
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 152064,
        }
    )
    # V = 152k: one 512-row chunk is 311 MB > 256 MiB, nothing is kept
    assert planner.activation_bytes(cfg, big, 4, 2048, 1024)["kept_softmax"] == 0
    dense = cfg.model_copy(update={"train": cfg.train.model_copy(update={"keep_decoded_weights": True})})
    extra = (
        planner.activation_bytes(dense, small, 2, 200, 100)["transient"]
        - planner.activation_bytes(cfg, small, 2, 200, 100)["transient"]
    )
    assert extra > 0  # the dense base alive through the update is planned for when asked for
