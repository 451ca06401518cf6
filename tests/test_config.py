"""Parameter validation: every shipped env validates; bad values fail naming the field."""

from __future__ import annotations

import pytest
import yaml
from kedro.config import OmegaConfigLoader

from qerl_pipeline.config import AQNConfig, ConfigError, QerlConfig, flatten, validate
from qerl_pipeline.profile import engine_env, load_profile
from tests.helpers.project import PROJECT, project_copy, run_kedro

ENVS = sorted(p.name for p in (PROJECT / "conf").iterdir() if p.is_dir() and p.name not in ("base", "local"))


def _params(env: str) -> dict:
    from qerl_pipeline import settings

    loader = OmegaConfigLoader(
        conf_source=str(PROJECT / "conf"),
        env=env,
        **{k: v for k, v in settings.CONFIG_LOADER_ARGS.items() if k != "default_run_env"},
    )
    return dict(loader["parameters"])


def test_shipped_envs_exist():
    assert {"smoke", "paper_gsm8k_7b", "paper_bigmath_7b", "paper_bigmath_14b", "paper_bigmath_32b"} <= set(ENVS)


@pytest.mark.parametrize("env", ["base", *ENVS])
def test_every_env_validates(env):
    cfg = validate(_params(env))
    assert isinstance(cfg, QerlConfig)


def test_smoke_overlays_base_softly():
    base, smoke = validate(_params("base")), validate(_params("smoke"))
    assert smoke.model.source == "random" and base.model.source == "auto"
    # keys smoke does not touch keep base's values
    assert smoke.grpo.clip_eps_high == base.grpo.clip_eps_high
    assert smoke.data.sources["math500"].hub_id == "HuggingFaceH4/MATH-500"


def _base() -> dict:
    return yaml.safe_load((PROJECT / "conf/base/parameters.yml").read_text())


@pytest.mark.parametrize(
    "edit, field, expected",
    [
        (lambda p: p["optim"]["lr"].update(qerl=-1e-5), "optim", "lr.qerl must be > 0"),
        (lambda p: p["grpo"].update(num_generations=1), "grpo.num_generations", "greater than or equal to 2"),
        (lambda p: p["aqn"].update(sigma_start=1e-4, sigma_end=1e-2), "aqn", "sigma_end"),
        (
            lambda p: p.update(method="qat"),
            "method",
            "'qerl', 'qerl_noaqn', 'qlora', 'lora', 'lora_aqn', 'mxfp4', 'mxfp4_noaqn' or 'fp8'",
        ),
        (lambda p: p["train"].update(steps="many"), "train.steps", "valid integer"),
        (lambda p: p["rollout"].update(temprature=0.7), "rollout.temprature", "Extra inputs are not permitted"),
        (
            lambda p: p["grpo"].update(loss_type="mean"),
            "grpo.loss_type",
            "registered: grpo, bnpo, dr_grpo, dapo, cispo",
        ),
        (lambda p: p.update(unknown_section={}), "unknown_section", "Extra inputs"),
        (lambda p: p["reward"].update(format_style="tags"), "reward.format_style", "'think_answer' or 'answer_line'"),
        (lambda p: p["data"].update(system_prompt=None), "<root>", "reward.format_style: 'answer_line'"),
        (lambda p: p["evaluate"].update(adapter_mode="fused"), "evaluate.adapter_mode", "'auto', 'lora' or 'merged'"),
        (
            lambda p: (p["model"].update(max_seq_len=512), p["rollout"].update(max_new_tokens=600)),
            "<root>",
            "rollout.max_new_tokens (600) must be below model.max_seq_len (512): the prompt budget, max_seq_len - "
            "max_new_tokens, is -88 tokens",
        ),
    ],
)
def test_bad_values_name_the_field(edit, field, expected):
    params = _base()
    edit(params)
    with pytest.raises(ConfigError) as err:
        validate(params)
    msg = str(err.value)
    assert f"  {field}: " in msg, msg
    assert expected in msg, msg


def test_aqn_enabled_by_method():
    p = _base()
    assert validate({**p, "method": "qerl"}).aqn_enabled()
    assert not validate({**p, "method": "qerl_noaqn"}).aqn_enabled()
    assert not validate({**p, "method": "lora"}).aqn_enabled()
    assert validate({**p, "method": "lora_aqn"}).aqn_enabled()  # BF16 + AQN: the noise-without-quantization arm
    assert (
        validate({**p, "method": "lora_aqn"}).optim.lr["lora_aqn"]
        == validate({**p, "method": "lora"}).optim.lr["lora"]
    )
    p["aqn"]["enabled"] = True
    assert validate({**p, "method": "lora"}).aqn_enabled()
    with pytest.raises(ConfigError):
        validate({"sigma_start": 1e-3, "sigma_end": 1e-2}, AQNConfig)


def test_flatten():
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": [1]}) == {"a.b": 1, "a.c.d": 2, "e": [1]}


def test_profile_is_read(tmp_path, monkeypatch):
    prof = load_profile(PROJECT / ".kedro.yml")
    assert prof["backend"] in ("auto", "cpu", "cuda")
    f = tmp_path / ".kedro.yml"
    f.write_text("backend: cpu\nengine_env:\n  VLLM_CPU_KVCACHE_SPACE: '3'\n  VLLM_CPU_OMP_THREADS_BIND: auto\n")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    env = engine_env(f)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] != "auto"
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "5")
    assert engine_env(f)["VLLM_CPU_KVCACHE_SPACE"] == "5"
    f.write_text("backend: tpu\n")
    with pytest.raises(ValueError, match="backend must be one of"):
        load_profile(f)


@pytest.mark.kedro_run
def test_kedro_run_rejects_bad_params_before_any_node(tmp_path):
    """The hook validates the whole tree at run start: no node (no model load) runs."""
    root = project_copy(tmp_path / "project")
    out = run_kedro(
        root,
        "run",
        "--pipeline=data_prep",
        "--env=smoke",
        "--params",
        "grpo.num_generations=1",
        timeout=300,
        check=False,
    )
    assert out.returncode != 0
    assert "grpo.num_generations" in out.stdout, out.stdout[-3000:]
    assert "Running node" not in out.stdout and "Completed node" not in out.stdout


def test_trainer_logprob_combinations_are_refused():
    """Training rollouts: the trainer's log-probs are the full softmax at the temperature."""
    with pytest.raises(ConfigError, match=r"rollout: Value error, top_p 0.9: training rollouts need top_p 1.0"):
        validate({"rollout": {"top_p": 0.9}}, QerlConfig)
    with pytest.raises(ConfigError, match=r"raw_logprobs' with temperature 0.7"):
        validate({"rollout": {"logprobs_mode": "raw_logprobs", "temperature": 0.7}}, QerlConfig)
    validate({"rollout": {"logprobs_mode": "raw_logprobs", "temperature": 1.0}}, QerlConfig)
    validate({"evaluate": {"top_p": 0.95}}, QerlConfig)  # evaluation keeps its own nucleus sampling
    assert QerlConfig().model.norm_dtype == "float32"
