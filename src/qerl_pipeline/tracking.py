"""A small logger protocol for metrics, tags and artifacts, with MLflow and in-memory backends.

Library code (trainer, evaluator, benchmarks) logs through ``MetricsLogger`` and never
imports MLflow's fluent API directly. That keeps three things simple:

- Kedro runs: kedro-mlflow opens one MLflow run per ``kedro run``; ``MlflowLogger()``
  logs into that active run.
- Resumed training: the checkpoint stores the run id; ``MlflowLogger(run_id=...)`` keeps
  logging into the original run through ``MlflowClient``, whatever run kedro-mlflow opened.
- Tests: ``MemoryLogger`` keeps everything in memory, so the numbers can be asserted.

The tracking store defaults to the embedded SQLite file ``mlflow.db`` at the project root
(conf/base/mlflow.yml); ``MLFLOW_TRACKING_URI`` overrides it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
log = logging.getLogger(__name__)


@runtime_checkable
class MetricsLogger(Protocol):
    """What the library needs from a tracker."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...
    def log_params(self, params: dict[str, Any]) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def log_table(self, rows: list[dict], artifact_file: str) -> None: ...


def scalar_metrics(values: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a report dict (ints and floats, not bools) as metrics ``<prefix><name>``."""
    return {f"{prefix}{k}": float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _finite(metrics: dict[str, Any]) -> dict[str, float]:
    """Numbers only; NaN/Inf are kept out of the store (they break MLflow's plots)."""
    out = {}
    for key, value in metrics.items():
        try:
            f = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f):
            out[key] = f
    return out


class MemoryLogger:
    """Keeps everything in memory (tests, dry runs)."""

    def __init__(self) -> None:
        self.metrics: dict[str, list[tuple[int | None, float]]] = defaultdict(list)
        self.params: dict[str, Any] = {}
        self.tags: dict[str, str] = {}
        self.artifacts: dict[str, Any] = {}

    def log_metrics(self, metrics, step=None):
        for key, value in _finite(metrics).items():
            self.metrics[key].append((step, value))

    def log_params(self, params):
        self.params.update(params)

    def set_tags(self, tags):
        self.tags.update({k: str(v) for k, v in tags.items()})

    def log_artifact(self, path, artifact_path=None):
        name = Path(path).name if artifact_path is None else f"{artifact_path}/{Path(path).name}"
        self.artifacts[name] = Path(path)

    def log_text(self, text, artifact_file):
        self.artifacts[artifact_file] = text

    def log_table(self, rows, artifact_file):
        self.artifacts[artifact_file] = list(rows)

    def history(self, names) -> dict[str, list[tuple[int, float]]]:
        return {n: [(s, v) for s, v in self.metrics.get(n, []) if s is not None] for n in names}


class MlflowLogger:
    """Logs to one MLflow run through ``MlflowClient``.

    ``run_id=None`` takes the active run (the one kedro-mlflow started), or starts one
    in ``experiment`` when none is active (library use outside Kedro).
    """

    def __init__(self, run_id: str | None = None, *, experiment: str = "qerl_pipeline", tracking_uri: str | None = None):
        import mlflow
        from mlflow.tracking import MlflowClient

        if tracking_uri:
            mlflow.set_tracking_uri(tracking_uri)
        elif not os.environ.get("MLFLOW_TRACKING_URI") and mlflow.get_tracking_uri().startswith(("file:", "/", "./", "mlruns")):
            # never fall back to the file store (maintenance mode): use the embedded SQLite
            mlflow.set_tracking_uri(DEFAULT_TRACKING_URI)
        self.client = MlflowClient()
        if run_id is None:
            active = mlflow.active_run()
            if active is None:
                mlflow.set_experiment(experiment)
                active = mlflow.start_run()
                self._owns_run = True
            else:
                self._owns_run = False
            run_id = active.info.run_id
        else:
            self._owns_run = False
        self.run_id = run_id

    def log_metrics(self, metrics, step=None):
        from mlflow.entities import Metric
        import time

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step or 0) for k, v in _finite(metrics).items()]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def history(self, names) -> dict[str, list[tuple[int, float]]]:
        """``{name: [(step, value), ...]}`` of the run's logged metrics (all of its steps)."""
        return {n: [(m.step, m.value) for m in self.client.get_metric_history(self.run_id, n)] for n in names}

    def log_params(self, params):
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params
        batch = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in existing]
        for i in range(0, len(batch), 100):
            self.client.log_batch(self.run_id, params=batch[i : i + 100])

    def set_tags(self, tags):
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, str(value))

    def log_artifact(self, path, artifact_path=None):
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path=artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path=artifact_path)

    def log_text(self, text, artifact_file):
        self.client.log_text(self.run_id, text, artifact_file)

    def log_table(self, rows, artifact_file):
        """Rows as a JSON table MLflow's UI shows (``artifact_file`` should end in .json)."""
        rows = list(rows)
        columns = sorted({k for r in rows for k in r})
        payload = {"columns": columns, "data": [[_jsonable(r.get(c)) for c in columns] for r in rows]}
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / Path(artifact_file).name
            target.write_text(json.dumps(payload))
            parent = str(Path(artifact_file).parent)
            self.client.log_artifact(self.run_id, str(target), artifact_path=None if parent == "." else parent)

    def end(self, status: str = "FINISHED") -> None:
        """Close the run if this logger opened it, or force a status (e.g. FAILED)."""
        import mlflow

        active = mlflow.active_run()
        if self._owns_run and active is not None and active.info.run_id == self.run_id:
            mlflow.end_run(status=status)  # also clears the fluent API's active run
        elif self._owns_run or status != "FINISHED":
            self.client.set_terminated(self.run_id, status=status)


def _jsonable(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def git_commit(cwd: str | Path | None = None) -> str:
    """The checkout's commit (with ``-dirty`` when it has changes), or ``unknown``."""
    import subprocess

    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd, capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


# ------------------------------------------------------------------ run names, groups
#: Tag of a compare run's children: the id of the compare run (``evaluation/report.py`` reads it).
GROUP_TAG = "qerl.compare_group"
#: Tag saying what a run is: train, evaluate, compare, quantize, benchmark.
ROLE_TAG = "qerl.role"


def model_label(model: dict[str, Any] | Any) -> str:
    """A short model name for run names: the Hub id's last part, a folder's name, or ``random``."""
    get = model.get if isinstance(model, dict) else (lambda k, d=None: getattr(model, k, d))
    if get("source", "auto") == "random":
        return "random"
    return Path(str(get("name", "model"))).name


def run_name(role: str, method: str | None, model: dict[str, Any] | Any, seed: int | None) -> str:
    """``"train qerl · SmolLM2-135M-Instruct · seed 0"``: what a run is, at a glance in the MLflow UI."""
    parts = [f"{role} {method}" if method else role, model_label(model)]
    if seed is not None:
        parts.append(f"seed {seed}")
    return " · ".join(parts)


def name_run(run_id: str, name: str, role: str, client=None) -> None:
    """Set a run's display name and role tag."""
    from mlflow.tracking import MlflowClient

    client = client or MlflowClient()
    client.set_tag(run_id, "mlflow.runName", name)
    client.set_tag(run_id, ROLE_TAG, role)


def child_run(parent_id: str, name: str, tags: dict[str, str] | None = None) -> str:
    """A new run in the parent's experiment, nested under it in the UI (``mlflow.parentRunId``) and grouped."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    parent = client.get_run(parent_id)
    run = client.create_run(
        parent.info.experiment_id, run_name=name,
        tags={**(tags or {}), GROUP_TAG: parent_id, "mlflow.parentRunId": parent_id},
    )
    return run.info.run_id


def regroup(run_id: str, parent_id: str) -> None:
    """Nest an existing run (a compare branch finished by an earlier, killed compare) under ``parent_id``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    client.set_tag(run_id, GROUP_TAG, parent_id)
    client.set_tag(run_id, "mlflow.parentRunId", parent_id)


def training_loggers(name: str, method: str, params: dict[str, Any], compare_parent: str | None = None,
                     active_run_id: str | None = None):
    """``(make_logger, used)`` for ``rl.trainer.train``: which MLflow run a training logs to.

    ``make_logger(stored_run_id)`` is called with the run id of the checkpoint it resumes
    (None for a fresh run). Standalone (``compare_parent`` None): the active run (the one
    kedro-mlflow opened for this ``kedro run``); a resume logs into the checkpoint's run and
    tags the active one ``qerl.resumed_run_id``. In a compare branch: a fresh run is a new
    child of ``compare_parent`` named ``name`` with ``params`` logged; a resumed one keeps its
    run, re-nested under ``compare_parent``. ``used`` records ``active`` and ``run`` (the logger).
    ``active_run_id``: the run that stands for "the active run" (rank 0 of a distributed
    training logs into the run its launching ``kedro run`` holds; rl/distributed.py).
    """
    used: dict[str, Any] = {}

    def standalone(run_id: str | None):
        logger = MlflowLogger(active_run_id)  # the active run (kedro-mlflow's), or a new one outside Kedro
        used["active"] = logger.run_id
        if run_id and run_id != logger.run_id:
            logger.set_tags({"qerl.resumed_run_id": run_id})
            try:
                logger.client.get_run(run_id)
            except Exception:  # noqa: BLE001 - e.g. a different tracking store: keep the new run
                log.warning("MLflow run %s of the checkpoint not found; logging to run %s", run_id, logger.run_id)
                used["run"] = logger
                return logger
            logger = MlflowLogger(run_id=run_id)
        used["run"] = logger
        return logger

    def branch(run_id: str | None):
        if run_id:
            regroup(run_id, compare_parent)
            logger = MlflowLogger(run_id=run_id)
        else:
            rid = child_run(compare_parent, name, tags={"method": method})
            name_run(rid, name, "train")
            logger = MlflowLogger(run_id=rid)
            logger.log_params(params)
        used["run"] = logger
        return logger

    return (branch if compare_parent else standalone), used
