"""The memory planner (``qerl_pipeline.planner``) against the project's real tensors.

Fast tier: tiny random Llama / Qwen2 bases written with ``checkpoint.write_base`` and loaded
with ``policy.build_policy`` (no vLLM, no Kedro run). Every trainer-side figure the planner
computes is compared with bytes measured on those objects: the packed base and the rest of
the policy's parameters and buffers, the LoRA, the AdamW (torch and bitsandbytes 8-bit) state
after one step, and the activations autograd saves in a forward through
``update.completion_logprobs`` (counted with ``saved_tensors_hooks``), with and without
gradient checkpointing. The config is read through Kedro's own loader, compared with the
loader ``kedro run`` builds. The engine-side figures (vLLM) have no CPU counterpart here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qerl_pipeline.config import QerlConfig
from qerl_pipeline.planner import cli, inputs, sizing
from qerl_pipeline.planner.model_shape import ModelShape
from qerl_pipeline.quantization import checkpoint
from qerl_pipeline.quantization.policy import PackedLinear, build_policy
from qerl_pipeline.rl.update import completion_logprobs

CONF = Path(__file__).resolve().parents[1] / "conf"
NF4_BLOCK = 48  # not a divisor of every weight's numel: exercises the trailing partial block


def _tiny(kind: str):
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
    if kind == "llama":  # untied head, no biases
        return LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True)).eval()  # q/k/v biases, tied head


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """``(kind, fmt) -> (base folder, ModelShape read from the model's config)``."""
    root = tmp_path_factory.mktemp("planner")
    out = {}
    for kind in ("llama", "qwen2"):
        model = _tiny(kind)
        shape = ModelShape.from_config(model.config)
        for fmt in ("nvfp4", "nf4", "bf16"):
            folder = root / f"{kind}_{fmt}"
            checkpoint.write_base(model, None, fmt, folder, settings={"nf4_blocksize": NF4_BLOCK})
            out[kind, fmt] = (folder, shape)
    return out


def _cfg(
    fmt: str,
    *,
    dtype: str = "bfloat16",
    train_norms: bool = True,
    gc: bool = False,
    rank: int = 4,
    optim: str = "adamw",
    seq: int = 40,
    completion: int = 20,
    entropy_coef: float = 0.0,
) -> QerlConfig:
    method = {"nvfp4": "qerl", "nf4": "qlora", "bf16": "lora"}[fmt]
    return QerlConfig.model_validate(
        {
            "method": method,
            "model": {"dtype": dtype, "max_seq_len": seq},
            "quantize": {"nf4_blocksize": NF4_BLOCK},
            "lora": {"rank": rank, "alpha": 2 * rank, "train_norms": train_norms, "gradient_checkpointing": gc},
            "optim": {"name": optim},
            "rollout": {"max_new_tokens": completion},
            "grpo": {"entropy_coef": entropy_coef},
        }
    )


def _policy(bases, kind, fmt, cfg):
    folder, shape = bases[kind, fmt]
    dtype = torch.float32 if cfg.model.dtype == "float32" else torch.bfloat16
    return build_policy(folder, fmt, cfg.lora, dtype=dtype, norm_dtype=cfg.model.norm_dtype), shape


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            total += _nbytes(t)
    return total


# ----------------------------------------------------------------------------- resident bytes
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("fmt", ["nvfp4", "nf4", "bf16"])
def test_resident_bytes_equal_the_policys_tensors(bases, kind, fmt):
    cfg = _cfg(fmt)
    policy, shape = _policy(bases, kind, fmt, cfg)
    model = policy.get_base_model()
    head = model.get_output_embeddings()
    base_linear = 0
    for name, mod in model.named_modules():
        if isinstance(mod, PackedLinear):
            base_linear += mod.packed_bytes()
        elif isinstance(mod, torch.nn.Linear) and "lora_" not in name and mod is not head:
            base_linear += _nbytes(mod.weight)
    lora = sum(_nbytes(p) for n, p in policy.named_parameters() if "lora_" in n)
    everything = _unique_bytes([*policy.parameters(), *policy.buffers()])

    planned = sizing.weight_bytes(cfg, shape)
    assert planned["base_linears"] == base_linear
    assert sizing._trainer_resident(cfg, shape)["lora"] == lora
    assert sum(planned.values()) + lora == everything
    if fmt == "nvfp4":  # 4.5 bits a weight: the codes and one FP8 scale per 16 (+ 4 bytes per tensor)
        numel = shape.num_hidden_layers * sum(a * b for a, b, _ in shape.linears().values())
        assert base_linear == numel * 9 // 16 + 4 * 7 * shape.num_hidden_layers


def test_trainable_tensors_are_the_policys(bases):
    cfg = _cfg("nvfp4", train_norms=True)
    policy, shape = _policy(bases, "llama", "nvfp4", cfg)
    measured = sorted((p.numel(), p.element_size()) for p in policy.parameters() if p.requires_grad)
    assert sorted(sizing.trainable_tensors(cfg, shape)) == measured


# ----------------------------------------------------------------------------- optimizer state
def _one_step(opt, params):
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]


@pytest.mark.parametrize("train_norms", [False, True])
def test_torch_adamw_state_after_one_step(bases, train_norms):
    from qerl_pipeline.rl.optim import build_optimizer

    cfg = _cfg("nvfp4", train_norms=train_norms)
    policy, shape = _policy(bases, "llama", "nvfp4", cfg)
    params = [p for p in policy.parameters() if p.requires_grad]
    opt, note = build_optimizer(params, cfg)
    assert note == "torch AdamW"
    state = _one_step(opt, params)
    planned = sizing.optimizer_bytes(cfg, sizing.trainable_tensors(cfg, shape))
    assert planned["gpu"] + planned["host"] == _unique_bytes(state)
    assert sizing._trainer_resident(cfg, shape)["grads"] == sum(_nbytes(p.grad) for p in params)


def test_bitsandbytes_adamw8bit_state_after_one_step(bases):
    bnb = pytest.importorskip("bitsandbytes")
    # rank 64: lora_A of q/k/v/gate/up has 4096 elements (8-bit state), k/v's lora_B 2048 (kept fp32)
    cfg = _cfg("nvfp4", rank=64, optim="adamw_8bit")
    policy, shape = _policy(bases, "llama", "nvfp4", cfg)
    params = [p for p in policy.parameters() if p.requires_grad]
    sizes = {p.numel() for p in params}
    assert min(sizes) < sizing.BNB_MIN_8BIT_SIZE <= max(sizes)  # both kinds of state occur
    opt = bnb.optim.AdamW8bit(params, lr=1e-3)
    state = _one_step(opt, params)
    assert sizing.optimizer_bytes(cfg, sizing.trainable_tensors(cfg, shape))["gpu"] == _unique_bytes(state)


# ----------------------------------------------------------------------------- activations
def _saved_bytes(policy, b: int, seq: int, completion: int, entropy_grad: bool = False) -> int:
    """Bytes of the distinct tensors autograd saves in one forward (parameters and buffers excluded)."""
    own = {t.untyped_storage().data_ptr() for t in [*policy.parameters(), *policy.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in own:
            seen[st.data_ptr()] = st.nbytes()
        return t

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (b, seq), generator=g)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = completion_logprobs(
            policy, ids, torch.full((b,), seq - completion), completion, 1.0, entropy_grad=entropy_grad
        )
    assert logp.requires_grad
    return sum(seen.values())


@pytest.mark.parametrize(
    "kind,fmt,dtype,train_norms,gc",
    [
        ("llama", "nvfp4", "bfloat16", False, False),
        ("llama", "nvfp4", "bfloat16", True, False),
        ("qwen2", "nf4", "bfloat16", True, False),
        ("llama", "bf16", "bfloat16", False, False),
        ("llama", "nvfp4", "float32", True, False),
        ("llama", "nvfp4", "bfloat16", True, True),
        ("qwen2", "bf16", "bfloat16", False, True),
    ],
)
def test_saved_activations_equal_autograds(bases, kind, fmt, dtype, train_norms, gc):
    b, seq, completion = 3, 40, 20
    cfg = _cfg(fmt, dtype=dtype, train_norms=train_norms, gc=gc, seq=seq, completion=completion)
    policy, shape = _policy(bases, kind, fmt, cfg)
    policy.train()
    acts = sizing.activation_bytes(cfg, shape, b)
    assert acts["saved"] == _saved_bytes(policy, b, seq, completion)
    if gc:  # checkpointing keeps less, and pays one layer's recompute in backward
        full = sizing.activation_bytes(
            _cfg(fmt, dtype=dtype, train_norms=train_norms, seq=seq, completion=completion), shape, b
        )
        assert acts["saved"] < full["saved"] and acts["recompute"] == full["per_layer"] + full["rotary"]


def test_an_entropy_bonus_saves_the_entropy_for_backward(bases):
    """grpo.entropy_coef != 0 makes the head's entropy differentiable: one more fp32 per completion token saved."""
    b, seq, completion = 3, 40, 20
    plain = _cfg("nvfp4", seq=seq, completion=completion)
    bonus = _cfg("nvfp4", seq=seq, completion=completion, entropy_coef=0.01)
    policy, shape = _policy(bases, "llama", "nvfp4", bonus)
    policy.train()
    saved = _saved_bytes(policy, b, seq, completion, entropy_grad=True)
    assert sizing.activation_bytes(bonus, shape, b)["saved"] == saved
    assert saved - sizing.activation_bytes(plain, shape, b)["saved"] == 4 * b * completion


def test_saved_activations_scale_with_the_micro_batch(bases):
    cfg = _cfg("nvfp4")
    policy, shape = _policy(bases, "llama", "nvfp4", cfg)
    policy.train()
    for b in (1, 2, 5):
        assert sizing.activation_bytes(cfg, shape, b)["saved"] == _saved_bytes(policy, b, 40, 20)


# ----------------------------------------------------------------------------- the plan
def _paper(env: str, **params) -> QerlConfig:
    over = ",".join(f"{k}={v}" for k, v in params.items())
    return inputs.load_config(env, over or None, CONF)


def test_largest_micro_batch_is_the_boundary():
    cfg = _paper("paper_bigmath_7b")
    shape = inputs.PRESETS["qwen2.5-7b"]
    p = sizing.plan(cfg, shape, 80)
    assert 0 < p.max_micro_batch < p.rollout_batch
    assert sizing.plan(cfg, shape, 80, micro_batch=p.max_micro_batch).peak <= p.gpu_bytes
    assert sizing.plan(cfg, shape, 80, micro_batch=p.max_micro_batch + 1).peak > p.gpu_bytes
    assert p.peak == max(p.rollout_phase, p.update_phase) and p.fits == (p.engine_starts and p.peak <= p.gpu_bytes)


def test_sleep_gradient_checkpointing_and_utilization_move_the_plan():
    shape = inputs.PRESETS["qwen2.5-14b"]
    awake_cfg = _paper("paper_bigmath_14b", **{"rollout.sleep_between_steps": "false"})
    asleep_cfg = _paper("paper_bigmath_14b", **{"rollout.sleep_between_steps": "true"})
    awake, asleep = sizing.plan(awake_cfg, shape, 80), sizing.plan(asleep_cfg, shape, 80, empty_cache=False)
    # the default follows the code: the sleeper empties the trainer's cache, an awake engine never has it emptied
    assert (
        sizing.plan(asleep_cfg, shape, 80).to_dict() == sizing.plan(asleep_cfg, shape, 80, empty_cache=True).to_dict()
    )
    assert awake.to_dict() == sizing.plan(awake_cfg, shape, 80, empty_cache=False).to_dict()
    assert awake.update_phase - asleep.update_phase == awake.engine_reserved - asleep.engine_asleep
    # the trainer's cached activations meet the waking engine: sleep alone buys no larger micro-batch ...
    assert awake.max_micro_batch == asleep.max_micro_batch
    assert asleep.rollout_phase == asleep.update_phase - asleep.engine_asleep + asleep.engine_reserved
    # ... an emptied cache does
    emptied = sizing.plan(asleep_cfg, shape, 80, empty_cache=True)
    assert asleep.rollout_phase - emptied.rollout_phase == asleep.activations["peak"]
    assert emptied.max_micro_batch > asleep.max_micro_batch
    assert emptied.max_gpu_memory_utilization > asleep.max_gpu_memory_utilization
    assert sizing.plan(awake_cfg, shape, 80, empty_cache=True).max_micro_batch == awake.max_micro_batch
    no_gc = sizing.plan(_paper("paper_bigmath_14b", **{"lora.gradient_checkpointing": "false"}), shape, 80)
    assert no_gc.activations["peak"] > asleep.activations["peak"]
    low = sizing.plan(_paper("paper_bigmath_14b", **{"rollout.gpu_memory_utilization": 0.05}), shape, 80)
    assert not low.engine_starts and not low.fits and low.notes
    assert low.min_gpu_memory_utilization == asleep.min_gpu_memory_utilization
    starts = sizing.plan(
        _paper("paper_bigmath_14b", **{"rollout.gpu_memory_utilization": asleep.min_gpu_memory_utilization + 1e-3}),
        shape,
        80,
    )
    assert starts.engine_starts and starts.max_concurrent_rollouts >= 1


def test_kv_cache_per_token():
    cfg, shape = _paper("paper_bigmath_32b"), inputs.PRESETS["qwen2.5-32b"]
    # K and V, 64 layers, 8 KV heads of 128, bf16
    assert sizing.plan(cfg, shape, 80).kv_per_token == 2 * 64 * 8 * 128 * 2


def test_nf4_double_quant_is_refused_like_the_trainer():
    cfg = _paper("paper_bigmath_7b", method="qlora", **{"quantize.nf4_double_quant": "true"})
    with pytest.raises(ValueError, match="nf4_double_quant"):
        sizing.plan(cfg, inputs.PRESETS["qwen2.5-7b"], 80)


# ----------------------------------------------------------------------------- config and CLI
@pytest.mark.parametrize("env", ["smoke", "paper_bigmath_32b"])
def test_load_config_matches_kedros_loader(env):
    from kedro.config import OmegaConfigLoader

    from qerl_pipeline import settings

    loader = OmegaConfigLoader(conf_source=str(CONF), env=env, **settings.CONFIG_LOADER_ARGS)
    expected = QerlConfig.model_validate(loader["parameters"]).model_dump()
    assert inputs.load_config(env, conf_dir=CONF).model_dump() == expected


@pytest.mark.parametrize(
    "text",
    [
        "train.micro_batch_size=3,lora.gradient_checkpointing=false",
        "model.name=/tmp/a:b, rollout.gpu_memory_utilization=0.05,method=qlora",
        "a=",
        "",
    ],
)
def test_params_parse_as_kedro_runs_callback(text):
    import click
    from kedro.framework.cli.utils import _split_params

    assert inputs.parse_params(text) == _split_params(click.Context(click.Command("run")), None, text)
    with pytest.raises(ValueError, match="not key=value"):
        inputs.parse_params("train.micro_batch_size")


def test_params_override_and_bad_values_name_the_field():
    cfg = inputs.load_config("paper_bigmath_7b", "train.micro_batch_size=3,lora.gradient_checkpointing=false", CONF)
    assert cfg.train.micro_batch_size == 3 and cfg.lora.gradient_checkpointing is False
    with pytest.raises(ValueError, match="train.micro_batch_size"):
        inputs.load_config("paper_bigmath_7b", "train.micro_batch_size=-1", CONF)


def test_shape_from_a_local_config_folder(tmp_path):
    model = _tiny("qwen2")
    model.config.save_pretrained(tmp_path)
    cfg = inputs.load_config(None, f"model.name={tmp_path}", CONF)
    shape = inputs.resolve_shape(cfg)
    assert (
        shape.attention_bias
        and shape.tie_word_embeddings
        and shape.parameters() == sum(p.numel() for p in model.parameters())
    )


def test_cli_prints_the_table_and_json(capsys):
    assert (
        cli.main(["--conf-dir", str(CONF), "--env", "paper_bigmath_32b", "--gpu-gb", "80", "--methods", "qerl,lora"])
        == 0
    )
    out = capsys.readouterr().out
    assert "qerl (nvfp4)" in out and "lora (bf16)" in out and "fits" in out
    assert cli.main(["--conf-dir", str(CONF), "--env", "paper_bigmath_32b", "--gpu-gb", "80", "--format", "json"]) == 0
    (p,) = json.loads(capsys.readouterr().out)
    assert p["model"] == "Qwen/Qwen2.5-32B-Instruct" and p["method"] == "qerl"


def test_cli_errors_are_one_line(capsys):
    # the base env's SmolLM2 resolves through its preset
    assert cli.main(["--conf-dir", str(CONF), "--gpu-gb", "80"]) == 0
    capsys.readouterr()
    assert cli.main(["--conf-dir", str(CONF), "--gpu-gb", "80", "--params", "model.name=org/unknown-model"]) == 1
    assert "--model-preset" in capsys.readouterr().err
