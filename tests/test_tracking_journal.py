"""The tracking journal: records kept in order while the server is away, a torn last line, a resume after a
partial send, the outage bound; and ``MlflowLogger`` writing through it to a real MLflow store (SQLite)."""

from __future__ import annotations

import json

import pytest

from qerl_pipeline.tracking_journal import Journal, JournalError, Outbox, TrackingOutage


class Server:
    """A receiver that can be away: what it got, in order; ``down`` makes sends fail as an outage."""

    def __init__(self) -> None:
        self.got: list[int] = []
        self.down = False
        self.uncertain: list[int] = []

    def send(self, record: dict, uncertain: bool) -> None:
        if self.down:
            raise ConnectionError("connection refused")
        if uncertain:
            self.uncertain.append(record["i"])
            if record["i"] in self.got:  # it arrived before: what the MLflow sender checks for metrics
                return
        self.got.append(record["i"])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def outbox(path, server: Server, clock: Clock | None = None, outage_s: float = 60.0) -> Outbox:
    clock = clock or Clock()
    return Outbox(
        Journal(path),
        server.send,
        server="http://127.0.0.1:1",
        outage_s=outage_s,
        answers=lambda: not server.down,
        clock=clock,
        sleep=clock.sleep,
    )


def test_records_wait_while_away_and_go_in_order_once(tmp_path):
    server, clock = Server(), Clock()
    box = outbox(tmp_path / "j.jsonl", server, clock)
    box.submit({"i": 0})
    server.down = True
    for i in (1, 2, 3):
        box.submit({"i": i})
        clock.now += 1
    assert server.got == [0] and len(box.journal.records) == 3
    assert box.away_s() == pytest.approx(3.0) and box.outage() is None
    server.down = False
    box.submit({"i": 4})  # within RETRY_S of the failed send: kept, not tried
    assert server.got == [0]
    clock.now += 10
    box.submit({"i": 5})
    assert server.got == [0, 1, 2, 3, 4, 5]
    assert server.uncertain == [1]  # the one whose send failed; the others never left
    assert box.away_s() is None and not box.journal.records


def test_a_torn_last_line_is_dropped_and_the_file_goes_on(tmp_path):
    path = tmp_path / "j.jsonl"
    server = Server()
    server.down = True
    box = outbox(path, server)
    for i in range(3):
        box.submit({"i": i})
    box.journal.close()
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"i":3,"n":3,"op":"met')  # the process died writing record 3
    again = Journal(path)
    assert [r["i"] for r in again.pending] == [0, 1, 2]
    assert path.read_bytes() == whole  # cut back to its last whole line
    again.append({"i": 9})
    again.close()
    assert [r["i"] for r in Journal(path).pending] == [0, 1, 2, 9]


def test_a_bad_line_before_the_last_is_an_error_naming_it(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_text('{"n":0,"i":0}\nnot json\n{"n":1,"i":1}\n')
    with pytest.raises(JournalError, match=r"j.jsonl: line 2 is not a journal record"):
        Journal(path)


def test_a_resume_after_a_partial_send_sends_the_rest_once(tmp_path):
    path = tmp_path / "j.jsonl"
    server = Server()
    box = outbox(path, server)
    server.down = True
    for i in range(5):
        box.submit({"i": i})
    server.down = False
    sent = []

    def dies_after_two(record, uncertain):  # record 2 reaches the server, the process dies before its mark
        server.send(record, uncertain)
        sent.append(record["i"])
        if len(sent) == 3:
            raise SystemExit("killed")

    box.send, box.next_try = dies_after_two, 0.0
    with pytest.raises(SystemExit):
        box.flush()
    box.journal.close()
    assert server.got == [0, 1, 2]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [x["sent"] for x in lines if "sent" in x] == [0, 1]
    resumed = outbox(path, server)
    assert [r["i"] for r in resumed.journal.pending] == [2, 3, 4]
    resumed.flush(wait=True)
    assert server.got == [0, 1, 2, 3, 4]  # 2 was checked, not sent again
    assert server.uncertain == [0, 2]  # 0: its first send failed; 2: the first pending after the restart
    resumed.journal.close()
    assert Journal(path).pending == [] and path.read_bytes() == b""  # all sent: it starts empty


def test_past_the_bound_the_wait_stops_with_one_line(tmp_path):
    server, clock = Server(), Clock()
    box = outbox(tmp_path / "j.jsonl", server, clock, outage_s=30)
    server.down = True
    box.submit({"i": 0})
    clock.now += 31
    err = box.outage()
    assert isinstance(err, TrackingOutage)
    with pytest.raises(TrackingOutage) as waited:
        box.flush(wait=True)
    msg = str(waited.value)
    assert "\n" not in msg and "http://127.0.0.1:1" in msg and "31 s" in msg and "tracking.outage_s is 30" in msg
    assert "1 record(s) kept in" in msg and str(tmp_path / "j.jsonl") in msg


def test_the_wait_ends_when_the_server_is_back(tmp_path):
    server, clock = Server(), Clock()
    box = outbox(tmp_path / "j.jsonl", server, clock, outage_s=300)
    server.down = True
    box.submit({"i": 0})
    box.submit({"i": 1})

    def back_at_40(seconds):
        clock.now += seconds
        server.down = clock.now < 40

    box.sleep = back_at_40
    box.flush(wait=True)
    assert server.got == [0, 1] and 40 <= clock.now < 50


def test_a_refused_record_is_raised_and_does_not_block_the_rest(tmp_path):
    server = Server()
    box = outbox(tmp_path / "j.jsonl", server)
    box.is_outage = lambda err: not isinstance(err, ValueError)

    def refuses_one(record, uncertain):
        if record["i"] == 1:
            raise ValueError("bad record")
        server.send(record, uncertain)

    box.send = refuses_one
    box.submit({"i": 0})
    with pytest.raises(ValueError, match="bad record"):
        box.submit({"i": 1})
    box.submit({"i": 2})
    assert server.got == [0, 2] and box.away_s() is None


def test_mlflow_logger_through_its_journal_logs_each_point_once(sqlite_store, tmp_path):
    """A real MLflow store (SQLite): a record sent whose mark was lost is checked, not sent again."""
    from mlflow.tracking import MlflowClient

    from qerl_pipeline.tracking import MlflowLogger, metric_history

    client = MlflowClient()
    run_id = client.create_run(client.create_experiment("journal")).info.run_id
    path = tmp_path / "run" / "tracking_journal.jsonl"
    logger = MlflowLogger(run_id=run_id)
    logger.keep_journal(path, outage_s=60)
    for step in (1, 2, 3):
        logger.log_metrics({"reward/mean": step / 10, "loss": float(step)}, step=step)
    logger.set_tags({"k": "v"})
    logger.log_table([{"a": 1, "b": "x"}], "completions/step_00003.json")
    logger.outbox.journal.close()
    lines = path.read_text().splitlines()
    assert json.loads(lines[-1]) == {"sent": 4}
    path.write_text("\n".join(lines[:-1]) + "\n")  # the table's mark lost: it is uncertain on reopen
    lines = path.read_text().splitlines()
    metric_mark = max(i for i, line in enumerate(lines) if '"sent":2' in line)
    path.write_text("\n".join(lines[:metric_mark]) + "\n")  # step 3's mark lost too (and what came after)
    again = MlflowLogger(run_id=run_id)
    again.keep_journal(path, outage_s=60)
    assert not again.outbox.journal.records
    assert [s for s, _ in metric_history(client, run_id, "reward/mean")] == [1, 2, 3]
    assert len(client.get_metric_history(run_id, "loss")) == 3  # step 3 not appended a second time
    run = client.get_run(run_id)
    assert run.data.tags["k"] == "v"
    assert "completions/step_00003.json" in [a.path for a in client.list_artifacts(run_id, "completions")]
    history = again.history(["loss"])
    assert history == {"loss": [(1, 1.0), (2, 2.0), (3, 3.0)]}


def test_a_reader_waits_for_the_server_and_goes_on_when_it_answers(caplog):
    from qerl_pipeline.tracking_journal import await_server

    clock = Clock()
    await_server("http://127.0.0.1:1", 300, answers=lambda: clock.now >= 40, clock=clock, sleep=clock.sleep)
    assert 40 <= clock.now < 50
    assert "answers again after" in caplog.text
    slept = Clock()
    await_server("http://127.0.0.1:1", 300, answers=lambda: True, clock=slept, sleep=slept.sleep)
    assert slept.now == 0  # a server that answers costs no wait


def test_a_reader_past_the_bound_stops_with_one_line():
    from qerl_pipeline.tracking_journal import await_server

    clock = Clock()
    with pytest.raises(TrackingOutage) as err:
        await_server("http://127.0.0.1:1", 10, answers=lambda: False, clock=clock, sleep=clock.sleep)
    msg = str(err.value)
    assert "\n" not in msg and "http://127.0.0.1:1 has not answered for 15 s (tracking.outage_s is 10)" in msg, msg
    assert "stopped before reading from it: run the same command again once it answers" in msg
