"""The training loop end to end: real Kedro runs (smoke env), real vLLM, real MLflow (SQLite).

One module, few runs, shared between assertions (each run starts a vLLM engine, ~45 s):

1. ``reference``: an uninterrupted ``kedro run --pipeline=train --env smoke``.
2. ``resumed``: the same run with another output dir, SIGKILLed right after its first
   checkpoint, then started again: it resumes and must end with the reference's adapter.
3. an in-process run on the same base whose loss is made NaN at step 3.

A random tiny model never earns a math reward (no ``<answer>`` tags) and never stops
before the length cap, so every advantage would be 0 and the adapter would never move:
resume equivalence would hold trivially. So the runs use a tiny model edited to stop
after a varying number of tokens, with DAPO's overlong shaping over the whole length
(reward -length/cap): groups have unequal rewards and the adapter really trains.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.kedro_run]

STEPS = 4
# DAPO overlong shaping with a buffer as long as the cap: reward = -length / max_new_tokens (smoke: 24),
# a signal the stopping model below produces in every group.
PARAMS = ("train.steps={steps},train.checkpoint_every=2,train.output_dir={out},model.source=local,model.name={model},"
          "grpo.overlong.enabled=true,grpo.overlong.buffer_tokens=24,rollout.max_new_tokens=24")


def _stopping_model(folder: Path, eos_boost: float = 0.2) -> Path:
    """A random tiny model edited so that it ends completions early with varying lengths.

    Every token embedding gets the same constant (1.0) in dimension 0, so after the final
    RMSNorm the hidden state has a large, consistent component there; the (tied) EOS row
    gets ``eos_boost`` more, which lifts only EOS's logit. At 0.2, 16 samples of 24
    tokens end after 1..24 tokens (measured), so the length-based reward differs within
    groups.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl_pipeline.models import tiny_model_folder

    tiny_model_folder(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:, 0] = 1.0
        emb[tok.eos_token_id, 0] = 1.0 + eos_boost
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def stopping_model(tmp_path_factory) -> Path:
    return _stopping_model(tmp_path_factory.mktemp("stopping") / "model")


@pytest.fixture(scope="module")
def tracking(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def _kedro(project: Path, out: Path, model: Path, tracking: str) -> subprocess.Popen:
    env = dict(os.environ, MLFLOW_TRACKING_URI=tracking, KEDRO_DISABLE_TELEMETRY="true", PYTHONUNBUFFERED="1")
    cmd = [str(Path(sys.executable).parent / "kedro"), "run", "--pipeline=train", "--env", "smoke",
           "--params", PARAMS.format(steps=STEPS, out=out, model=model)]
    log = open(out.parent / f"{out.name}.log", "ab")
    return subprocess.Popen(cmd, cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, out: Path, timeout: float = 420) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert rc == 0, (out.parent / f"{out.name}.log").read_text()[-6000:]


def _adapter(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def _run_for(client, out: Path):
    """The MLflow run the trainer logged to (its id is in the newest checkpoint)."""
    from qerl_pipeline.rl import checkpoint as ckpt

    state = ckpt.peek_state(ckpt.find_latest(out / "qerl"))
    return client.get_run(state["run_id"])


@pytest.fixture(scope="module")
def reference(project_path, stopping_model, tracking, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "out"
    _finish(_kedro(project_path, out, stopping_model, tracking), out)
    return out


@pytest.fixture(scope="module")
def resumed(project_path, stopping_model, tracking, tmp_path_factory) -> tuple[Path, bool]:
    out = tmp_path_factory.mktemp("resume") / "out"
    proc = _kedro(project_path, out, stopping_model, tracking)
    first = out / "qerl" / "checkpoints" / "step-000002" / "meta.json"
    deadline = time.monotonic() + 420
    while not first.exists():
        assert proc.poll() is None, (out.parent / "out.log").read_text()[-6000:]
        assert time.monotonic() < deadline, "no checkpoint within the time limit"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # kedro and its children in that group; the engine exits on EOF
    proc.wait(timeout=30)
    killed_mid_run = not (out / "qerl" / "final_adapter").exists()
    _finish(_kedro(project_path, out, stopping_model, tracking), out)
    return out, killed_mid_run


def test_reference_run_trains_and_logs(reference, tracking):
    from mlflow.tracking import MlflowClient

    from qerl_pipeline.config import AQNConfig
    from qerl_pipeline.rl import aqn

    run_dir = reference / "qerl"
    adapter = _adapter(run_dir / "final_adapter")
    lora_b = [t for k, t in adapter.items() if "lora_B" in k]
    assert lora_b and any(float(t.abs().max()) > 0 for t in lora_b), "the adapter never moved from its zero init"
    client = MlflowClient(tracking)
    run = _run_for(client, reference)
    assert run.info.status == "FINISHED"
    assert run.data.tags["method"] == "qerl" and run.data.tags["dataset"] == "generator"
    assert run.data.tags["git_commit"] and run.data.tags["model"]
    for key in ("reward/mean", "reward/std", "reward/accuracy", "reward/format", "policy/entropy", "policy/kl_to_base",
                "policy/clip_fraction", "mismatch/kl", "completion/length", "groups/zero_std_fraction", "aqn/sigma",
                "optim/lr", "rollout/tokens_per_s", "time/update_s", "memory/peak_gb"):
        hist = client.get_metric_history(run.info.run_id, key)
        assert sorted(m.step for m in hist) == list(range(1, STEPS + 1)), key
    # the stopping model gives groups with unequal rewards: the loss had a signal
    stds = [m.value for m in client.get_metric_history(run.info.run_id, "reward/std")]
    assert max(stds) > 0
    # sigma follows the schedule of the smoke config (stage 0 = 0, then decaying)
    from qerl_pipeline.config import validate
    import yaml

    params = yaml.safe_load((Path(__file__).parents[1] / "conf/base/parameters.yml").read_text())["aqn"]
    params.update(yaml.safe_load((Path(__file__).parents[1] / "conf/smoke/parameters.yml").read_text()).get("aqn", {}))
    cfg = validate(params, AQNConfig)
    sig = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "aqn/sigma")}
    assert sig == {s + 1: pytest.approx(aqn.sigma_at(s, STEPS, cfg)[1]) for s in range(STEPS)}
    assert sig[1] == 0.0
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"final_adapter", "completions", "config"} <= artifacts
    tables = client.list_artifacts(run.info.run_id, "completions")
    assert tables and all(t.path.endswith(".json") for t in tables)


def test_resume_after_sigkill_matches_uninterrupted(reference, resumed, tracking):
    from mlflow.tracking import MlflowClient

    out, killed_mid_run = resumed
    assert killed_mid_run, "the run finished before it could be killed"
    ref, res = _adapter(reference / "qerl" / "final_adapter"), _adapter(out / "qerl" / "final_adapter")
    assert ref.keys() == res.keys()
    for key in ref:
        torch.testing.assert_close(res[key], ref[key], rtol=1e-4, atol=1e-6, msg=key)
    client = MlflowClient(tracking)
    run = _run_for(client, out)
    assert run.data.tags.get("qerl.resumed_at_step") == "2"
    assert run.info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "reward/mean"))
    assert steps == list(range(1, STEPS + 1))  # one run: steps before and after the kill
    ref_rewards = [m.value for m in sorted(client.get_metric_history(_run_for(client, reference).info.run_id, "reward/mean"), key=lambda m: m.step)]
    res_rewards = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "reward/mean"), key=lambda m: m.step)]
    assert res_rewards == pytest.approx(ref_rewards)


def test_nan_loss_stops_with_step_and_marks_run_failed(reference, stopping_model, tracking, tmp_path, monkeypatch):
    import mlflow
    from mlflow.tracking import MlflowClient

    from qerl_pipeline.config import QerlConfig
    from qerl_pipeline.rl import checkpoint as ckpt
    from qerl_pipeline.rl import trainer
    from qerl_pipeline.tracking import MlflowLogger

    mlflow.set_tracking_uri(tracking)
    base = Path(json.loads(Path(_latest_summary(reference)).read_text())["base_dir"])
    records = [
        {"id": str(i), "messages": [{"role": "user", "content": f"What is {i} plus {i}?"}], "gold": str(2 * i)}
        for i in range(1, 9)
    ]
    cfg = QerlConfig.model_validate({
        "model": {"source": "local", "name": str(stopping_model), "max_seq_len": 512},
        "lora": {"rank": 4, "alpha": 8}, "rollout": {"max_new_tokens": 16},
        "grpo": {"num_generations": 2, "overlong": {"enabled": True, "buffer_tokens": 16}},
        "train": {"steps": 4, "prompts_per_step": 2, "checkpoint_every": 2, "output_dir": str(tmp_path)},
    })
    real_update, real_loss = trainer._update, trainer.grpo.policy_loss

    def nan_loss(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        return loss * float("nan"), stats

    def update(*args, **kwargs):
        if args[-1] == 2:  # 0-based step 2 = step 3
            monkeypatch.setattr(trainer.grpo, "policy_loss", nan_loss)
        return real_update(*args, **kwargs)

    monkeypatch.setattr(trainer, "_update", update)
    loggers = []

    def make_logger(run_id):
        loggers.append(MlflowLogger(run_id))
        return loggers[-1]

    with pytest.raises(trainer.TrainingDiverged, match=r"at step 3\b"):
        trainer.train(cfg, base, records, make_logger=make_logger, progress=False)
    run = MlflowClient(tracking).get_run(loggers[0].run_id)
    assert run.info.status == "FAILED"
    assert "step 3" in run.data.tags["qerl.failure"]
    latest = ckpt.find_latest(tmp_path / "qerl")
    assert latest is not None and latest.name == "step-000002"  # the last good state is kept
    assert not (tmp_path / "qerl" / "final_adapter").exists()
    mlflow.end_run("FAILED")  # the fluent run MlflowLogger(None) opened in this process


def _latest_summary(out: Path) -> Path:
    """The train_summary written by the reference run (its base_dir is the smoke base)."""
    root = Path(__file__).parents[1] / "data/08_reporting/smoke/train_summary.json"
    versions = sorted(root.iterdir())
    for v in reversed(versions):
        path = v / "train_summary.json"
        if json.loads(path.read_text()).get("run_dir") == str(out / "qerl"):
            return path
    raise AssertionError(f"no train_summary for {out}")
