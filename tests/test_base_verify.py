"""Bases that verify themselves (``quantization/store.py``, ``quantize.verify``).

The stamp records each file's size and sha256; reuse checks them. Damage at the same size
(a garbled safetensors header, garbled weights) is re-quantized with the file named in the
log, or, with ``quantize.verify: fail``, refused naming the file; never reused. On a tiny
local model (NF4: about a second per quantize).
"""

from __future__ import annotations

import json
import logging

import pytest

from qerl_pipeline.config import ModelConfig, QuantizeConfig
from qerl_pipeline.quantization import store
from tests.helpers.files import rewritten, snapshot

LOGGER = "qerl_pipeline.quantization.store"


@pytest.fixture()
def model(tiny_model_dir) -> ModelConfig:
    return ModelConfig(source="local", name=str(tiny_model_dir))


def _garble(path, at: int) -> None:
    """Flip 64 bytes from offset ``at``: same size, other content."""
    data = bytearray(path.read_bytes())
    for i in range(at, min(len(data), at + 64)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _messages(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == LOGGER)


@pytest.mark.parametrize(
    ("name", "where"),
    [
        ("model.safetensors", "middle"),  # garbled weights: would train into NaN
        ("model.safetensors", "header"),  # garbled header: "invalid JSON in header", naming no file
        ("config.json", "middle"),
    ],
)
def test_a_base_garbled_at_the_same_size_is_requantized_naming_the_file(model, tmp_path, caplog, name, where):
    folder = tmp_path / "base_nf4"
    store.ensure_base(model, QuantizeConfig(), "nf4", folder)
    path = folder / name
    size = path.stat().st_size
    _garble(path, 16 if where == "header" else size // 2)
    assert path.stat().st_size == size
    before = snapshot(folder)
    caplog.set_level(logging.INFO, logger=LOGGER)
    _, report, reused = store.ensure_base(model, QuantizeConfig(), "nf4", folder)
    assert not reused and report["reused"] is False and rewritten(before, snapshot(folder))
    assert f"damaged folder: {name}: hash mismatch" in _messages(caplog)
    assert store.check_base(model, QuantizeConfig(), "nf4", folder).reuse  # intact again


def test_verify_fail_refuses_a_damaged_base_by_name_and_writes_nothing(model, tmp_path):
    folder = tmp_path / "base_nf4"
    store.ensure_base(model, QuantizeConfig(), "nf4", folder)
    _garble(folder / "model.safetensors", (folder / "model.safetensors").stat().st_size // 2)
    before = snapshot(folder)
    with pytest.raises(
        store.BaseDamaged, match=rf"base_nf4 in {folder} is damaged: model\.safetensors: hash mismatch"
    ):
        store.ensure_base(model, QuantizeConfig(verify="fail"), "nf4", folder)
    assert snapshot(folder) == before
    (folder / "tokenizer.json").unlink()
    with pytest.raises(store.BaseDamaged, match=r"tokenizer\.json: missing"):
        store.ensure_base(model, QuantizeConfig(verify="fail"), "nf4", folder)
    # quantize.force still rewrites it
    assert not store.ensure_base(model, QuantizeConfig(verify="fail", force=True), "nf4", folder)[2]
    assert store.ensure_base(model, QuantizeConfig(verify="fail"), "nf4", folder)[2]


def test_a_damaged_serving_copy_is_removed_or_refused_by_name(model, tmp_path, caplog):
    """The dense ``serving/`` copy is written on first use with its own stamp (``store.ensure_serving``) and verified
    with the base: damage at the same size removes it under ``requantize`` (the base itself is reused, the copy is
    decoded again on its next use) and names it under ``fail``; a copy cut short is rewritten by its next use."""
    folder = tmp_path / "base_nf4"
    store.ensure_base(model, QuantizeConfig(), "nf4", folder)
    serving = store.ensure_serving(folder)
    _garble(serving / "model.safetensors", 16)
    with pytest.raises(store.BaseDamaged, match=r"damaged serving copy: serving/model\.safetensors: hash mismatch"):
        store.ensure_base(model, QuantizeConfig(verify="fail"), "nf4", folder)

    def base_files() -> dict:
        return {
            k: v for k, v in snapshot(folder).items() if k not in (".", "serving") and not k.startswith("serving/")
        }

    before = base_files()
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert store.ensure_base(model, QuantizeConfig(), "nf4", folder)[2]  # the base reused ...
    assert "damaged serving copy removed (serving/model.safetensors: hash mismatch" in _messages(caplog)
    assert not serving.exists() and base_files() == before  # ... only the copy removed
    store.ensure_serving(folder)
    with (serving / "model.safetensors").open("r+b") as fh:
        fh.truncate(100)
    caplog.clear()
    assert store.ensure_serving(folder) == serving
    assert "serving/model.safetensors: size mismatch: 100 bytes" in _messages(caplog)
    assert store.check_base(model, QuantizeConfig(), "nf4", folder).serving_damage is None  # intact again


def test_verify_sizes_does_not_hash(model, tmp_path):
    """The documented trade-off: no hashing, so damage at the same size passes (a cut file does not)."""
    folder = tmp_path / "base_nf4"
    store.ensure_base(model, QuantizeConfig(), "nf4", folder)
    _garble(folder / "model.safetensors", 4096)
    assert store.ensure_base(model, QuantizeConfig(verify="sizes"), "nf4", folder)[2]
    with (folder / "model.safetensors").open("r+b") as fh:
        fh.truncate(100)
    assert not store.ensure_base(model, QuantizeConfig(verify="sizes"), "nf4", folder)[2]


def test_a_stamp_without_hashes_is_requantized_once_or_reused_by_sizes(model, tmp_path, caplog):
    folder = tmp_path / "base_nf4"
    store.ensure_base(model, QuantizeConfig(), "nf4", folder)
    stamp = json.loads((folder / store.STAMP).read_text())
    assert all(len(v["sha256"]) == 64 and v["size"] >= 0 for v in stamp["files"].values())
    # as an older version wrote it: each file's size only
    older = {**stamp, "schema": 1, "files": {n: v["size"] for n, v in stamp["files"].items()}}
    (folder / store.STAMP).write_text(json.dumps(older))
    before = snapshot(folder)
    assert store.ensure_base(model, QuantizeConfig(verify="sizes"), "nf4", folder)[2]
    assert snapshot(folder) == before
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert not store.ensure_base(model, QuantizeConfig(), "nf4", folder)[2]
    assert "its stamp records no content hashes" in _messages(caplog)
    assert store.ensure_base(model, QuantizeConfig(), "nf4", folder)[2]  # once
    with pytest.raises(ValueError, match="verify"):
        QuantizeConfig(verify="maybe")
