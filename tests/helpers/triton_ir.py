"""What the Triton NVFP4 launchers would compile, read without a GPU.

``record_launches`` swaps the compiled kernels for recorders, so a launcher can be called with
``device="meta"`` tensors of any size (nothing is allocated, nothing runs) and each launch's
kernel, grid, arguments and options are kept. ``ttir`` lowers one recorded launch to Triton's
first IR for an sm_90 target, with the argument types Triton would give those values (a Python
int below 2^31 is passed as int32, a larger one as int64): the offsets a kernel computes at a
shape can then be read on a CPU. It uses Triton's own front end (``ASTSource.make_ir``), which
needs no driver.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

from qerl_pipeline.quantization import triton_nvfp4_kernels

_TYPE = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.uint8: "u8",
    torch.float8_e4m3fn: "fp8e4nv",
}


@dataclass
class Launch:
    name: str
    grid: tuple
    args: tuple
    kwargs: dict


class _Recorder:
    def __init__(self, name: str, seen: list[Launch]):
        self.name, self.seen = name, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.append(Launch(self.name, tuple(grid), args, kwargs))

        return launch


def record_launches(monkeypatch, module) -> list[Launch]:
    """Make ``module`` (``triton_nvfp4``) launch recorders instead of kernels; returns the record."""
    seen: list[Launch] = []
    fake = types.SimpleNamespace(**{n: _Recorder(n, seen) for n in triton_nvfp4_kernels._KERNEL_NAMES})
    monkeypatch.setattr(module, "jit_functions", lambda interpret: fake)
    monkeypatch.setattr(module, "interpreted", lambda t: False)
    return seen


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TYPE[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    raise TypeError(f"no Triton type for {value!r}")


def ttir(launch: Launch) -> str:
    """Triton's TTIR of the compiled kernel ``launch`` names, for the recorded arguments."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    fn = getattr(triton_nvfp4_kernels.jit_functions(False), launch.name)
    names = list(fn.arg_names)
    values = dict(zip(names, launch.args, strict=False)) | {k: v for k, v in launch.kwargs.items() if k in names}
    constexpr = {n for n, p in zip(names, fn.params, strict=True) if p.is_constexpr}
    signature = {n: "constexpr" if n in constexpr else _arg_type(values[n]) for n in names}
    options = {k: v for k, v in launch.kwargs.items() if k not in names}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(n),): values[n] for n in constexpr})
    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    opts = backend.parse_options(options)
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    return str(src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), ctx))


def stride_uses(ir_text: str) -> list[tuple[str, str]]:
    """``(op, result element type)`` of every operation that computes with a ``stride_*`` argument
    (its passing on to a called function aside): a row stride is used only as a 64-bit integer
    when each of these is ``i64``."""
    out = []
    for line in ir_text.splitlines():
        line = line.strip()
        if "%stride_" not in line or line.startswith(("tt.func", "tt.return")) or " tt.call " in line:
            continue
        op = line.split("=", 1)[1].split()[0]
        result = line.split(" loc(")[0].rsplit(" ", 1)[-1].rstrip(">")
        out.append((op, result.rsplit("x", 1)[-1] if "tensor<" in line.split("->")[-1] else result))
    return out
