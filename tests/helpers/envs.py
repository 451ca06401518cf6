"""The shipped environments (``conf/<env>/``) and the GPU each one's header names.

An env's ``parameters.yml`` opens with comment lines; one of them, ``# GPU: planned at <N> GiB ...``,
names the GPU it is planned on, in GiB as CUDA counts a GPU's memory (NVML's installed total less
what the driver reserves: ``platform.gpu_memory_bytes``). ``base`` is ``conf/base`` alone.
"""

from __future__ import annotations

import re

from tests.helpers.project import PROJECT

CONF = PROJECT / "conf"
ENVS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "local")
GPU_LINE = re.compile(r"^# GPU: planned at ([0-9]+(?:\.[0-9]+)?) GiB", re.M)
#: The GPU of an env whose header names none.
DEFAULT_GPU_GIB = 80.0


def header(env: str) -> str:
    """The comment lines that open ``conf/<env>/parameters.yml``."""
    lines = (CONF / env / "parameters.yml").read_text().splitlines()
    end = next((i for i, s in enumerate(lines) if not s.startswith("#")), len(lines))
    return "\n".join(lines[:end])


def declared_gpu_gib(env: str | None) -> float:
    """The GiB the env's header plans it on (``None``: the base); ``DEFAULT_GPU_GIB`` when it names none."""
    m = GPU_LINE.search(header(env or "base"))
    return float(m.group(1)) if m else DEFAULT_GPU_GIB
