"""Validation asks the memory planner on CUDA: settings that cannot run on this GPU stop the run in one line.

Fast tier. The hook (``hooks.ValidateConfigHook.before_pipeline_run``) is driven directly, with
the project's registered pipelines and the parameters Kedro's loader gives ``kedro run --env ...
--params ...`` (``planner/inputs.py``); the platform is mocked as ``cuda`` and the GPU's size is a
fake NVML answer, since this machine has neither. The NVML reading itself runs against a stand-in
``pynvml`` module that answers as the driver does (v2 memory info: installed total and the
driver's reservation; on an H200 the difference was CUDA's total to the byte, 150109880320, and
``platform.gpu_memory_bytes`` read it so there: docs/gpu.md, "What has run on a GPU").
"""

from __future__ import annotations

import json
import logging
import sys
from types import SimpleNamespace

import click
import pytest

from qerl_pipeline import hooks, platform
from qerl_pipeline.config import ConfigError
from qerl_pipeline.planner import guard, inputs
from tests.helpers.envs import CONF

GIB = 2**30
H100 = 79.1  # GiB: about CUDA's total on an 80 GB H100 (NVML's 79.6 less the driver's reservation)


@pytest.fixture(scope="module")
def pipelines():
    from kedro.framework.project import configure_project, pipelines

    configure_project("qerl_pipeline")
    return pipelines


def _validate(
    pipeline, env: str, params: str = "", *, platform_name="cuda", gpu_gib: float | None = H100, monkeypatch
) -> None:
    monkeypatch.setattr(hooks, "current_platform", lambda: platform_name)
    monkeypatch.setattr(hooks, "gpu_memory_bytes", lambda: None if gpu_gib is None else int(gpu_gib * GIB))
    hook = hooks.ValidateConfigHook()
    hook._context = SimpleNamespace(params=inputs.load_parameters(env, inputs.parse_params(params), CONF))
    hook.before_pipeline_run(run_params={}, pipeline=pipeline, catalog=None)


def _refused(pipeline, env, params="", **kw) -> str:
    with pytest.raises(hooks.PlannerRefusal) as err:
        _validate(pipeline, env, params, **kw)
    assert isinstance(err.value, click.ClickException) and isinstance(err.value, ConfigError)
    message = err.value.format_message()
    assert "\n" not in message and message.endswith("nothing ran"), message  # one `Error:` line
    return message


def test_a_utilization_below_the_engines_minimum_is_refused_naming_the_gpu_and_the_pick(pipelines, monkeypatch):
    text = _refused(
        pipelines["train"], "paper_bigmath_32b", "rollout.gpu_memory_utilization=0.25", monkeypatch=monkeypatch
    )
    assert text.startswith(
        "rollout.gpu_memory_utilization: 0.25 does not fit this 79.1 GiB GPU (qerl: the engine needs "
        "at least 0.32 to start"
    ), text
    assert "0.32-0.73 fits qerl, the planner picks 0.65" in text and "planner.check=false" in text, text
    # the shipped setting passes, and so does the refused one on CPU, or with the check off
    _validate(pipelines["train"], "paper_bigmath_32b", monkeypatch=monkeypatch)
    _validate(
        pipelines["train"],
        "paper_bigmath_32b",
        "rollout.gpu_memory_utilization=0.25",
        platform_name="cpu",
        monkeypatch=monkeypatch,
    )
    _validate(
        pipelines["train"],
        "paper_bigmath_32b",
        "rollout.gpu_memory_utilization=0.25,planner.check=false",
        monkeypatch=monkeypatch,
    )


def test_trainer_and_engine_above_the_gpu_are_refused(pipelines, monkeypatch):
    text = _refused(
        pipelines["train"], "paper_bigmath_32b", "rollout.gpu_memory_utilization=0.8", monkeypatch=monkeypatch
    )
    peak = inputs.load_config("paper_bigmath_32b", "rollout.gpu_memory_utilization=0.8", CONF)
    peak = guard.plans(peak, ["qerl"], inputs.PRESETS["qwen2.5-32b"], H100)["qerl"].peak / GIB
    assert peak > H100
    assert text.startswith(
        f"rollout.gpu_memory_utilization: 0.8 does not fit this 79.1 GiB GPU (qerl: trainer and "
        f"engine need {peak:.1f} GiB); 0.32-0.73 fits qerl, the planner picks 0.65"
    ), text
    # the same settings fit a larger GPU (an H200's 139.8 GiB)
    _validate(
        pipelines["train"],
        "paper_bigmath_32b",
        "rollout.gpu_memory_utilization=0.8",
        gpu_gib=139.8,
        monkeypatch=monkeypatch,
    )


def test_a_method_that_fits_at_no_utilization_names_those_that_do(pipelines, monkeypatch):
    text = _refused(pipelines["train"], "paper_bigmath_32b", "method=lora", monkeypatch=monkeypatch)
    assert text.startswith(
        "method: lora fits this 79.1 GiB GPU at no rollout.gpu_memory_utilization (lora: the engine "
        "needs at least 0.85, the trainer leaves at most 0.20); qerl, qerl_noaqn, qlora fit at "
        "0.32-0.73, the planner picks 0.65"
    ), text
    text = _refused(pipelines["compare"], "paper_bigmath_32b", "compare.methods=qerl lora", monkeypatch=monkeypatch)
    assert text.startswith("compare.methods: lora fits this 79.1 GiB GPU at no rollout.gpu_memory_utilization"), text
    # a compare asks for its branches only: the env's own compare.methods (the quantized arms) pass
    _validate(pipelines["compare"], "paper_bigmath_32b", monkeypatch=monkeypatch)
    # ... and so does a branch run alone with Kedro's selection (qerl's branch of that compare)
    branch = pipelines["compare"].filter(node_namespaces=["compare.qerl"])
    _validate(branch, "paper_bigmath_32b", "compare.methods=qerl lora", monkeypatch=monkeypatch)


def test_an_activation_peak_above_the_gpu_names_the_micro_batch_that_fits(pipelines, monkeypatch):
    text = _refused(
        pipelines["train"],
        "paper_bigmath_14b",
        "rollout.sleep_between_steps=false,train.micro_batch_size=16,rollout.gpu_memory_utilization=0.4",
        monkeypatch=monkeypatch,
    )
    assert text.startswith(
        "train.micro_batch_size: 16 does not fit this 79.1 GiB GPU at rollout.gpu_memory_utilization "
        "0.4 (qerl: trainer and engine need "
    ), text
    fits = int(text.split("); ")[1].split(" fits")[0])
    _validate(
        pipelines["train"],
        "paper_bigmath_14b",
        f"rollout.sleep_between_steps=false,rollout.gpu_memory_utilization=0.4,train.micro_batch_size={fits}",
        monkeypatch=monkeypatch,
    )


def test_evaluation_alone_checks_the_engines_start(pipelines, monkeypatch):
    text = _refused(
        pipelines["evaluate"],
        "paper_bigmath_14b",
        "method=lora,rollout.gpu_memory_utilization=0.3",
        monkeypatch=monkeypatch,
    )
    assert text.startswith(
        "rollout.gpu_memory_utilization: 0.3 cannot start the engine on this 79.1 GiB GPU (lora: the "
        "engine needs at least 0.40 to start"
    ), text
    assert "0.40 or more starts it" in text
    # the engine alone may take more of the GPU than a training leaves it
    _validate(
        pipelines["evaluate"],
        "paper_bigmath_14b",
        "method=lora,rollout.gpu_memory_utilization=0.9",
        monkeypatch=monkeypatch,
    )


def test_runs_without_an_engine_or_without_a_plan_are_not_refused(pipelines, monkeypatch, caplog):
    for name in ("data_prep", "quantize"):
        _validate(pipelines[name], "paper_bigmath_32b", "rollout.gpu_memory_utilization=0.25", monkeypatch=monkeypatch)
    assert hooks.engine_runs(inputs.load_config("smoke", conf_dir=CONF), pipelines["data_prep"]) == []
    with caplog.at_level(logging.INFO, logger="qerl_pipeline.hooks"):
        _validate(
            pipelines["train"],
            "paper_bigmath_32b",
            "rollout.gpu_memory_utilization=0.25",
            gpu_gib=None,
            monkeypatch=monkeypatch,
        )
        _validate(
            pipelines["train"],
            "paper_bigmath_32b",
            "rollout.gpu_memory_utilization=0.25,rollout.tensor_parallel_size=2",
            monkeypatch=monkeypatch,
        )
        _validate(
            pipelines["train"],
            "paper_bigmath_32b",
            "rollout.gpu_memory_utilization=0.25,model.name=org/unknown",
            monkeypatch=monkeypatch,
        )
    said = caplog.text
    assert "NVML cannot tell this GPU's memory" in said and "tensor_parallel_size 2" in said, said
    assert "model.name 'org/unknown'" in said, said


def test_which_engines_a_run_starts(pipelines):
    cfg = inputs.load_config("paper_bigmath_32b", "method=qlora", CONF)
    assert hooks.engine_runs(cfg, pipelines["train"]) == [(["qlora"], "method", False)]
    assert hooks.engine_runs(cfg, pipelines["__default__"]) == [(["qlora"], "method", False)]
    assert hooks.engine_runs(cfg, pipelines["evaluate"]) == [(["qlora"], "method", True)]
    assert hooks.engine_runs(cfg, pipelines["compare"]) == [
        (["qerl", "qerl_noaqn", "qlora"], "compare.methods", False)
    ]
    evaluated = pipelines["compare"].filter(node_names=["compare.qerl.evaluate_policies"])
    assert hooks.engine_runs(cfg, evaluated) == [(["qerl"], "compare.methods", True)]


def test_the_shipped_envs_pass_their_own_gpu_check(pipelines, monkeypatch):
    """What test_shipped_envs.py plans, through the hook: the paper envs' compare on an 80 GB GPU."""
    for env in ("paper_gsm8k_7b", "paper_bigmath_7b", "paper_bigmath_14b", "paper_bigmath_32b"):
        _validate(pipelines["compare"], env, monkeypatch=monkeypatch)
    assert (
        guard.pick_utilization(
            inputs.load_config("paper_bigmath_14b", conf_dir=CONF),
            ["qerl", "lora"],
            inputs.PRESETS["qwen2.5-14b"],
            H100,
        )
        == 0.55
    )


@pytest.mark.parametrize(
    "env, methods, gpu",
    [
        ("paper_bigmath_32b", ["qerl", "qlora"], H100),
        ("paper_bigmath_14b", ["qerl", "qerl_noaqn", "qlora", "lora", "lora_aqn"], H100),
        ("paper_bigmath_7b", ["qerl"], H100),
        ("paper_bigmath_32b", ["qerl", "lora"], 139.8),  # a range narrower than the headroom: its middle
    ],
)
def test_the_pick_is_the_largest_step_that_leaves_the_headroom_and_fits(env, methods, gpu):
    cfg = inputs.load_config(env, conf_dir=CONF)
    shape = inputs.resolve_shape(cfg)
    lo, hi = guard.utilization_range(guard.plans(cfg, methods, shape, gpu))
    pick = guard.pick_utilization(cfg, methods, shape, gpu)
    assert lo <= pick <= hi and all(p.fits for p in guard.plans(cfg, methods, shape, gpu, pick).values())
    if hi - lo >= guard.HEADROOM + guard.STEP:
        assert round(pick / guard.STEP, 6).is_integer(), pick
        assert pick <= hi - guard.HEADROOM < pick + guard.STEP
    else:
        assert pick == pytest.approx((lo + hi) / 2, abs=0.01)


def test_the_cli_prints_the_pick(capsys):
    from qerl_pipeline.planner import cli

    assert (
        cli.main(
            [
                "--conf-dir",
                str(CONF),
                "--env",
                "paper_bigmath_32b",
                "--gpu-gb",
                "79",
                "--methods",
                "qerl,lora",
                "--format",
                "json",
            ]
        )
        == 0
    )
    assert [p["picked_gpu_memory_utilization"] for p in json.loads(capsys.readouterr().out)] == [0.65, None]
    assert (
        cli.main(["--conf-dir", str(CONF), "--env", "paper_bigmath_14b", "--gpu-gb", "79", "--methods", "qerl,lora"])
        == 0
    )
    out = capsys.readouterr().out
    assert "qerl, lora together: rollout.gpu_memory_utilization 0.40-0.63 fits them all, the planner picks 0.55" in out


# ----------------------------------------------------------------------------- the GPU's size through NVML
class FakeNVML:
    """``pynvml`` as the driver answers it: GPUs by index and UUID, v1 and v2 memory info, MIG mode."""

    class NVMLError(Exception):
        pass

    nvmlMemory_v2 = 0x02000028

    def __init__(self, gpus: list[dict], fail_init: bool = False):
        self.gpus, self.fail_init, self.calls = gpus, fail_init, []

    def nvmlInit(self):
        self.calls.append("init")
        if self.fail_init:
            raise self.NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        for g in self.gpus:
            if g["uuid"] == uuid:
                return g
        raise self.NVMLError("Not Found")

    def nvmlDeviceGetMigMode(self, g):
        return (1 if g.get("mig") else 0, 0)

    def nvmlDeviceGetMemoryInfo(self, g, version=None):
        if version and not g.get("v2", True):
            raise self.NVMLError("Function Not Found")
        return SimpleNamespace(total=g["total"], reserved=g["reserved"], free=g["total"], used=0)


H200 = {"uuid": "GPU-31a864a8", "total": 150754820096, "reserved": 644939776}  # an H200's NVML answer
SMALL = {"uuid": "GPU-0b", "total": 24 * GIB, "reserved": GIB // 2}


@pytest.mark.parametrize(
    "visible, expected",
    [
        (None, SMALL["total"] - SMALL["reserved"]),  # every GPU: the smallest
        ("0", 150109880320),  # CUDA's total on the H200: installed less reserved
        ("GPU-31a864a8", 150109880320),
        ("0,1", SMALL["total"] - SMALL["reserved"]),
        ("0,x,1", 150109880320),  # CUDA reads up to the first entry it cannot take
        ("", None),  # no GPU visible
        ("7", None),
        ("GPU-missing", None),
    ],
)
def test_gpu_memory_is_cudas_total_of_the_smallest_visible_gpu(monkeypatch, visible, expected):
    fake = FakeNVML([H200, SMALL])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert platform.gpu_memory_bytes(env) == expected
    assert fake.calls == ["init", "shutdown"]


def test_gpu_memory_without_nvml_answers_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML([H200], fail_init=True))
    assert platform.gpu_memory_bytes({}) is None
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML([{**H200, "mig": True}]))
    assert platform.gpu_memory_bytes({}) is None  # a MIG-mode GPU named by index: CUDA sees its instances
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML([{**H200, "v2": False}]))
    assert platform.gpu_memory_bytes({}) == H200["total"]  # an older driver: the installed total
