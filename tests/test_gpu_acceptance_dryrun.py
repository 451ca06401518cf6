"""scripts/gpu_acceptance.py --dry-run on this CPU: one line per check, the same in its JSON.

The GPU run itself needs CUDA (and vLLM for the engine checks); here the trainer check runs
the real policy update on a tiny NVFP4 and BF16 base, the collectives run in a gloo group of
one, and the engine check is skipped with its reason. No timing is asserted.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_prints_and_writes_one_row_per_check(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_acceptance.py"), "--dry-run"], capture_output=True,
                          text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.split(" ", 1)[0] in ("PASS", "FAIL", "SKIP")]
    report = json.loads((tmp_path / "gpu_acceptance.json").read_text())
    assert report["mode"] == "dry-run"
    rows = {r["name"]: r for r in report["checks"]}
    assert [f"{r['status']} {r['name']}: {r['detail']}" for r in report["checks"]] == lines
    assert set(rows) == {"trainer", "trainer_7b_layers", "collectives", "engine"}
    trainer = rows["trainer"]
    assert trainer["status"] == "PASS" and set(trainer["formats"]) == {"nvfp4", "bf16"}
    for fmt in trainer["formats"].values():
        assert math.isfinite(fmt["loss"]) and fmt["lora_moved"] > 0
        assert fmt["triton_layers"]["triton"] == 0  # never on CPU
    col = rows["collectives"]
    assert col["status"] == "PASS" and col["backend"] == "gloo"
    assert col["values"]["grads"] == [1.0, 2.0, 3.0, 0.5, 0.5] and col["values"]["gather"] == [{"r": 0}]
    assert rows["engine"]["status"] == "SKIP" and "CUDA vLLM" in rows["engine"]["detail"]
    assert rows["trainer_7b_layers"]["status"] == "SKIP"
