"""The export folders on tiny bases in every format, with the outside libraries alone (fast tier).

One tiny Llama (untied head, norms drawn from [0.5, 1.5]) written as an NVFP4, NF4 and BF16 base; an
adapter "trained" on each by the training policy itself (``build_policy`` with ``lora.train_norms``,
random LoRA B and moved norms, ``save_adapter``), exported in float32 so the checks can be exact:

* transformers on ``merged/`` = PEFT on ``adapter/`` + ``base/`` = the training policy (logits);
* the norms reach PEFT through ``modules_to_save``: without them the logits move far;
* ``vllm_lora/`` (base with the norms, LoRA-only adapter) is the same policy again;
* ``merged_nvfp4/`` decodes, by our decoder and compressed-tensors' own, to the same tensors, and
  is the NVFP4 encoding of ``merged/``'s bf16 weights; ``merged_nf4/`` (qlora) is bitsandbytes' layout;
* an interrupted export leaves the earlier one intact and no stage behind; a missing training is one
  ``MissingTraining`` line naming the command (evaluate's too), a missing base an ``ExportInputError``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qerl_pipeline.adapter import NORMS_FILE, MissingTraining, save_adapter, trained_adapter
from qerl_pipeline.config import LoraConfig
from qerl_pipeline.export import ExportInputError, folders
from qerl_pipeline.export.quantized import decode_folder, packed_format
from qerl_pipeline.export.serve import served_export
from qerl_pipeline.quantization import checkpoint, nf4, nvfp4
from tests.helpers.exports import adapter_without_norms
from tests.helpers.models import tiny_llama

FORMATS = ("nvfp4", "nf4", "bf16")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _ids(seed=0, shape=(2, 11)):
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``{fmt: (base folder, adapter folder, the training policy)}`` for every base format."""
    from qerl_pipeline.quantization.policy import build_policy

    model = tiny_llama()
    root = tmp_path_factory.mktemp("export")
    out = {}
    for fmt in FORMATS:
        checkpoint.write_base(model, None, fmt, root / f"base_{fmt}")
        policy = build_policy(
            root / f"base_{fmt}",
            fmt,
            LoraConfig(rank=4, alpha=8, target_modules=TARGETS, train_norms=True),
            dtype=torch.float32,
        ).eval()
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
                elif p.requires_grad:  # the trained norms
                    p.mul_(1 + 0.3 * torch.randn(p.shape, generator=gen))
        adapter = save_adapter(policy, root / "adapters" / fmt, meta={"method": "qerl", "model": "tiny", "seed": 0})
        out[fmt] = (root / f"base_{fmt}", adapter, policy)
    return out


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """``{fmt: export folder}`` in float32 (exact checks)."""
    root = tmp_path_factory.mktemp("exports")
    return {
        fmt: (folders.write_export(adapter, base, root / fmt, dtype="float32"), root / fmt)[1]
        for fmt, (base, adapter, _) in trained.items()
    }


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("fmt", FORMATS)
def test_merged_equals_peft_over_base_equals_the_training_policy(trained, exported, fmt):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder, (_, _, policy), ids = exported[fmt], trained[fmt], _ids()
    merged = AutoModelForCausalLM.from_pretrained(folder / folders.MERGED, dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(folder / folders.BASE, dtype=torch.float32), folder / folders.ADAPTER
    ).eval()
    want = _logits(policy, ids)
    assert (want - _logits(merged, ids)).abs().max() < 1e-4
    assert (want - _logits(peft, ids)).abs().max() < 1e-4
    # greedy continuations agree token for token
    a = merged.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(a, peft.generate(ids, max_new_tokens=8, do_sample=False))
    manifest = json.loads((folder / folders.MANIFEST).read_text())
    assert manifest["base_format"] == fmt and manifest["trained_norms"] and manifest["dtype"] == "float32"
    assert set(manifest["folders"]) == {
        folders.ADAPTER,
        folders.BASE,
        folders.MERGED,
        folders.VLLM_LORA,
        *(folders.merged_name(q) for q in folders.formats_for(fmt)),
    }


def test_peft_applies_the_trained_norms_and_fails_without_them(trained, exported, tmp_path):
    """The norms travel as modules_to_save: the same adapter with them removed is a different policy."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder, ids = exported["nvfp4"], _ids(1)
    cfg = json.loads((folder / folders.ADAPTER / "adapter_config.json").read_text())
    norms = load_file(str(trained["nvfp4"][1] / NORMS_FILE))
    assert sorted(cfg["modules_to_save"]) == sorted(n.removesuffix(".weight") for n in norms)
    stripped = adapter_without_norms(folder / folders.ADAPTER, tmp_path / "no_norms")

    def peft(adapter):
        base = AutoModelForCausalLM.from_pretrained(folder / folders.BASE, dtype=torch.float32)
        return _logits(PeftModel.from_pretrained(base, adapter).eval(), ids)

    merged = _logits(AutoModelForCausalLM.from_pretrained(folder / folders.MERGED, dtype=torch.float32).eval(), ids)
    assert (peft(folder / folders.ADAPTER) - merged).abs().max() < 1e-4
    assert (peft(stripped) - merged).abs().max() > 1e-2


def test_vllm_lora_pair_carries_the_norms_in_the_base_and_none_in_the_adapter(exported):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder, ids = exported["nvfp4"], _ids(2)
    pair = folder / folders.VLLM_LORA
    cfg = json.loads((pair / folders.ADAPTER / "adapter_config.json").read_text())
    assert not cfg.get("modules_to_save")
    assert all(
        ".lora_A." in k or ".lora_B." in k
        for k in load_file(str(pair / folders.ADAPTER / "adapter_model.safetensors"))
    )
    served = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(pair / folders.BASE, dtype=torch.float32), pair / folders.ADAPTER
    ).eval()
    merged = AutoModelForCausalLM.from_pretrained(folder / folders.MERGED, dtype=torch.float32).eval()
    assert (_logits(served, ids) - _logits(merged, ids)).abs().max() < 1e-4


def test_merged_nvfp4_is_merged_encoded_and_decodes_like_compressed_tensors(exported):
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    folder = exported["nvfp4"]
    packed = checkpoint.read_tensors(folder / "merged_nvfp4")
    merged = checkpoint.read_tensors(folder / folders.MERGED)
    owners = [k.removesuffix(".weight_packed") for k in packed if k.endswith(".weight_packed")]
    assert len(owners) == 14  # 7 linears x 2 layers; lm_head is in quantize.ignore
    expected = nvfp4.encode_linears({o: merged[f"{o}.weight"].to(torch.bfloat16) for o in owners})
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    for owner in owners:
        sd = {s: packed[f"{owner}.{s}"] for s in nvfp4.CODEC.suffixes}
        for key, tensor in expected[owner].state_dict().items():
            assert torch.equal(sd[key].view(torch.uint8), tensor.view(torch.uint8)), (owner, key)
        theirs = NVFP4PackedCompressor.decompress(sd, scheme)["weight"]
        ours = nvfp4.decode(*sd.values(), dtype=theirs.dtype)
        assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16)), owner
    cfg = json.loads((folder / "merged_nvfp4" / "config.json").read_text())
    assert cfg["quantization_config"] == nvfp4.CODEC.checkpoint_config(["lm_head"], {})["quantization_config"]
    error = json.loads((folder / folders.MANIFEST).read_text())["weight_error"]["merged_nvfp4"]
    assert error["quantized_linears"] == 14 and 0 < error["rel_error_mean"] <= error["rel_error_max"] < 0.2


def test_merged_nf4_is_the_bitsandbytes_layout_of_merged(exported):
    folder = exported["nf4"]
    assert packed_format(folder / "merged_nf4") == "nf4" and packed_format(folder / folders.MERGED) is None
    cfg = json.loads((folder / "merged_nf4" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "bitsandbytes" and cfg["bnb_4bit_quant_type"] == "nf4"
    merged = checkpoint.read_tensors(folder / folders.MERGED)
    dense = checkpoint.read_tensors(decode_folder(folder / "merged_nf4", folder.parent / "nf4_dense"))
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(dense[name], nf4.encode(merged[name].to(torch.bfloat16), 64).decode(torch.float32))
    assert torch.equal(dense["lm_head.weight"], merged["lm_head.weight"].to(torch.bfloat16).float())
    # transformers + bitsandbytes load it as 4-bit layers holding exactly the codes and block scales bitsandbytes'
    # own quantize_4bit writes for merged/'s bf16 weights, and those layers compute what the decoded weights do
    # (bitsandbytes computes in bf16). The forward is compared on the layers whose in-width is a multiple of the
    # blocksize: on a CPU with AVX512-BF16, bitsandbytes 0.50's CPU kernels read the absmax as [out, in // 64] and
    # decode a 96-wide down_proj wrongly even from its own quantize_4bit (checked: its round trip is off by 0.13
    # there); real models' widths are multiples of 64.
    import bitsandbytes.functional as bnb_functional
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder / "merged_nf4").eval()
    decoded = dict(
        AutoModelForCausalLM.from_pretrained(folder.parent / "nf4_dense", dtype=torch.float32).named_modules()
    )
    layers = {n: m for n, m in model.named_modules() if type(m).__name__ == "Linear4bit"}
    assert len(layers) == 14 and "model.layers.1.mlp.down_proj" in layers
    compared = 0
    for owner, layer in layers.items():
        codes, state = bnb_functional.quantize_4bit(
            merged[f"{owner}.weight"].to(torch.bfloat16), blocksize=64, quant_type="nf4"
        )
        assert torch.equal(layer.weight.data.view(-1), codes.view(-1)), owner
        assert torch.equal(layer.weight.quant_state.absmax.float(), state.absmax.float()), owner
        if layer.in_features % 64 == 0:
            x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                got, want = layer(x.to(torch.bfloat16)).float(), decoded[owner](x)
            assert (got - want).abs().max() < 0.02 * want.abs().max(), owner
            compared += 1
    assert compared == 12  # all but the two down_proj (96 wide)


def test_default_dtype_is_bf16_and_the_4bit_folder_encodes_what_merged_holds(trained, tmp_path):
    base, adapter, _ = trained["bf16"]
    manifest = folders.write_export(adapter, base, tmp_path / "e")
    merged = checkpoint.read_tensors(tmp_path / "e" / folders.MERGED)
    assert manifest["dtype"] == "bfloat16" and {t.dtype for t in merged.values()} == {torch.bfloat16}
    packed = checkpoint.read_tensors(tmp_path / "e" / "merged_nvfp4")
    name = "model.layers.0.self_attn.o_proj"
    code = nvfp4.encode(merged[f"{name}.weight"])  # o_proj is alone in its fused group: its own global scale
    assert torch.equal(packed[f"{name}.weight_packed"], code.packed)


def test_served_export_decodes_a_packed_folder_on_cpu_and_serves_it_packed_on_cuda(exported):
    folder = exported["nvfp4"] / "merged_nvfp4"
    with served_export(folder, platform="cpu") as served:
        assert served.dense and served.served_format == "dense-decoded-nvfp4" and served.path != folder.resolve()
        dense = checkpoint.read_tensors(served.path)
        packed = checkpoint.read_tensors(folder)
        name = "model.layers.0.mlp.up_proj"
        code = nvfp4.NVFP4Weight(*(packed[f"{name}.{s}"] for s in nvfp4.CODEC.suffixes))
        assert torch.equal(dense[f"{name}.weight"], code.decode(torch.float32))
        copy = served.path
    assert not copy.exists()  # the dense copy lives for the block only
    with served_export(folder, platform="cuda") as served:  # the decision only: no engine starts here
        assert (
            not served.dense
            and served.path == folder.resolve()
            and served.engine_args == {"quantization": "compressed-tensors"}
        )
    with served_export(exported["nvfp4"] / folders.MERGED, platform="cpu") as served:
        assert served.dense and served.path == (exported["nvfp4"] / folders.MERGED).resolve()
    with pytest.raises(ExportInputError, match="not a model folder"):
        with served_export(exported["nvfp4"] / "nowhere"):
            pass


def test_an_interrupted_export_leaves_the_earlier_one_intact_and_no_stage(trained, tmp_path, monkeypatch):
    base, adapter, _ = trained["nvfp4"]
    out = tmp_path / "exports" / "qerl"
    folders.write_export(adapter, base, out, dtype="float32")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def broken(*args, **kwargs):
        raise RuntimeError("killed while quantizing")

    monkeypatch.setattr(folders, "requantize", broken)
    with pytest.raises(RuntimeError, match="killed while quantizing"):
        folders.write_export(adapter, base, out, dtype="bfloat16")
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert [p.name for p in out.parent.iterdir()] == ["qerl"]  # no half folder, no stage left beside it


def test_a_missing_training_names_what_is_missing_and_the_command(trained, tmp_path):
    root = tmp_path / "adapters"
    with pytest.raises(MissingTraining) as err:
        trained_adapter(root, "lora", want_seed=0)
    assert "no trained adapter for method 'lora'" in err.value.format_message()
    assert "kedro run --pipelines=train --params method=lora" in err.value.format_message()
    assert "\n" not in err.value.format_message() and isinstance(err.value, FileNotFoundError)
    with pytest.raises(MissingTraining, match=r"seed 3 .*--namespaces=compare\.qlora"):
        trained_adapter(root, "qlora", 3)
    shutil.copytree(trained["nvfp4"][1], root / "qerl")
    assert trained_adapter(root, "qerl", want_seed=0) == root / "qerl"
    with pytest.raises(MissingTraining, match=r"seed 0, not train.seed 2.*train.seed=2"):
        trained_adapter(root, "qerl", want_seed=2)
    with pytest.raises(ExportInputError, match="kedro run --pipelines=quantize --params method=qlora"):
        folders.base_folder(tmp_path, "qlora")
    # the evaluate pipeline's node says the same one line (kedro prints a ClickException as `Error: ...`)
    from qerl_pipeline.config import QerlConfig, validate
    from qerl_pipeline.pipelines.evaluate.nodes import run_evaluation

    with pytest.raises(MissingTraining, match=r"no trained adapter for method 'lora' at .*--params method=lora"):
        run_evaluation({}, tmp_path, root, validate({"method": "lora"}, QerlConfig))


def test_a_compare_branch_exports_every_seed_and_only_with_in_compare(trained, tmp_path, caplog):
    """The compare template's export nodes: one ``seed-<k>`` folder per seed of ``compare.seeds`` with
    ``export.in_compare``, nothing without it or for a method ``compare.methods`` leaves out: the branch's
    three nodes return their empty markers and its reason is logged once (by ``export_policy``)."""
    import logging

    from qerl_pipeline.config import SKIPPED_BRANCH, QerlConfig, validate
    from qerl_pipeline.pipelines.export.nodes import evaluate_exports, export_policy, report_exports

    base, adapter, _ = trained["nvfp4"]
    root = tmp_path / "adapters" / "compare" / "qerl"
    for seed in (0, 1):
        shutil.copytree(adapter, root / f"seed-{seed}")
    group = {"run_id": "the-compare-run"}
    on = {"in_compare": True, "dtype": "float32"}

    def config(export, **compare):
        return validate({"method": "qerl", "export": export, "compare": compare}, QerlConfig)

    for cfg, why in (
        (config({}, seeds=[0, 1]), "compare.qerl: export.in_compare is off, not exported"),
        (config(on, seeds=[0, 1], methods=["lora"]), "compare.qerl: not in compare.methods, skipped"),
    ):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            assert export_policy(root, base, cfg, group) == {}
            result = evaluate_exports({}, root, base, {}, cfg, eval_result={})
            report = report_exports(result, {}, root, cfg, group)
        assert result[SKIPPED_BRANCH] == report[SKIPPED_BRANCH] == why and result["records"] == []
        assert caplog.text.count(why) == 1
    out = export_policy(root, base, config(on, seeds=[0, 1]), group)
    assert sorted(out) == ["seed-0", "seed-1"]
    for folder in map(Path, out.values()):
        assert (folder / folders.MERGED / "config.json").is_file() and (
            folder / "merged_nvfp4" / "config.json"
        ).is_file()
    with pytest.raises(MissingTraining, match=r"seed 2 .*--namespaces=compare\.qerl"):
        export_policy(root, base, config(on, seeds=[0, 2]), group)


def test_a_version_registered_by_reference_generates_from_the_folder(tiny_model_dir, sqlite_store):
    """``export.log_weights: false``: the run holds a small pyfunc model (no weights) that generates with the
    folder where it lies; ``mlflow.pyfunc.load_model("models:/...")`` needs nothing of this project."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from qerl_pipeline.export.registry import register_export

    mlflow.set_experiment("export")
    run = mlflow.start_run()
    mlflow.end_run()
    got = register_export(
        tiny_model_dir, run.info.run_id, "random-qerl", {"method": "qerl", "seed": 0}, log_weights=False
    )
    assert got["model_uri"] == "models:/random-qerl/1" and not got["log_weights"]
    client = MlflowClient()
    version = client.get_model_version("random-qerl", "1")
    assert version.run_id == run.info.run_id and version.tags == {"method": "qerl", "seed": "0"}
    local = Path(mlflow.artifacts.download_artifacts(got["source"]))
    files = [p.name for p in local.rglob("*") if p.is_file()]
    assert "MLmodel" in files and not any(f.endswith(".safetensors") for f in files)
    texts = mlflow.pyfunc.load_model(got["model_uri"]).predict(["What is 3 + 4?", "Half of 9?"], params=None)
    assert len(texts) == 2 and all(isinstance(t, str) and t for t in texts)
    again = register_export(tiny_model_dir, run.info.run_id, "random-qerl", {"method": "qerl"}, log_weights=False)
    assert again["version"] == 2 and again["source"] != got["source"]  # each export its own artifact: v1 unchanged
