"""An evaluation logged with its key is found again (compare's resume), and only for the same key."""

from __future__ import annotations

from qerl_pipeline.config import EvaluateConfig
from qerl_pipeline.evaluation.evaluator import EvalResult, evaluation_key, log_evaluation, logged_evaluation


def test_logged_evaluation_round_trip(tmp_path, monkeypatch):
    import mlflow

    from qerl_pipeline.tracking import MlflowLogger

    monkeypatch.chdir(tmp_path)  # the store's default artifact root is ./mlruns: never the checkout's
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 4}')
    (adapter / "adapter_model.safetensors").write_bytes(b"weights-1")
    records = [
        {"id": "a", "source": "gsm8k", "gold": "3", "completions": ["x"], "correct": [True], "policy": "trained"}
    ]
    cfg = EvaluateConfig()
    key = evaluation_key(adapter, cfg, records)
    logger = MlflowLogger(experiment="reuse")
    result = EvalResult(records=records, timings={"generate_s": 1.5}, tags={"rollout.served_format": "bf16"})
    rows = [{"policy": "trained", "source": "gsm8k", "benchmark": "gsm8k", "n_problems": 1, "pass1": 1.0}]
    log_evaluation(logger, result, rows, key=key)
    back = logged_evaluation(logger.run_id, key)
    assert back is not None and back.records == records and back.timings == {"generate_s": 1.5}
    # another adapter, other settings or other prompts: a different key, nothing reused
    (adapter / "adapter_model.safetensors").write_bytes(b"weights-2")
    assert evaluation_key(adapter, cfg, records) != key
    assert logged_evaluation(logger.run_id, evaluation_key(adapter, cfg, records)) is None
    (adapter / "adapter_model.safetensors").write_bytes(b"weights-1")
    assert evaluation_key(adapter, EvaluateConfig(limit=3), records) != key
    assert evaluation_key(adapter, cfg, records + [{"id": "b", "source": "gsm8k", "gold": "4"}]) != key
    assert evaluation_key(adapter, cfg, records) == key  # and it is a function of those alone
    logger.end()


def test_an_evaluation_kept_while_the_server_was_away_is_sent_first_by_the_rerun_and_reused(sqlite_store, tmp_path):
    """A compare branch's evaluation goes into its training run through the run folder's journal: the server away,
    it waits there (past the bound: one line); the rerun's logger sends it first, and the reuse check finds it."""
    import pytest
    from mlflow.tracking import MlflowClient

    from qerl_pipeline.evaluation.seeds import training_run_logger
    from qerl_pipeline.tracking_journal import JOURNAL_FILE, Journal, TrackingOutage

    client = MlflowClient()
    run_id = client.create_run(client.create_experiment("away")).info.run_id
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    records = [
        {"id": "a", "source": "gsm8k", "gold": "3", "completions": ["x"], "correct": [True], "policy": "trained"}
    ]
    result = EvalResult(records=records, timings={"generate_s": 1.5})
    rows = [{"policy": "trained", "source": "gsm8k", "benchmark": "gsm8k", "n_problems": 1, "pass1": 1.0}]

    logger = training_run_logger(run_id, str(run_dir), outage_s=60)

    def away(record, uncertain):
        raise ConnectionError("connection refused")

    logger.outbox.send, logger.outbox.answers = away, lambda: False
    log_evaluation(logger, result, rows, key="k1")
    kept = Journal(run_dir / JOURNAL_FILE).pending
    assert [r["op"] for r in kept] == ["tags", "metrics", "table", "table", "text", "tags"]
    assert logged_evaluation(run_id, "k1") is None  # nothing reached the store
    logger.outbox.outage_s = 0.0
    with pytest.raises(TrackingOutage, match=r"stopped with 6 record\(s\) kept in .*tracking_journal.jsonl"):
        logger.drain()
    logger.outbox.journal.close()

    training_run_logger(run_id, str(run_dir), outage_s=60)  # the rerun, the server back
    back = logged_evaluation(run_id, "k1")
    assert back is not None and back.records == records
    assert len(client.get_metric_history(run_id, "eval/trained/gsm8k/pass1")) == 1
    assert Journal(run_dir / JOURNAL_FILE).pending == []
