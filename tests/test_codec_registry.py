"""The codec registry (quantization/codec.py, formats.py): every registered format keeps its promises, a codec
that does not is refused when it registers, an unregistered format or method is refused at validation naming the
registered ones, and a format of one's own is one module: ``Toy6Codec`` below, defined in this file alone (no
source file touched), is validated, written, served, planned, built into the policy and, in the integration tier,
trained one step through the real trainer on the smoke model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qerl_pipeline import config
from qerl_pipeline.config import ConfigError, MethodSpec, QerlConfig, register_method, validate
from qerl_pipeline.quantization import checkpoint, formats
from qerl_pipeline.quantization.codec import REGISTRY, Codec, CodecError, probe_weight, register
from qerl_pipeline.rollout.serving import decide, engine_dtype

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Toy6Codec(Codec):
    """6-bit symmetric round-to-nearest with one float32 scale per row: int8 codes in [-31, 31]."""

    name = "toy6"
    label = "TOY6"
    suffixes = ("weight_q6", "weight_s6")
    buffers = {"weight_q6": "q6", "weight_s6": "s6_bits"}
    settings = ("ignore",)
    max_rel_error = 0.05

    def encode(self, weight, settings):
        w = weight.float()
        scale = (w.abs().amax(-1, keepdim=True) / 31).clamp(min=1e-30)
        return {"weight_q6": torch.round(w / scale).clamp(-31, 31).to(torch.int8), "weight_s6": scale}

    def decode(self, tensors, shape, dtype, params):
        return (tensors["weight_q6"].to(torch.float32) * tensors["weight_s6"]).to(dtype)

    def tensor_specs(self, n_out, n_in, params):
        return {"weight_q6": ((n_out, n_in), torch.int8), "weight_s6": ((n_out, 1), torch.float32)}


@pytest.fixture(scope="module")
def toy():
    """The toy format and a method on it, registered for this module's tests and removed after them."""
    codec = register(Toy6Codec())
    spec = register_method(MethodSpec("toy6", "toy6", False, 1e-3, "Toy 6-bit + LoRA"))
    try:
        yield codec, spec
    finally:
        REGISTRY.pop(codec.name, None)
        config.METHOD_SPECS.pop(spec.name, None)


def _tiny_llama():
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
    return LlamaForCausalLM(cfg).eval()


# ----------------------------------------------------------------------------- every registered format
@pytest.mark.parametrize("fmt", formats.names())
def test_every_built_in_format_keeps_its_promises(fmt):
    """The registration checks hold, the planner's bytes are the written bytes, and each has a served row."""
    from qerl_pipeline.quantization.codec import round_trip_problem

    codec = formats.get(fmt)
    assert round_trip_problem(codec) is None
    w = probe_weight()
    if codec.quantizes:
        params = codec.params(codec.checkpoint_config([], {}))
        written = sum(t.numel() * t.element_size() for t in codec.encode(w, {}).values())
        assert codec.linear_bytes(*w.shape, params) == written
    cpu = decide(fmt, "cpu")
    assert cpu.dense and cpu.path == Path("serving") and cpu.served_format in (fmt, f"dense-decoded-{fmt}")
    cuda = decide(fmt, "cuda", vllm_features={"bitsandbytes"})
    assert cuda.base_format == fmt and cuda.platform == "cuda"


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_mxfp4_and_fp8_are_served_packed_on_cuda_through_compressed_tensors(fmt):
    served = decide(fmt, "cuda")
    assert (served.path, served.served_format, served.dense, served.engine_args) == (
        Path("."),
        fmt,
        False,
        {"quantization": "compressed-tensors"},
    )
    assert decide(fmt, "cpu").served_format == f"dense-decoded-{fmt}"
    with pytest.raises(ValueError, match="bfloat16/float16 activations only"):
        engine_dtype({"dtype": "float32"}, "cuda", served)
    assert engine_dtype({}, "cuda", served) == "bfloat16"


def test_the_format_sweep_methods_are_registered():
    assert {m: config.METHOD_FORMAT[m] for m in ("mxfp4", "mxfp4_noaqn", "fp8")} == {
        "mxfp4": "mxfp4",
        "mxfp4_noaqn": "mxfp4",
        "fp8": "fp8",
    }
    assert "mxfp4" in config.AQN_METHODS and "mxfp4_noaqn" not in config.AQN_METHODS
    assert all(config.METHOD_SPECS[m].quantized for m in ("mxfp4", "mxfp4_noaqn", "fp8"))
    cfg = validate({"compare": {"methods": "qerl mxfp4 fp8"}})
    assert cfg.compare.methods == ["qerl", "mxfp4", "fp8"]


# ----------------------------------------------------------------------------- refusals
class _Lossy(Toy6Codec):
    name = "toy_lossy"

    def decode(self, tensors, shape, dtype, params):
        return super().decode(tensors, shape, dtype, params) / 2  # a forgotten factor


class _WrongSpecs(Toy6Codec):
    name = "toy_specs"

    def tensor_specs(self, n_out, n_in, params):
        return {"weight_q6": ((n_out, n_in), torch.int16), "weight_s6": ((n_out, 1), torch.float32)}


class _Raises(Toy6Codec):
    name = "toy_raises"

    def encode(self, weight, settings):
        raise RuntimeError("no such kernel")


class _Unnamed(Toy6Codec):
    name = "toy-6"


@pytest.mark.parametrize(
    "codec, why",
    [
        (_Lossy(), r"decode\(encode\(w\)\) is 0\.5\d* off \(relative\), beyond its stated bound 0\.05"),
        (_WrongSpecs(), r"weight_q6 is torch\.int8 \(64, 128\), expected torch\.int16"),
        (_Raises(), r"its round trip raised RuntimeError: no such kernel"),
        (_Unnamed(), r"a Python identifier is needed"),
        (type("Again", (Toy6Codec,), {"name": "nvfp4"})(), r"'nvfp4' is registered already"),
    ],
    ids=["lossy", "specs", "raises", "name", "taken"],
)
def test_a_codec_that_breaks_its_promises_is_refused_when_it_registers(codec, why):
    before = dict(REGISTRY)
    with pytest.raises(CodecError, match=why):
        register(codec)
    assert REGISTRY == before


def test_an_unregistered_format_or_method_is_refused_naming_the_registered_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"method: Input should be 'qerl', .*'fp8' \(got 'toy7'\)"):
        validate({"method": "toy7"})
    for section in ({"compare": {"methods": ["qerl", "toy7"]}}, {"benchmark": {"methods": ["toy7"]}}):
        with pytest.raises(ConfigError, match=r"Input should be 'qerl', .* \(got 'toy7'\)"):
            validate(section)
    with pytest.raises(ConfigError, match=r"lr: unknown method 'toy7'; allowed: qerl, .*, fp8"):
        validate({"optim": {"lr": {"toy7": 1e-3}}})
    with pytest.raises(ValueError, match=r"unknown base format 'int3'; registered formats: .*mxfp4"):
        register_method(MethodSpec("toy7", "int3", False, 1e-3, "int3"))
    assert "toy7" not in config.METHOD_SPECS
    with pytest.raises(ValueError, match="method 'qerl' is registered already"):
        register_method(MethodSpec("qerl", "nvfp4", True, 1e-5, "again"))
    with pytest.raises(ValueError, match=r"unknown method or format 'int3'; registered methods: qerl"):
        checkpoint.base_dir_for(tmp_path, "int3")
    with pytest.raises(ValueError, match=r"unsupported quantization format 'int3'; registered formats"):
        formats.format_of({"qerl_quantization": {"format": "int3"}})


# ----------------------------------------------------------------------------- a format of one's own
def test_a_registered_codec_is_accepted_by_validation(toy):
    cfg = validate({"method": "toy6", "optim": {"lr": {"toy6": 2e-3}}, "benchmark": {"methods": ["toy6", "qerl"]}})
    assert cfg.method == "toy6" and config.METHOD_FORMAT["toy6"] == "toy6" and not cfg.aqn_enabled()
    assert config.METHOD_SPECS["toy6"].quantized and "toy6" in config.METHODS
    # compare's branches (and its pipeline) are the methods registered when the config module was imported
    with pytest.raises(ConfigError, match="toy6 registered after the compare branches were built"):
        validate({"compare": {"methods": ["qerl", "toy6"]}})
    served = decide("toy6", "cuda")  # no vLLM scheme of its own: the dense decoded copy, on CUDA too
    assert (served.path, served.served_format, served.dense) == (Path("serving"), "dense-decoded-toy6", True)


@pytest.fixture(scope="module")
def toy_base(toy, tmp_path_factory):
    folder = tmp_path_factory.mktemp("toy") / "base_toy6"
    stats = checkpoint.write_base(_tiny_llama(), None, "toy6", folder)
    return folder, stats


def test_a_registered_codec_writes_and_reads_its_base(toy_base):
    import json

    folder, stats = toy_base
    assert checkpoint.base_format(folder) == "toy6"
    assert json.loads((folder / "config.json").read_text())["qerl_quantization"] == {
        "format": "toy6",
        "ignore": ["lm_head"],
    }
    tensors = checkpoint.read_tensors(folder)
    assert tensors["model.layers.0.self_attn.q_proj.weight_q6"].dtype == torch.int8
    assert (
        "model.layers.0.self_attn.q_proj.weight" not in tensors and tensors["lm_head.weight"].dtype == torch.bfloat16
    )
    assert stats["n_quantized_linears"] == 14 and 0 < stats["rel_error_max"] < Toy6Codec.max_rel_error


BUFFERS = {
    "mxfp4": {"packed": torch.uint8, "scale_exponents": torch.uint8},
    "fp8": {"codes": torch.uint8, "scale_bits": torch.int16},
    "toy6": {"q6": torch.int8, "s6_bits": torch.int32},
}


@pytest.mark.parametrize("fmt", sorted(BUFFERS))
def test_a_codec_trains_in_the_policy(toy, fmt, tmp_path):
    """The policy holds the codec's buffers (floats as their bits), computes what the dense decoded copy (what vLLM
    on CPU serves) computes, its dense state is that copy, and LoRA learns over it."""
    from transformers import AutoModelForCausalLM

    from qerl_pipeline.config import LoraConfig
    from qerl_pipeline.quantization.policy import PackedLinear, build_policy, dense_state_dict

    folder = tmp_path / fmt
    checkpoint.write_base(_tiny_llama(), None, fmt, folder)
    checkpoint.write_serving(folder, checkpoint.serving_dir(folder))  # what the first CPU engine start writes
    policy = build_policy(folder, fmt, LoraConfig(rank=4, alpha=8, target_modules=TARGETS), dtype=torch.float32)
    layers = [m for m in policy.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 14 and all(m.codec is formats.get(fmt) for m in layers)
    assert {n: b.dtype for n, b in layers[0].named_buffers()} == BUFFERS[fmt]
    served = checkpoint.read_tensors(checkpoint.serving_dir(folder))
    ours = dense_state_dict(policy)
    assert ours.keys() == served.keys() and all(torch.equal(ours[k], t) for k, t in served.items())
    dense = AutoModelForCausalLM.from_pretrained(checkpoint.serving_dir(folder), dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            policy.eval()(input_ids=ids).logits, dense(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )
    policy.train()
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trainable]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    policy(input_ids=ids).logits.float().pow(2).mean().backward()
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, trainable, strict=True))


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4", "mxfp4", "fp8", "toy6"])
def test_the_planner_takes_the_bytes_of_each_codec(toy, fmt, tmp_path):
    """The planner's packed base linears == what the policy holds, for every quantizing format (toy6 included)."""
    from qerl_pipeline.config import LoraConfig
    from qerl_pipeline.planner import sizing
    from qerl_pipeline.planner.model_shape import ModelShape
    from qerl_pipeline.quantization.policy import build_policy, parameter_bytes

    model = _tiny_llama()
    checkpoint.write_base(model, None, fmt, tmp_path / fmt)
    method = next(m for m, s in config.METHOD_SPECS.items() if s.format == fmt)
    cfg = QerlConfig.model_validate({"method": method, "lora": {"rank": 4, "alpha": 8}})
    policy = build_policy(
        tmp_path / fmt, fmt, LoraConfig(rank=4, alpha=8, target_modules=TARGETS), dtype=torch.float32
    )
    planned = sizing.weight_bytes(cfg, ModelShape.from_config(model.config))["base_linears"]
    assert planned == parameter_bytes(policy)["packed_base"] > 0


@pytest.mark.vllm
def test_a_registered_codec_trains_one_step_through_the_trainer(toy, tmp_path, sqlite_store):
    """The smoke env's settings with ``method: toy6``: base written by the store, served dense by vLLM on CPU
    (``dense-decoded-toy6``), one GRPO step by ``rl.trainer.train`` (rollout, reward, update, adapter sync)."""
    from qerl_pipeline.planner.inputs import load_config
    from qerl_pipeline.quantization.store import ensure_base
    from qerl_pipeline.rl import trainer
    from qerl_pipeline.rl.run_setup import Reporting
    from qerl_pipeline.tracking import MemoryLogger
    from tests.helpers.project import PROJECT
    from tests.helpers.rewards import letter_fraction

    cfg = load_config(
        "smoke", "method=toy6,optim.lr.toy6=1e-2,train.steps=1,train.checkpoint_every=1", conf_dir=PROJECT / "conf"
    )
    folder, report, reused = ensure_base(cfg.model, cfg.quantize, "toy6", tmp_path / "base_toy6")
    assert not reused and report["format"] == "toy6" and checkpoint.base_format(folder) == "toy6"
    records = [
        {"id": str(i), "messages": [{"role": "user", "content": f"What is {i} plus {i}?"}], "gold": str(2 * i)}
        for i in range(1, 5)
    ]
    logger = MemoryLogger()
    result = trainer.train(
        cfg,
        folder,
        records,
        output_dir=tmp_path / "runs",
        reporting=Reporting(make_logger=lambda _rid: logger, progress=False),
        reward_fn=letter_fraction,
    )
    assert result.steps == 1 and (result.adapter_dir / "adapter_model.safetensors").is_file()
    (row,) = result.history
    assert torch.isfinite(torch.tensor(row["loss"])) and row["optim/grad_norm"] > 0
    assert logger.tags["rollout.served_format"] == "dense-decoded-toy6"
