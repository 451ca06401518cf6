"""The machine profile in ``.kedro.yml``: which vLLM build, and the engine process's env.

``.kedro.yml`` sits at the project root. ``install.sh`` reads its ``backend`` key; this
module reads ``engine_env`` for the separate Python process that hosts vLLM. A variable
already set in the environment wins over the file, so CI and users can override it
without editing the file.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

PROFILE_FILE = ".kedro.yml"


def find_profile(start: Path | None = None) -> Path | None:
    """The nearest ``.kedro.yml`` at or above ``start`` (default: cwd), or None."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / PROFILE_FILE
        if candidate.is_file():
            return candidate
    return None


def load_profile(path: Path | None = None) -> dict:
    """Parse the profile; an absent file gives the built-in defaults."""
    path = path or find_profile()
    data = {}
    if path is not None:
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
    data.setdefault("backend", "auto")
    data.setdefault("engine_env", {})
    if data["backend"] not in ("auto", "cpu", "cuda"):
        raise ValueError(f"{path}: backend must be one of auto, cpu, cuda; got {data['backend']!r}")
    return data


def engine_env(path: Path | None = None) -> dict[str, str]:
    """Environment variables for the vLLM engine process (file values, shell overrides)."""
    env = {}
    for key, value in load_profile(path)["engine_env"].items():
        value = os.environ.get(key, str(value))
        if key == "VLLM_CPU_OMP_THREADS_BIND" and value == "auto":
            cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
            cores = list(cores)
            value = f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
        env[key] = value
    return env
