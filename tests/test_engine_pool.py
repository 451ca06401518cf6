"""rollout/pool.py: which engine a compare node gets (fast tier: stand-in engines, the platform a parameter).

The real shared engines run in tests/test_compare_pipeline.py (a resumed smoke compare).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from qerl_pipeline.config import ModelConfig, RolloutConfig
from qerl_pipeline.rollout import pool


class FakeEngine:
    started = 0

    def __init__(self, path):
        FakeEngine.started += 1
        self.path, self._closed, self.start_seconds = path, False, 0.0
        self.weights = {"model.norm.weight": torch.ones(4)}
        self.updates = 0
        self.merged = None

    def merge_adapter(self, path):
        self.merged = path
        return 0.0

    def unmerge(self):
        self.merged = None
        return 0.0

    def norm_weight_names(self):
        return sorted(self.weights)

    def update_weights(self, tensors):
        self.updates += 1
        self.weights.update({k: v.clone() for k, v in tensors.items()})
        return 0.0

    def read_weights(self, names):
        return {n: self.weights[n].clone() for n in names}

    def close(self):
        self._closed = True


@dataclass
class Served:
    path: Path
    platform: str = "cpu"
    served_format: str = "bf16"
    engine_args: dict = None
    activations_16bit: bool = False


@pytest.fixture(autouse=True)
def fake(monkeypatch):
    FakeEngine.started = 0
    monkeypatch.setattr("qerl_pipeline.rollout.serving.open_engine", lambda served, *a, **k: FakeEngine(served.path))
    monkeypatch.setattr(pool, "clean_norms", lambda engine, path: {"model.norm.weight": torch.ones(4)})
    yield
    pool.close_shared()


MC = ModelConfig(dtype="float32")


def test_same_base_is_shared_and_its_norms_restored(tmp_path):
    a = pool.shared_engine(Served(tmp_path / "a"), MC, lora_rank=4)
    a.weights["model.norm.weight"] += 0.5  # what AQN leaves behind
    a.merge_adapter(tmp_path / "step-000004")  # and what a training with rollout.sync merge leaves
    again = pool.shared_engine(Served(tmp_path / "a"), MC, lora_rank=4)
    assert again is a and FakeEngine.started == 1
    assert torch.equal(a.weights["model.norm.weight"], torch.ones(4))
    assert a.merged is None
    # a larger LoRA rank than the live engine was started for needs a new engine
    bigger = pool.shared_engine(Served(tmp_path / "a"), MC, lora_rank=64)
    assert bigger is not a and FakeEngine.started == 2


def test_cpu_keeps_one_engine_per_base_and_evicts_the_least_recent(tmp_path):
    rc = RolloutConfig()
    engines = [pool.shared_engine(Served(tmp_path / n), MC, rollout=rc) for n in ("bf16", "nvfp4", "nf4")]
    assert FakeEngine.started == 3 and not any(e._closed for e in engines)
    # the evaluation phase finds all three alive
    assert [pool.shared_engine(Served(tmp_path / n), MC, rollout=rc) for n in ("bf16", "nvfp4", "nf4")] == engines
    assert FakeEngine.started == 3
    fourth = pool.shared_engine(Served(tmp_path / "other"), MC, rollout=rc)
    assert engines[0]._closed and not engines[1]._closed and not fourth._closed  # bf16 was the least recent
    pool.close_shared()
    assert all(e._closed for e in engines + [fourth])


@pytest.mark.parametrize(
    "platform, asked, expected", [("cpu", None, 3), ("cuda", None, 1), ("cpu", 1, 1), ("cuda", 3, 1)]
)
def test_capacity_by_platform(platform, asked, expected):
    assert pool.capacity(RolloutConfig(shared_engines=asked), platform) == expected


def test_cuda_never_holds_two_engines(tmp_path):
    first = pool.shared_engine(Served(tmp_path / "a", platform="cuda"), MC, rollout=RolloutConfig(shared_engines=3))
    second = pool.shared_engine(Served(tmp_path / "b", platform="cuda"), MC, rollout=RolloutConfig(shared_engines=3))
    assert first._closed and not second._closed


def test_restore_refuses_an_engine_that_does_not_take_the_values(tmp_path):
    engine = FakeEngine(tmp_path)
    engine.read_weights = lambda names: {n: torch.zeros(4) for n in names}
    with pytest.raises(RuntimeError, match="differ from the clean ones"):
        pool.restore_norms(engine, {"model.norm.weight": torch.ones(4)})


@pytest.mark.parametrize(
    "cuda, env, expected",
    [
        (False, {}, True),
        (False, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, False),
        (True, {}, False),
        (True, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, False),
    ],
)
def test_engine_core_in_the_server_process_on_cpu_only(cuda, env, expected):
    """rollout/server.py: on CPU vLLM's EngineCore and worker run in the server (no re-imports);
    CUDA keeps vLLM's chain."""
    from qerl_pipeline.rollout.server import in_process_engine

    environ = dict(env)
    assert in_process_engine(cuda, environ) is expected
    if not cuda and not env:
        assert environ == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # set before vLLM reads it
