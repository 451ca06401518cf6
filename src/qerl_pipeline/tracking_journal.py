"""What a run logs waits on disk while its tracking server is away, and is sent once, in order, when it answers.

``Journal`` is the file: JSON lines appended and fsync'd, each record ``{"n": i, ...}`` (what to send)
or ``{"sent": i}`` (record ``i`` reached the server). Records are sent strictly in order, so the
records after the last ``sent`` mark are the pending ones. A torn last line (the process died
mid-write) is cut off when the file is opened; a bad line before the last is an error naming it.
A journal whose records were all sent starts empty the next time it is opened.

``Outbox`` sends through a journal: ``submit`` appends a record and sends what is pending; a send
that fails as an outage (``is_outage``) keeps it pending and starts the outage clock. While the
server is away, sends are retried at most every ``RETRY_S`` seconds and only once ``answers()``
says the server is back, so a training is not held by the client's own retries on every step.
``flush(wait=True)`` waits for the server (a run's end, a read of its history); past ``outage_s``
seconds away it raises ``TrackingOutage``, as ``outage()`` tells the training loop after a step.

Nothing is sent twice. A record whose send failed, or the first pending one after a restart, may
have reached the server anyway (the reply was lost, or the process died before its ``sent`` mark):
it is sent as uncertain, and the sender skips what the server already holds (for metrics: a point
of the same key, step and timestamp; the other records are idempotent: tags, params, artifacts, inputs).
A record the server refuses (not an outage) is marked sent, so it cannot block the journal, and raised.

``await_server`` is the same wait for a reader (a compare's report, an evaluation's reuse check): what
it reads cannot wait in a journal, so it waits for the server up to the bound, then stops the same way.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qerl_pipeline.atomic import write_atomic

log = logging.getLogger(__name__)

#: seconds between two tries of a server that is away
RETRY_S = 5.0
#: seconds between two "still waiting" lines while a run waits for its server
SAY_EVERY_S = 30.0
#: a run folder's journal (a training's, and the evaluations logged into its run)
JOURNAL_FILE = "tracking_journal.jsonl"


class JournalError(RuntimeError):
    """The journal file is damaged before its last line: one line naming the file and line."""


class TrackingOutage(RuntimeError):
    """The tracking server has been away longer than the bound: one line naming it and for how long."""

    def __init__(self, server: str, away_s: float, bound_s: float, pending: int, journal: Path | None) -> None:
        kept = (
            f"stopped with {pending} record(s) kept in {journal}: run the same command again once it answers, "
            "they are sent first and the run goes on"
            if journal is not None
            else "stopped before reading from it: run the same command again once it answers"
        )
        super().__init__(
            f"MLflow tracking server {server} has not answered for {away_s:.0f} s (tracking.outage_s is {bound_s:g}); "
            + kept
        )
        self.server, self.away_s = server, away_s


class Journal:
    """The append-only file of one run folder's records (module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.records: dict[int, dict] = {}  # the pending ones, by number
        self.next = 0
        if self.path.exists():
            self._load()
        if not self.records and self.path.exists() and self.path.stat().st_size:
            write_atomic(self.path, b"")  # everything sent: start empty
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")

    def _load(self) -> None:
        data = self.path.read_bytes()
        lines, good, sent = data.split(b"\n"), 0, -1
        for i, line in enumerate(lines):
            last = i == len(lines) - 1
            if not line.strip():
                good += len(line) + (0 if last else 1)
                continue
            try:
                item = json.loads(line)
                if last:  # no newline after it: the process died while writing it
                    raise ValueError("torn")
            except ValueError:
                if last:
                    log.warning("%s: its last line is torn (the process died writing it); it is dropped", self.path)
                    break
                raise JournalError(f"{self.path}: line {i + 1} is not a journal record: {line[:80]!r}") from None
            good += len(line) + 1
            if "sent" in item:
                sent = max(sent, int(item["sent"]))
            else:
                self.records[int(item["n"])] = item
                self.next = max(self.next, int(item["n"]) + 1)
        if good < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)
        self.records = {n: r for n, r in self.records.items() if n > sent}

    def _write(self, item: dict) -> None:
        self._file.write(json.dumps(item, separators=(",", ":")).encode() + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def append(self, record: dict) -> int:
        n = self.next
        self.next += 1
        self.records[n] = {**record, "n": n}
        self._write(self.records[n])
        return n

    def mark_sent(self, n: int) -> None:
        self._write({"sent": n})
        self.records.pop(n, None)

    @property
    def pending(self) -> list[dict]:
        return [self.records[n] for n in sorted(self.records)]

    def close(self) -> None:
        self._file.close()


class Outbox:
    """Records sent through a ``Journal`` in order, kept while the server is away (module docstring).

    ``send(record, uncertain)`` sends one record; ``is_outage(err)`` says whether its error means the
    server is away (else it is the server refusing the record); ``answers()`` is a quick probe of
    the server (a ``/health`` request). ``server`` names it in messages.
    """

    def __init__(
        self,
        journal: Journal,
        send: Callable[[dict, bool], None],
        *,
        server: str,
        outage_s: float,
        answers: Callable[[], bool] = lambda: True,
        is_outage: Callable[[BaseException], bool] = lambda err: True,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.journal, self.send, self.server, self.outage_s = journal, send, server, outage_s
        self.answers, self.is_outage, self.clock, self.sleep = answers, is_outage, clock, sleep
        self.uncertain = {r["n"] for r in journal.pending[:1]}  # may have been sent before a restart
        if journal.records:
            log.info("%s: %d record(s) kept from before; they are sent first", journal.path, len(journal.records))
        self.away_since: float | None = None
        self.next_try = 0.0

    def submit(self, record: dict) -> None:
        self.journal.append(record)
        self.flush()

    def away_s(self) -> float | None:
        """Seconds since a send first failed with records still pending, or None while the server answers."""
        return None if self.away_since is None else self.clock() - self.away_since

    def outage(self) -> TrackingOutage | None:
        """The error to stop with when the server has been away longer than ``outage_s``, else None."""
        away = self.away_s()
        if away is None or away <= self.outage_s or not self.journal.records:
            return None
        return TrackingOutage(self.server, away, self.outage_s, len(self.journal.records), self.journal.path)

    def flush(self, wait: bool = False) -> None:
        """Send the pending records in order; ``wait``: until all are sent, or raise ``TrackingOutage``."""
        said = self.clock()
        while self.journal.records:
            if self.away_since is not None and not self._may_try():
                if not wait:
                    return
                if (err := self.outage()) is not None:
                    raise err
                if self.clock() - said >= SAY_EVERY_S:
                    said = self.clock()
                    log.warning(
                        "waiting for MLflow tracking server %s: away %.0f s of tracking.outage_s %g; %d records kept",
                        self.server,
                        self.away_s(),
                        self.outage_s,
                        len(self.journal.records),
                    )
                self.sleep(max(0.1, min(RETRY_S, self.next_try - self.clock())))
                continue
            record, started = self.journal.pending[0], self.clock()
            try:
                self.send(record, record["n"] in self.uncertain)
            except Exception as err:
                if not self.is_outage(err):
                    self.journal.mark_sent(record["n"])  # refused: it must not block what follows
                    raise
                self.uncertain.add(record["n"])
                self.next_try = self.clock() + RETRY_S
                if self.away_since is None:  # away since the send began (the client retried it meanwhile)
                    self.away_since = started
                    log.warning(
                        "MLflow tracking server %s does not answer (%s); the run goes on and keeps what it logs in %s "
                        "until it does (tracking.outage_s %g)",
                        self.server,
                        str(err).splitlines()[0][:200] if str(err) else type(err).__name__,
                        self.journal.path,
                        self.outage_s,
                    )
                continue
            self.journal.mark_sent(record["n"])
            self.uncertain.discard(record["n"])
            if self.away_since is not None:
                log.warning("MLflow tracking server %s answers again after %.0f s", self.server, self.away_s())
                self.away_since = None

    def _may_try(self) -> bool:
        if self.clock() < self.next_try:
            return False
        if self.answers():
            return True
        self.next_try = self.clock() + RETRY_S
        return False

    def drop_pending(self, keep: Callable[[dict], bool]) -> int:
        """Mark pending records that ``keep`` rejects as sent without sending them; return how many."""
        dropped = [r["n"] for r in self.journal.pending if not keep(r)]
        for n in dropped:
            self.journal.mark_sent(n)
            self.uncertain.discard(n)
        if dropped:
            log.info("%s: %d pending record(s) dropped (logged again by the resume)", self.journal.path, len(dropped))
        return len(dropped)


# ------------------------------------------------------------------ MLflow as the receiver
def send_record(client, record: dict, uncertain: bool) -> None:
    """Send one record to its MLflow run with ``client``; ``uncertain``: it may be there already (see above)."""
    op, run_id = record["op"], record["run_id"]
    if op == "metrics":
        from mlflow.entities import Metric

        step, t = record["step"], record["t"]
        metrics = record["metrics"]
        if uncertain:  # the points the server holds already are not sent again
            metrics = {k: v for k, v in metrics.items() if not _has_point(client, run_id, k, step, t)}
        if metrics:
            client.log_batch(run_id, metrics=[Metric(k, v, t, step) for k, v in metrics.items()])
    elif op == "params":
        from mlflow.entities import Param

        existing = client.get_run(run_id).data.params
        batch = [Param(k, v) for k, v in record["params"].items() if k not in existing]
        for i in range(0, len(batch), 100):
            client.log_batch(run_id, params=batch[i : i + 100])
    elif op == "tags":
        for key, value in record["tags"].items():
            client.set_tag(run_id, key, value)
    elif op == "artifact":
        path = Path(record["path"])
        if not path.exists():
            log.warning("artifact %s is gone; not logged to run %s", path, run_id)
        elif path.is_dir():
            client.log_artifacts(run_id, str(path), artifact_path=record["artifact_path"])
        else:
            client.log_artifact(run_id, str(path), artifact_path=record["artifact_path"])
    elif op == "text":
        client.log_text(run_id, record["text"], record["file"])
    elif op == "table":
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / Path(record["file"]).name
            target.write_text(json.dumps(record["table"]))
            parent = str(Path(record["file"]).parent)
            client.log_artifact(run_id, str(target), artifact_path=None if parent == "." else parent)
    elif op == "input":  # a dataset input (tracking_view.dataset_input); MLflow keeps one per dataset and run
        from mlflow.entities import Dataset, DatasetInput, InputTag

        tag = InputTag("mlflow.data.context", record["context"])
        client.log_inputs(run_id, datasets=[DatasetInput(Dataset(**record["dataset"]), tags=[tag])])
    else:
        raise ValueError(f"unknown journal record {op!r}")


def _has_point(client, run_id: str, key: str, step: int, timestamp: int) -> bool:
    return any(int(m.step) == step and int(m.timestamp) == timestamp for m in client.get_metric_history(run_id, key))


def server_answers(uri: str, timeout_s: float = 2.0) -> bool:
    """A quick probe: an ``http(s)`` server's ``/health`` answers within ``timeout_s`` (other stores: True)."""
    import urllib.request

    if not uri.startswith(("http://", "https://")):
        return True
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as response:
            return response.status == 200
    except OSError:
        return False


def await_server(
    uri: str,
    outage_s: float,
    *,
    answers: Callable[[], bool] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Return once the server at ``uri`` answers (at once when it does); ``TrackingOutage`` past ``outage_s``."""
    answers = answers or (lambda: server_answers(uri))
    start, said = clock(), None
    while not answers():
        away = clock() - start
        if away > outage_s:
            raise TrackingOutage(uri, away, outage_s, 0, None)
        if said is None or clock() - said >= SAY_EVERY_S:
            said = clock()
            log.warning(
                "waiting for MLflow tracking server %s: away %.0f s of tracking.outage_s %g", uri, away, outage_s
            )
        sleep(RETRY_S)
    if said is not None:
        log.warning("MLflow tracking server %s answers again after %.0f s", uri, clock() - start)


#: a server's answers that mean it is away (its store down, say), not that it refuses the record
_AWAY_CODES = ("INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED")


def is_outage(err: BaseException) -> bool:
    """Whether a failed send means the tracking store is away (no answer, or a 5xx), not a refused record."""
    from mlflow.exceptions import MlflowException

    if isinstance(err, MlflowException):  # a request that failed after its retries is one too, code INTERNAL_ERROR
        return err.error_code in _AWAY_CODES
    return isinstance(err, OSError) or type(err).__module__.startswith(("requests", "urllib3"))


def jsonable(value: Any) -> Any:
    """A journal field: str, int, float, bool, None as they are, anything else as its ``str``."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
