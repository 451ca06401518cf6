"""The trainable policy over packed NVFP4 / NF4 / plain bases."""

from __future__ import annotations

import pytest
import torch

from qerl_pipeline.config import LoraConfig
from qerl_pipeline.quantization import checkpoint, store
from qerl_pipeline.quantization.policy import (
    DENSE_TRACKER,
    PackedLinear,
    build_policy,
    dense_state_dict,
    load_adapter_weights,
    measure_training_memory,
    parameter_bytes,
    trainable_state_dict,
)

FORMATS = ("nvfp4", "nf4", "bf16")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LAYERS = 2


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """A small random Llama (GQA, untied lm_head) written in all three formats, each with its dense serving copy
    (``store.ensure_serving``: what a CPU engine serves)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms, so that norm gradients and values are meaningful
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    root = tmp_path_factory.mktemp("bases")
    stats = {fmt: checkpoint.write_base(model, None, fmt, root / fmt) for fmt in FORMATS}
    for fmt in FORMATS:
        store.ensure_serving(root / fmt)
    return root, stats


def _ids(seed=0, shape=(2, 11)):
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


def _lora(**kw):
    return LoraConfig(**{"rank": 4, "alpha": 8, "target_modules": TARGETS, **kw})


@pytest.mark.parametrize("fmt", FORMATS)
def test_logits_equal_the_decoded_dense_model(bases, fmt):
    from transformers import AutoModelForCausalLM

    root, _ = bases
    policy = build_policy(root / fmt, fmt, _lora(), dtype=torch.float32).eval()
    dense = AutoModelForCausalLM.from_pretrained(checkpoint.serving_dir(root / fmt), dtype=torch.float32).eval()
    ids = _ids()
    with torch.no_grad():
        got, want = policy(input_ids=ids).logits, dense(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if fmt != "bf16":
        mods = [m for m in policy.modules() if isinstance(m, PackedLinear)]
        assert len(mods) == LAYERS * len(TARGETS)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_gradients_reach_every_target(bases, fmt, checkpointing):
    root, _ = bases
    policy = build_policy(
        root / fmt, fmt, _lora(train_norms=True, gradient_checkpointing=checkpointing), dtype=torch.float32
    )
    policy.train()
    with torch.no_grad():  # B starts at zero (so A's gradient would be zero): make both sides live
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    policy(input_ids=_ids()).logits.float().pow(2).mean().backward()
    trainable = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    lora = [n for n in trainable if "lora_" in n]
    norms = [n for n in trainable if "norm" in n]
    assert len(lora) == 2 * LAYERS * len(TARGETS)
    assert len(norms) == 2 * LAYERS + 1
    for target in TARGETS:
        assert sum(f".{target}.lora_A" in n for n in lora) == LAYERS
    dead = [n for n, p in trainable.items() if p.grad is None or not torch.any(p.grad != 0)]
    assert dead == []
    frozen_with_grad = [n for n, p in policy.named_parameters() if not p.requires_grad and p.grad is not None]
    assert frozen_with_grad == []
    assert set(trainable_state_dict(policy)) == set(trainable)


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4"])
def test_no_dense_copy_stays_resident(bases, fmt):
    root, _ = bases
    policy = build_policy(root / fmt, fmt, _lora(), dtype=torch.float32).train()
    packed = [m for m in policy.modules() if isinstance(m, PackedLinear)]
    weight_shapes = {(m.out_features, m.in_features) for m in packed}
    layer_bytes = max(m.out_features * m.in_features * 4 for m in packed)
    # 1. no parameter or buffer anywhere is a float tensor of a packed linear's shape
    for name, t in list(policy.named_parameters()) + list(policy.named_buffers()):
        if t.is_floating_point() and "lora_" not in name:
            assert tuple(t.shape) not in weight_shapes or "embed" in name or "lm_head" in name, name
    # 2. nothing weight-shaped is saved for backward
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = policy(input_ids=_ids(shape=(1, 5))).logits.sum()
    assert saved and not [s for s in saved if s[0] in weight_shapes and s[1].is_floating_point]
    out.backward()
    # 3. at most one decoded layer alive at any time during forward+backward, with its W + sBA (the fused LoRA)
    mem = measure_training_memory(policy, _ids(shape=(1, 5)))
    assert 0 < mem["peak_dense_transient"] <= 2 * layer_bytes
    assert DENSE_TRACKER.live == DENSE_TRACKER.baseline
    # 4. resident bytes of the packed linears: 4.5 bits a weight (+ one fp32 global scale each)
    numel = sum(m.out_features * m.in_features for m in packed)
    assert mem["resident_packed_base"] == sum(m.packed_bytes() for m in packed)
    assert mem["resident_packed_base"] * 8 / numel == pytest.approx(4.5, abs=0.05)
    assert mem["peak_param_bytes"] == mem["resident_total"] + mem["peak_dense_transient"]


def test_parameter_bytes_by_format(bases):
    root, _ = bases
    sizes = {fmt: parameter_bytes(build_policy(root / fmt, fmt, _lora(), dtype=torch.float32)) for fmt in FORMATS}
    for s in sizes.values():
        assert s["total"] == s["packed_base"] + s["lora"] + s["other"]
    assert sizes["nvfp4"]["lora"] == sizes["bf16"]["lora"] > 0
    assert sizes["nvfp4"]["other"] == sizes["bf16"]["other"]
    # plain base linears are float32 on CPU: 32 bits vs 4.5 -> ratio ~ 0.14
    assert sizes["nvfp4"]["packed_base"] / sizes["bf16"]["packed_base"] == pytest.approx(4.5 / 32, rel=0.01)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dense_state_dict_matches_serving_copy(bases, fmt):
    root, _ = bases
    policy = build_policy(root / fmt, fmt, _lora(), dtype=torch.float32)
    ours = dense_state_dict(policy)
    served = checkpoint.read_tensors(checkpoint.serving_dir(root / fmt))
    assert ours.keys() == served.keys()
    for key, tensor in served.items():
        assert torch.equal(ours[key], tensor), key


def test_adapter_save_and_reload(bases, tmp_path):
    root, _ = bases
    a = build_policy(root / "nvfp4", "nvfp4", _lora(), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in a.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    a.save_pretrained(tmp_path / "adapter")
    b = build_policy(root / "nvfp4", "nvfp4", _lora(), dtype=torch.float32).eval()
    ids = _ids()
    with torch.no_grad():
        assert not torch.allclose(a(input_ids=ids).logits, b(input_ids=ids).logits)
        load_adapter_weights(b, tmp_path / "adapter")
        torch.testing.assert_close(a(input_ids=ids).logits, b(input_ids=ids).logits)


def test_bf16_compute_dtype_decodes_in_bf16(bases):
    root, _ = bases
    policy = build_policy(root / "nvfp4", "nvfp4", _lora(), dtype=torch.bfloat16)
    layer = next(m for m in policy.modules() if isinstance(m, PackedLinear))
    assert layer.dense_weight().dtype == torch.bfloat16
    before = layer.dense_weight(torch.float32)
    policy.to(torch.float16)  # a stray cast must not touch the codes or scales
    assert layer.gs_bits.dtype == torch.int32 and layer.scale_bits.dtype == torch.uint8
    assert torch.equal(layer.dense_weight(torch.float32), before)


def test_errors_name_the_problem(bases):
    root, _ = bases
    with pytest.raises(ValueError, match="holds a 'nvfp4' base"):
        build_policy(root / "nvfp4", "nf4", _lora(), dtype=torch.float32)
    with pytest.raises(ValueError, match="lora.target_modules"):
        build_policy(root / "nvfp4", "nvfp4", _lora(target_modules=["qkv_proj"]), dtype=torch.float32)
    policy = build_policy(root / "nvfp4", "nvfp4", _lora(), dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="merge"):
        policy.merge_adapter()


def test_tied_lm_head_is_never_quantized(tmp_path):
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg)
    stats = checkpoint.write_base(model, None, "nvfp4", tmp_path / "b", ignore=[])  # lm_head not ignored
    ignore = json.loads((tmp_path / "b" / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore == ["lm_head"] and stats["n_quantized_linears"] == 7
    policy = build_policy(tmp_path / "b", "nvfp4", _lora(), dtype=torch.float32)
    base = policy.get_base_model()
    assert base.lm_head.weight is base.model.embed_tokens.weight


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4"])
def test_fused_lora_forward_equals_peft(bases, fmt, monkeypatch):
    """``PackedLoraLinear``'s one-matmul LoRA (``_PackedLoraMatmul``) against PEFT's own forward."""
    from qerl_pipeline.quantization import policy as pol

    root, _ = bases
    policy = build_policy(root / fmt, fmt, _lora(train_norms=True), dtype=torch.float32).train()
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
    ids = _ids(shape=(3, 9))
    fused_calls = []
    real = pol._PackedLoraMatmul.apply
    monkeypatch.setattr(pol._PackedLoraMatmul, "apply", lambda *a: fused_calls.append(1) or real(*a))

    def run():
        policy.zero_grad(set_to_none=True)
        logits = policy(input_ids=ids).logits
        (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}

    fused = run()
    assert len(fused_calls) == LAYERS * len(TARGETS)
    fused_calls.clear()
    lora_layers = [m for m in policy.modules() if type(m).__name__ == "PackedLoraLinear"]
    monkeypatch.setattr(type(lora_layers[0]), "_fused_adapter", lambda self, x, args, kwargs: None)
    peft = run()
    assert not fused_calls
    torch.testing.assert_close(fused[0], peft[0], atol=1e-5, rtol=1e-5)
    assert (
        fused[1].keys() == peft[1].keys() and any("lora_A" in k for k in peft[1]) and any("norm" in k for k in peft[1])
    )
    for name, want in peft[1].items():
        assert float((fused[1][name] - want).abs().max()) <= 1e-5 * float(want.abs().max()) + 1e-8, name


def test_fused_lora_steps_aside(bases):
    root, _ = bases
    x = torch.randn(2, 5, 64)
    drop = build_policy(root / "nvfp4", "nvfp4", _lora(dropout=0.1), dtype=torch.float32)
    plain = build_policy(root / "nvfp4", "nvfp4", _lora(), dtype=torch.float32)
    layer = next(m for m in plain.modules() if type(m).__name__ == "PackedLoraLinear")
    assert layer._fused_adapter(x, (), {}) == "default"
    assert next(m for m in drop.modules() if type(m).__name__ == "PackedLoraLinear")._fused_adapter(x, (), {}) is None
    assert layer._fused_adapter(x.bfloat16(), (), {}) is None  # bf16: W + sBA would round the delta away
    with plain.disable_adapter():
        assert layer._fused_adapter(x, (), {}) is None
    # CUDA, where the dispatcher picks the fused Triton NVFP4 kernel: PEFT's forward over it
    layer.base_layer.uses_triton = lambda op, a: True
    assert layer._fused_adapter(x, (), {}) is None
