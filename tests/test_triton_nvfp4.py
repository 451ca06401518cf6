"""The Triton NVFP4 kernels (``quantization/triton_nvfp4.py``) and how PackedLinear chooses them.

The kernels run here in Triton's CPU interpreter: ``triton_nvfp4`` sends CPU tensors to an
interpreted copy of the kernels whatever ``TRITON_INTERPRET`` said when triton was first
imported, so these tests run in the same pytest process as every other module (no
subprocess, no import-order dependence). Tiny shapes only: the interpreter is slow.

Tolerances (relative Frobenius error against the torch path, decode then matmul):
float32 1e-5 (same products, another summation order; observed ~2e-7); bfloat16 4e-3
(both round one float32 sum to bf16, at most 2^-8 relative per element; observed 0).
The dequantization must equal ``nvfp4.decode`` bit for bit.

The CUDA side of ``auto`` (the one-time correctness check + timing) is driven with the
platform as a parameter: a fake ``"cuda"`` with fake timings, the check itself running the
real kernel in the interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from qerl_pipeline.quantization import nvfp4
from qerl_pipeline.quantization import triton_nvfp4 as tn
from qerl_pipeline.quantization.policy import DENSE_TRACKER, PackedLinear

ROOT = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(not tn.HAVE_TRITON, reason=f"triton not importable ({tn.TRITON_IMPORT_ERROR})")
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}
DTYPES = [torch.float32, torch.bfloat16]


def _weight(out_f: int, in_f: int, seed: int = 0) -> nvfp4.NVFP4Weight:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=gen) * 0.02
    w[0, :16] = 0.0  # an all-zero block (scale replaced by 0.125, codes 0)
    w[1, 3] = -1e-6  # a small negative that rounds to "-0" (nibble 8)
    return nvfp4.encode(w)


def _randn(*shape: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _layer(out_f: int, in_f: int, kernel: str, dtype: torch.dtype, bias: bool = True) -> PackedLinear:
    w = _weight(out_f, in_f, seed=3)
    b = _randn(out_f, dtype=torch.float32, seed=4) if bias else None
    return PackedLinear(in_f, out_f, "nvfp4", w.state_dict(), compute_dtype=dtype, bias=b, kernel=kernel)


# ----------------------------------------------------------------------------- kernels
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("shape", [(64, 128), (200, 144), (72, 256)])  # out not /16, in not /32
def test_dequant_equals_the_torch_codec_exactly(shape, dtype):
    w = _weight(*shape)
    got = tn.KERNELS.dequant(w, dtype)
    want = w.decode(dtype)
    assert got.dtype == dtype and got.shape == want.shape
    # bit for bit (also the sign of zero)
    bits = torch.int16 if dtype != torch.float32 else torch.int32
    assert torch.equal(got.view(bits), want.view(bits))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_f,in_f,tokens", [(64, 128, 1), (200, 144, 33), (256, 256, 17), (72, 208, 5)])
def test_fused_forward_and_input_gradient_match_the_torch_path(out_f, in_f, tokens, dtype):
    w = _weight(out_f, in_f)
    x = _randn(tokens, in_f, dtype=dtype)
    g = _randn(tokens, out_f, dtype=dtype, seed=2)
    y, dx = tn.KERNELS.fwd(x, w), tn.KERNELS.dx(g, w)
    assert y.dtype == dx.dtype == dtype and y.shape == (tokens, out_f) and dx.shape == (tokens, in_f)
    assert tn.rel_err(y, tn.torch_matmul("fwd", x, w)) < REL_TOL[dtype]
    assert tn.rel_err(dx, tn.torch_matmul("dx", g, w)) < REL_TOL[dtype]
    # a row-strided operand (a column slice: stride 2*in, not in) gives the same numbers
    wide = torch.cat([x, x], dim=1)[:, :in_f]
    assert wide.stride(0) == 2 * in_f and torch.equal(tn.KERNELS.fwd(wide, w), y)


@needs_triton
def test_config_search_keeps_the_fastest_and_every_block_divides_k():
    in_f = 144  # no listed BK (64..256) divides it: the search falls back to smaller K blocks
    w, x = _weight(64, in_f), _randn(5, in_f, dtype=torch.float32)
    calls = []

    def timer(fn, device, warmup, iters):  # pretend each later config is faster
        calls.append(fn)
        return 10.0 - len(calls)

    kernels = tn.NVFP4Kernels(tune=True, timer=timer)
    candidates = kernels._candidates(kernels.FWD_CONFIGS, in_f)
    assert candidates and all(in_f % c["BK"] == 0 for c in candidates)
    y = kernels.fwd(x, w)
    assert len(calls) == len(candidates)
    assert list(kernels.chosen.values()) == [candidates[-1]]
    assert tn.rel_err(y, tn.torch_matmul("fwd", x, w)) < REL_TOL[torch.float32]
    kernels.fwd(x[:3], w)  # same token bucket: no new search
    assert len(calls) == len(candidates) and len(kernels.chosen) == 1


def test_token_buckets():
    assert [tn.token_bucket(m) for m in (0, 1, 16, 17, 33, 64, 65, 4096)] == [16, 16, 16, 32, 64, 64, 128, 4096]


# ----------------------------------------------------------------------------- PackedLinear
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_on_the_triton_path_matches_the_torch_path(dtype):
    """Forward + backward through autograd (3-D input, bias, a non-trivial loss)."""
    layers = {k: _layer(96, 160, k, dtype) for k in ("torch", "triton")}
    x0 = _randn(2, 7, 160, dtype=dtype, seed=5)
    r = _randn(2, 7, 96, dtype=torch.float32, seed=6)
    out, grads = {}, {}
    for kernel, layer in layers.items():
        x = x0.clone().requires_grad_(True)
        DENSE_TRACKER.reset()
        y = layer(x)
        (y.float() * r).sum().backward()
        out[kernel], grads[kernel] = y.detach(), x.grad
        decoded = DENSE_TRACKER.transient_peak
        # the fused path never materialises the dense weight; the torch path decodes it
        assert (decoded == 0) if kernel == "triton" else (decoded > 0)
    assert out["triton"].shape == (2, 7, 96) and out["triton"].dtype == dtype
    assert tn.rel_err(out["triton"], out["torch"]) < REL_TOL[dtype]
    assert tn.rel_err(grads["triton"], grads["torch"]) < REL_TOL[dtype]


@needs_triton
def test_force_kernel_drives_auto_layers_and_restores():
    layer = _layer(64, 128, "auto", torch.float32, bias=False)
    x = _randn(3, 128, dtype=torch.float32, seed=7)
    ref = x @ layer.dense_weight().t()
    previous = tn.kernel_mode()
    with tn.force_kernel("triton"):
        assert tn.kernel_mode() == "triton"
        assert layer.uses_triton("fwd", x) and layer.uses_triton("dx", x[:, :64])
        y = layer(x)
    assert tn.kernel_mode() == previous
    assert tn.rel_err(y, ref) < REL_TOL[torch.float32]
    with tn.force_kernel("torch"):
        assert not _layer(64, 128, "auto", torch.float32).uses_triton("fwd", x)
        assert _layer(64, 128, "triton", torch.float32).uses_triton("fwd", x)  # the layer's own choice wins


@tn.force_kernel("auto")  # whatever QERL_NVFP4_KERNEL says
def test_auto_on_cpu_is_the_torch_path():
    layer = _layer(64, 128, "auto", torch.float32)
    x = _randn(4, 128, dtype=torch.float32, seed=8)
    before = dict(tn.DISPATCHER.decisions)
    assert layer.kernel == "auto" and tn.kernel_mode() == "auto"
    assert not layer.uses_triton("fwd", x) and not layer.uses_triton("dx", x[:, :64])
    decision = tn.DISPATCHER.choose("fwd", x, layer.nvfp4_weight())
    assert decision.kernel == "torch" and "CUDA only" in decision.reason and not decision.failed
    DENSE_TRACKER.reset()
    y = layer(x)
    assert DENSE_TRACKER.transient_peak > 0  # decoded by the torch codec
    assert torch.equal(y, x @ layer.dense_weight().t() + layer.bias)
    assert tn.DISPATCHER.decisions == before  # nothing timed, nothing cached


def test_nf4_and_bad_kernel_names():
    with pytest.raises(ValueError, match="kernel must be one of"):
        _layer(64, 128, "cuda", torch.float32)
    with pytest.raises(ValueError, match="kernel mode must be one of"):
        tn.set_kernel_mode("fast")
    from qerl_pipeline.quantization import nf4

    layer = PackedLinear(64, 32, "nf4", nf4.encode(torch.randn(32, 64) * 0.02).state_dict(), kernel="triton")
    assert not layer.uses_triton("fwd", torch.zeros(2, 64))  # NF4 never takes the NVFP4 kernel


# ----------------------------------------------------------------------------- the decision
def _decide(**kw):
    args = dict(
        platform="cuda",
        available=True,
        check=lambda: 1e-6,
        time_triton=lambda: 1.0,
        time_torch=lambda: 2.0,
        tolerance=1e-3,
    )
    return tn.decide(**{**args, **kw})


def test_decide_picks_the_faster_correct_path():
    assert _decide().kernel == "triton"
    slower = _decide(time_triton=lambda: 3.0)
    assert slower.kernel == "torch" and not slower.failed and slower.triton_ms == 3.0 and slower.torch_ms == 2.0
    assert _decide(platform="cpu").kernel == "torch"
    assert _decide(available=False).kernel == "torch"
    wrong = _decide(check=lambda: 0.5)
    assert wrong.kernel == "torch" and wrong.failed and wrong.rel_err == 0.5
    assert _decide(check=lambda: float("nan")).failed

    def broken():
        raise RuntimeError("PassManager::run failed")

    crashed = _decide(check=broken)
    assert crashed.kernel == "torch" and crashed.failed and "PassManager" in crashed.reason
    timed_out = _decide(time_triton=broken)
    assert timed_out.kernel == "torch" and timed_out.failed


@needs_triton
def test_dispatcher_on_a_fake_cuda_checks_the_real_kernel_then_times(monkeypatch):
    w = _weight(64, 128)
    a = _randn(5, 128, dtype=torch.bfloat16, seed=9)
    timings = {"fast": 1.0}
    seen = []

    def timer(fn, device):  # the fused kernel is timed first, then the torch path
        seen.append(fn)
        return timings["fast"] if len(seen) % 2 else 2.0

    disp = tn.Dispatcher(tn.NVFP4Kernels(), timer=timer)
    first = disp.choose("fwd", a, w, platform="cuda")
    assert first.kernel == "triton" and first.rel_err is not None and first.rel_err < tn.TOLERANCE[torch.bfloat16]
    assert disp.choose("fwd", a[:3], w, platform="cuda") is first and len(seen) == 2  # cached per token bucket
    timings["fast"] = 5.0
    assert disp.choose("dx", _randn(5, 64, dtype=torch.bfloat16), w, platform="cuda").kernel == "torch"
    assert disp.choose("fwd", a.float(), w, platform="cuda").kernel == "torch"  # float32: torch's IEEE cuBLAS

    # a kernel that disagrees with the torch path: torch, with exactly one warning
    bad = tn.NVFP4Kernels()
    monkeypatch.setattr(bad, "fwd", lambda x, w: torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype))
    disp = tn.Dispatcher(bad, timer=timer)
    with pytest.warns(RuntimeWarning, match="disagrees"):
        assert disp.choose("fwd", a, w, platform="cuda").kernel == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert disp.choose("fwd", _randn(40, 128, dtype=torch.bfloat16), w, platform="cuda").kernel == "torch"
    assert all(d.failed for d in disp.decisions.values()) and len(disp.decisions) == 2
    assert set(disp.summary()) == {"fwd/16/64/128/bfloat16/cpu", "fwd/64/64/128/bfloat16/cpu"}


def test_import_and_policy_work_without_triton():
    """With ``import triton`` failing, the module imports, auto is torch and "triton" raises."""
    code = """
import sys
sys.modules["triton"] = None  # import triton -> ImportError
import torch
from qerl_pipeline.quantization import nvfp4, triton_nvfp4 as tn
from qerl_pipeline.quantization.policy import PackedLinear
assert not tn.HAVE_TRITON and tn.TRITON_IMPORT_ERROR
w = nvfp4.encode(torch.randn(32, 64) * 0.02)
x = torch.randn(3, 64)
assert tn.DISPATCHER.choose("fwd", x, w, platform="cuda").kernel == "torch"
layer = PackedLinear(64, 32, "nvfp4", w.state_dict())
assert torch.equal(layer(x), x @ w.decode().t())
try:
    PackedLinear(64, 32, "nvfp4", w.state_dict(), kernel="triton")(x)
except RuntimeError as exc:
    assert "triton is not available" in str(exc)
else:
    raise AssertionError("kernel='triton' without triton must raise")
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
