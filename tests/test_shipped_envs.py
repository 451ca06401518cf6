"""Every shipped environment fits the GPU its header names, for every method it trains (the memory planner).

Each folder of ``conf/`` but ``local`` (``base``: conf/base alone) is read as ``kedro run --env``
reads it (``planner/inputs.py``) and planned (``planner/sizing.py``) at its own settings for
``method`` and every method of ``compare.methods`` (a compare trains each of them on the same
GPU, at the same ``rollout.gpu_memory_utilization``). The GPU is the one the env's
``parameters.yml`` header names in a line ``# GPU: planned at <N> GiB ...``
(``tests/helpers/envs.py``), in GiB as CUDA counts it: validation on CUDA plans the GPU it finds
(hooks.py), and CUDA counts a GPU's installed memory less what the driver reserves (on an H200
139.8 of NVML's 140.4 GiB), so the paper envs, for an "80 GB" GPU (79.6 GiB installed), are
planned at 79, not 80.

The CPU environments (base, smoke, cpu_compare) are made for CPU, but they run on CUDA too
(install.sh runs the base's training wherever it is installed), so they are planned like the
others, on the GPU their header declares; what "fits" means is the same: the engine starts and
trainer + engine stay within the GPU, with activations counted for rows padded to
``model.max_seq_len`` (the planner's worst case).
"""

from __future__ import annotations

import pytest

from qerl_pipeline.planner import guard, inputs
from tests.helpers.envs import CONF, ENVS, GPU_LINE, declared_gpu_gib, header


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
    assert not misfits, f"{env} on {gpu} GiB: " + guard.refusal(
        cfg, methods, shape, gpu, methods_field="compare.methods"
    )
    assert guard.refusal(cfg, methods, shape, gpu, methods_field="compare.methods") == ""


@pytest.mark.parametrize("env", ENVS)
def test_every_shipped_env_names_its_gpu(env):
    assert GPU_LINE.search(header(env)), (
        f"conf/{env}/parameters.yml: no '# GPU: planned at <N> GiB' line in its header"
    )
