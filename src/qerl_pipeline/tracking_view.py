"""What MLflow's UI shows of the project's runs, beyond their metrics: the experiment's kind, each run's
dataset inputs and the commit it ran.

An experiment's kind is its ``mlflow.experimentKind`` tag; without it MLflow infers GenAI development (traces
and token usage, empty here). Every experiment the project writes is tagged ``custom_model_development``
(``mark_model_development``, once per experiment and process; a kind the user set is kept). MLflow 3.17's own
UI goes by its GenAI / Model training switch rather than the tag (docs/mlflow-ui.md says what to open).

A training logs its prompts and an evaluation each of its benchmarks as MLflow dataset inputs
(``dataset_input``: the runs list's Dataset column). The digest is MLflow's own of the prompts' fields (id,
source, split, question, gold), so the same prompts are one dataset across runs and seeds; the source says
which Kedro dataset they came from (``train_prompts``, ``eval_prompts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

KIND_TAG = "mlflow.experimentKind"
MODEL_DEVELOPMENT = "custom_model_development"
#: the dataset input's context for a training's prompts and for an evaluation's benchmark
TRAINING, EVALUATION = "training", "evaluation"
#: the prompt record fields a dataset input is made of (its digest: the same prompts, the same dataset)
FIELDS = ("id", "source", "split", "question", "gold")

_marked: set[tuple[str, str]] = set()


def mark_model_development(experiment_id: str, client=None) -> None:
    """Tag the experiment as model development (MLflow's UI then opens on its runs), unless it has a kind."""
    from mlflow.tracking import MlflowClient

    client = client or MlflowClient()
    key = (client.tracking_uri, str(experiment_id))
    if key in _marked:
        return
    if KIND_TAG not in client.get_experiment(experiment_id).tags:
        client.set_experiment_tag(experiment_id, KIND_TAG, MODEL_DEVELOPMENT)
    _marked.add(key)


def dataset_input(records: Sequence[dict[str, Any]], kedro_dataset: str, name: str | None = None) -> dict[str, str]:
    """The MLflow dataset of prompt ``records`` as the fields of ``mlflow.entities.Dataset`` (what a logger's
    ``log_input`` takes, JSON for the tracking journal). ``name``: by default their ``<source>/<split>``s."""
    import warnings

    import mlflow
    import pandas as pd
    from mlflow.data.code_dataset_source import CodeDatasetSource

    frame = pd.DataFrame([{f: "" if r.get(f) is None else str(r.get(f)) for f in FIELDS} for r in records])
    if name is None:
        parts = {"/".join(str(r[k]) for k in ("source", "split") if r.get(k)) for r in records}
        name = "+".join(sorted(parts)) or "prompts"
    source = CodeDatasetSource({"qerl.kedro_dataset": kedro_dataset})
    with warnings.catch_warnings():  # MLflow warns of a dataset without targets
        warnings.simplefilter("ignore")
        entity = mlflow.data.from_pandas(frame, source=source, name=name)._to_mlflow_entity()
    return {
        "name": entity.name,
        "digest": entity.digest,
        "source_type": entity.source_type,
        "source": entity.source,
        "schema": entity.schema or "",
        "profile": entity.profile or "",
    }


def git_commit(cwd: str | Path | None = None) -> str:
    """The checkout's commit (with ``-dirty`` when it has changes), or ``unknown``."""
    import subprocess

    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd, capture_output=True, text=True
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"
