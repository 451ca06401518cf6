"""The tracking store on a real PostgreSQL and a real ``mlflow server``, started by the project's command.

One store for the module (``python -m qerl_pipeline.tracking_server start``: free ports on 127.0.0.1,
its own folder, each start under a timeout, stopped by its PIDs at the end). It is started, given a
probe run, stopped and started again over the same folder before the Kedro runs use it, so the runs
below also show that a second start keeps the store. Then, with ``MLFLOW_TRACKING_URI`` the server:
the smoke training with its export, and a smoke compare of 2 methods x 1 seed. Every assertion reads
the server (runs, each step's metrics once, artifacts downloaded through it, the registered model)
or what the compare report built from it.

A training outlives its server: the smoke training's server is SIGKILLed right after its step-2
checkpoint (its process group stopped meanwhile, so the kill lands between steps 2 and 3) and started
again on the same store 60 s later; the training goes on, exits 0, and every assertion above holds. The
compare's server is killed when its first evaluation starts and started again once that evaluation's records
wait in its training's journal: the compare finishes, the evaluation in its run once. Last,
a server away past a 10 s ``tracking.outage_s``: one ``Error:`` line, a non-zero exit, the checkpoint
kept, and the same command with the server back finishes the same run, each step once.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from qerl_pipeline import tracking_server
from qerl_pipeline.rl import checkpoint as ckpt
from qerl_pipeline.tracking_journal import JOURNAL_FILE, Journal
from qerl_pipeline.tracking_server import StoreServerError, free_port
from tests.helpers.project import project_copy, start_kedro, stop_kedro, wait_kedro
from tests.helpers.store import exported_uri, kill_recorded, store_command, store_folder

#: the tests that read the store: a real PostgreSQL and mlflow server (the integration tier)
SERVICES = pytest.mark.services

TRAIN_STEPS = 3  # conf/smoke/parameters.yml train.steps
METHODS = ["qerl", "lora"]
RUN_DIR = "data/06_models/train_smoke/qerl"
CURVES = ("reward/mean", "policy/entropy", "aqn/sigma", "optim/lr")


@pytest.fixture(scope="module")
def store():
    from mlflow.tracking import MlflowClient

    port, pg_port = free_port(), free_port()
    with store_folder() as folder:
        first = store_command("start", "--folder", str(folder), "--port", str(port), "--pg-port", str(pg_port))
        uri = exported_uri(first)
        client = MlflowClient(tracking_uri=uri)
        exp = client.create_experiment("probe")
        probe = client.create_run(exp).info.run_id
        client.log_metric(probe, "probe/value", 7.0, step=1)
        client.set_terminated(probe)
        again = store_command("start", "--folder", str(folder))  # while running: the same processes
        state_running = json.loads((folder / "store.json").read_text())
        store_command("stop", "--folder", str(folder))
        second = store_command("start", "--folder", str(folder))  # the same folder: its ports and data
        yield {
            "folder": folder,
            "uri": exported_uri(second),
            "first_uri": uri,
            "again": again,
            "running": state_running,
            "state": json.loads((folder / "store.json").read_text()),
            "probe": probe,
        }
        stopped = store_command("stop", "--folder", str(folder))
        assert "stopped mlflow server" in stopped.stderr and "PostgreSQL" in stopped.stderr, stopped.stderr


@pytest.fixture(scope="module")
def project(store, tmp_path_factory):
    return project_copy(tmp_path_factory.mktemp("server") / "project", shared=["gsm8k/test.jsonl"])


@pytest.fixture(scope="module")
def trained(store, project):
    """The smoke training and its export (method qerl), logged to the server, which is SIGKILLed right after the
    step-2 checkpoint and started again on the same store 60 s later: the training goes on meanwhile."""
    log = project / "train.log"
    proc, killed, _ = _train_and_kill_the_server_at_step_2(
        project, store, log, "export.dtype=float32", pipelines="train,export"
    )
    try:
        time.sleep(max(0.0, 60 - (time.monotonic() - killed)))
        _restart(store)
    except BaseException:
        stop_kedro(proc)
        raise
    return wait_kedro(proc, log, timeout=1200).stdout


@pytest.fixture(scope="module")
def compared(store, project, trained):
    """A smoke compare of 2 methods x 1 seed, logged to the server, which is SIGKILLed when lora's evaluation starts
    (its first) and started again once that evaluation's records wait in lora's training journal."""
    log = project / "compare.log"
    params = f"compare.methods={' '.join(METHODS)},compare.seeds=[0],evaluate.greedy=false"
    args = ["run", "--pipelines=compare", "--env=smoke", f"--params={params}"]
    proc = start_kedro(project, *args, log=log, env={"MLFLOW_TRACKING_URI": store["uri"]})
    try:
        _wait_for(
            lambda: "evaluate lora seed 0 on " in log.read_text(errors="replace"), proc, log, "lora's evaluation"
        )
        os.killpg(proc.pid, signal.SIGSTOP)
        kill_recorded(store["folder"], which=("mlflow_pid",))
        os.killpg(proc.pid, signal.SIGCONT)
        (meta,) = project.glob("data/06_models/**/compare/lora/seed-0/qerl_adapter.json")
        journal = project / json.loads(meta.read_text())["run_dir"] / JOURNAL_FILE  # relative to the project
        _wait_for(lambda: "eval/accuracy.json" in _pending_files(journal), proc, log, "the evaluation in the journal")
        _restart(store)
    except BaseException:
        stop_kedro(proc)
        raise
    return {"stdout": wait_kedro(proc, log, timeout=1500).stdout, "journal": journal}


def _wait_for(ready, proc, log: Path, what: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no {what} (rc {proc.poll()})\n{log.read_text(errors='replace')[-6000:]}")
        time.sleep(0.02)


def _pending_files(journal: Path) -> list[str]:
    """The artifact files of the journal's pending records, read without opening it as a ``Journal`` (which may
    rewrite the file its writer holds): the whole lines after the last ``sent`` mark."""
    try:
        lines = journal.read_text().splitlines()
    except FileNotFoundError:
        return []
    items = []
    for line in lines:
        try:
            items.append(json.loads(line))
        except ValueError:  # a line being written
            break
    sent = max((x["sent"] for x in items if "sent" in x), default=-1)
    return [x.get("file", "") for x in items if x.get("n", -1) > sent]


def _train_and_kill_the_server_at_step_2(project: Path, store: dict, log: Path, *params: str, pipelines="train"):
    """``kedro run --pipelines=<pipelines>`` logging to the store; the run's process group stopped (SIGSTOP) within one
    20 ms poll of its step-2 checkpoint's rename (a smoke step takes ~0.2 s), the server SIGKILLed, the run
    continued. Returns the process (running), the time of the kill and the command's arguments."""
    args = ["run", f"--pipelines={pipelines}", "--env=smoke", *([f"--params={','.join(params)}"] if params else [])]
    proc = start_kedro(project, *args, log=log, env={"MLFLOW_TRACKING_URI": store["uri"]})
    step2 = project / RUN_DIR / ckpt.CHECKPOINTS / "step-000002"
    try:
        _wait_for(step2.is_dir, proc, log, "step-2 checkpoint")
        os.killpg(proc.pid, signal.SIGSTOP)
        kill_recorded(store["folder"], which=("mlflow_pid",))
        killed = time.monotonic()
        os.killpg(proc.pid, signal.SIGCONT)
    except BaseException:
        stop_kedro(proc)
        raise
    return proc, killed, args


def _restart(store: dict) -> None:
    again = store_command("start", "--folder", str(store["folder"]))
    assert exported_uri(again) == store["uri"] and "mlflow server started" in again.stderr, again.stderr


def _client(store):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=store["uri"])


def _runs(client, role: str) -> list:
    exp = client.get_experiment_by_name("qerl_pipeline")
    return [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("qerl.role") == role]


def _each_step_once(client, run_id: str, name: str, steps: int) -> None:
    logged = [m.step for m in client.get_metric_history(run_id, name)]
    assert sorted(logged) == list(range(1, steps + 1)), (name, logged)


@SERVICES
def test_a_second_start_over_the_folder_keeps_the_first_starts_runs(store):
    state, running = store["state"], store["running"]
    assert store["uri"] == store["first_uri"]  # the folder's ports are kept
    assert state["backend_store_uri"].startswith("postgresql+psycopg://") and state["backend_store_uri"].endswith(
        f":{state['pg_port']}/mlflow"
    )
    # a start while both run reuses them
    assert "already running" in store["again"].stderr and "made a PostgreSQL data folder" not in store["again"].stderr
    # the restart started new processes over the same data folder
    assert state["mlflow_pid"] != running["mlflow_pid"] and state["pg_pid"] != running["pg_pid"]
    run = _client(store).get_run(store["probe"])
    assert run.info.status == "FINISHED" and run.data.metrics["probe/value"] == 7.0


@pytest.mark.services
@pytest.mark.kedro_run
@pytest.mark.vllm
def test_the_smoke_training_logs_to_the_server_each_step_once(store, project, trained):
    client = _client(store)
    (run,) = [r for r in _runs(client, "train") if "qerl.compare_group" not in r.data.tags]
    assert run.info.status == "FINISHED" and run.data.tags["method"] == "qerl"
    for name in CURVES:
        _each_step_once(client, run.info.run_id, name, TRAIN_STEPS)
    # artifacts go through the server (mlflow-artifacts:/) and come back byte for byte
    assert run.info.artifact_uri.startswith("mlflow-artifacts:/"), run.info.artifact_uri
    top = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"final_adapter", "config", "plots", "completions"} <= top, top
    local = project / "data/06_models/train_smoke/qerl/final_adapter/adapter_config.json"
    got = Path(client.download_artifacts(run.info.run_id, "final_adapter/adapter_config.json", str(project)))
    assert got.read_bytes() == local.read_bytes()
    assert str(got).startswith(str(project)) and not str(got).startswith(str(store["folder"]))
    # and they live in the store's artifact folder, not the project's
    assert any(Path(store["state"]["artifacts"]).rglob("adapter_config.json"))
    assert not (project / "mlruns").exists() and not (project / "mlflow.db").exists()


@pytest.mark.services
@pytest.mark.kedro_run
@pytest.mark.vllm
def test_the_export_registers_its_model_in_the_server(store, trained):
    client = _client(store)
    versions = client.search_model_versions("")
    assert versions and all(v.status == "READY" for v in versions), versions
    (run,) = [r for r in _runs(client, "train") if "qerl.compare_group" not in r.data.tags]
    assert {v.run_id for v in versions} == {run.info.run_id}


@pytest.mark.services
@pytest.mark.kedro_run
@pytest.mark.vllm
def test_the_compare_logs_to_the_server_and_its_report_is_built_from_it(store, project, compared):
    client = _client(store)
    (parent,) = _runs(client, "compare")
    assert parent.info.status == "FINISHED"
    children = [r for r in _runs(client, "train") if r.data.tags.get("qerl.compare_group") == parent.info.run_id]
    assert sorted((r.data.tags["method"], r.data.tags["seed"]) for r in children) == sorted((m, "0") for m in METHODS)
    for run in children:
        assert run.info.status == "FINISHED"
        for name in ("reward/mean", "policy/entropy"):
            _each_step_once(client, run.info.run_id, name, TRAIN_STEPS)
        assert run.data.metrics["eval/trained/gsm8k/n_problems"] == 4  # the evaluation logged there too
        assert "eval/accuracy.json" in {a.path for a in client.list_artifacts(run.info.run_id, "eval")}
    report = project / "data/08_reporting/smoke/compare"
    runs = json.loads((report / "runs.json").read_text())
    assert {r["run_id"] for m in METHODS for r in runs[m]} == {r.info.run_id for r in children}, runs
    page = (report / "report.html").read_text()
    assert all(r.info.run_id in page for r in children)
    # the report's files in the compare run, read back through the server
    got = Path(client.download_artifacts(parent.info.run_id, "report/claims.json", str(project / "dl")))
    assert json.loads(got.read_text()) == json.loads((report / "claims.json").read_text())


@pytest.mark.services
@pytest.mark.kedro_run
@pytest.mark.vllm
def test_the_compare_kept_an_evaluation_while_the_server_was_away_and_sent_it_once(store, compared):
    assert "does not answer" in compared["stdout"] and "answers again after" in compared["stdout"]
    client = _client(store)
    (parent,) = _runs(client, "compare")
    assert parent.info.status == "FINISHED"
    (lora,) = [r for r in _runs(client, "train") if r.data.tags.get("method") == "lora"]
    assert len(client.get_metric_history(lora.info.run_id, "eval/trained/gsm8k/n_problems")) == 1
    assert lora.data.tags["qerl.evaluation_key"]  # what the compare's rerun would find and reuse
    assert Journal(compared["journal"]).pending == []


@pytest.mark.services
@pytest.mark.kedro_run
@pytest.mark.vllm
def test_the_training_went_on_while_the_server_was_away_and_sent_what_it_kept(store, project, trained):
    assert "does not answer" in trained and "answers again after" in trained, trained[-4000:]
    client = _client(store)
    (run,) = [r for r in _runs(client, "train") if "qerl.compare_group" not in r.data.tags]
    step3 = [a.path for a in client.list_artifacts(run.info.run_id, "completions")]
    assert "completions/step_00003.json" in step3  # logged while the server was away
    journal = project / RUN_DIR / JOURNAL_FILE
    assert journal.stat().st_size > 0 and Journal(journal).pending == []


@pytest.mark.services
@pytest.mark.kedro_run
@pytest.mark.vllm
def test_a_server_away_past_the_bound_stops_the_training_and_the_rerun_finishes_it(store, compared, tmp_path):
    """Last in the module (it kills the server again): its own project copy, 6 steps, a 10 s bound."""
    project = project_copy(tmp_path / "project", shared=["gsm8k/test.jsonl"])
    log = tmp_path / "first.log"
    proc, _, args = _train_and_kill_the_server_at_step_2(project, store, log, "train.steps=6", "tracking.outage_s=10")
    first = wait_kedro(proc, log, timeout=900, check=False)
    assert first.returncode != 0
    errors = [line for line in first.stdout.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and f"MLflow tracking server {store['uri']} has not answered for" in errors[0], errors
    assert "tracking.outage_s is 10" in errors[0] and "Traceback" not in first.stdout, first.stdout[-4000:]
    stopped_at = int(ckpt.peek_state(ckpt.find_latest(project / RUN_DIR))["step"])
    assert stopped_at >= 3  # the step it finished while away was checkpointed before the stop
    kept = Journal(project / RUN_DIR / JOURNAL_FILE).pending
    assert kept and all(r["run_id"] == kept[0]["run_id"] for r in kept)
    assert any(r["op"] == "metrics" and r["step"] == 3 for r in kept), kept

    _restart(store)
    log2 = tmp_path / "second.log"
    second = wait_kedro(start_kedro(project, *args, log=log2, env={"MLFLOW_TRACKING_URI": store["uri"]}), log2)
    assert "kept from before; they are sent first" in second.stdout
    client = _client(store)
    run = client.get_run(kept[0]["run_id"])  # the run it stopped in
    assert run.info.status == "FINISHED" and run.data.tags["qerl.role"] == "train", run.info
    for name in CURVES:
        _each_step_once(client, run.info.run_id, name, 6)
    assert Journal(project / RUN_DIR / JOURNAL_FILE).pending == []
    assert json.loads((project / RUN_DIR / "final_logged.json").read_text()) == {"run_id": run.info.run_id, "steps": 6}


# ----------------------------------------------------------------------------- refusals (fast tier: nothing starts)
@pytest.fixture()
def open_folder():
    """A folder under /tmp the postgres user can reach (pytest's own tmp_path sits under a 0700 folder)."""
    with store_folder() as folder:
        yield folder.parent


@pytest.mark.skipif(os.geteuid() != 0, reason="PostgreSQL runs as the postgres user only when this process is root")
def test_as_root_a_folder_the_postgres_user_cannot_reach_is_refused_naming_the_closed_folder(tmp_path):
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    with pytest.raises(StoreServerError) as err:
        tracking_server.start(closed / "store", timeout_s=10)
    line = str(err.value)
    assert "\n" not in line and "postgres user" in line and f"{closed} is closed to it (mode 700)" in line, line
    assert not (closed / "store" / "postgres" / "PG_VERSION").exists()  # refused before initdb


def test_missing_postgresql_binaries_are_named_with_the_fix(open_folder):
    with pytest.raises(StoreServerError, match=r"PostgreSQL's initdb is not in /no/such/bin: install PostgreSQL"):
        tracking_server.start(open_folder / "store", pg_bin="/no/such/bin", timeout_s=10)


def test_stop_without_a_store_says_so_in_one_line_and_exits_1(open_folder, capsys):
    assert tracking_server.main(["stop", "--folder", str(open_folder / "none")]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"error: no tracking store in {open_folder / 'none'} (store.json missing): nothing to stop", err
