"""The logger protocol: MLflow (embedded SQLite) and in-memory backends record the same things."""

from __future__ import annotations

import json

import mlflow

from qerl_pipeline.tracking import (
    GROUP_TAG,
    ROLE_TAG,
    MemoryLogger,
    MetricsLogger,
    MlflowLogger,
    TrainingRun,
    label_run,
)


def _exercise(logger: MetricsLogger):
    logger.log_metrics({"reward": 0.5, "bad": float("nan"), "text": "x"}, step=1)
    logger.log_metrics({"reward": 0.75}, step=2)
    logger.log_params({"grpo.num_generations": 4})
    logger.set_tags({"method": "qerl"})
    logger.log_table([{"prompt": "p", "reward": 1.0}], "completions/step_1.json")


def test_memory_logger():
    log = MemoryLogger()
    assert isinstance(log, MetricsLogger)
    _exercise(log)
    assert log.metrics["reward"] == [(1, 0.5), (2, 0.75)]
    assert "bad" not in log.metrics and "text" not in log.metrics
    assert log.tags == {"method": "qerl"}


def test_mlflow_logger_resumes_a_run_by_id(sqlite_store, tmp_path):
    first = MlflowLogger(experiment="t")
    _exercise(first)
    first.end()
    again = MlflowLogger(run_id=first.run_id)  # e.g. a resumed training run
    again.log_metrics({"reward": 1.0}, step=3)
    again.log_params({"grpo.num_generations": 4})  # same value again: no error
    client = mlflow.tracking.MlflowClient()
    history = client.get_metric_history(first.run_id, "reward")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.75), (3, 1.0)]
    assert client.get_run(first.run_id).data.tags["method"] == "qerl"
    table = client.download_artifacts(first.run_id, "completions/step_1.json", str(tmp_path))
    assert json.loads(open(table).read()) == {"columns": ["prompt", "reward"], "data": [["p", 1.0]]}


def test_a_step_logged_again_after_a_resume_counts_once_with_its_last_value(sqlite_store):
    """A kill between a step's metrics and its checkpoint leaves that step in MLflow; the resume trains it again
    and logs it again (MLflow cannot delete a logged point). Every reader takes one value per step, the last
    logged (the one the final adapter went through): the logger's history, the curves the trainer draws, and
    the compare report's runs."""
    import time

    from qerl_pipeline.evaluation.report_runs import run_data
    from qerl_pipeline.rl.trainer import _full_history

    first = MlflowLogger(experiment="t")
    for step, value in ((1, 0.1), (2, 0.2), (3, 0.3)):
        first.log_metrics({"reward/mean": value, "policy/entropy": 1.0 + value}, step=step)
    first.end("KILLED")
    time.sleep(0.01)  # the resume logs later
    again = MlflowLogger(run_id=first.run_id)
    again.log_metrics({"reward/mean": 0.9, "policy/entropy": 1.9}, step=3)
    client = mlflow.tracking.MlflowClient()
    assert sorted(m.step for m in client.get_metric_history(first.run_id, "reward/mean")) == [1, 2, 3, 3]
    assert again.history(["reward/mean"]) == {"reward/mean": [(1, 0.1), (2, 0.2), (3, 0.9)]}
    assert [(r["step"], r["reward/mean"]) for r in _full_history(again)] == [(1, 0.1), (2, 0.2), (3, 0.9)]
    data = run_data(client, client.get_run(first.run_id))
    assert data.history["reward/mean"] == [(1, 0.1), (2, 0.2), (3, 0.9)]
    assert data.history["policy/entropy"] == [(1, 1.1), (2, 1.2), (3, 1.9)]


def test_failed_status(sqlite_store):
    log = MlflowLogger(experiment="t")
    log.end("FAILED")
    assert mlflow.tracking.MlflowClient().get_run(log.run_id).info.status == "FAILED"


def test_training_run_standalone_resume_logs_into_the_checkpoints_run(sqlite_store):
    client = mlflow.tracking.MlflowClient()
    original = MlflowLogger(experiment="t")
    original.end()  # the killed training's run
    mlflow.set_experiment("t")
    with mlflow.start_run() as active:  # the resuming kedro run's
        run = TrainingRun("train qerl · random · seed 0", "qerl", {})
        assert run.logger(original.run_id).run_id == original.run_id
        run.finish()
    assert client.get_run(active.info.run_id).data.tags["qerl.resumed_run_id"] == original.run_id
    assert client.get_run(original.run_id).info.status == "FINISHED"
    with mlflow.start_run() as fresh:  # a fresh training logs into the active run and names it
        run = TrainingRun("train qerl · random · seed 0", "qerl", {})
        assert run.logger(None).run_id == fresh.info.run_id
        run.finish()
        assert client.get_run(fresh.info.run_id).info.status == "RUNNING"  # kedro-mlflow closes its own run
    tags = client.get_run(fresh.info.run_id).data.tags
    assert tags["mlflow.runName"] == "train qerl · random · seed 0" and tags[ROLE_TAG] == "train"


def test_a_training_run_has_its_name_from_its_start_through_a_kill_and_resume(sqlite_store):
    """The training's run is named as it starts (not as it finishes), so a stopped run carries the same name as a
    finished one, and the resume that finishes it keeps that name; the resuming kedro run is named as a resume."""
    client = mlflow.tracking.MlflowClient()
    name = "train qerl · random · seed 0"
    mlflow.set_experiment("t")
    with mlflow.start_run(run_name="train") as first:  # kedro-mlflow names its run after the pipeline
        run = TrainingRun(name, "qerl", {})
        assert run.logger(None).run_id == first.info.run_id
        tags = client.get_run(first.info.run_id).data.tags
        assert tags["mlflow.runName"] == name and tags[ROLE_TAG] == "train"  # while it runs
    # killed here: never finished, its name stays
    with mlflow.start_run(run_name="train") as second:  # the kedro run that resumes it
        run = TrainingRun(name, "qerl", {})
        assert run.logger(first.info.run_id).run_id == first.info.run_id
        run.finish()
    kept, resume = client.get_run(first.info.run_id), client.get_run(second.info.run_id)
    assert kept.info.run_name == name and kept.data.tags[ROLE_TAG] == "train" and kept.info.status == "FINISHED"
    assert resume.info.run_name == f"{name} · resume" and resume.data.tags[ROLE_TAG] == "resume"
    assert resume.data.tags["qerl.resumed_run_id"] == first.info.run_id


def test_training_run_in_a_branch_is_a_child_of_the_compare_run(sqlite_store):
    client = mlflow.tracking.MlflowClient()
    parent = label_run("compare · random", "compare", run_id=MlflowLogger(experiment="t").run_id)
    run = TrainingRun("train qlora · random · seed 1", "qlora", {"lora.rank": 4}, parent, tags={"seed": "1"})
    child = run.logger(None).run_id
    run.finish()
    got = client.get_run(child)
    assert got.info.status == "FINISHED" and got.data.params == {"lora.rank": "4"}
    assert {k: got.data.tags[k] for k in (GROUP_TAG, "mlflow.parentRunId", "method", "seed", ROLE_TAG)} == {
        GROUP_TAG: parent,
        "mlflow.parentRunId": parent,
        "method": "qlora",
        "seed": "1",
        ROLE_TAG: "train",
    }
    mlflow.end_run()
