"""Shared fixtures: paths to the project, ../shared, and a tiny random model folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[1]
SHARED = PROJECT.parent / "shared"

os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the Hub is unreachable here: fail fast, not after DNS timeouts


@pytest.fixture(scope="session")
def project_path() -> Path:
    return PROJECT


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = SHARED / "data"
    if not path.is_dir():
        pytest.skip(f"offline data copies not found at {path} (../shared beside the checkout)")
    return path


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    path = SHARED / "golden" / "nvfp4a16"
    if not path.is_dir():
        pytest.skip(f"golden NVFP4 files not found at {path} (../shared beside the checkout)")
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random tiny Llama (hidden 128, 2 heads of 64, 2 layers) with the SmolLM2 tokenizer."""
    from qerl_pipeline.models import tiny_model_folder

    return tiny_model_folder(tmp_path_factory.mktemp("tiny") / "model")


def project_copy(root: Path) -> Path:
    """A throw-away Kedro project at ``root``: this checkout's conf and metadata, the package installed.

    Pipeline tests run there so their data, checkpoints and ``mlflow.db`` never touch the checkout.
    """
    import shutil

    shutil.copytree(PROJECT / "conf", root / "conf", ignore=shutil.ignore_patterns("local"))
    (root / "conf" / "local").mkdir()
    (root / "src").mkdir()  # Kedro wants the source dir; the package itself is installed
    for name in ("pyproject.toml", ".kedro.yml"):
        shutil.copy(PROJECT / name, root / name)
    return root


@pytest.fixture(autouse=True, scope="module")
def no_leftover_mlflow_run():
    """kedro-mlflow leaves its run active after an in-process session (a CLI run ends with its
    process); close any such run around each test module so one module's sessions never log
    into another module's run."""
    import mlflow

    while mlflow.active_run():
        mlflow.end_run()
    yield
    while mlflow.active_run():
        mlflow.end_run()
