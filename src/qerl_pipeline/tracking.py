"""A small logger protocol for metrics, tags and artifacts, with MLflow and in-memory backends.

Library code (trainer, evaluator, benchmarks) logs through ``MetricsLogger`` and never
imports MLflow's fluent API directly. That keeps three things simple:

- Kedro runs: kedro-mlflow opens one MLflow run per ``kedro run``; ``MlflowLogger()``
  logs into that active run.
- Resumed training: ``MlflowLogger(run_id=...)`` logs into the checkpoint's run, whatever run kedro-mlflow
  opened. ``TrainingRun`` decides which run a training logs into (standalone or a compare branch's child) and
  closes it; the nodes call it and ``label_run`` instead of MLflow itself.
- Tests: ``MemoryLogger`` keeps everything in memory, so the numbers can be asserted.

What MLflow's UI shows of the runs (the experiment's kind, dataset inputs) is ``tracking_view.py``'s.

The tracking store defaults to the embedded SQLite file ``mlflow.db`` at the project root
(conf/base/mlflow.yml); ``MLFLOW_TRACKING_URI`` overrides it. ``check_store`` tries it within
seconds (a TCP connect to a server, a write probe beside a SQLite file) so a run that cannot log
stops before its first node, ``bound_http_retries`` shortens MLflow's HTTP retries, and a training's
journal (``MlflowLogger.keep_journal``) outlives a server away.

How a run ended is its MLflow status and tags (``mark_ended``, ``reopen``): FINISHED when every
step ran; KILLED on Ctrl-C or SIGTERM (``Interrupted``), tagged with the signal; FAILED on an
error, tagged with its one-line summary; a training also tags its last completed step. A
resumed training reopens its run and keeps how it ended before as ``qerl.previous_end``.

MLflow is imported inside the functions that use it (a heavy import): a ``MemoryLogger`` never needs it.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import tempfile
import time
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from qerl_pipeline.metric_names import REWARD_MEAN
from qerl_pipeline.tracking_journal import (
    Journal,
    Outbox,
    TrackingOutage,
    is_outage,
    jsonable,
    send_record,
    server_answers,
)
from qerl_pipeline.tracking_view import mark_model_development

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
    def log_input(self, dataset: dict[str, str], context: str) -> None: ...  # tracking_view.dataset_input


def scalar_metrics(values: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a report dict (ints and floats, not bools) as metrics ``<prefix><name>``."""
    return {
        f"{prefix}{k}": float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


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
        self.inputs: list[tuple[dict[str, str], str]] = []

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

    def log_input(self, dataset, context):
        self.inputs.append((dict(dataset), context))

    def history(self, names) -> dict[str, list[tuple[int, float]]]:
        return {n: [(s, v) for s, v in self.metrics.get(n, []) if s is not None] for n in names}


def metric_history(client, run_id: str, name: str) -> list[tuple[int, float]]:
    """``[(step, value), ...]`` of one MLflow metric, one value per step, the last logged, in step order.

    A kill between a step's metrics and its checkpoint leaves that step logged; the resume trains it again
    and logs it again, and MLflow has no way to delete the first point. The last one is the step the final
    adapter went through (and the one MLflow's own latest-metric value keeps); every reader of a run's
    curves goes through here so that a resumed run counts each step once."""
    points = sorted(client.get_metric_history(run_id, name), key=lambda m: (int(m.step), int(m.timestamp)))
    return list({int(m.step): (int(m.step), float(m.value)) for m in points}.values())


class MlflowLogger:
    """Logs to one MLflow run through ``MlflowClient``.

    ``run_id=None``: the active run (kedro-mlflow's), or a new one in ``experiment`` (library use outside Kedro).

    ``keep_journal(path, outage_s)`` (a training's run folder): every write then goes through a journal there
    and outlives a tracking server that is away (``tracking_journal.py``); ``history`` and ``end`` wait for it.
    """

    def __init__(
        self, run_id: str | None = None, *, experiment: str = "qerl_pipeline", tracking_uri: str | None = None
    ):
        import mlflow
        from mlflow.tracking import MlflowClient

        if tracking_uri:
            mlflow.set_tracking_uri(tracking_uri)
        elif not os.environ.get("MLFLOW_TRACKING_URI") and mlflow.get_tracking_uri().startswith(
            ("file:", "/", "./", "mlruns")
        ):
            # never fall back to the file store (maintenance mode): use the embedded SQLite
            mlflow.set_tracking_uri(DEFAULT_TRACKING_URI)
        self.client = MlflowClient()
        self.uri = mlflow.get_tracking_uri()
        self.outbox: Outbox | None = None
        if run_id is None:
            active = mlflow.active_run()
            if active is None:
                mark_model_development(mlflow.set_experiment(experiment).experiment_id, self.client)
                active = mlflow.start_run()
                self._owns_run = True
            else:
                self._owns_run = False
            run_id = active.info.run_id
        else:
            self._owns_run = False
        self.run_id = run_id

    def keep_journal(self, path: str | Path, outage_s: float, after_step: int | None = None) -> None:
        """Write through the journal at ``path`` from now on; what it holds from before is sent first (waiting for
        the server up to ``outage_s``). ``after_step``: a resume from that step drops the pending metrics of later
        steps, which it trains and logs again."""
        self.outbox = Outbox(
            Journal(path),
            partial(send_record, self.client),
            server=self.uri,
            outage_s=outage_s,
            answers=partial(server_answers, self.uri),
            is_outage=is_outage,
        )
        if after_step is not None:  # a resume trains the later steps again: their pending metrics would come twice
            self.outbox.drop_pending(lambda r: r["op"] != "metrics" or r["step"] <= after_step)
        self.outbox.flush(wait=True)  # what it kept from before goes first

    def outage(self) -> TrackingOutage | None:
        """The error to stop with when the server has been away past the journal's bound (None without a journal)."""
        return self.outbox.outage() if self.outbox is not None else None

    def away_s(self) -> float | None:
        """Seconds the server has been away with records pending (None while it answers, or without a journal)."""
        return self.outbox.away_s() if self.outbox is not None else None

    def drain(self) -> None:
        """Wait until the journal's records are sent (``TrackingOutage`` past its bound); no journal: nothing."""
        if self.outbox is not None:
            self.outbox.flush(wait=True)

    def _submit(self, op: str, **fields) -> None:
        record = {"op": op, "run_id": self.run_id, **fields}
        if self.outbox is None:
            send_record(self.client, record, uncertain=False)
        else:
            self.outbox.submit(record)

    def log_metrics(self, metrics, step=None):
        metrics = _finite(metrics)
        if metrics:
            self._submit("metrics", metrics=metrics, step=step or 0, t=int(time.time() * 1000))

    def history(self, names) -> dict[str, list[tuple[int, float]]]:
        """``{name: [(step, value), ...]}`` of the run's logged metrics (all of its steps, one value each)."""
        self.drain()
        return {n: metric_history(self.client, self.run_id, n) for n in names}

    def log_params(self, params):
        self._submit("params", params={k: str(v)[:6000] for k, v in params.items()})

    def set_tags(self, tags):
        self._submit("tags", tags={k: str(v) for k, v in tags.items()})

    def log_artifact(self, path, artifact_path=None):
        self._submit("artifact", path=str(Path(path).absolute()), artifact_path=artifact_path)

    def log_text(self, text, artifact_file):
        self._submit("text", text=text, file=artifact_file)

    def log_input(self, dataset, context):
        self._submit("input", dataset=dict(dataset), context=context)

    def log_table(self, rows, artifact_file):
        """Rows as a JSON table MLflow's UI shows (``artifact_file`` should end in .json)."""
        rows = list(rows)
        columns = sorted({k for r in rows for k in r})
        table = {"columns": columns, "data": [[jsonable(r.get(c)) for c in columns] for r in rows]}
        self._submit("table", table=table, file=artifact_file)

    def end(self, status: str = "FINISHED") -> None:
        """Close the run if this logger opened it, or force a status (e.g. FAILED); after what the journal holds."""
        import mlflow

        self.drain()
        active = mlflow.active_run()
        if self._owns_run and active is not None and active.info.run_id == self.run_id:
            mlflow.end_run(status=status)  # also clears the fluent API's active run
        elif self._owns_run or status != "FINISHED":
            self.client.set_terminated(self.run_id, status=status)


# ------------------------------------------------------------------ how a run ended
#: FAILED: the exception's one-line summary (``one_line``).
FAILURE_TAG = "qerl.failure"
#: KILLED: what stopped it, the signal (SIGINT, SIGTERM) or KeyboardInterrupt.
KILLED_BY_TAG = "qerl.killed_by"
#: A training that did not finish: its last step whose metrics were logged (a resume continues from its checkpoint).
LAST_STEP_TAG = "qerl.last_completed_step"
#: A ``kedro run`` that did not finish: its last node that completed.
LAST_NODE_TAG = "qerl.last_completed_node"
#: A resumed run: how it ended before the resume (its status and the tags above, which the resume removes).
PREVIOUS_END_TAG = "qerl.previous_end"
END_TAGS = (FAILURE_TAG, KILLED_BY_TAG, LAST_STEP_TAG, LAST_NODE_TAG)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM during a ``kedro run`` (``hooks.RunStatusHook`` raises it in the main thread).

    A ``KeyboardInterrupt``, so no ``except Exception`` swallows it and every ``finally`` (the
    engine's close) runs; it names the signal for the run's ``qerl.killed_by`` tag.
    """

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


def end_status(exc: BaseException | None) -> str:
    """The MLflow status of a run that ended with ``exc``: FINISHED (none), KILLED (an interrupt), FAILED."""
    if exc is None:
        return "FINISHED"
    return "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"


def one_line(exc: BaseException, limit: int = 500) -> str:
    """``Type: first line of the message``, at most ``limit`` characters."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def end_tags(exc: BaseException) -> dict[str, str]:
    """Why a run ended with ``exc``: ``qerl.killed_by`` for an interrupt, ``qerl.failure`` for an error."""
    if isinstance(exc, KeyboardInterrupt):
        return {KILLED_BY_TAG: getattr(exc, "signal_name", type(exc).__name__)}
    return {FAILURE_TAG: one_line(exc)}


def mark_ended(logger: MetricsLogger, exc: BaseException, last_step: int | None = None) -> None:
    """Tag and close the run of ``logger`` that ``exc`` ended (KILLED or FAILED, ``end_tags``, ``last_step``).

    Never raises: recording the end must not hide ``exc`` (a dead tracking server only warns). A server away
    (``away_s``) records nothing: the journal keeps what came before, and the resume goes on in the same run.
    """
    away = getattr(logger, "away_s", lambda: None)()
    if away is not None:
        log.warning("the run's end (%s) is not recorded: its tracking server is away (%.0f s)", end_status(exc), away)
        return
    tags = end_tags(exc)
    if last_step is not None:
        tags[LAST_STEP_TAG] = str(last_step)
    try:
        logger.set_tags(tags)
        if hasattr(logger, "end"):
            logger.end(end_status(exc))
    except Exception as err:  # see the docstring
        log.warning("could not record how the run ended (%s): %s", end_status(exc), err)


def reopen(logger: MlflowLogger) -> None:
    """A resumed run is running again: a KILLED or FAILED run gets status RUNNING, its end tags are
    removed and summed up in ``qerl.previous_end`` (a FINISHED or RUNNING run is left as it is)."""
    run = logger.client.get_run(logger.run_id)
    if run.info.status in ("RUNNING", "FINISHED"):
        return
    ended = {k: run.data.tags[k] for k in END_TAGS if k in run.data.tags}
    logger.client.set_tag(
        logger.run_id,
        PREVIOUS_END_TAG,
        "; ".join([run.info.status, *(f"{k.removeprefix('qerl.')}={v}" for k, v in ended.items())]),
    )
    for key in ended:
        logger.client.delete_tag(logger.run_id, key)
    logger.client.update_run(logger.run_id, status="RUNNING")


# ------------------------------------------------------------------ the tracking store
class TrackingStoreError(RuntimeError):
    """The tracking store cannot be used; the one-line message names its URI or path and why."""


#: MLflow's HTTP retry settings where the user set none. MLflow's own (7 retries, backoff factor 2,
#: a 120 s timeout) retry one call for about four minutes, so a server that dies mid-run held a
#: training ~12 minutes; these give up after ~15 s of refused connections (a hung server: ~2 min).
HTTP_RETRY_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "2",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}


def bound_http_retries(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set ``HTTP_RETRY_DEFAULTS`` in ``environ`` (``os.environ``) where unset; return what was set."""
    environ = os.environ if environ is None else environ
    added = {k: v for k, v in HTTP_RETRY_DEFAULTS.items() if k not in environ}
    environ.update(added)
    return added


def check_store(uri: str, timeout_s: float = 5.0) -> None:
    """Raise ``TrackingStoreError`` (one line naming ``uri`` or the path) when the store cannot be used.

    ``http(s)://``: a TCP connect to its host and port within ``timeout_s`` (MLflow's client
    retries a dead server for minutes). ``sqlite:///<path>``: an existing database must be a
    file this process can open for writing, and its folder (the nearest existing one, which
    MLflow would create the rest under) must take a new file: SQLite writes its journal there,
    and MLflow retries a database it cannot open for ~100 s. The probes write, not ask
    (``os.access`` says yes to root on a folder it may not write in, e.g. a read-only mount).
    ``file:`` or a plain path: its folder must take a new file. Other schemes are not checked.
    """
    from urllib.parse import urlparse

    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        try:
            socket.create_connection((parsed.hostname or "", port), timeout=timeout_s).close()
        except OSError as err:
            raise TrackingStoreError(f"MLflow tracking server {uri} is unreachable: {err.strerror or err}") from None
    elif parsed.scheme == "sqlite":
        path = uri[len("sqlite:///") :].split("?", 1)[0] if uri.startswith("sqlite:///") else ""
        if path and path != ":memory:":
            _check_sqlite(uri, Path(path))
    elif parsed.scheme in ("", "file"):
        _check_folder(uri, Path(parsed.path if parsed.scheme == "file" else uri))


def _check_sqlite(uri: str, path: Path) -> None:
    if path.exists():
        if not path.is_file():
            raise TrackingStoreError(f"MLflow tracking store {uri}: {path} is not a file")
        try:
            open(path, "r+b").close()  # opened for writing, nothing written
        except OSError as err:
            raise TrackingStoreError(f"MLflow tracking store {uri}: cannot write {path} ({err.strerror})") from None
    _check_folder(uri, path.parent)


def _check_folder(uri: str, folder: Path) -> None:
    folder = folder.absolute()
    while not folder.exists() and folder != folder.parent:  # MLflow creates the missing part
        folder = folder.parent
    if not folder.is_dir():
        raise TrackingStoreError(f"MLflow tracking store {uri}: {folder} is not a folder")
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as err:
        raise TrackingStoreError(f"MLflow tracking store {uri}: cannot write in {folder} ({err.strerror})") from None


# ------------------------------------------------------------------ run names, groups
#: Tag of a compare run's children: the id of the compare run (``evaluation/report_runs.py`` reads it).
GROUP_TAG = "qerl.compare_group"
#: Tag saying what a run is: train, evaluate, compare, quantize, benchmark; resume (a ``kedro run`` whose
#: training went on in the run it resumed, ``TrainingRun``).
ROLE_TAG = "qerl.role"
#: The name of a ``kedro run`` that resumed the training ``name`` (the training's metrics stay in its own run).
RESUME_NAME = "{name} · resume"


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
        parent.info.experiment_id,
        run_name=name,
        tags={**(tags or {}), GROUP_TAG: parent_id, "mlflow.parentRunId": parent_id},
    )
    return run.info.run_id


def regroup(run_id: str, parent_id: str) -> None:
    """Nest an existing run (a compare branch finished by an earlier, killed compare) under ``parent_id``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    client.set_tag(run_id, GROUP_TAG, parent_id)
    client.set_tag(run_id, "mlflow.parentRunId", parent_id)


def label_run(name: str, role: str, tags: dict[str, str] | None = None, run_id: str | None = None) -> str:
    """Name, role-tag and tag a run (``run_id``, else the active one, kedro-mlflow's); return its id."""
    logger = MlflowLogger(run_id)
    if tags:
        logger.set_tags(tags)
    name_run(logger.run_id, name, role, client=logger.client)
    return logger.run_id


class TrainingRun:
    """The MLflow run of one training: chosen when the trainer knows its checkpoint's run id, closed after.

    ``logger(stored_run_id)`` is the ``make_logger`` of ``rl.trainer.train``'s ``Reporting``: called with the
    run id of the checkpoint it resumes (None for a fresh training). Standalone (``parent`` None):
    the active run (the one kedro-mlflow opened for this ``kedro run``, or ``active_run_id``, the
    run of the ``kedro run`` that launched a distributed training's ranks); a resume logs into the
    checkpoint's run and tags the active one ``qerl.resumed_run_id`` (named ``RESUME_NAME``, role
    ``resume``), so the whole training stays one run. The training's run is named ``name`` (role
    ``train``) as it starts, so it carries that one name while it runs, if it is stopped, and
    after a resume. In a compare branch (``parent``: the compare run's id): a fresh training is
    a new child run of ``parent`` named ``name`` (tagged ``method``, ``params`` logged); a
    resumed one keeps its run, re-nested under ``parent``. ``tags`` are set on the run used,
    whichever it is.

    ``finish`` closes what kedro-mlflow does not: a branch's own run, or the original run a
    resume logged into (``reopen``: RUNNING again while it trains). ``fail`` ends such a run
    when the training raised before its loop could (the loop tags and closes its run itself,
    ``rl/trainer.py``).
    """

    def __init__(
        self,
        name: str,
        method: str,
        params: dict[str, Any],
        parent: str | None = None,
        tags: dict[str, str] | None = None,
        active_run_id: str | None = None,
    ):
        self.name, self.method, self.params, self.parent = name, method, params, parent
        self.tags = dict(tags or {})
        self.active_run_id = active_run_id
        self.run: MlflowLogger | None = None

    def logger(self, stored_run_id: str | None) -> MlflowLogger:
        """The logger the training writes to (see the class docstring)."""
        self.run = self._branch(stored_run_id) if self.parent else self._standalone(stored_run_id)
        if self.tags:
            self.run.set_tags(self.tags)
        return self.run

    def _standalone(self, run_id: str | None) -> MlflowLogger:
        logger = MlflowLogger(self.active_run_id)  # the active run (kedro-mlflow's), or a new one outside Kedro
        self.active_run_id = logger.run_id
        if run_id and run_id != logger.run_id:
            logger.set_tags({"qerl.resumed_run_id": run_id})
            try:
                logger.client.get_run(run_id)
            except Exception:  # e.g. a different tracking store: keep the new run
                log.warning("MLflow run %s of the checkpoint not found; logging to run %s", run_id, logger.run_id)
            else:
                name_run(logger.run_id, RESUME_NAME.format(name=self.name), "resume", client=logger.client)
                resumed = MlflowLogger(run_id=run_id)
                reopen(resumed)
                logger = resumed
        name_run(logger.run_id, self.name, "train", client=logger.client)  # its name from the start, kept by a resume
        return logger

    def _branch(self, run_id: str | None) -> MlflowLogger:
        if run_id:
            regroup(run_id, self.parent)
            resumed = MlflowLogger(run_id=run_id)
            reopen(resumed)
            return resumed
        rid = child_run(self.parent, self.name, tags={"method": self.method})
        name_run(rid, self.name, "train")
        logger = MlflowLogger(run_id=rid)
        logger.log_params(self.params)
        return logger

    def launch_spec(self) -> dict[str, Any]:
        """What a distributed training's rank 0 needs to log as ``logger`` would here (``rl/launch.py``)."""
        import mlflow

        self.active_run_id = MlflowLogger(self.active_run_id).run_id
        return {
            "uri": mlflow.get_tracking_uri(),
            "active_run_id": self.active_run_id,
            "name": self.name,
            "params": self.params,
        }

    def adopt(self, run_id: str | None) -> None:
        """The run a distributed training's rank 0 logged into (the active one or its checkpoint's)."""
        active = MlflowLogger(self.active_run_id)
        self.active_run_id = active.run_id
        self.run = active if run_id in (None, active.run_id) else MlflowLogger(run_id=run_id)

    def fail(self, exc: BaseException) -> None:
        """After a training that raised ``exc``: end its run if still RUNNING (not kedro-mlflow's, which the
        Kedro hooks end), tagged as ``mark_ended`` does with the last step its metrics reached."""
        run = self.run
        if run is None or (not self.parent and run.run_id == self.active_run_id) or run.away_s() is not None:
            return
        try:
            if run.client.get_run(run.run_id).info.status != "RUNNING":
                return
            steps = [s for s, _ in run.history([REWARD_MEAN])[REWARD_MEAN]]
        except Exception as err:  # must not hide exc
            log.warning("could not read MLflow run %s: %s", run.run_id, err)
            return
        mark_ended(run, exc, last_step=max(steps, default=0))

    def finish(self) -> None:
        """After the training: what its journal holds sent (waiting for the server, ``TrackingOutage`` past the
        bound), then the run kedro-mlflow does not own closed (a branch's, or the one a resume reopened)."""
        if self.run is not None:
            self.run.drain()
        if self.run is not None and (self.parent or self.run.run_id != self.active_run_id):
            self.run.client.set_terminated(self.run.run_id, status="FINISHED")
