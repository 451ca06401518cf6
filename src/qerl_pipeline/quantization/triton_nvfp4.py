"""Multiplying by a packed NVFP4 weight without materialising it: launchers, tuning, and when to.

What is here
------------
The Triton kernels themselves (``dequant``, the fused ``fwd`` ``y = x @ W^T`` and the
input gradient ``dx = g @ W``; the base is frozen, so there is no weight gradient) are in
``triton_nvfp4_kernels.py``. They decode W tile by tile in registers with the same numbers
``nvfp4.decode`` gives and accumulate in float32; float32 activations use IEEE products
(no TF32), like torch's default.

``NVFP4Kernels`` launches them. On CUDA it times a few block configurations once per
(op, token bucket, out, in, dtype, device) and keeps the fastest (``chosen``); token counts
are bucketed to the next power of two (at least 16) so that variable sequence lengths do
not retune. CPU tensors run the same kernel code in Triton's interpreter (tests only: it
is slow), with one fixed configuration, whether or not ``TRITON_INTERPRET`` was set.

When the kernel is used
-----------------------
``PackedLinear`` (``quantization/policy.py``) asks :func:`use_triton` before each NVFP4
forward (``op="fwd"``) and backward (``op="dx"``). The mode comes from the layer's
``kernel`` argument, else :func:`kernel_mode` (``QERL_NVFP4_KERNEL`` env var, default
``"auto"``; :func:`force_kernel` overrides it for a block of code):

* ``"torch"``: never; the torch codec decodes W and torch multiplies.
* ``"triton"``: always (tests; CPU tensors go through the interpreter). No check, no
  fallback: an error surfaces.
* ``"auto"``: :data:`DISPATCHER` decides once per (op, token bucket, out, in, dtype,
  device) with :func:`decide`. Off CUDA, without Triton, or for a dtype other than
  bfloat16/float16 (``AUTO_DTYPES``; float32 stays on torch's IEEE cuBLAS) the answer is
  torch, at no cost. On CUDA it first runs the fused kernel on random operands of the
  token count that is about to run (not the bucket's largest: a check twice the size of
  the real product could run out of memory, or past int32 offsets, where the product
  itself does not) and compares it with the torch path (decode, then matmul); a compile
  error or a relative error above ``TOLERANCE[dtype]`` means torch, with one warning per
  process (later fallbacks are logged). Then it times both (median of CUDA-event
  timings) and picks the faster. Its memory, :func:`check_bytes`, is what the planner
  counts for it (``planner/sizing.py``). The decision is cached;
  ``DISPATCHER.decisions`` lists them with their timings and errors. The first step of
  a run pays for it: Triton compiles the candidate configurations (cached on disk by
  Triton afterwards) and times them.

Import never fails: without a working ``triton`` (``HAVE_TRITON`` False), ``auto`` is
always torch and ``"triton"`` raises.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from qerl_pipeline.quantization import nvfp4
from qerl_pipeline.quantization.triton_nvfp4_kernels import (
    HAVE_TRITON,
    TRITON_IMPORT_ERROR,
    interpreted,
    jit_functions,
    triton,
)

log = logging.getLogger(__name__)

MODES = ("auto", "torch", "triton")
OPS = ("fwd", "dx")
#: Activation dtypes the fused kernels take (the weight tile is cast to this dtype).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Dtypes ``auto`` considers on CUDA. Float32 is left to torch: IEEE float32 products
#: (what torch computes by default) cannot use tensor cores, so the fused kernel runs on
#: FMA units (and compiles slowly) and never beats cuBLAS; ``"triton"`` still forces it.
AUTO_DTYPES = (torch.bfloat16, torch.float16)
#: Largest relative (Frobenius) error of the fused kernel against the torch path that the
#: one-time check accepts. Both round the same products once to the output dtype; the
#: tolerances are ~10x that rounding and far below what a wrong kernel gives (~1).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


# ----------------------------------------------------------------------------- timing
def bench_ms(fn: Callable[[], Any], device: torch.device | str, warmup: int = 3, iters: int = 10) -> float:
    """Median wall time of ``fn()`` in ms (CUDA events on CUDA, perf_counter elsewhere)."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


#: Float32 bytes ``rel_err`` works in at once (rows at a time), so that checking a large product
#: costs no float32 copies of its outputs.
REL_ERR_CHUNK_BYTES = 64 * 2**20


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float32 (0 when both are zero), a few rows at a time."""
    a, b = a.reshape(-1, a.shape[-1] if a.ndim else 1), b.reshape(-1, b.shape[-1] if b.ndim else 1)
    rows = max(1, REL_ERR_CHUNK_BYTES // (3 * 4 * max(1, a.shape[1])))  # a, b and a - b in float32
    diff = ref = 0.0
    for start in range(0, a.shape[0], rows):
        ca, cb = a[start : start + rows].float(), b[start : start + rows].float()
        diff += float(torch.linalg.vector_norm(ca - cb)) ** 2
        ref += float(torch.linalg.vector_norm(cb)) ** 2
    return math.sqrt(diff) / max(math.sqrt(ref), 1e-30)


def check_bytes(op: str, m: int, n: int, k: int, elem: int) -> int:
    """Device bytes the ``auto`` check of one ``[n, k]`` weight and ``m`` tokens holds at its peak.

    The random probe (``m`` x the input width), the kernel's output and the torch path's
    output (``m`` x the output width, ``elem`` bytes each), and the torch path's decode
    (``nvfp4.DECODE_BYTES_PER_WEIGHT`` a weight: codes, indices, float32 values, the result);
    ``rel_err``'s float32 rows are bounded by ``REL_ERR_CHUNK_BYTES``.
    """
    width_in, width_out = (k, n) if op == "fwd" else (n, k)
    return elem * m * (width_in + 2 * width_out) + nvfp4.DECODE_BYTES_PER_WEIGHT * n * k + REL_ERR_CHUNK_BYTES


def _precision(a: torch.Tensor) -> str:
    """``tl.dot``'s input precision: IEEE products for float32 (torch's default: no TF32)."""
    return "ieee" if a.dtype == torch.float32 else "tf32"  # (ignored for 16-bit operands)


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def token_bucket(m: int) -> int:
    """Token counts sharing one config and one decision: the next power of two, at least 16."""
    return max(16, 1 << max(m - 1, 0).bit_length())


def _largest_block_dividing(k: int, cap: int) -> int:
    """Largest power of two <= cap dividing k, at least 16 (k % 16 == 0 for NVFP4)."""
    b = _pow2_floor(cap)
    while b > 16 and k % b:
        b //= 2
    return b


def _check_operands(a: torch.Tensor, w: nvfp4.NVFP4Weight, inner: int, what: str) -> None:
    if a.ndim != 2:
        raise ValueError(f"{what}: expected a 2-D input, got shape {tuple(a.shape)}")
    if a.dtype not in DTYPES:
        raise ValueError(f"{what}: dtype {a.dtype} not supported (one of {DTYPES})")
    if a.shape[1] != inner:
        raise ValueError(f"{what}: input has {a.shape[1]} columns, the weight {w.shape} needs {inner}")
    if w.shape[1] % nvfp4.GROUP_SIZE:
        raise ValueError(f"{what}: in_features {w.shape[1]} is not a multiple of {nvfp4.GROUP_SIZE}")
    for t in (w.packed, w.scale, w.global_scale):
        if t.device != a.device:
            raise ValueError(f"{what}: input on {a.device}, weight tensors on {t.device}")


def _weight_args(w: nvfp4.NVFP4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    packed = w.packed if w.packed.stride(-1) == 1 else w.packed.contiguous()
    scale = w.scale if w.scale.stride(-1) == 1 else w.scale.contiguous()
    if scale.dtype == torch.uint8:  # bit pattern (as PackedLinear stores it)
        scale = scale.view(torch.float8_e4m3fn)
    gs = w.global_scale.reshape(-1)[:1]
    if gs.dtype != torch.float32:
        gs = gs.view(torch.float32) if gs.dtype == torch.int32 else gs.float()
    return packed, scale, gs


class NVFP4Kernels:
    """Launchers for the three kernels, with a per-shape block configuration.

    ``tune`` (default: on CUDA, compiled) times ``FWD_CONFIGS`` / ``DX_CONFIGS`` (those whose
    BK divides ``in_features``; smaller-BK variants when none does) on the first call per
    (op, token bucket, out, in, dtype, device) and keeps the fastest in ``chosen``.
    Otherwise one fixed configuration is used (the interpreter's: large blocks, so that
    it runs few programs).
    """

    FWD_CONFIGS = (
        dict(BM=128, BN=128, BK=128, GROUP_M=8, num_warps=8, num_stages=3),
        dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=4),
        dict(BM=64, BN=128, BK=128, GROUP_M=8, num_warps=4, num_stages=3),
        dict(BM=128, BN=64, BK=128, GROUP_M=8, num_warps=4, num_stages=4),
        dict(BM=64, BN=64, BK=128, GROUP_M=8, num_warps=4, num_stages=4),
        dict(BM=16, BN=128, BK=128, GROUP_M=1, num_warps=4, num_stages=4),
        dict(BM=16, BN=64, BK=256, GROUP_M=1, num_warps=4, num_stages=3),
    )
    DX_CONFIGS = (
        dict(BM=128, BN=64, BK=128, num_warps=8, num_stages=3),
        dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3),
        dict(BM=64, BN=64, BK=128, num_warps=4, num_stages=4),
        dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=4),
    )

    def __init__(self, *, tune: bool | None = None, timer: Callable[..., float] = bench_ms) -> None:
        self.tune = tune
        self.timer = timer
        self.chosen: dict[tuple, dict] = {}

    # --------------------------------------------------------------- configuration
    @staticmethod
    def _fixed_config(op: str, m: int, n: int, k: int) -> dict:
        bm = min(token_bucket(m), 64)
        if op == "fwd":
            return dict(
                BM=bm,
                BN=min(max(16, _pow2_floor(n)), 128),
                BK=_largest_block_dividing(k, 128),
                GROUP_M=1,
                num_warps=4,
                num_stages=1,
            )
        return dict(
            BM=bm, BN=min(max(16, _pow2_floor(n)), 128), BK=_largest_block_dividing(k, 128), num_warps=4, num_stages=1
        )

    @staticmethod
    def _candidates(configs: tuple[dict, ...], k: int) -> list[dict]:
        fits = [dict(c) for c in configs if k % c["BK"] == 0]
        if fits:
            return fits
        out = []
        for c in configs:  # no BK divides k: the same tiles with the largest BK that does
            c = dict(c, BK=_largest_block_dividing(k, c["BK"]))
            if c not in out:
                out.append(c)
        return out

    def _config(self, key: tuple, a: torch.Tensor, configs: tuple[dict, ...], launch: Callable[[dict], Any]) -> dict:
        if key in self.chosen:
            return self.chosen[key]
        op, _, n, k = key[:4]
        tune = self.tune if self.tune is not None else (a.device.type == "cuda" and not interpreted(a))
        if not tune:
            self.chosen[key] = self._fixed_config(op, a.shape[0], n, k)
            return self.chosen[key]
        best, best_ms, errors = None, math.inf, []
        for cfg in self._candidates(configs, k):
            try:
                ms = self.timer(lambda cfg=cfg: launch(cfg), a.device, warmup=1, iters=5)
            except Exception as exc:  # e.g. a config that needs more shared memory than there is
                errors.append(f"{cfg}: {exc!r}")
                continue
            if ms < best_ms:
                best, best_ms = cfg, ms
        if best is None:
            raise RuntimeError(f"no Triton configuration ran for {key}: {errors[:2]}")
        self.chosen[key] = best
        return best

    @staticmethod
    def _key(op: str, m: int, n: int, k: int, a: torch.Tensor) -> tuple:
        return (op, token_bucket(m), n, k, str(a.dtype).removeprefix("torch."), str(a.device))

    # --------------------------------------------------------------- launchers
    def dequant(self, w: nvfp4.NVFP4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense ``[out, in]`` weight in ``dtype``; equals ``w.decode(dtype)`` exactly."""
        packed, scale, gs = _weight_args(w)
        n, k = w.shape
        if k % nvfp4.GROUP_SIZE:
            raise ValueError(f"dequant: in_features {k} is not a multiple of {nvfp4.GROUP_SIZE}")
        out = torch.empty(n, k, device=packed.device, dtype=dtype)
        if n == 0 or k == 0:
            return out
        interpret = interpreted(packed)
        fns = jit_functions(interpret)
        br = 32 if packed.device.type == "cuda" else min(max(16, _pow2_floor(n)), 128)
        bk = _largest_block_dividing(k, 128)
        fns._dequant_kernel[(triton.cdiv(n, br), k // bk)](
            packed,
            scale,
            gs,
            out,
            n,
            packed.stride(0),
            scale.stride(0),
            out.stride(0),
            BR=br,
            BK=bk,
            EMULATE=interpret,
            enable_fp_fusion=False,
        )
        return out

    def fwd(self, x: torch.Tensor, w: nvfp4.NVFP4Weight) -> torch.Tensor:
        """``x[M, in] @ W^T`` -> ``[M, out]`` in x's dtype."""
        n, k = w.shape
        _check_operands(x, w, k, "fwd")
        x = x if x.stride(-1) == 1 else x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, n, device=x.device, dtype=x.dtype)
        if m == 0 or n == 0:
            return y
        packed, scale, gs = _weight_args(w)
        interpret = interpreted(x)
        fns = jit_functions(interpret)

        def launch(cfg: dict) -> torch.Tensor:
            grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]),)
            fns._fused_fwd_kernel[grid](
                x,
                packed,
                scale,
                gs,
                y,
                m,
                n,
                k,
                x.stride(0),
                packed.stride(0),
                scale.stride(0),
                y.stride(0),
                PRECISION=_precision(x),
                EMULATE=interpret,
                enable_fp_fusion=False,
                **cfg,
            )
            return y

        return launch(self._config(self._key("fwd", m, n, k, x), x, self.FWD_CONFIGS, launch))

    def dx(self, g: torch.Tensor, w: nvfp4.NVFP4Weight) -> torch.Tensor:
        """``g[M, out] @ W`` -> ``[M, in]`` in g's dtype."""
        n, k = w.shape
        _check_operands(g, w, n, "dx")
        g = g if g.stride(-1) == 1 else g.contiguous()
        m = g.shape[0]
        dx = torch.empty(m, k, device=g.device, dtype=g.dtype)
        if m == 0 or k == 0:
            return dx
        if n == 0:
            return dx.zero_()
        packed, scale, gs = _weight_args(w)
        interpret = interpreted(g)
        fns = jit_functions(interpret)

        def launch(cfg: dict) -> torch.Tensor:
            grid = (triton.cdiv(m, cfg["BM"]), k // cfg["BK"])
            fns._fused_dx_kernel[grid](
                g,
                packed,
                scale,
                gs,
                dx,
                m,
                n,
                k,
                g.stride(0),
                packed.stride(0),
                scale.stride(0),
                dx.stride(0),
                PRECISION=_precision(g),
                EMULATE=interpret,
                enable_fp_fusion=False,
                **cfg,
            )
            return dx

        return launch(self._config(self._key("dx", m, n, k, g), g, self.DX_CONFIGS, launch))

    def matmul(self, op: str, a: torch.Tensor, w: nvfp4.NVFP4Weight) -> torch.Tensor:
        return self.fwd(a, w) if op == "fwd" else self.dx(a, w)


def torch_matmul(op: str, a: torch.Tensor, w: nvfp4.NVFP4Weight) -> torch.Tensor:
    """The torch path the kernels replace: decode W (float32 math, then a's dtype), multiply."""
    dense = w.decode(a.dtype)
    return a @ dense.t() if op == "fwd" else a @ dense


# ----------------------------------------------------------------------------- decision
@dataclass(frozen=True)
class Decision:
    """Which path one (op, token bucket, out, in, dtype, device) takes, and why."""

    kernel: str  # "triton" | "torch"
    reason: str
    rel_err: float | None = None
    triton_ms: float | None = None
    torch_ms: float | None = None
    failed: bool = False  # the kernel failed or disagreed (the fallback that warns)

    def as_dict(self) -> dict:
        return asdict(self)


def decide(
    platform: str,
    *,
    available: bool,
    check: Callable[[], float],
    time_triton: Callable[[], float],
    time_torch: Callable[[], float],
    tolerance: float,
) -> Decision:
    """The one-time choice between the fused kernel and the torch path.

    ``platform`` is the device type (the kernel is considered on ``"cuda"`` only);
    ``check()`` runs the kernel and returns its relative error against the torch path (an
    exception = the kernel failed); ``time_triton`` / ``time_torch`` return ms.
    """
    if platform != "cuda":
        return Decision("torch", f"platform {platform!r}: the fused kernel is used on CUDA only")
    if not available:
        return Decision(
            "torch", f"triton unavailable ({TRITON_IMPORT_ERROR})" if not HAVE_TRITON else "triton unavailable"
        )
    try:
        err = float(check())
    except Exception as exc:
        return Decision("torch", f"the Triton kernel failed: {exc!r}", failed=True)
    if not math.isfinite(err) or err > tolerance:
        return Decision(
            "torch",
            f"the Triton kernel disagrees with the torch path: relative error {err:.3g} > {tolerance:g}",
            rel_err=err,
            failed=True,
        )
    try:
        t_triton = float(time_triton())
    except Exception as exc:
        return Decision("torch", f"the Triton kernel failed while timed: {exc!r}", rel_err=err, failed=True)
    t_torch = float(time_torch())
    if t_triton < t_torch:
        return Decision("triton", f"fused {t_triton:.4g} ms < decode+matmul {t_torch:.4g} ms", err, t_triton, t_torch)
    return Decision("torch", f"decode+matmul {t_torch:.4g} ms <= fused {t_triton:.4g} ms", err, t_triton, t_torch)


class Dispatcher:
    """Caches :func:`decide` per (op, token bucket, out, in, dtype, device); warns once on a failure."""

    def __init__(self, kernels: NVFP4Kernels, *, timer: Callable[..., float] = bench_ms) -> None:
        self.kernels = kernels
        self.timer = timer
        self.decisions: dict[tuple, Decision] = {}
        self._warned = False

    def key(self, op: str, a: torch.Tensor, w: nvfp4.NVFP4Weight) -> tuple:
        n, k = w.shape
        return (op, token_bucket(a.shape[0]), n, k, str(a.dtype).removeprefix("torch."), str(a.device))

    def choose(self, op: str, a: torch.Tensor, w: nvfp4.NVFP4Weight, *, platform: str | None = None) -> Decision:
        """The (cached) decision for multiplying ``a`` by ``w`` (``op`` "fwd": ``a @ W^T``, "dx": ``a @ W``)."""
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        platform = platform or a.device.type
        if platform != "cuda" or not HAVE_TRITON:  # answered at no cost, not cached
            return decide(
                platform,
                available=HAVE_TRITON,
                check=lambda: math.nan,
                time_triton=lambda: math.inf,
                time_torch=lambda: 0.0,
                tolerance=0.0,
            )
        if a.dtype not in AUTO_DTYPES:
            return Decision("torch", f"dtype {a.dtype}: auto considers the fused kernel for {AUTO_DTYPES} only")
        key = self.key(op, a, w)
        if key in self.decisions:
            return self.decisions[key]
        with torch.no_grad():
            # random operands of the token count about to run (an empty or all-zero input cannot fool
            # the check); the later token counts of the bucket reuse the decision
            gen = torch.Generator(device=a.device).manual_seed(0)
            probe = torch.randn(max(1, a.shape[0]), a.shape[1], generator=gen, device=a.device, dtype=a.dtype)

            def check() -> float:
                fused = self.kernels.matmul(op, probe, w)
                return rel_err(fused, torch_matmul(op, probe, w))

            decision = decide(
                platform,
                available=True,
                check=check,
                time_triton=lambda: self.timer(lambda: self.kernels.matmul(op, probe, w), a.device),
                time_torch=lambda: self.timer(lambda: torch_matmul(op, probe, w), a.device),
                tolerance=TOLERANCE[a.dtype],
            )
        self.decisions[key] = decision
        if decision.failed:
            msg = f"NVFP4 Triton kernel not used for {key}: {decision.reason}; using the torch path"
            if not self._warned:
                self._warned = True
                warnings.warn(msg + " (further fallbacks are logged, not warned)", RuntimeWarning, stacklevel=2)
            else:
                log.info(msg)
        else:
            log.debug("NVFP4 %s: %s (%s)", key, decision.kernel, decision.reason)
        return decision

    def summary(self) -> dict[str, dict]:
        return {"/".join(map(str, k)): d.as_dict() for k, d in self.decisions.items()}

    def clear(self) -> None:
        self.decisions.clear()
        self._warned = False


#: The process-wide launchers and decisions that PackedLinear uses.
KERNELS = NVFP4Kernels()
DISPATCHER = Dispatcher(KERNELS)


# ----------------------------------------------------------------------------- mode
def _env_mode() -> str:
    mode = os.environ.get("QERL_NVFP4_KERNEL", "auto").strip().lower() or "auto"
    if mode not in MODES:
        warnings.warn(f"QERL_NVFP4_KERNEL={mode!r} is not one of {MODES}; using 'auto'", RuntimeWarning, stacklevel=2)
        return "auto"
    return mode


_mode = _env_mode()


def kernel_mode() -> str:
    """The process-wide mode for layers whose own ``kernel`` is ``"auto"``."""
    return _mode


def set_kernel_mode(mode: str) -> None:
    global _mode
    if mode not in MODES:
        raise ValueError(f"kernel mode must be one of {MODES}, got {mode!r}")
    _mode = mode


@contextlib.contextmanager
def force_kernel(mode: str) -> Iterator[None]:
    """Within the block, layers with ``kernel="auto"`` use ``mode`` ("auto", "torch" or "triton")."""
    previous = kernel_mode()
    set_kernel_mode(mode)
    try:
        yield
    finally:
        set_kernel_mode(previous)


def use_triton(op: str, a: torch.Tensor, w: nvfp4.NVFP4Weight, mode: str = "auto") -> bool:
    """Whether ``a`` (2-D) times ``w`` runs through the fused kernel under ``mode``.

    ``mode="auto"`` defers to :func:`kernel_mode` first (so a forced process-wide mode
    applies), then to :data:`DISPATCHER`.
    """
    if mode not in MODES:
        raise ValueError(f"kernel mode must be one of {MODES}, got {mode!r}")
    if mode == "auto":
        mode = kernel_mode()
    if mode == "torch":
        return False
    if mode == "triton":
        if not HAVE_TRITON:
            raise RuntimeError(f"kernel='triton' requested but triton is not available ({TRITON_IMPORT_ERROR})")
        return True
    return DISPATCHER.choose(op, a, w).kernel == "triton"


def matmul(op: str, a: torch.Tensor, w: nvfp4.NVFP4Weight) -> torch.Tensor:
    """The fused product through the shared launchers (``op`` "fwd": ``a @ W^T``, "dx": ``a @ W``)."""
    return KERNELS.matmul(op, a, w)
