"""quantization/store.py on a tiny local model: reuse when the fingerprint matches, rewrite (saying why) when not.

"Untouched" is checked on every file of the base: same inode, same mtime_ns, same size (a
rewrite, even of identical bytes, makes new files: new inodes). The log line of each
decision is checked, since saying what happened is part of the contract.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from qerl_pipeline.config import ModelConfig, QuantizeConfig
from qerl_pipeline.datasets.hf_model_folder import HFModelFolderDataset
from qerl_pipeline.quantization import formats, store
from tests.helpers.files import rewritten, snapshot

LOGGER = "qerl_pipeline.quantization.store"


@pytest.fixture()
def model(tiny_model_dir) -> ModelConfig:
    return ModelConfig(source="local", name=str(tiny_model_dir))


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4"])
def test_same_settings_reuse_every_file_untouched(model, tmp_path, caplog, fmt):
    folder = tmp_path / "bases" / f"base_{fmt}"
    caplog.set_level(logging.INFO, logger=LOGGER)
    got, first, reused = store.ensure_base(model, QuantizeConfig(), fmt, folder)
    assert got == folder and not reused and first["reused"] is False
    assert any(f"base_{fmt} quantized into {folder}: no base there yet" in m for m in _messages(caplog))
    assert store.stored_fingerprint(folder)["digest"] == first["fingerprint"]
    before = snapshot(folder)
    caplog.clear()
    got, second, reused = store.ensure_base(model, QuantizeConfig(), fmt, folder)
    assert reused and second["reused"] is True and got == folder
    assert snapshot(folder) == before
    # the stored report comes back, the same numbers as when it was written
    assert {k: v for k, v in second.items() if k != "reused"} == {k: v for k, v in first.items() if k != "reused"}
    digest = first["fingerprint"][:12]
    assert (
        f"base_{fmt} reused: {folder} (fingerprint {digest}, same model and quantize settings; "
        "quantize.force=true redoes it)"
    ) in _messages(caplog)
    # nothing left beside the folder (staging folders are removed)
    assert [p.name for p in folder.parent.iterdir()] == [f"base_{fmt}"]


def test_force_rewrites(model, tmp_path, caplog):
    folder = tmp_path / "base_nvfp4"
    store.ensure_base(model, QuantizeConfig(), "nvfp4", folder)
    caplog.set_level(logging.INFO, logger=LOGGER)
    for kwargs, quantize in (({"force": True}, QuantizeConfig()), ({}, QuantizeConfig(force=True))):
        before = snapshot(folder)
        caplog.clear()
        _, report, reused = store.ensure_base(model, quantize, "nvfp4", folder, **kwargs)
        assert not reused and report["reused"] is False
        assert rewritten(before, snapshot(folder))
        assert any("base_nvfp4 quantized into" in m and "quantize.force=true" in m for m in _messages(caplog))
    assert [p.name for p in folder.parent.iterdir()] == ["base_nvfp4"]


@pytest.mark.parametrize(
    ("fmt", "change", "key"),
    [
        ("nvfp4", {"quantize": {"ignore": ["lm_head", "q_proj"]}}, "quantize.ignore"),
        ("nf4", {"quantize": {"nf4_blocksize": 32}}, "quantize.nf4_blocksize"),
        ("nvfp4", {"model": {"revision": "v2"}}, "model.revision"),
    ],
)
def test_relevant_change_rewrites_and_names_it(model, tmp_path, caplog, fmt, change, key):
    folder = tmp_path / f"base_{fmt}"
    store.ensure_base(model, QuantizeConfig(), fmt, folder)
    before = snapshot(folder)
    new_model = model.model_copy(update=change.get("model", {}))
    new_quantize = QuantizeConfig(**change.get("quantize", {}))
    caplog.set_level(logging.INFO, logger=LOGGER)
    caplog.clear()  # the first write's line, when an earlier test left the logger at INFO
    _, report, reused = store.ensure_base(new_model, new_quantize, fmt, folder)
    assert not reused
    assert rewritten(before, snapshot(folder))
    (msg,) = [m for m in _messages(caplog) if "quantized into" in m]
    assert "different fingerprint: " in msg and key in msg
    assert store.stored_fingerprint(folder)["digest"] == report["fingerprint"]
    cfg = json.loads((folder / "config.json").read_text())
    if key == "quantize.ignore":
        assert any(n.endswith("q_proj") for n in cfg["quantization_config"]["ignore"])
    if key == "quantize.nf4_blocksize":
        assert cfg["qerl_quantization"]["blocksize"] == 32
    # and the new settings are reused from now on
    assert store.ensure_base(new_model, new_quantize, fmt, folder)[2]


@pytest.mark.parametrize(
    ("fmt", "quantize"),
    [("nvfp4", {"nf4_blocksize": 32}), ("bf16", {"ignore": ["lm_head", "q_proj"], "nf4_blocksize": 128})],
)
def test_irrelevant_change_reuses(model, tmp_path, fmt, quantize):
    folder = tmp_path / f"base_{fmt}"
    store.ensure_base(model, QuantizeConfig(), fmt, folder)
    before = snapshot(folder)
    assert store.ensure_base(model, QuantizeConfig(**quantize), fmt, folder)[2]
    assert snapshot(folder) == before


def test_half_written_or_damaged_folder_is_rewritten(model, tmp_path, caplog):
    folder = tmp_path / "base_nf4"
    store.ensure_base(model, QuantizeConfig(), "nf4", folder)
    caplog.set_level(logging.INFO, logger=LOGGER)
    (folder / store.STAMP).unlink()  # as a crash between the weights and the stamp would leave it
    before = snapshot(folder)
    assert not store.ensure_base(model, QuantizeConfig(), "nf4", folder)[2]
    assert rewritten(before, snapshot(folder))
    assert any("no fingerprint file (qerl_base.json)" in m for m in _messages(caplog))
    # a weight file cut short under a valid stamp
    with (folder / "model.safetensors").open("r+b") as fh:
        fh.truncate(100)
    caplog.clear()
    assert not store.ensure_base(model, QuantizeConfig(), "nf4", folder)[2]
    assert any("damaged folder: model.safetensors: size mismatch: 100 bytes" in m for m in _messages(caplog))
    assert store.ensure_base(model, QuantizeConfig(), "nf4", folder)[2]
    # a stamp that is not JSON
    (folder / store.STAMP).write_text("{not json")
    caplog.clear()
    assert not store.ensure_base(model, QuantizeConfig(), "nf4", folder)[2]
    assert any("its stamp is unreadable" in m for m in _messages(caplog))


def test_changed_local_model_is_not_reused(tiny_model_dir, tmp_path, caplog):
    src = shutil.copytree(tiny_model_dir, tmp_path / "model")
    model = ModelConfig(source="local", name=str(src))
    folder = tmp_path / "base_bf16"
    store.ensure_base(model, QuantizeConfig(), "bf16", folder)
    cfg = json.loads((src / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5 if cfg.get("rms_norm_eps") != 1e-5 else 1e-6
    (src / "config.json").write_text(json.dumps(cfg))
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert not store.ensure_base(model, QuantizeConfig(), "bf16", folder)[2]
    assert any("model.files.config.json.sha256" in m for m in _messages(caplog))
    assert json.loads((folder / "config.json").read_text())["rms_norm_eps"] == cfg["rms_norm_eps"]


def test_fingerprint_holds_only_what_the_format_depends_on(model, tmp_path):
    q = QuantizeConfig()
    nvfp4 = store.base_fingerprint(model, q, "nvfp4")
    assert nvfp4 == store.base_fingerprint(model.model_dump(), q.model_dump(), "nvfp4")  # dicts or configs
    assert json.loads(json.dumps(nvfp4)) == nvfp4 and len(nvfp4["digest"]) == 64
    assert nvfp4["quantize"] == {"ignore": ["lm_head"], "nvfp4_algorithm": "rtn"}
    assert nvfp4["codec_version"] == formats.get("nvfp4").version and nvfp4["serving_dtype"] == "float32"
    assert nvfp4["model"]["resolved"] == "local" and "config.json" in nvfp4["model"]["files"]
    assert set(nvfp4["model"]["files"]["model.safetensors"]) == {"size"}  # weights: name and size, not read
    assert store.base_fingerprint(model, q, "bf16")["quantize"] == {}
    assert store.base_fingerprint(model, q, "nf4")["quantize"]["nf4_blocksize"] == 64
    # the ignore list is a set: order and repeats do not matter
    same = QuantizeConfig(ignore=["lm_head", "lm_head"])
    assert store.base_fingerprint(model, same, "nvfp4")["digest"] == nvfp4["digest"]
    # serving dtype and the format change the digest
    assert (
        store.base_fingerprint(model.model_copy(update={"dtype": "bfloat16"}), q, "nvfp4")["digest"] != nvfp4["digest"]
    )
    assert store.base_fingerprint(model, q, "nf4")["digest"] != nvfp4["digest"]
    with pytest.raises(ValueError, match="unknown base format 'int4'; registered formats: .*nvfp4"):
        store.base_fingerprint(model, q, "int4")
    with pytest.raises(ValueError, match="nf4_double_quant"):
        store.ensure_base(model, QuantizeConfig(nf4_double_quant=True), "nf4", tmp_path / "x")


def test_random_and_calibrated_fingerprints(tmp_path):
    rand = ModelConfig(source="random")
    fp = store.base_fingerprint(rand, QuantizeConfig(), "nf4")
    assert fp["model"]["random_init"]["seed"] == 0 and "name" not in fp["model"]
    other_seed = rand.model_copy(update={"random_init": rand.random_init.model_copy(update={"seed": 1})})
    assert store.base_fingerprint(other_seed, QuantizeConfig(), "nf4")["digest"] != fp["digest"]
    longer = rand.model_copy(update={"max_seq_len": 2048})  # written as max_position_embeddings
    assert store.base_fingerprint(longer, QuantizeConfig(), "nf4")["digest"] != fp["digest"]
    # awq/gptq: the calibration rows count, not where the file lies
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"question": "q1"}\n{"question": "q2"}\n')
    shutil.copy(a, b)
    awq = store.base_fingerprint(
        rand, QuantizeConfig(nvfp4_algorithm="awq", calibration_path=str(a), calibration_samples=2), "nvfp4"
    )
    moved = store.base_fingerprint(
        rand, QuantizeConfig(nvfp4_algorithm="awq", calibration_path=str(b), calibration_samples=2), "nvfp4"
    )
    assert awq["digest"] == moved["digest"] and awq["quantize"]["calibration_count"] == 2
    b.write_text('{"question": "q1"}\n{"question": "other"}\n')
    changed = store.base_fingerprint(
        rand, QuantizeConfig(nvfp4_algorithm="awq", calibration_path=str(b), calibration_samples=2), "nvfp4"
    )
    assert changed["digest"] != awq["digest"]
    # a calibration path is irrelevant to rtn and to nf4
    assert (
        "calibration_texts_sha256"
        not in store.base_fingerprint(rand, QuantizeConfig(calibration_path="/none"), "nvfp4")["quantize"]
    )


def test_quantize_format_node_and_dataset_round_trip_leave_files_untouched(model, tmp_path, caplog):
    """The Kedro wiring without Kedro: existing folder in (missing_ok), the same path out (a no-op save)."""
    from qerl_pipeline.pipelines.quantize.nodes import quantize_base, quantize_format

    root = tmp_path / "models"
    existing = HFModelFolderDataset(str(root), missing_ok=True)
    assert existing.load() == root and not root.exists()  # missing: its path, not an error
    path, report = quantize_format(model, QuantizeConfig(), existing.load(), fmt="nf4")
    assert Path(path) == root / "base_nf4" and report["reused"] is False
    before = snapshot(root / "base_nf4")
    HFModelFolderDataset(str(root / "base_nf4"), move=False).save(path)  # the base_nf4 dataset
    assert snapshot(root / "base_nf4") == before
    caplog.set_level(logging.INFO, logger=LOGGER)
    written, report = quantize_base(model, QuantizeConfig(), "qlora", existing.load())
    assert written == {"base_nf4": str(root / "base_nf4")} and report["reused"] is True and report["method"] == "qlora"
    HFModelFolderDataset(str(root)).save(written)  # base_models: the mapping form, same path
    assert snapshot(root / "base_nf4") == before
    assert any("base_nf4 reused" in m for m in _messages(caplog))
    from kedro.io.core import DatasetError, Version

    with pytest.raises(DatasetError, match="missing_ok is for unversioned"):
        HFModelFolderDataset(str(root), version=Version(None, None), missing_ok=True)
    with pytest.raises(ValueError, match="existing_base_models"):
        quantize_format(model, QuantizeConfig(), None, fmt="nf4")
