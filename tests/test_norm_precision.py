"""Norm weights in fp32 under a bf16 model (quantization/norms.py, rollout/vllm_plugin.py).

Fast tier: the trainer's ``Fp32WeightRMSNorm`` against Hugging Face's and vLLM's RMSNorm
math, the swap in a bf16 policy, the served-noise check of config validation, and the vLLM
internals the plugin relies on (the out-of-tree op registry, ``RMSNorm``'s ``dtype``
argument, the IR op's mixed-dtype native path): each test fails when vLLM changes them.
Slow tier (``vllm``): a bf16 vLLM-CPU engine without the plugin, noise read back (with the
plugin: tests/test_train_precision.py, in a real run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from qerl_pipeline.config import ConfigError, QerlConfig
from qerl_pipeline.quantization import aqn, norms

PROJECT = Path(__file__).resolve().parents[1]
PAPER_ENVS = sorted(p.name for p in (PROJECT / "conf").glob("paper_*"))


def _hf_norm(hidden=64, dtype=torch.float32, seed=0):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    m = LlamaRMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(seed))
    return m.to(dtype)


def test_fp32_weight_norm_equals_hf_in_fp32_and_vllm_math_in_bf16():
    hf = _hf_norm()
    ours = norms.Fp32WeightRMSNorm(hf.weight, hf.variance_epsilon)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ours(x), hf(x))  # fp32: bit for bit the stock module
    hf16 = _hf_norm(dtype=torch.bfloat16)
    ours16 = norms.Fp32WeightRMSNorm(hf16.weight, hf16.variance_epsilon)
    x16 = x.to(torch.bfloat16)
    out = ours16(x16)
    assert out.dtype == torch.bfloat16 and ours16.weight.dtype == torch.float32
    # bf16-exact weights: within one bf16 rounding of the stock bf16 module
    assert float((out.float() - hf16(x16).float()).abs().max()) <= 2**-7 * float(out.float().abs().max())
    from vllm import ir

    served = ir.ops.rms_norm(x16, ours16.weight.data, 1e-5)  # vLLM's op with an fp32 weight
    assert served.dtype == torch.bfloat16 and torch.equal(served, out)


def test_bf16_policy_keeps_norm_noise(tmp_path):
    """A bf16 policy: with fp32 norms the noise is held as drawn; stock bf16 norms lose it."""
    from transformers import AutoModelForCausalLM

    from qerl_pipeline.config import LoraConfig
    from qerl_pipeline.models import tiny_model_folder
    from qerl_pipeline.quantization import checkpoint
    from qerl_pipeline.quantization.policy import build_policy

    model = AutoModelForCausalLM.from_pretrained(tiny_model_folder(tmp_path / "tiny"))
    checkpoint.write_base(model, None, "nvfp4", tmp_path / "nvfp4")
    lora = LoraConfig(rank=4, alpha=8)
    ratios = {}
    for nd in ("float32", "model"):
        policy = build_policy(tmp_path / "nvfp4", "nvfp4", lora, dtype=torch.bfloat16, norm_dtype=nd)
        names = aqn.noisy_target_names(n.replace("base_model.model.", "", 1) for n, _ in policy.named_parameters())
        params = aqn.norm_parameters(policy, names)
        clean = {n: p.detach().clone() for n, p in params.items()}
        assert all(t.dtype == (torch.float32 if nd == "float32" else torch.bfloat16) for t in clean.values())
        ids = torch.randint(0, 1000, (1, 6))
        logits = policy(input_ids=ids).logits
        assert logits.dtype == torch.bfloat16  # activations stay in the compute dtype
        for sigma in (1e-2, 2e-3, 5e-4):
            noise = aqn.draw_noise(clean, sigma, seed=0, step=1)
            with aqn.noisy_norms(params, aqn.apply_noise(clean, noise)):
                held = {n: p.detach().clone() for n, p in params.items()}
            drawn = float(torch.cat([noise[n].flatten() for n in names]).std(unbiased=False))
            ratios[nd, sigma] = norms.sigma_effective(held, clean, names) / drawn
    for sigma in (1e-2, 2e-3, 5e-4):
        assert abs(ratios["float32", sigma] - 1) < 1e-4
    assert ratios["model", 5e-4] < 0.5, ratios  # what bf16 storage does to the paper's last stage


@pytest.mark.parametrize("env", PAPER_ENVS)
def test_paper_schedules_pass_with_fp32_norms_and_are_refused_with_bf16_norms(env):
    base = yaml.safe_load((PROJECT / "conf/base/parameters.yml").read_text())
    over = yaml.safe_load((PROJECT / "conf" / env / "parameters.yml").read_text())
    for key, value in over.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    cfg = QerlConfig.model_validate(base)
    assert cfg.model.norm_dtype == "float32"
    norms.check_noise_precision(cfg, torch.bfloat16)  # fp32 norm storage: every stage as drawn
    for stage in range(1, cfg.aqn.num_stages):  # the fp32 storage of 1 + Z keeps sigma within 1e-6
        assert abs(norms.rounded_sigma_ratio(aqn.stage_sigma(stage, cfg.aqn), torch.float32) - 1) < 1e-6
    stock = cfg.model_copy(update={"model": cfg.model.model_copy(update={"norm_dtype": "model"})})
    with pytest.raises(ConfigError) as err:
        norms.check_noise_precision(stock, torch.bfloat16)
    msg = str(err.value)
    assert "model.norm_dtype" in msg and "bfloat16" in msg and "stage 9: sigma 0.0005" in msg
    norms.check_noise_precision(stock, torch.float32)  # fp32 compute: nothing rounds


def test_rounding_simulation_matches_bf16_spacing():
    # far above the spacing (2^-8..2^-7 around 1) the noise survives; far below it is gone
    assert abs(norms.rounded_sigma_ratio(0.1, torch.bfloat16) - 1) < 0.01
    assert norms.rounded_sigma_ratio(5e-4, torch.bfloat16) < 0.3
    assert norms.rounded_sigma_ratio(5e-4, torch.float32) == pytest.approx(1, abs=1e-5)


_PLUGIN_PROBE = r"""
import json, os, sys, torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.layernorm import RMSNorm
from qerl_pipeline.rollout import vllm_plugin
vllm_plugin.register(); vllm_plugin.register()  # idempotent, as vLLM may load plugins twice
torch.set_default_dtype(torch.bfloat16)  # what vLLM does while it builds a bf16 model
with set_current_vllm_config(VllmConfig()):
    m = RMSNorm(64, eps=1e-5)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        m.weight.copy_(1 + 1e-3 * torch.randn(64, dtype=torch.float32))
    y = m(x)
    r = torch.randn(4, 64, dtype=torch.bfloat16)
    y2, res = m(x.clone(), r.clone())
print(json.dumps({"cls": type(m).__name__, "weight": str(m.weight.dtype), "out": str(y.dtype),
                  "is_rmsnorm": isinstance(m, RMSNorm), "fused_out": str(y2.dtype), "name": type(m).name}))
"""


@pytest.mark.parametrize("enabled", [True, False])
def test_vllm_plugin_builds_fp32_norm_weights_only_when_asked(enabled):
    env = {k: v for k, v in os.environ.items() if k != "QERL_NORM_WEIGHT_DTYPE"}
    if enabled:
        env["QERL_NORM_WEIGHT_DTYPE"] = "float32"
    proc = subprocess.run([sys.executable, "-c", _PLUGIN_PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["is_rmsnorm"] and got["out"] == "torch.bfloat16" and got["fused_out"] == "torch.bfloat16"
    assert got["name"] == "rms_norm"  # vLLM's op name (custom_ops settings) is kept
    if enabled:
        assert got["cls"] == "Fp32WeightRMSNorm" and got["weight"] == "torch.float32"
    else:
        assert got["cls"] == "RMSNorm" and got["weight"] == "torch.bfloat16"


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("qerl_fp32_norms") == "qerl_pipeline.rollout.vllm_plugin:register"


@pytest.mark.vllm
def test_stock_bf16_engine_rounds_the_noise_away(tiny_model_dir):
    """vLLM-CPU in bf16 (accepted on this AVX2 CPU) without the plugin: noisy norms pushed and
    read back lose the paper's last stages, which is why the plugin exists. The plugin's side
    (fp32 norm weights in a bf16 engine serve every stage within 10%) is checked at every step
    of a real run: ``tests/test_train_precision.py`` (``aqn/sigma_effective`` is read back from
    the engine after each push), so it starts no second engine here."""
    from qerl_pipeline.rollout.engine import RolloutEngine

    with RolloutEngine(
        tiny_model_dir, max_model_len=128, max_lora_rank=None, dtype="bfloat16", norm_dtype=None
    ) as engine:
        assert engine.info["dtype"] == "bfloat16"
        names = aqn.noisy_target_names(engine.norm_weight_names())
        clean = engine.read_weights(names)
        assert {str(t.dtype) for t in clean.values()} == {"torch.bfloat16"}
        res = {}
        for sigma in (1e-2, 2e-3, 5e-4):
            noise = aqn.draw_noise(clean, sigma, seed=0, step=1)
            engine.update_weights(aqn.apply_noise({n: t.float() for n, t in clean.items()}, noise))
            res[sigma] = norms.sigma_effective(engine.read_weights(names), clean, names) / sigma
        engine.update_weights(clean)
        gen = engine.generate([[1, 2, 3, 4]], n=1, temperature=0.0, top_p=1.0, max_new_tokens=4)
        assert len(gen.samples[0][0].completion_ids) == 4
    assert abs(res[1e-2] - 1) < 0.1, res  # far above bf16's spacing the noise survives (the check can pass)
    assert res[5e-4] < 0.5, res  # the stock engine serves almost none of the last stage's noise
