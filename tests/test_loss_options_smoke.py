"""Smoke training runs of the loss options, on real vLLM: every ``grpo.is_mode``, GSPO, entropy
selection, every ``grpo.loss_type`` (dapo, the default, in the is_mode runs; grpo in GSPO's; the
other six each in a run of its own, one of them with the entropy bonus; one registered by the test
itself), and method ``lora_aqn``
(AQN on a BF16 base).

The smoke env's settings (conf/base + conf/smoke parameters, merged as Kedro's soft merge
does), 2 steps each, one BF16 base and one engine shared by the runs (``train(engine=...)``,
as compare's shared engines): each run is the trainer's loop end to end (rollout, rewards,
update, adapter sync) and must finish and log what its option promises. The math reward
never fires on a random model, so the runs use the custom-reward hook
(``tests.helpers.rewards:letter_fraction``) and their advantages are not all zero.
The values are unit-tested against hand computations and TRL in test_grpo.py,
test_trl_oracle.py and test_policy_update.py; here the options meet a live engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.project import PROJECT
from tests.helpers.rewards import letter_fraction

pytestmark = [pytest.mark.vllm]

STEPS = 2  # step 2 is in a stage with sigma > 0 (smoke: 5 stages over 2 steps)
IS_MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none"]


def _smoke_params(tmp: Path, **over) -> dict:
    from omegaconf import OmegaConf

    base = yaml.safe_load((PROJECT / "conf/base/parameters.yml").read_text())
    smoke = yaml.safe_load((PROJECT / "conf/smoke/parameters.yml").read_text())
    merged = OmegaConf.to_container(OmegaConf.merge(base, smoke))
    merged["train"].update(steps=STEPS, output_dir=str(tmp), checkpoint_every=STEPS)
    for key, value in over.items():
        if isinstance(value, dict):
            merged.setdefault(key, {}).update(value)
        else:
            merged[key] = value
    return merged


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A BF16 smoke base and one engine on it, shared by the module's runs."""
    from qerl_pipeline.config import QerlConfig
    from qerl_pipeline.pipelines.quantize.nodes import quantize_format
    from qerl_pipeline.rollout.serving import open_engine, served_model

    work = tmp_path_factory.mktemp("loss_options")
    cfg = QerlConfig.model_validate(_smoke_params(work))
    folder, _ = quantize_format(cfg.model, cfg.quantize, work / "bases", fmt="bf16")
    served = served_model(Path(folder), "bf16", platform="cpu")
    engine = open_engine(served, cfg.model, rollout=cfg.rollout, lora_rank=cfg.lora.rank)
    records = [
        {"id": str(i), "messages": [{"role": "user", "content": f"What is {i} plus {i}?"}], "gold": str(2 * i)}
        for i in range(1, 9)
    ]
    try:
        yield work, Path(folder), engine, records
    finally:
        engine.close()


def _train(setup, name: str, **over):
    from qerl_pipeline.config import QerlConfig
    from qerl_pipeline.rl import trainer
    from qerl_pipeline.rl.run_setup import Reporting
    from qerl_pipeline.tracking import MemoryLogger

    work, base, engine, records = setup
    cfg = QerlConfig.model_validate(_smoke_params(work / name, **{"method": "lora", **over}))
    logger = MemoryLogger()
    result = trainer.train(
        cfg,
        base,
        records,
        engine=engine,
        reporting=Reporting(make_logger=lambda _rid: logger, progress=False),
        reward_fn=letter_fraction,
    )
    assert result.steps == STEPS and (result.adapter_dir / "adapter_model.safetensors").exists()
    steps = {m["step"] for m in result.history}
    assert steps == set(range(1, STEPS + 1))
    return result.history, logger


@pytest.mark.parametrize("mode", IS_MODES)
def test_each_is_mode_finishes_and_logs_its_fraction(setup, mode):
    history, _ = _train(setup, f"is_{mode}", grpo={"is_mode": mode})
    for row in history:
        if mode == "none":
            assert "mismatch/is_masked_fraction" not in row and "mismatch/is_clipped_fraction" not in row
            continue
        for key in ("mismatch/is_masked_fraction", "mismatch/is_clipped_fraction"):
            assert 0.0 <= row[key] <= 1.0, (key, row[key])
        assert 0.0 < row["mismatch/is_ratio_min"] <= row["mismatch/is_ratio_mean"] <= row["mismatch/is_ratio_max"]
        # the other kind of correction did nothing
        other = "mismatch/is_clipped_fraction" if mode.endswith("mask") else "mismatch/is_masked_fraction"
        assert row[other] == 0.0
        assert row["mismatch/kl"] >= 0.0


def test_gspo_runs_and_its_ratios_move(setup):
    history, _ = _train(
        setup, "gspo", grpo={"importance_sampling_level": "sequence", "loss_type": "grpo", "updates_per_rollout": 2}
    )
    assert all(0.0 <= row["policy/clip_fraction"] <= 1.0 for row in history)
    assert any(row["optim/grad_norm"] > 0 for row in history)


#: the loss types beyond the default (dapo) and GSPO's grpo, each with a setting that makes its run tell:
#: bnpo over two micro-batches (else it is dapo), luspo at GSPO's sequence level (its paper's), vespo with a
#: token IS mode (it refuses sequence ones), sapo with the entropy bonus (the entropy's gradient on a live update)
LOSS_TYPE_RUNS = {
    "bnpo": {"train": {"micro_batch_size": 2}},
    "dr_grpo": {},
    "cispo": {},
    "sapo": {"grpo": {"entropy_coef": 0.01}},
    "luspo": {"grpo": {"importance_sampling_level": "sequence"}},
    "vespo": {"grpo": {"is_mode": "token_mask"}},
}


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPE_RUNS))
def test_each_loss_type_trains(setup, loss_type):
    over = {k: dict(v) for k, v in LOSS_TYPE_RUNS[loss_type].items()}
    over.setdefault("grpo", {})["loss_type"] = loss_type
    history, logger = _train(setup, f"loss_{loss_type}", **over)
    assert yaml.safe_load(logger.artifacts["config/resolved_config.yaml"])["grpo"]["loss_type"] == loss_type
    assert all(torch.isfinite(torch.tensor(row["loss"])) for row in history)
    assert all(0.0 <= row["policy/clip_fraction"] <= 1.0 for row in history)
    assert any(row["optim/grad_norm"] > 0 for row in history)


def test_a_loss_type_registered_in_this_file_trains(setup, monkeypatch):
    """A loss type of this file's own (REINFORCE, -A logp, token mean), registered for this test only: the trainer's
    loop runs it end to end on the live engine under its name (rl/losses.py is the one place a loss is added)."""
    from qerl_pipeline.rl import losses

    monkeypatch.setattr(losses, "LOSSES", dict(losses.LOSSES))

    @losses.register_loss("reinforce", aggregation="token")
    def reinforce(t: losses.LossTerms, options) -> losses.TokenLoss:
        """-A logp over the tokens."""
        return losses.TokenLoss(-t.advantages * t.logp)

    history, logger = _train(setup, "loss_reinforce", grpo={"loss_type": "reinforce"})
    assert yaml.safe_load(logger.artifacts["config/resolved_config.yaml"])["grpo"]["loss_type"] == "reinforce"
    assert all(torch.isfinite(torch.tensor(row["loss"])) for row in history)
    assert all(row["policy/clip_fraction"] == 0.0 for row in history)  # it declares no clip
    assert any(row["optim/grad_norm"] > 0 for row in history)


def test_entropy_selection_trains_on_the_top_fraction(setup):
    history, _ = _train(setup, "entropy", grpo={"top_entropy_quantile": 0.2})
    for row in history:
        assert 0.0 < row["policy/selected_token_fraction"] <= 0.5, row["policy/selected_token_fraction"]
        assert row["policy/entropy_threshold"] > 0.0


def test_sync_merge_serves_the_step_adapter_and_adapter_sync_starts_clean(setup):
    """rollout.sync on CPU: auto merges (the engine's linears are then W + s B A of the last rollout's adapter);
    a later run with adapter (LoRARequests) on the same engine first serves the clean linears again, so its
    step 1 (B = 0) samples exactly what the merge run's step 1 sampled."""
    from safetensors.torch import load_file

    from qerl_pipeline.quantization.checkpoint import serving_dir
    from qerl_pipeline.rollout.engine import merged_weights

    work, base, engine, _records = setup
    merged_hist, merged_log = _train(setup, "sync_auto")
    assert merged_log.tags["rollout.sync"] == "merge"
    checkpoint = {}
    for f in sorted(serving_dir(base).glob("*.safetensors")):
        checkpoint.update(load_file(str(f)))
    last = work / "sync_auto" / "lora" / "adapters" / f"step-{STEPS - 1:06d}"  # the last rollout's adapter
    expected = merged_weights(checkpoint, last)
    names = sorted(expected)[:4]
    served = engine.read_weights(names)
    for n in names:
        torch.testing.assert_close(served[n], expected[n].to(served[n].dtype), rtol=0, atol=1e-6)
        assert not torch.equal(served[n], checkpoint[n].to(served[n].dtype))  # the adapter is in there

    adapter_hist, adapter_log = _train(setup, "sync_adapter", rollout={"sync": "adapter"})
    assert adapter_log.tags["rollout.sync"] == "adapter"
    assert merged_hist[0]["reward/mean"] == adapter_hist[0]["reward/mean"]
    assert merged_hist[0]["completion/length"] == adapter_hist[0]["completion/length"]
    served = engine.read_weights(names)
    assert all(torch.equal(served[n], checkpoint[n].to(served[n].dtype)) for n in names)


def test_lora_aqn_puts_noise_on_a_bf16_base(setup):
    """method lora_aqn: AQN on (aqn.enabled null), the base BF16, sigma > 0 and served
    (last: it leaves noisy norms)."""
    history, logger = _train(setup, "lora_aqn", method="lora_aqn")
    assert logger.tags["method"] == "lora_aqn" and logger.tags["rollout.served_format"] == "bf16"
    sigma = [row["aqn/sigma"] for row in history]
    assert max(sigma) > 0, sigma
    assert max(row["aqn/sigma_effective"] for row in history) > 0  # the engine serves the noise
