"""Every shipped environment fits the GPU its header names, for every method it trains (the memory planner).

Each folder of ``conf/`` but ``local`` (``base``: conf/base alone) is read as ``kedro run --env``
reads it (``planner/inputs.py``) and planned (``planner/sizing.py``) at its own settings for
``method`` and every method of ``compare.methods`` (a compare trains each of them on the same
GPU, at the same ``rollout.gpu_memory_utilization``). The GPU is the one the env's
``parameters.yml`` header names in a line ``# GPU: planned at <N> GiB ...``: an "80 GB" H100
reports 79.6 GiB, and validation on CUDA plans the GPU it finds (hooks.py), so the paper envs
are planned at that size, not at 80.

The CPU environments (base, smoke, cpu_compare) are made for CPU, but they run on CUDA too
(install.sh runs the base's training wherever it is installed), so they are planned like the
others, on the GPU their header declares; what "fits" means is the same: the engine starts and
trainer + engine stay within the GPU, with activations counted for rows padded to
``model.max_seq_len`` (the planner's worst case).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qerl_pipeline.planner import guard, inputs

CONF = Path(__file__).resolve().parents[1] / "conf"
ENVS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "local")
GPU_LINE = re.compile(r"^# GPU: planned at ([0-9]+(?:\.[0-9]+)?) GiB", re.M)
#: The GPU of an env whose header names none.
DEFAULT_GPU_GIB = 80.0


def header(env: str) -> str:
    """The comment lines that open ``conf/<env>/parameters.yml``."""
    lines = (CONF / env / "parameters.yml").read_text().splitlines()
    return "\n".join(line for line in lines[:next((i for i, s in enumerate(lines) if not s.startswith("#")), len(lines))])


def declared_gpu_gib(env: str) -> float:
    m = GPU_LINE.search(header(env))
    return float(m.group(1)) if m else DEFAULT_GPU_GIB


def trained_methods(cfg) -> list[str]:
    """``method`` and the methods a compare of this env trains, each once."""
    return list(dict.fromkeys([cfg.method, *cfg.compare.methods]))


@pytest.mark.parametrize("env", ENVS)
def test_every_method_of_every_shipped_env_fits_the_gpu_its_header_names(env):
    cfg = inputs.load_config(env, conf_dir=CONF)
    gpu, methods = declared_gpu_gib(env), trained_methods(cfg)
    shape = inputs.resolve_shape(cfg)
    planned = guard.plans(cfg, methods, shape, gpu)
    misfits = [m for m, p in planned.items() if not p.fits]
    # the line validation would print on such a GPU, which names the value that fits
    assert not misfits, f"{env} on {gpu} GiB: " + guard.refusal(cfg, methods, shape, gpu, methods_field="compare.methods")
    assert guard.refusal(cfg, methods, shape, gpu, methods_field="compare.methods") == ""


@pytest.mark.parametrize("env", ENVS)
def test_every_shipped_env_names_its_gpu(env):
    assert GPU_LINE.search(header(env)), f"conf/{env}/parameters.yml: no '# GPU: planned at <N> GiB' line in its header"

