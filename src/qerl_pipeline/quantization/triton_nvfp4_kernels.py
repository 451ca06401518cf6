"""The Triton kernel bodies for packed NVFP4 weights, and their compiled or interpreted copies.

The kernels read the packed E2M1 codes (uint8, two a byte, even column in the low nibble),
the FP8-E4M3 block scales (one per 16 inputs of a row) and the FP32 global scale straight
from memory, exactly as ``nvfp4.NVFP4Weight`` holds them:

* ``_dequant_kernel``: the dense ``W[out, in]`` in a chosen dtype, bit for bit what
  ``nvfp4.decode`` computes: ``E2M1 * (scale / global_scale)`` in float32 with a correctly
  rounded division (``div_rn``), then one cast.
* ``_fused_fwd_kernel``: ``y[M, out] = x[M, in] @ W^T`` (the frozen base's forward).
* ``_fused_dx_kernel``: ``dx[M, in] = g[M, out] @ W`` (the input gradient; the base is
  frozen, so there is no weight gradient).

The fused kernels decode one ``[BN, BK]`` tile of W in registers, cast it to the activation
dtype (the same value ``decode(W, dtype)`` gives) and feed it to ``tl.dot`` with a float32
accumulator. The global scale is read from its device tensor: no host synchronisation. Every
address offset is computed in 64-bit integers: Triton passes Python ints below 2^31 as int32,
and a row index times a row stride overflows int32 once a tensor has more than 2^31 elements
(at 7B's 18,944-wide MLP, about 113k tokens). ``in_features`` must be a multiple of 16 (NVFP4
requires it anyway); the launcher picks a K block that divides it, so no K masking is needed.
Rows (tokens, outputs) are masked, so any token count and any ``out_features`` work.

``jit_functions(interpret)`` gives the set for the compiler or for Triton's interpreter
(``interpreted(t)`` says which a tensor needs). The launchers, the per-shape tuning and the
choice between these kernels and the torch path are in ``triton_nvfp4.py``. Import never
fails: without a working ``triton``, ``HAVE_TRITON`` is False and ``jit_functions`` raises.
"""

from __future__ import annotations

import os
import types

import torch

try:  # never let a missing or broken triton break the import
    import triton
    import triton.language as tl

    HAVE_TRITON = True
    TRITON_IMPORT_ERROR: str | None = None
except Exception as _exc:  # pragma: no cover - depends on the machine
    triton = tl = None
    HAVE_TRITON = False
    TRITON_IMPORT_ERROR = repr(_exc)

# Plain functions here; ``jit_functions`` wraps copies of them for the compiler or the
# interpreter (each set in its own globals, so both can live in one process, whatever
# TRITON_INTERPRET said when triton was imported). For that they call only Triton
# *builtins* (tl.full, tl.minimum, integer division), never triton.language's own @jit
# helpers (tl.zeros, tl.cdiv, tl.sum, ...): those are wrapped for one mode at import.


def _e2m1(code):
    """E2M1 value of 4-bit codes (bit 3 = sign): 0, .5, 1, 1.5, 2, 3, 4, 6 (exact, no exp2)."""
    mag = (code & 7).to(tl.int32)
    e = mag >> 1
    m = mag & 1
    quarters = tl.where(e == 0, 2 * m, (2 + m) << e)  # the value in units of 1/4
    val = quarters.to(tl.float32) * 0.25
    return tl.where((code & 8) != 0, -val, val)


def _round_like(v, dtype: tl.constexpr):
    """Float32 ``v`` rounded to nearest-even at ``dtype``'s precision, kept in float32.

    Interpreter only (``EMULATE``): its bf16 casts truncate and its ``tl.dot`` multiplies
    bf16 bit patterns, so there the kernels round with integer ops and multiply in float32
    (exact for bf16/fp16 operands: their products fit float32's mantissa). Finite inputs.
    """
    if dtype == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        return ((b >> 16) << 16).to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


def _dequant_tile(p_ptr, s_ptr, gs, rows, k0, n_rows, stride_p, stride_s, BR: tl.constexpr, BK: tl.constexpr):
    """Float32 tile ``W[rows, k0:k0+BK]`` (BK % 16 == 0); rows >= n_rows read as 0."""
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    pk = k0 // 2 + tl.arange(0, BK // 2)
    p = tl.load(p_ptr + rows64[:, None] * stride_p + pk[None, :], mask=row_ok[:, None], other=0)
    w = tl.reshape(tl.join(_e2m1(p & 15), _e2m1(p >> 4)), (BR, BK))
    sk = k0 // 16 + tl.arange(0, BK // 16)
    s = tl.load(s_ptr + rows64[:, None] * stride_s + sk[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    eff = tl.math.div_rn(s, tl.full((BR, BK // 16), 0.0, tl.float32) + gs)  # scale / gs, rounded like torch's
    eff = tl.reshape(tl.broadcast_to(eff[:, :, None], (BR, BK // 16, 16)), (BR, BK))
    return w * eff


def _dequant_kernel(
    p_ptr,
    s_ptr,
    gs_ptr,
    out_ptr,
    N,
    stride_p,
    stride_s,
    stride_o,
    BR: tl.constexpr,
    BK: tl.constexpr,
    EMULATE: tl.constexpr,
):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    k0 = tl.program_id(1) * BK
    gs = tl.load(gs_ptr)
    w = _dequant_tile(p_ptr, s_ptr, gs, rows, k0, N, stride_p, stride_s, BR, BK)
    if EMULATE:
        w = _round_like(w, out_ptr.dtype.element_ty)
    cols = k0 + tl.arange(0, BK)
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :],
        w.to(out_ptr.dtype.element_ty),
        mask=(rows < N)[:, None],
    )


def _fused_fwd_kernel(
    x_ptr,
    p_ptr,
    s_ptr,
    gs_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_p,
    stride_s,
    stride_ym,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """``y[M, N] = x[M, K] @ dequant(W)[N, K]^T``; K % BK == 0; grouped tile order."""
    pid = tl.program_id(0)
    n_m = (M + BM - 1) // BM
    n_n = (N + BN - 1) // BN
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rm64 = rm.to(tl.int64)
    gs = tl.load(gs_ptr)
    acc = tl.full((BM, BN), 0.0, tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rm64[:, None] * stride_xm + rk[None, :], mask=(rm < M)[:, None], other=0.0)
        w = _dequant_tile(p_ptr, s_ptr, gs, rn, k0, N, stride_p, stride_s, BN, BK)
        if EMULATE:
            acc = tl.dot(x.to(tl.float32), tl.trans(_round_like(w, x.dtype)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
    if EMULATE:
        acc = _round_like(acc, y_ptr.dtype.element_ty)
    tl.store(
        y_ptr + rm64[:, None] * stride_ym + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm < M)[:, None] & (rn < N)[None, :],
    )


def _fused_dx_kernel(
    g_ptr,
    p_ptr,
    s_ptr,
    gs_ptr,
    dx_ptr,
    M,
    N,
    K,
    stride_gm,
    stride_p,
    stride_s,
    stride_dm,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PRECISION: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """``dx[M, K] = g[M, N] @ dequant(W)[N, K]``; K % BK == 0."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rm64 = rm.to(tl.int64)
    k0 = tl.program_id(1) * BK
    gs = tl.load(gs_ptr)
    acc = tl.full((BM, BK), 0.0, tl.float32)
    for n0 in range(0, N, BN):
        rn = n0 + tl.arange(0, BN)
        g = tl.load(
            g_ptr + rm64[:, None] * stride_gm + rn[None, :], mask=(rm < M)[:, None] & (rn < N)[None, :], other=0.0
        )
        w = _dequant_tile(p_ptr, s_ptr, gs, rn, k0, N, stride_p, stride_s, BN, BK)
        if EMULATE:
            acc = tl.dot(g.to(tl.float32), _round_like(w, g.dtype), acc, input_precision="ieee")
        else:
            acc = tl.dot(g, w.to(g.dtype), acc, input_precision=PRECISION)
    if EMULATE:
        acc = _round_like(acc, dx_ptr.dtype.element_ty)
    rk = k0 + tl.arange(0, BK)
    tl.store(dx_ptr + rm64[:, None] * stride_dm + rk[None, :], acc.to(dx_ptr.dtype.element_ty), mask=(rm < M)[:, None])


_KERNEL_NAMES = ("_e2m1", "_round_like", "_dequant_tile", "_dequant_kernel", "_fused_fwd_kernel", "_fused_dx_kernel")
_JIT_SETS: dict[bool, types.SimpleNamespace] = {}


def jit_functions(interpret: bool) -> types.SimpleNamespace:
    """The kernels wrapped for the compiler (``interpret=False``) or the interpreter."""
    if not HAVE_TRITON:
        raise RuntimeError(f"triton is not available ({TRITON_IMPORT_ERROR})")
    if interpret not in _JIT_SETS:
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction as wrap
        else:
            wrap = triton.jit
        namespace = dict(globals())  # helpers resolve to this set's wrapped copies
        for name in _KERNEL_NAMES:
            raw = globals()[name]
            fn = types.FunctionType(raw.__code__, namespace, name, raw.__defaults__, raw.__closure__)
            fn.__annotations__ = dict(raw.__annotations__)
            fn.__doc__, fn.__module__, fn.__qualname__ = raw.__doc__, raw.__module__, raw.__qualname__
            namespace[name] = wrap(fn)
        _JIT_SETS[interpret] = types.SimpleNamespace(**{n: namespace[n] for n in _KERNEL_NAMES})
    return _JIT_SETS[interpret]


def interpreted(t: torch.Tensor) -> bool:
    """CPU tensors always go to the interpreter; CUDA ones too under TRITON_INTERPRET=1."""
    if t.device.type == "cpu":
        return True
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older ones read the env var
    return bool(knobs.runtime.interpret) if knobs is not None else os.environ.get("TRITON_INTERPRET") == "1"
