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
