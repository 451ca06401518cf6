"""scripts/gpu_acceptance.py --dry-run on this CPU: one line per check, the same in its JSON.

The GPU run itself needs CUDA (and vLLM for the engine checks); here the trainer check runs
the real ``policy_update`` on a tiny random Qwen2 written as an NVFP4 and a BF16 base,
gpu_check.py's measurement runs on its dry shapes, the collectives run in a gloo group of
world size 1, and the engine check is one SKIP line with its reason (no engine is started:
the fast tier forbids it). Only machine-independent things are asserted, never timings.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_acceptance.py"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_acceptance")
    env = {**os.environ, "OUT": str(out)}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=env, timeout=600, cwd=out
    )
    report = json.loads((out / "gpu_acceptance.json").read_text()) if (out / "gpu_acceptance.json").is_file() else None
    return proc, report


def test_dry_run_exits_0_and_prints_one_line_per_check_as_in_its_json(dry_run):
    proc, report = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()  # stdout holds the check lines only
    assert lines and all(ln.split(" ", 1)[0] in ("PASS", "FAIL", "SKIP") for ln in lines), lines
    assert report["mode"] == "dry-run" and report["torch"] and report["device"]
    assert [f"{c['status']} {c['name']}: {c['detail']}" for c in report["checks"]] == lines
    names = [c["name"] for c in report["checks"]]
    assert names == ["trainer", "trainer_7b_layers", "kernel_offsets", "collectives", "engine"]
    assert all("\n" not in c["detail"] and c["detail"] for c in report["checks"])


def test_trainer_updates_both_formats(dry_run):
    _, report = dry_run
    trainer = {c["name"]: c for c in report["checks"]}["trainer"]
    assert trainer["status"] == "PASS", trainer["detail"]
    formats = trainer["formats"]
    assert set(formats) == {"nvfp4", "bf16"}
    assert (formats["nvfp4"]["method"], formats["bf16"]["method"]) == ("qerl", "lora")
    for row in formats.values():
        assert row["dtype"] == "float32"
        assert math.isfinite(row["loss"]) and math.isfinite(row["loss_first"])
        assert row["lora_A_moved"] > 0 and row["lora_B_moved"] > 0 and row["lora_tensors"] > 0
        assert row["triton_used"] is False  # never on CPU (the fused kernel is considered on CUDA only)
        assert not any(v for k, v in row["kernel_calls"].items() if k.endswith("_triton"))
    assert trainer["mem_ratio_nvfp4_over_bf16"] is None  # VmHWM on CPU: no per-update peak to compare
    assert trainer["peak_mem_kind"] == "process VmHWM"


def test_kernel_offsets_check_runs_the_fused_kernels_against_the_torch_path(dry_run):
    _, report = dry_run
    row = {c["name"]: c for c in report["checks"]}["kernel_offsets"]
    assert row["status"] == "PASS", row["detail"]
    assert set(row["products"]) == {"fwd_gate", "dx_down", "fwd_down"}
    for product in row["products"].values():  # tiny shapes in the interpreter: nothing past 2^31, errors small
        assert product["rows_past_2_31"] == 0 and product["rel_err"] <= 2e-2


def test_7b_layers_check_runs_gpu_check_on_its_dry_shapes(dry_run):
    _, report = dry_run
    row = {c["name"]: c for c in report["checks"]}["trainer_7b_layers"]
    assert row["status"] == "PASS", row["detail"]
    assert row["detail"].startswith("gpu_check.py dry-run (float32, hidden 128, 2 layers")
    assert row["triton_used"] is False
    assert row["worst"]["torch_rel_err"] < 1e-6 and row["worst"]["stack.loss_rel_diff_vs_decoded_dense"] < 1e-6
    # NVFP4: half a byte per weight + one FP8 scale per 16 + a 4-byte global scale per tensor
    assert 0.14 < row["layer_base_bytes"]["nvfp4"] / row["layer_base_bytes"]["dense"] < 0.15


def test_collectives_in_a_gloo_group_of_one(dry_run):
    _, report = dry_run
    col = {c["name"]: c for c in report["checks"]}["collectives"]
    assert col["status"] == "PASS", col["detail"]
    assert col["backend"] == "gloo" and col["nccl_exercised"] is False and "NCCL not exercised" in col["detail"]
    v = col["values"]
    assert v["sum"] == 2.5 and v["sum_tensor"] == [1.5, -2.25, 1e-12] and v["sum_tensor_dtype"] == "float64"
    assert v["grads_fp32"] == [1.0, 2.0, 3.0] and v["grads_bf16"] == [0.5, -1.5]
    assert v["grad_dtypes"] == ["float32", "bfloat16"] and v["grad_devices"] == ["cpu", "cpu"] and v["grad_none_kept"]
    assert v["gather"] == [{"r": 0, "x": [1, 2]}] and v["bcast"] == ["x", 0] and v["barrier"] is True


def test_engine_is_one_skip_line_with_its_reason(dry_run):
    _, report = dry_run
    engine = [c for c in report["checks"] if c["name"].startswith("engine")]
    assert len(engine) == 1 and engine[0]["name"] == "engine" and engine[0]["status"] == "SKIP"
    assert "--dry-run" in engine[0]["detail"] and "CUDA vLLM" in engine[0]["detail"]


def test_json_option_and_unknown_check(tmp_path):
    target = tmp_path / "sub" / "r.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--only", "collectives,engine", "--json", str(target)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [c["name"] for c in json.loads(target.read_text())["checks"]] == ["collectives", "engine"]
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--only", "nope"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert bad.returncode == 2 and "unknown check" in bad.stderr


# ------------------------------------------------- the engine sub-steps against a fake engine
# The real engine checks need CUDA vLLM; here their logic (what is compared, what fails, that one
# failing sub-step leaves the others running) runs against an in-memory stand-in of RolloutEngine.
def _script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_acceptance_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class FakeEngine:
    """What EngineChecks uses of RolloutEngine: generation, norm weights, sleep/wake, adapters."""

    GIB = 2**30

    def __init__(self, level: int, pid: int, lora_effect: bool = True):
        import torch

        self.level, self.pid, self.lora_effect = level, pid, lora_effect
        self.info = {"cuda": True, "dtype": "bfloat16", "startup_s": 1.0, "pid": pid}
        self.start_seconds = 1.0
        self.norms = {
            f"model.layers.{i}.{k}.weight": torch.ones(256)
            for i in range(2)
            for k in ("input_layernorm", "post_attention_layernorm")
        }
        self.norms["model.norm.weight"] = torch.ones(256)
        self.kept: dict = {}
        self.asleep = False
        self.closed = False

    def alive(self):
        return not self.closed

    def generate(self, prompts, *, n, temperature, top_p, max_new_tokens, seed=None, lora_path=None, ignore_eos=False):
        from qerl_pipeline.rollout.engine import GenerateResult, Sample

        shift = 7 if (lora_path is not None and self.lora_effect) else 0
        groups = [
            [
                Sample(
                    list(p),
                    [(sum(p) + shift + i + j) % 100 for i in range(max_new_tokens)],
                    "",
                    [-1.0] * max_new_tokens,
                    "length",
                )
                for j in range(n)
            ]
            for p in prompts
        ]
        return GenerateResult(groups, 0.1, n * len(prompts) * max_new_tokens, 100.0)

    def norm_weight_names(self):
        return sorted(self.norms)

    def read_weights(self, names):
        return {n: self.norms[n].clone() for n in names}

    def update_weights(self, tensors):
        for n, t in tensors.items():
            self.norms[n] = t.detach().clone().float()
        if self.level == 2:
            self.kept.update(tensors)
        return 0.01

    def sleep(self, level=None):
        self.asleep = True
        return True

    def wake_up(self):
        out = {
            "was_asleep": self.asleep,
            "level": self.level,
            "reloaded": self.level == 2,
            "reapplied": sorted(self.kept) if self.level == 2 else [],
        }
        self.asleep = False
        return out

    def register_adapter(self, path):
        return {"lora_id": 1, "added": True, "loaded": [1]}

    def loaded_adapters(self):
        return [1]

    def reset_adapters(self):
        return [1]

    def close(self):
        self.closed = True


def _engine_checks(tmp_path, monkeypatch, *, lora_effect=True, start_error=None):
    import subprocess as sp
    from types import SimpleNamespace

    import torch

    from qerl_pipeline.config import LoraConfig, RolloutConfig

    mod = _script()
    engines = []

    def fake_mem_get_info(*_a):
        asleep = any(e.asleep for e in engines)
        return ((100 if asleep else 60) * FakeEngine.GIB, 140 * FakeEngine.GIB)

    monkeypatch.setattr(torch.cuda, "mem_get_info", fake_mem_get_info)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    child = sp.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # the "EngineCore" child of this process
    try:
        report = mod.Report({"mode": "gpu"})
        checks = mod.EngineChecks(tmp_path, report)

        def setup():
            checks.base, checks.adapter = tmp_path / "base", tmp_path / "adapter"
            checks.lora, checks.prompts = LoraConfig(rank=8, alpha=16), [[1, 2, 3], [4, 5]]

        def open_(level):
            if start_error:
                raise RuntimeError(start_error)
            engines.append(FakeEngine(level, os.getpid(), lora_effect))
            return (
                SimpleNamespace(served_format="nvfp4"),
                RolloutConfig(sleep_between_steps=True, sleep_level=level),
                engines[-1],
            )

        checks.setup, checks.open = setup, open_
        checks.run_all()
    finally:
        child.kill()
        child.wait()
    assert all(e.closed for e in engines)
    return {c["name"]: c for c in report.checks}


ENGINE_STEPS = [
    "engine.two_process_start",
    "engine.generate_with_adapter",
    "engine.norms_noise",
    "engine.sleep_level1",
    "engine.sleep_level2",
]


def test_engine_substeps_pass_against_a_working_fake(tmp_path, monkeypatch):
    rows = _engine_checks(tmp_path, monkeypatch)
    assert list(rows) == ENGINE_STEPS
    assert all(r["status"] == "PASS" for r in rows.values()), {n: r["detail"] for n, r in rows.items()}
    assert rows["engine.norms_noise"]["served_exact"] and rows["engine.norms_noise"]["restored"]
    assert abs(rows["engine.norms_noise"]["sigma_effective"] / 5e-4 - 1) < 0.1
    assert rows["engine.sleep_level2"]["woke"]["reloaded"] is True
    assert rows["engine.sleep_level1"]["freed_bytes"] == 40 * FakeEngine.GIB


def test_one_failing_engine_substep_leaves_the_others_running(tmp_path, monkeypatch):
    rows = _engine_checks(tmp_path, monkeypatch, lora_effect=False)
    assert rows["engine.generate_with_adapter"]["status"] == "FAIL"
    assert "the LoRA is not applied" in rows["engine.generate_with_adapter"]["detail"]
    assert [rows[n]["status"] for n in ENGINE_STEPS if n != "engine.generate_with_adapter"] == ["PASS"] * 4


def test_an_engine_that_does_not_start_fails_each_substep_with_the_reason(tmp_path, monkeypatch):
    rows = _engine_checks(tmp_path, monkeypatch, start_error="no GPU left")
    assert list(rows) == ENGINE_STEPS and all(r["status"] == "FAIL" for r in rows.values())
    assert rows["engine.two_process_start"]["detail"] == "RuntimeError: no GPU left"
    assert "the engine did not start (RuntimeError: no GPU left)" in rows["engine.norms_noise"]["detail"]
