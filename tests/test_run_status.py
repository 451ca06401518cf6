"""A run's MLflow status says how it ended; the tracking store is tried before the first node;
settings of different sections that do not fit together are refused before anything runs.

Fast tests on a real SQLite MLflow store and real signals (``os.kill`` of this process, and
SIGINT/SIGTERM to a Python child that holds an MLflow run the way kedro-mlflow does, so
MLflow's own exit handler runs as in a ``kedro run``). The one ``kedro run`` here fails in its
first seconds (an unreachable tracking server); the kill and resume of a real training is in
tests/test_compare_pipeline.py.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import click
import mlflow
import pytest
import yaml
from kedro.config import OmegaConfigLoader
from kedro.pipeline import Node, Pipeline
from mlflow.tracking import MlflowClient

from qerl_pipeline import metric_names, tracking
from qerl_pipeline.config import validate
from qerl_pipeline.hooks import (
    ParameterError,
    RunStatusHook,
    TrackingStoreUnusable,
    ValidateConfigHook,
    cross_field_errors,
    node_roles,
)
from qerl_pipeline.tracking import MlflowLogger, TrainingRun
from tests.helpers.project import PROJECT, project_copy, run_kedro


def _dead_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ how a run ended
def test_status_and_tags_follow_the_exception():
    assert tracking.end_status(None) == "FINISHED"
    assert tracking.end_status(KeyboardInterrupt()) == "KILLED"
    assert tracking.end_status(tracking.Interrupted("SIGTERM")) == "KILLED"
    assert tracking.end_status(ValueError("x")) == "FAILED"
    assert tracking.end_tags(tracking.Interrupted("SIGTERM")) == {tracking.KILLED_BY_TAG: "SIGTERM"}
    assert tracking.end_tags(KeyboardInterrupt()) == {tracking.KILLED_BY_TAG: "KeyboardInterrupt"}
    err = RuntimeError("\n  engine process died (exit code -9) during 'generate'\n--- engine log tail ---\nvllm line")
    assert tracking.end_tags(err) == {
        tracking.FAILURE_TAG: "RuntimeError: engine process died (exit code -9) during 'generate'"
    }
    assert len(tracking.one_line(ValueError("y" * 2000))) == 500


def test_a_failed_training_run_is_failed_with_the_error_and_its_last_step(sqlite_store):
    parent = MlflowLogger(experiment="t")
    run = TrainingRun("train qerl · random · seed 0", "qerl", {}, parent=parent.run_id, tags={"seed": "0"})
    branch = run.logger(None)  # a compare branch's own run
    branch.log_metrics({metric_names.REWARD_MEAN: 0.1}, step=1)
    branch.log_metrics({metric_names.REWARD_MEAN: 0.2}, step=2)
    run.fail(ValueError("lora.rank 1024 exceeds vLLM's largest max_lora_rank (512)\nmore detail"))
    got = MlflowClient().get_run(branch.run_id)
    assert got.info.status == "FAILED"
    assert (
        got.data.tags[tracking.FAILURE_TAG] == "ValueError: lora.rank 1024 exceeds vLLM's largest max_lora_rank (512)"
    )
    assert got.data.tags[tracking.LAST_STEP_TAG] == "2"
    run.fail(KeyboardInterrupt())  # ended already (the training loop's own mark): left as it is
    assert MlflowClient().get_run(branch.run_id).info.status == "FAILED"


def test_a_killed_run_resumed_runs_again_and_finishes_with_its_earlier_end_kept(sqlite_store):
    client = MlflowClient()
    original = MlflowLogger(experiment="t")  # the killed kedro run's training run
    original.log_metrics({metric_names.REWARD_MEAN: 0.5}, step=2)
    tracking.mark_ended(original, tracking.Interrupted("SIGINT"), last_step=2)
    mlflow.end_run("KILLED")
    got = client.get_run(original.run_id)
    assert got.info.status == "KILLED"
    assert got.data.tags[tracking.KILLED_BY_TAG] == "SIGINT" and got.data.tags[tracking.LAST_STEP_TAG] == "2"
    mlflow.set_experiment("t")
    with mlflow.start_run():  # the resuming kedro run's
        run = TrainingRun("train qerl · random · seed 0", "qerl", {})
        assert run.logger(original.run_id).run_id == original.run_id
        resumed = client.get_run(original.run_id)
        assert resumed.info.status == "RUNNING"
        assert not set(tracking.END_TAGS) & set(resumed.data.tags)
        assert resumed.data.tags[tracking.PREVIOUS_END_TAG] == "KILLED; killed_by=SIGINT; last_completed_step=2"
        run.finish()
    assert client.get_run(original.run_id).info.status == "FINISHED"


def _node(name: str) -> Node:
    return Node(
        lambda: None,
        None,
        name.rsplit(".", 1)[-1] + "_out",
        name=name.rsplit(".", 1)[-1],
        namespace=name.rsplit(".", 1)[0] if "." in name else None,
    )


def test_a_pipeline_error_tags_the_kedro_run_with_its_summary_and_last_node(sqlite_store):
    mlflow.set_experiment("t")
    before = signal.getsignal(signal.SIGINT)
    with mlflow.start_run() as active:  # kedro-mlflow's run
        hook = RunStatusHook()
        hook.before_pipeline_run(run_params={}, pipeline=Pipeline([]), catalog=None)
        assert signal.getsignal(signal.SIGTERM) == hook._on_signal
        hook.after_node_run(_node("prepare_train_prompts"))
        hook.on_pipeline_error(RuntimeError("training source unavailable: no local folder\n  details"))
    assert signal.getsignal(signal.SIGINT) is before and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    tags = MlflowClient().get_run(active.info.run_id).data.tags
    assert tags[tracking.FAILURE_TAG] == "RuntimeError: training source unavailable: no local folder"
    assert tags[tracking.LAST_NODE_TAG] == "prepare_train_prompts"


def test_sigterm_during_the_run_is_an_interrupt_that_ends_the_run_killed(sqlite_store):
    mlflow.set_experiment("t")
    run = mlflow.start_run()
    hook = RunStatusHook()
    hook.before_pipeline_run(run_params={}, pipeline=Pipeline([]), catalog=None)
    try:
        hook.after_node_run(_node("quantize_nvfp4"))
        with pytest.raises(tracking.Interrupted) as caught:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler raises at the next bytecode
        assert caught.value.signal_name == "SIGTERM" and isinstance(caught.value, KeyboardInterrupt)
        hook._at_exit()  # what the interpreter's exit runs (the child-process test below runs it for real)
    finally:
        hook._close()
    got = MlflowClient().get_run(run.info.run_id)
    assert got.info.status == "KILLED" and mlflow.active_run() is None
    assert got.data.tags[tracking.KILLED_BY_TAG] == "SIGTERM"
    assert got.data.tags[tracking.LAST_NODE_TAG] == "quantize_nvfp4"


#: A process that holds an MLflow run as a kedro run does (started by kedro-mlflow before the pipeline and
#: started again before each node, so it stands twice on MLflow's run stack; the project's hooks called through
#: Kedro's hook manager), then waits for the signal.
_CHILD = """
import sys, time
import mlflow
from kedro.framework.hooks.manager import _create_hook_manager
from kedro.pipeline import Node, Pipeline
from qerl_pipeline.settings import HOOKS

mlflow.set_tracking_uri(sys.argv[1])
mlflow.set_experiment("t")
run = mlflow.start_run()
manager = _create_hook_manager()
for hook in HOOKS:
    manager.register(hook)
manager.hook.before_pipeline_run(run_params={}, pipeline=Pipeline([]), catalog=None)
# kedro-mlflow's before_node_run (nested: true, conf/base/mlflow.yml)
mlflow.start_run(run_id=run.info.run_id, nested=True)
node = Node(lambda: None, None, "x", name="prepare_train_prompts")
manager.hook.after_node_run(node=node, catalog=None, inputs={}, outputs={}, is_async=False, run_id="r")
print(run.info.run_id, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_process_ends_its_run_killed_not_finished(sqlite_store, sig):
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, sqlite_store], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        # its last line before the wait (importing the settings configures Kedro's logging, which says so first)
        lines = iter(proc.stdout.readline, "")
        run_id = next((line.strip() for line in lines if re.fullmatch(r"[0-9a-f]{32}", line.strip())), "")
        assert run_id, proc.stderr.read()
        proc.send_signal(sig)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    got = MlflowClient().get_run(run_id)
    assert got.info.status == "KILLED", (got.info.status, proc.stderr.read()[-3000:])
    assert got.data.tags[tracking.KILLED_BY_TAG] == signal.Signals(sig).name
    assert got.data.tags[tracking.LAST_NODE_TAG] == "prepare_train_prompts"


# ------------------------------------------------------------------ the tracking store
def test_an_unreachable_server_is_named_at_once():
    uri = f"http://127.0.0.1:{_dead_port()}"
    with pytest.raises(tracking.TrackingStoreError, match=rf"^MLflow tracking server {uri} is unreachable: "):
        tracking.check_store(uri)


def test_a_listening_server_and_a_writable_sqlite_file_pass(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        tracking.check_store(f"http://127.0.0.1:{s.getsockname()[1]}")
    tracking.check_store(f"sqlite:///{tmp_path}/new/folders/mlflow.db")  # MLflow creates the folders
    assert not (tmp_path / "new").exists()
    (tmp_path / "mlflow.db").write_bytes(b"")
    tracking.check_store(f"sqlite:///{tmp_path}/mlflow.db")


def test_sqlite_stores_that_cannot_be_written_are_named(tmp_path):
    """Failures root meets too (tests run as root here): a file where the folder should be, a folder
    where the database should be."""
    (tmp_path / "afile").write_text("x")
    uri = f"sqlite:///{tmp_path}/afile/mlflow.db"
    with pytest.raises(tracking.TrackingStoreError, match=rf"{uri}: {tmp_path}/afile is not a folder$"):
        tracking.check_store(uri)
    (tmp_path / "mlflow.db").mkdir()
    with pytest.raises(tracking.TrackingStoreError, match=rf"{tmp_path}/mlflow.db is not a file$"):
        tracking.check_store(f"sqlite:///{tmp_path}/mlflow.db")


def test_a_sqlite_store_in_a_read_only_folder_is_named(tmp_path):
    """A folder this process may not write in. Root writes wherever chmod forbids it, so as root the
    check runs in a child under a read-only bind mount of the folder (``unshare -m``; skipped only
    where root cannot make one); any other user meets a chmod 555 folder."""
    folder = tmp_path / "ro"
    folder.mkdir()
    uri = f"sqlite:///{folder}/mlflow.db"
    code = (
        "from qerl_pipeline.tracking import check_store, TrackingStoreError\n"
        f"try:\n    check_store({uri!r})\nexcept TrackingStoreError as e:\n    print(e)\n"
    )
    if os.geteuid() != 0:
        folder.chmod(0o555)
        cmd = [sys.executable, "-c", code]
    else:
        cmd = [
            "unshare",
            "-m",
            "sh",
            "-c",
            'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$1" -c "$2"',
            str(folder),
            sys.executable,
            code,
        ]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        pytest.skip("no unshare to make a read-only mount as root")
    finally:
        folder.chmod(0o755)
    if os.geteuid() == 0 and "mount" in out.stderr:
        pytest.skip(f"root cannot make a read-only bind mount here: {out.stderr.strip()}")
    assert out.stdout.startswith(f"MLflow tracking store {uri}: cannot write in {folder} ("), out
    assert out.stdout.strip().endswith(("(Read-only file system)", "(Permission denied)")), out


def test_mlflow_http_retries_are_bounded_unless_the_user_set_them():
    env = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "300"}
    added = tracking.bound_http_retries(env)
    assert env["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "300" and "MLFLOW_HTTP_REQUEST_TIMEOUT" not in added
    assert env["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == tracking.HTTP_RETRY_DEFAULTS["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]


def _context(tmp_path: Path, uri: str) -> SimpleNamespace:
    conf = tmp_path / "conf"
    (conf / "base").mkdir(parents=True)
    (conf / "local").mkdir()
    (conf / "base" / "mlflow.yml").write_text(yaml.safe_dump({"server": {"mlflow_tracking_uri": uri}}))
    return SimpleNamespace(
        config_loader=OmegaConfigLoader(conf_source=str(conf), base_env="base", default_run_env="local")
    )


def test_the_hook_stops_a_run_on_an_unreachable_server_with_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"http://127.0.0.1:{_dead_port()}"
    with pytest.raises(TrackingStoreUnusable) as err:
        ValidateConfigHook().after_context_created(_context(tmp_path, uri))
    assert isinstance(err.value, click.ClickException)
    message = err.value.format_message()
    assert (
        "\n" not in message
        and message.startswith(f"MLflow tracking server {uri} is unreachable")
        and "nothing ran" in message
    ), message


# ------------------------------------------------------------------ settings that do not fit together
def _params(env: str = "smoke") -> dict:
    from qerl_pipeline import settings

    loader = OmegaConfigLoader(
        conf_source=str(PROJECT / "conf"),
        env=env,
        **{k: v for k, v in settings.CONFIG_LOADER_ARGS.items() if k != "default_run_env"},
    )
    return dict(loader["parameters"])


def _refused(params: dict, nodes: list[str]) -> str:
    hook = ValidateConfigHook()
    hook._context = SimpleNamespace(params=params)
    with pytest.raises(ParameterError) as err:
        hook.before_pipeline_run(run_params={}, pipeline=Pipeline([_node(n) for n in nodes]), catalog=None)
    return err.value.format_message()


def test_an_unknown_benchmark_is_an_error_naming_the_allowed_sets():
    params = _params()
    params["evaluate"] = {**params["evaluate"], "benchmarks": ["gsm8k", "gsm8kk"]}
    text = _refused(params, ["evaluate_policies"])
    assert "evaluate.benchmarks: 'gsm8kk' not an evaluation set; allowed: generator, gsm8k" in text, text
    assert text.startswith("invalid parameters (nothing ran):")
    assert cross_field_errors(validate(params), {"train_policy"}) == []  # a run without evaluation is not refused
    # the export scores too
    assert "'gsm8kk' not an evaluation set" in _refused(params, ["export_policy", "evaluate_export"])


def test_an_evaluation_length_without_prompt_budget_is_refused():
    params = _params()
    params["evaluate"] = {**params["evaluate"], "max_new_tokens": 600}
    text = _refused(params, ["compare.qerl.evaluate_policies"])
    assert (
        "evaluate.max_new_tokens: 600 must be below model.max_seq_len (512): the prompt budget, "
        "max_seq_len - max_new_tokens, is -88 tokens"
    ) in text, text


def test_compare_with_several_ranks_is_refused_before_data_prep():
    params = _params()
    params["train"] = {**params["train"], "nproc": 2}
    assert "train.nproc: 2 (x train.nnodes 1) ranks are not supported in compare branches" in _refused(
        params, ["prepare_train_prompts", "compare.qerl.train_policy"]
    )
    assert node_roles(Pipeline([_node("compare.qerl.train_policy")])) == {"train_policy", "compare:train_policy"}
    assert cross_field_errors(validate(params), {"train_policy"}) == []  # a standalone training may use ranks


def test_a_compare_branch_called_outside_kedro_refuses_several_ranks_with_the_same_sentence(tmp_path):
    from qerl_pipeline.pipelines.train.nodes import _train_seed

    params = _params()
    params["train"] = {**params["train"], "nproc": 2}
    cfg = validate(params)
    with pytest.raises(ValueError) as err:  # before any run, launch or engine: the base folder is never read
        _train_seed(cfg, [], str(tmp_path / "no-base"), None, compare_group={"run_id": "parent"}, seed=0)
    assert str(err.value) == cfg.train.compare_ranks_error() != ""


@pytest.mark.parametrize(
    "env", sorted(p.name for p in (PROJECT / "conf").iterdir() if p.is_dir() and p.name != "local")
)
def test_every_shipped_env_fits_together(env):
    assert cross_field_errors(validate(_params(env))) == []


# ------------------------------------------------------------------ one real kedro run
@pytest.mark.kedro_run
def test_kedro_run_with_an_unreachable_server_stops_before_any_node(tmp_path):
    root = project_copy(tmp_path / "project")
    uri = f"http://127.0.0.1:{_dead_port()}"
    proc = run_kedro(
        root, "run", "--pipelines=data_prep", "--env=smoke", env={"MLFLOW_TRACKING_URI": uri}, check=False, timeout=300
    )
    text = proc.stdout
    assert proc.returncode == 1, text
    assert f"Error: MLflow tracking server {uri} is unreachable" in text, text
    assert "Traceback" not in text and "Running node" not in text and "Retrying" not in text, text
    assert not (root / "data").exists() or not any((root / "data").rglob("*.json")), text
    db = root / "mlflow.db"
    if db.exists():
        with sqlite3.connect(db) as con:
            assert con.execute("select count(*) from runs").fetchone()[0] == 0
