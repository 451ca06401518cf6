"""scripts/gpu_check.py runs end to end on CPU in its tiny --dry-run mode.

The real check needs an H200 (see the script's docstring); here the same code paths run
on tiny shapes: the project's NVFP4 codec on a Qwen2-shaped layer, the packed LoRA layer
(dequantized in forward and backward) against the same weights decoded to dense, and,
where Triton is installed, the fused dequant-matmul kernels in Triton's CPU interpreter.
Only machine-independent numbers are asserted (bytes, exactness), never timings.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
# (out, in) of q, k, v, o, gate, up, down for the dry shape: hidden 128, 2 heads of 64, 1 KV head, MLP 256
DRY_SHAPES = [(128, 128), (64, 128), (64, 128), (128, 128), (256, 128), (256, 128), (128, 256)]


def _run(tmp_path: Path, *args: str) -> dict:
    env = {**os.environ, "OUT": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout)
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert printed == written
    return written


def test_dry_run_produces_the_summary(tmp_path):
    s = _run(tmp_path)
    assert s["mode"] == "dry-run" and s["triton_used"] is False and s["dtype"] == "float32"
    assert s["packed_layer"] == "qerl_pipeline.quantization.policy.PackedLinear"  # the training policy's own layer
    per = s["ops"]["per_projection"]
    assert set(per) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    for row in per.values():
        assert row["torch_rel_err"] < 1e-6
        assert row["matmul_ms"] > 0 and row["dequant_torch_ms"] > 0
    # NVFP4 bytes: half a byte per weight + one FP8 scale per 16 weights + a 4-byte global scale per tensor
    nvfp4 = sum(o * i // 2 + o * i // 16 + 4 for o, i in DRY_SHAPES)
    assert s["ops"]["layer_base_bytes"] == {"dense": 4 * sum(o * i for o, i in DRY_SHAPES), "nvfp4": nvfp4}
    stack = s["stack"]
    assert set(stack) == {"bf16_lora", "nvfp4_lora_decoded_dense", "nvfp4_lora_dequant_matmul"}
    packed = stack["nvfp4_lora_dequant_matmul"]
    # the packed layer computes exactly what the dense decoded weights compute
    assert packed["loss_rel_diff_vs_decoded_dense"] < 1e-6
    assert packed["lora_grad_rel_err_vs_decoded_dense"] < 1e-5
    assert packed["base_bytes"] == s["shape"]["layers"] * nvfp4
    assert stack["bf16_lora"]["base_bytes"] == stack["nvfp4_lora_decoded_dense"]["base_bytes"]
    assert packed["lora_bytes"] == stack["bf16_lora"]["lora_bytes"] > 0
    # quantization does change the numbers: the bf16 base is not the decoded one
    assert stack["bf16_lora"]["loss_rel_diff_vs_decoded_dense"] > 0


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_kernels_match_the_reference_in_the_interpreter(tmp_path):
    s = _run(tmp_path, "--interpret")
    assert s["triton_used"] is True and s["triton_interpreter"] is True
    for row in s["ops"]["per_projection"].values():
        assert row["triton_dequant_max_abs_diff"] < 1e-6
        assert row["fused_fwd_rel_err"] < 1e-5
        assert row["fused_dx_rel_err"] < 1e-5
    fused = s["stack"]["nvfp4_lora_fused_triton"]
    assert fused["loss_rel_diff_vs_decoded_dense"] < 1e-5
    assert fused["lora_grad_rel_err_vs_decoded_dense"] < 1e-4
