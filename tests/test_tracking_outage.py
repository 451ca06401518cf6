"""A training outlives its tracking server: a real ``mlflow server`` on PostgreSQL (the project's store command)
is killed after step 2 of a smoke training and started again on the same store.

The kill is exact: the training's process group is stopped (SIGSTOP) within one 20 ms poll of its step-2
checkpoint's rename (a smoke step takes ~0.2 s), the server is SIGKILLed, then the training goes on
(SIGCONT). Two cases: the server back ~60 s later (within ``tracking.outage_s``): the same ``kedro run``
ends 0, its run FINISHED; and the server away past a short bound: one ``Error:`` line naming the server,
a non-zero exit and the checkpoint kept, then the same command with the server back finishes the run.
Either way every step's metrics are in the server exactly once, steps 1..N with no gap, and the
journal has sent everything.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from qerl_pipeline.rl import checkpoint as ckpt
from qerl_pipeline.rl.trainer import JOURNAL
from qerl_pipeline.tracking_journal import Journal
from qerl_pipeline.tracking_server import free_port
from tests.helpers.project import project_copy, start_kedro, stop_kedro, wait_kedro
from tests.helpers.store import exported_uri, kill_recorded, store_command, store_folder

pytestmark = [pytest.mark.services, pytest.mark.kedro_run, pytest.mark.vllm]

RUN_DIR = "data/06_models/train_smoke/qerl"
CURVES = ("reward/mean", "policy/entropy", "aqn/sigma", "optim/lr")


@pytest.fixture(scope="module")
def store():
    with store_folder() as folder:
        proc = store_command("start", "--folder", str(folder), "--port", str(free_port()))
        yield {"folder": folder, "uri": exported_uri(proc)}
        store_command("stop", "--folder", str(folder))


def _train_and_kill_the_server_at_step_2(project: Path, store: dict, log: Path, *params: str):
    """``kedro run --pipelines=train`` with the store's URI; its server SIGKILLed right after the step-2 checkpoint;
    returns the process (still running) and the time of the kill."""
    args = ["run", "--pipelines=train", "--env=smoke", *([f"--params={','.join(params)}"] if params else [])]
    proc = start_kedro(project, *args, log=log, env={"MLFLOW_TRACKING_URI": store["uri"]})
    step2 = project / RUN_DIR / ckpt.CHECKPOINTS / "step-000002"
    deadline = time.monotonic() + 900
    try:
        while not step2.is_dir():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no step-2 checkpoint (rc {proc.poll()})\n{log.read_text(errors='replace')[-6000:]}")
            time.sleep(0.02)
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


def _training_run(store: dict, run_id: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store["uri"])
    run = client.get_run(run_id)
    assert run.data.tags.get("qerl.role") == "train", run.data.tags
    return client, run


def _each_step_once(client, run, steps: int) -> None:
    """Every curve has steps 1..steps, each exactly once (MLflow would append a second value for a repeated step)."""
    for name in CURVES:
        logged = sorted(m.step for m in client.get_metric_history(run.info.run_id, name))
        assert logged == list(range(1, steps + 1)), (name, logged)


def test_a_server_back_within_the_bound_costs_the_training_nothing(store, tmp_path):
    project = project_copy(tmp_path / "project", shared=["gsm8k/test.jsonl"])
    log = tmp_path / "train.log"
    proc, killed, _ = _train_and_kill_the_server_at_step_2(project, store, log)
    try:
        time.sleep(max(0.0, 60 - (time.monotonic() - killed)))
        _restart(store)
    except BaseException:
        stop_kedro(proc)
        raise
    text = wait_kedro(proc, log, timeout=900).stdout
    assert "does not answer" in text and "answers again after" in text, text[-4000:]
    run_id = json.loads((project / RUN_DIR / "final_logged.json").read_text())["run_id"]
    client, run = _training_run(store, run_id)
    assert run.info.status == "FINISHED", run.info
    _each_step_once(client, run, 3)
    assert {"final_adapter", "plots", "completions"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    step3 = client.list_artifacts(run.info.run_id, "completions")
    assert "completions/step_00003.json" in [a.path for a in step3]  # logged while the server was away
    journal = project / RUN_DIR / JOURNAL
    assert journal.stat().st_size > 0 and Journal(journal).pending == []


def test_a_server_away_past_the_bound_stops_the_training_and_the_rerun_finishes_it(store, tmp_path):
    project = project_copy(tmp_path / "project", shared=["gsm8k/test.jsonl"])
    log = tmp_path / "first.log"
    proc, _, args = _train_and_kill_the_server_at_step_2(project, store, log, "train.steps=6", "tracking.outage_s=10")
    first = wait_kedro(proc, log, timeout=900, check=False)
    assert first.returncode != 0
    errors = [line for line in first.stdout.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and f"MLflow tracking server {store['uri']} has not answered for" in errors[0], errors
    assert "tracking.outage_s is 10" in errors[0] and "Traceback" not in first.stdout, first.stdout[-4000:]
    newest = ckpt.find_latest(project / RUN_DIR)
    stopped_at = int(ckpt.peek_state(newest)["step"])
    assert stopped_at >= 3  # the step it finished while away was checkpointed before the stop
    kept = Journal(project / RUN_DIR / JOURNAL).pending
    assert kept and all(r["run_id"] == kept[0]["run_id"] for r in kept)
    assert any(r["op"] == "metrics" and r["step"] == 3 for r in kept), kept

    _restart(store)
    log2 = tmp_path / "second.log"
    second = wait_kedro(start_kedro(project, *args, log=log2, env={"MLFLOW_TRACKING_URI": store["uri"]}), log2)
    assert "kept from before; they are sent first" in second.stdout
    client, run = _training_run(store, kept[0]["run_id"])  # the run it stopped in
    assert run.info.status == "FINISHED", run.info
    _each_step_once(client, run, 6)
    assert Journal(project / RUN_DIR / JOURNAL).pending == []
    resumed = json.loads((project / RUN_DIR / "final_logged.json").read_text())
    assert resumed == {"run_id": run.info.run_id, "steps": 6}
