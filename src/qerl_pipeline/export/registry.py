"""The export in MLflow: logged into the training's run, registered as a model version that loads anywhere.

``register_export`` puts ``merged/`` into the training's run as an MLflow model under
``export/model-<UTC time>`` (each export its own, so a later export never changes what an earlier
version loads) and registers a version of ``registered_name`` (``<model>-<method>`` unless ``export.registered_name``)
from it, tagged with the method, the seed, the training run and the evaluation's accuracies:

* ``export.log_weights: true`` (default): the transformers flavour saved from the folder
  (``mlflow.transformers.save_model(transformers_model=<merged/>, task="text-generation")``):
  ``mlflow.transformers.load_model("models:/<name>/<version>")`` returns a text-generation pipeline
  (the pyfunc flavour works too). The weights are copied into the run's artifacts.
* ``false``: registered by reference, for models too large to copy: a pyfunc model from code
  (``reference_model.py``) whose config holds the absolute path of ``merged/``;
  ``mlflow.pyfunc.load_model(...)`` generates with the folder where it lies (it must stay there).

Why not kedro-mlflow's model datasets (``MlflowModelTrackingDataset``): they log into the run the
``kedro run`` opened (or a run id fixed in the catalog), while an export belongs to the training's
run, known only from the adapter it exports; and they do not register with tags. The export's own
``kedro run`` gets the report through the catalog (``export_report``) as usual.

``MlflowClient.log_artifacts`` + ``create_model_version(source="runs:/<run>/export/model-<time>")`` instead of a
flavour's ``log_model``: ``log_model`` logs into the active run only.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from qerl_pipeline.tracking import model_label

log = logging.getLogger(__name__)

#: Where the MLflow model goes in the training's run (``{stamp}``: the UTC time of the export).
MODEL_ARTIFACT = "export/model-{stamp}"
REFERENCE_CODE = Path(__file__).with_name("reference_model.py")


def registered_name(name: str | None, model: dict[str, Any] | Any, method: str) -> str:
    """``export.registered_name``, else ``<model label>-<method>`` (``tracking.model_label``)."""
    return name or f"{model_label(model)}-{method}"


def _requirements() -> list[str]:
    """Pinned requirements of the logged model (MLflow's own inference would import torchvision)."""
    import importlib.metadata

    from packaging.version import Version

    out = []
    for package in ("transformers", "torch", "accelerate", "safetensors"):
        try:
            out.append(f"{package}=={Version(importlib.metadata.version(package)).base_version}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def save_mlflow_model(folder: Path, out: Path, *, log_weights: bool, max_new_tokens: int = 64) -> Path:
    """The MLflow model of the model folder ``folder`` in ``out`` (module docstring)."""
    import mlflow

    folder, out = Path(folder), Path(out)
    if log_weights:
        mlflow.transformers.save_model(
            transformers_model=str(folder), path=str(out), task="text-generation", pip_requirements=_requirements()
        )
    else:
        mlflow.pyfunc.save_model(
            path=str(out),
            python_model=str(REFERENCE_CODE),
            pip_requirements=_requirements(),
            model_config={"path": str(folder.resolve()), "max_new_tokens": max_new_tokens},
        )
    return out


def register_export(
    folder: Path, run_id: str, name: str, tags: dict[str, Any], *, log_weights: bool = True
) -> dict[str, Any]:
    """Log the model folder ``folder`` (an export's ``merged/``) into run ``run_id`` under ``export/model-<time>``
    and register a version of ``name`` from it with ``tags``; returns
    ``{"name", "version", "model_uri", "source"}``."""
    from datetime import datetime, timezone

    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    artifact = MODEL_ARTIFACT.format(stamp=datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ"))
    with tempfile.TemporaryDirectory(prefix="qerl-mlflow-model-") as tmp:
        local = save_mlflow_model(folder, Path(tmp) / "model", log_weights=log_weights)
        client.log_artifacts(run_id, str(local), artifact_path=artifact)
    try:
        client.create_registered_model(
            name, description="QeRL-trained policies exported by qerl-pipeline (kedro run --pipelines=export)"
        )
    except MlflowException as err:
        if "already exists" not in str(err).lower() and "RESOURCE_ALREADY_EXISTS" not in str(err):
            raise
    source = f"runs:/{run_id}/{artifact}"
    version = client.create_model_version(
        name, source=source, run_id=run_id, tags={k: str(v) for k, v in tags.items() if v is not None}
    )
    log.info(
        "registered %s version %s from run %s (%s)",
        name,
        version.version,
        run_id,
        "weights copied" if log_weights else f"reference to {folder}",
    )
    return {
        "name": name,
        "version": int(version.version),
        "model_uri": f"models:/{name}/{version.version}",
        "source": source,
        "log_weights": log_weights,
    }


def training_fingerprint(run_id: str | None) -> dict[str, Any] | None:
    """The base fingerprint a training logged (``quantize/fingerprint.json`` of its run), or None where its run or
    that artifact is not in this tracking store."""
    import json

    from mlflow.tracking import MlflowClient

    if not run_id:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = MlflowClient().download_artifacts(run_id, "quantize/fingerprint.json", tmp)
            return json.loads(Path(path).read_text())
        except Exception:  # another store, or a run without it: the caller warns
            return None
