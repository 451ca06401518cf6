"""The benchmark's "our step vs TRL" rows and its sync / reward measurements, on hand-made inputs (no vLLM).

Our step is the full training step, phase by phase (rollout on the path of the sync training
uses + reward + that sync + update), and our memory is the trainer's plus the engine's
(benchmarking/table.py's docstring); ``measure_sync`` times merge as the trainer does it
(``merge_adapter`` per step, one ``unmerge`` at the end).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from qerl_pipeline.config import BenchmarkConfig
from tests.helpers.models import fake_base

HW = {
    "device": "cpu",
    "cpu": "x",
    "cpu_cores": 2,
    "bandwidth_gbs": 10.0,
    "matmul_flops": 1e12,
    "matmul_dtype": "float32",
}
TRL = {
    "skipped": False,
    "trl_version": "1.16.0",
    "generation": "transformers",
    "step_time_s": 8.0,
    "generation_s": 5.0,
    "update_s": 3.0,
    "peak_memory_bytes": 2**31,
}
BENCH = BenchmarkConfig(methods=["qerl"], prompt_len=8, completion_len=4)


def _training() -> list[dict]:
    return [
        {
            "method": "qerl",
            "format": "nvfp4",
            "step_time_s": 1.5,
            "tokens_per_s": 40.0,
            "tokens_per_step": 60,
            "flops_per_step": 6e12,
            "sequences": 4,
            "step_impl": "x",
            "peak_memory_bytes": 2**30,
            "param_bytes_packed_base": 2**20,
            "param_bytes_lora": 2**20,
            "param_bytes_other": 0,
            "optimizer_state_bytes": 2**21,
        }
    ]


def _rollout(used: str | None, engine_mem: int | None = 2**29) -> dict:
    served = {"path": "", "served_format": "dense-decoded-nvfp4", "dense": True, "dtype": "float32"}
    if engine_mem is not None:
        served["engine_peak_memory_bytes"] = engine_mem
    return {
        "train_batch": 4,
        "rows": [
            {
                "format": "nvfp4",
                "batch_size": 4,
                "lora": True,
                "tokens_per_s": 100.0,
                "seconds": 2.0,
                "is_train_batch": True,
            },
            {
                "format": "nvfp4",
                "batch_size": 4,
                "lora": False,
                "tokens_per_s": 300.0,
                "seconds": 0.5,
                "is_train_batch": True,
            },
        ],
        # recommended deliberately differs from used: the table must follow used
        "sync": {
            "nvfp4": {
                "configured": "auto",
                "recommended": "adapter" if used == "merge" else "merge",
                "used": used,
                "adapter_sync_s": 0.5,
                "merge_sync_s": 0.25,
            }
        },
        "reward": {"nvfp4": {"reward_s": 0.125, "sequences": 4, "scorer": "RewardScorer"}},
        "served": {"nvfp4": served},
    }


def _table(tmp_path: Path, rollout: dict, trl: dict = TRL) -> dict:
    from qerl_pipeline.benchmarking.table import metric_name
    from qerl_pipeline.pipelines.benchmark.nodes import build_table

    if not (tmp_path / "base_nvfp4").exists():
        fake_base(tmp_path / "base_nvfp4", 1)
    rollout["served"]["nvfp4"]["path"] = str(tmp_path / "base_nvfp4" / "serving")
    table = build_table(HW, {"nvfp4": str(tmp_path / "base_nvfp4")}, rollout, _training(), trl, BENCH)
    return table, {metric_name(r): r for r in table["rows"]}


def test_our_step_is_rollout_reward_sync_and_update_on_the_used_sync(tmp_path):
    _, got = _table(tmp_path, _rollout("merge"))
    peer = {k.removeprefix("bench.peer.qerl."): r["value"] for k, r in got.items() if k.startswith("bench.peer.qerl.")}
    # merge: the no-LoRA rollout (0.5 s) and the merge sync (0.25 s), not the recommended adapter path
    assert peer["our_rollout_s"] == pytest.approx(0.5)
    assert peer["our_reward_s"] == pytest.approx(0.125)
    assert peer["our_sync_s"] == pytest.approx(0.25)
    assert peer["our_update_s"] == pytest.approx(1.5)
    assert peer["our_step_time_s"] == pytest.approx(0.5 + 0.125 + 0.25 + 1.5)
    assert "merge sync" in got["bench.peer.qerl.our_step_time_s"]["note"]
    assert peer["our_over_trl_step_time"] == pytest.approx((0.5 + 0.125 + 0.25 + 1.5) / 8.0)
    assert peer["our_over_trl_generation"] == pytest.approx((0.5 + 0.25) / 5.0)
    assert peer["our_over_trl_update"] == pytest.approx(1.5 / 3.0)
    assert got["bench.rollout.nvfp4.reward_s"]["value"] == pytest.approx(0.125)
    assert got["bench.sync.nvfp4.used"]["note"] == "merge"

    _, got = _table(tmp_path, _rollout("adapter"))
    # adapter: the LoRA rollout (2.0 s) and the adapter sync (0.5 s)
    assert got["bench.peer.qerl.our_rollout_s"]["value"] == pytest.approx(2.0)
    assert got["bench.peer.qerl.our_sync_s"]["value"] == pytest.approx(0.5)
    assert got["bench.peer.qerl.our_step_time_s"]["value"] == pytest.approx(2.0 + 0.125 + 0.5 + 1.5)


def test_a_sync_training_refuses_leaves_no_step_time_and_says_why(tmp_path):
    rollout = _rollout(None)
    rollout["sync"]["nvfp4"]["used_error"] = "rollout.sync: merge needs dense served linears"
    _, got = _table(tmp_path, rollout)
    row = got["bench.peer.qerl.our_step_time_s"]
    assert row["value"] is None and "rollout.sync" in row["note"]
    assert "bench.peer.qerl.our_over_trl_step_time" not in got


def test_our_memory_counts_trainer_and_engine(tmp_path):
    table, got = _table(tmp_path, _rollout("merge", engine_mem=2**29))
    assert got["bench.peer.qerl.our_trainer_peak_memory"]["value"] == pytest.approx(1024)
    assert got["bench.peer.qerl.our_engine_peak_memory"]["value"] == pytest.approx(512)
    assert got["bench.peer.qerl.our_peak_memory"]["value"] == pytest.approx(1536)
    assert got["bench.rollout.nvfp4.engine_peak_memory"]["value"] == pytest.approx(512)
    ratio = got["bench.peer.qerl.our_over_trl_peak_memory"]
    assert ratio["value"] == pytest.approx((2**30 + 2**29) / 2**31)
    assert "TRAINER ONLY" not in ratio["note"]

    from qerl_pipeline.benchmarking.table import headline

    head = headline(table)[0]
    assert head["ours_over_trl_memory"] == pytest.approx(0.75)
    assert head["our_peak_mem_MiB"] == pytest.approx(1536)
    assert {k: head[k] for k in ("our_rollout_s", "our_reward_s", "our_sync_s", "our_update_s")} == pytest.approx(
        {"our_rollout_s": 0.5, "our_reward_s": 0.125, "our_sync_s": 0.25, "our_update_s": 1.5}
    )
    assert head["ours_over_trl"] == pytest.approx(got["bench.peer.qerl.our_over_trl_step_time"]["value"])


def test_missing_engine_memory_falls_back_to_the_trainer_and_says_so(tmp_path):
    _, got = _table(tmp_path, _rollout("merge", engine_mem=None))
    assert got["bench.peer.qerl.our_engine_peak_memory"]["value"] is None
    assert got["bench.peer.qerl.our_peak_memory"]["value"] == pytest.approx(1024)
    ratio = got["bench.peer.qerl.our_over_trl_peak_memory"]
    assert ratio["value"] == pytest.approx(0.5) and "TRAINER ONLY" in ratio["note"]
    assert "bench.rollout.nvfp4.engine_peak_memory" not in got


class _MergingEngine:
    """A dense served base: records every adapter load, merge and unmerge."""

    def __init__(self):
        self.calls: list[tuple] = []

    def generate(self, prompts, **kw):
        self.calls.append(("generate", kw["lora_path"]))

    def merge_adapter(self, lora_path):
        self.calls.append(("merge_adapter", Path(lora_path)))
        return 0.25

    def unmerge(self):
        self.calls.append(("unmerge",))
        return 0.125

    def read_weights(self, names):
        raise AssertionError("the merge path reads no weights client-side any more")

    def load_dense_weights(self, tensors):
        raise AssertionError("the merge path sends no dense weights client-side any more")

    update_weights = load_dense_weights


def test_measure_sync_merges_each_step_in_the_engine_then_unmerges_once(tmp_path):
    from qerl_pipeline.benchmarking.rollout import measure_sync

    dirs = [tmp_path / "step-1", tmp_path / "step-2", tmp_path / "step-3"]
    engine = _MergingEngine()
    report = measure_sync(engine, dirs, dense=True)
    merges = [c for c in engine.calls if c[0] != "generate"]
    assert merges == [("merge_adapter", d) for d in dirs] + [("unmerge",)]
    assert [c[1] for c in engine.calls if c[0] == "generate"] == [d for d in dirs for _ in range(2)]
    assert report["merge_supported"] is True and report["steps"] == 3
    assert report["merge_sync_all_s"] == [0.25] * 3 and report["merge_sync_s"] == pytest.approx(0.25)


def test_measure_sync_unmerges_after_a_failed_merge(tmp_path):
    from qerl_pipeline.benchmarking.rollout import measure_sync
    from qerl_pipeline.rollout.engine import EngineError

    engine = _MergingEngine()

    def fail(lora_path):
        engine.calls.append(("merge_adapter", Path(lora_path)))
        raise EngineError("layer x is packed\ntraceback ...")

    engine.merge_adapter = fail
    report = measure_sync(engine, [tmp_path / "step-1", tmp_path / "step-2"])
    assert report["merge_supported"] is False and report["merge_error"] == "layer x is packed"
    assert engine.calls[-2:] == [("merge_adapter", tmp_path / "step-1"), ("unmerge",)]


_SCORED: list[tuple] = []


def recording_reward(completions, golds, samples):
    """``train.reward_fn`` for the test below: records each call."""
    _SCORED.append((list(completions), list(golds), list(samples)))
    return [0.0] * len(completions)


def test_measure_reward_times_our_scorer_after_a_warm_up():
    from qerl_pipeline.benchmarking.rollout import measure_reward
    from qerl_pipeline.config import QerlConfig
    from qerl_pipeline.rollout.engine import Sample

    cfg = QerlConfig.model_validate({"train": {"reward_fn": f"{__name__}:recording_reward"}})
    samples = [Sample([1], [2, 3], f"text {i}", [0.0, 0.0], "length") for i in range(3)]
    _SCORED.clear()
    out = measure_reward(cfg, samples)
    # the scorer training uses (train.reward_fn here), called twice: warm-up, then the timed call
    assert _SCORED == [(["text 0", "text 1", "text 2"], ["42"] * 3, samples)] * 2
    assert out["sequences"] == 3 and out["scorer"] == "FunctionScorer" and isinstance(out["reward_s"], float)
