"""Checkpoints that verify themselves (``rl/checkpoint.py``, resume in ``rl/trainer.py``).

Each checkpoint's ``meta.json`` records every file's size and sha256 (the adapter's files
included) and its own hash. A resume checks the newest checkpoint; a damaged one (a file cut
short, garbled at the same size, missing, or an unreadable manifest) is named in the log
with the file and what is wrong, the newest intact checkpoint is resumed, and the damaged
folder is kept (renamed ``step-NNNNNN.damaged``, out of reach of pruning). None intact: one
error listing them, nothing moved. Fast tier: real ``save_checkpoint`` files, real
``open_run_dir``, and one real (in-process) training resumed over a damaged checkpoint with
the fake engine of ``tests/helpers/engines.py``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qerl_pipeline.config import QerlConfig
from qerl_pipeline.rl import checkpoint as ckpt
from qerl_pipeline.rl import trainer
from qerl_pipeline.rl.run_setup import Reporting

ADAPTER_FILE = "adapter/adapter_model.safetensors"
KINDS = ["state.pt", "trainable.pt", ADAPTER_FILE, "adapter/adapter_config.json", "meta.json"]


class _Policy(torch.nn.Module):
    """Trainable tensors and a PEFT-like ``save_pretrained`` (a safetensors file and its config)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(256, dtype=torch.float32) / 7)

    def save_pretrained(self, path: str) -> None:
        Path(path).mkdir(parents=True)
        save_file({"w": self.w.detach().clone()}, str(Path(path) / "adapter_model.safetensors"))
        (Path(path) / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q"]}))


def _cfg(out: Path, resume: bool = True) -> QerlConfig:
    return QerlConfig.model_validate({"method": "qerl", "train": {"output_dir": str(out), "resume": resume}})


def _save(run_dir: Path, steps=(1, 2), keep_last: int | None = None) -> list[Path]:
    policy = _Policy()
    opt = torch.optim.AdamW(policy.parameters())
    policy.w.grad = torch.ones_like(policy.w)
    opt.step()  # Adam's moments in state.pt
    return [
        ckpt.save_checkpoint(
            run_dir,
            s,
            policy=policy,
            optimizer=opt,
            scheduler=None,
            state={"step": s, "run_id": "r"},
            keep_last=keep_last,
        )
        for s in steps
    ]


def _truncate(path: Path) -> None:
    with path.open("r+b") as fh:
        fh.truncate(path.stat().st_size // 2)


def _garble(path: Path) -> None:
    """Flip 16 bytes in the middle: the size stays the same."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(max(0, mid - 8), min(len(data), mid + 8)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _expected(name: str, damage: str) -> str:
    if name == "meta.json":
        return "unreadable manifest"
    return {"truncate": "size mismatch", "garble": "hash mismatch", "delete": "missing"}[damage]


#: every file kind cut short, garbled at the same size, deleted (meta.json deleted: its own test below)
CASES = [
    (name, damage)
    for name in KINDS
    for damage in ("truncate", "garble", "delete")
    if (name, damage) != ("meta.json", "delete")
]


@pytest.mark.parametrize(("name", "damage"), CASES)
def test_a_damaged_newest_checkpoint_is_named_skipped_and_kept(tmp_path, caplog, name, damage):
    run_dir = tmp_path / "qerl"
    first, newest = _save(run_dir)
    target = newest / name
    {"truncate": _truncate, "garble": _garble, "delete": Path.unlink}[damage](target)
    damaged = _tree(newest)
    with caplog.at_level(logging.WARNING):
        _, latest, moved = trainer.open_run_dir(_cfg(tmp_path))
    assert latest == first and moved is None  # the previous, intact checkpoint
    said = f"{target}: {_expected(name, damage)}"
    assert any(said in r.getMessage() for r in caplog.records), caplog.text
    assert _tree(newest) == damaged  # nothing touched yet
    # the trainer then sets it aside, kept byte for byte, out of the way of saves and pruning
    ((found, kept),) = ckpt.set_aside_damaged(run_dir, latest)
    assert kept == newest.with_name("step-000002.damaged") and str(found).startswith(said)
    assert _tree(kept) == damaged and not newest.exists()
    _save(run_dir, steps=(2, 3, 4), keep_last=2)
    assert [s for s, _ in ckpt.list_checkpoints(run_dir)] == [3, 4]
    assert _tree(kept) == damaged
    assert ckpt.find_resumable(run_dir) == run_dir / "checkpoints" / "step-000004"


def test_an_intact_checkpoint_verifies_and_lists_every_file_with_size_and_hash(tmp_path):
    _, newest = _save(tmp_path)
    assert ckpt.verify_checkpoint(newest) is None
    meta = json.loads((newest / "meta.json").read_text())
    assert set(meta["files"]) == {"state.pt", "trainable.pt", ADAPTER_FILE, "adapter/adapter_config.json"}
    for name, entry in meta["files"].items():
        assert entry["size"] == (newest / name).stat().st_size and len(entry["sha256"]) == 64


def test_an_edited_manifest_that_still_parses_is_named(tmp_path):
    """meta.json changed at the same size but still valid JSON: its own hash gives it away."""
    first, newest = _save(tmp_path)
    text = (newest / "meta.json").read_text()
    (newest / "meta.json").write_text(text.replace('"step": 2', '"step": 3', 1))
    found = ckpt.verify_checkpoint(newest)
    assert found is not None and found.file == "meta.json" and "manifest hash mismatch" in found.problem
    assert ckpt.find_resumable(tmp_path) == first


def test_a_step_folder_without_its_manifest_is_damage(tmp_path, caplog):
    """Saves are staged, so a visible step folder without meta.json was damaged after its save."""
    first, newest = _save(tmp_path)
    (newest / "meta.json").unlink()
    with caplog.at_level(logging.WARNING):
        assert ckpt.find_resumable(tmp_path) == first
    assert f"{newest / 'meta.json'}: missing" in caplog.text


def test_no_intact_checkpoint_fails_in_one_line_naming_each_and_moves_nothing(tmp_path):
    run_dir = tmp_path / "qerl"
    first, newest = _save(run_dir)
    _truncate(newest / "state.pt")
    _garble(first / ADAPTER_FILE)
    before = _tree(run_dir)
    with pytest.raises(ckpt.CheckpointDamaged) as err:
        trainer.open_run_dir(_cfg(tmp_path))
    message = str(err.value)
    assert "\n" not in message and "no intact checkpoint" in message and "train.resume=false" in message
    assert f"{newest / 'state.pt'}: size mismatch" in message and f"{first / ADAPTER_FILE}: hash mismatch" in message
    assert _tree(run_dir) == before and ckpt.previous_runs(run_dir) == []


def _legacy(folder: Path) -> None:
    """meta.json as checkpoints had it before sizes and hashes: the step and a list of file names."""
    files = sorted(
        p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != "meta.json"
    )
    (folder / "meta.json").write_text(json.dumps({"step": ckpt.step_of(folder), "files": files}))


@pytest.mark.parametrize("damage", ["truncate", "garble"])
def test_a_checkpoint_without_hashes_resumes_and_its_broken_torch_files_are_found(tmp_path, damage):
    run_dir = tmp_path / "qerl"
    first, newest = _save(run_dir)
    for folder in (first, newest):
        _legacy(folder)
    assert trainer.open_run_dir(_cfg(tmp_path))[1] == newest  # loads as before
    {"truncate": _truncate, "garble": _garble}[damage](newest / "trainable.pt")
    found = ckpt.verify_checkpoint(newest)
    assert found is not None and found.file == "trainable.pt"
    assert trainer.open_run_dir(_cfg(tmp_path))[1] == first


def test_a_checkpoint_file_torch_cannot_read_is_named(tmp_path):
    _, newest = _save(tmp_path)
    _truncate(newest / "state.pt")
    with pytest.raises(ckpt.CheckpointDamaged, match=rf"^{newest / 'state.pt'}: cannot be read"):
        ckpt.peek_state(newest)


# ----------------------------------------------------------------------------- a real resume
@pytest.fixture(scope="module")
def bf16_base(tiny_model_dir, tmp_path_factory) -> Path:
    from tests.helpers.models import tokenized_base

    return tokenized_base(tiny_model_dir, "bf16", tmp_path_factory.mktemp("verify_base") / "bf16")


def test_training_resumes_over_a_garbled_adapter_from_the_previous_checkpoint(bf16_base, tmp_path, caplog):
    """Steps 1-3 (checkpoints 2 and 3), then step 3's adapter file garbled at the same size: the
    resume names it, tags the run, trains step 3 again from checkpoint 2 and ends with the same
    adapter as the first run; the damaged folder is kept."""
    from qerl_pipeline.tracking import MemoryLogger
    from tests.helpers.engines import FakeEngine
    from tests.helpers.rewards import letter_fraction

    cfg = QerlConfig.model_validate(
        {
            "method": "lora",
            "model": {"dtype": "float32", "max_seq_len": 256},
            "lora": {"rank": 4, "alpha": 8},
            "grpo": {"num_generations": 2},
            "rollout": {"max_new_tokens": 4, "temperature": 1.0},
            "train": {
                "steps": 3,
                "prompts_per_step": 2,
                "micro_batch_size": 4,
                "checkpoint_every": 2,
                "output_dir": str(tmp_path),
            },
        }
    )
    records = [
        {"id": str(i), "messages": [{"role": "user", "content": f"What is {i} plus {i}?"}], "gold": str(2 * i)}
        for i in range(1, 7)
    ]
    loggers: list[MemoryLogger] = []

    def run():
        loggers.append(MemoryLogger())
        return trainer.train(
            cfg,
            bf16_base,
            records,
            engine=FakeEngine(cuda=False),
            reporting=Reporting(make_logger=lambda _rid: loggers[-1], progress=False),
            reward_fn=letter_fraction,
        )

    first = run()
    reference = load_file(str(first.adapter_dir / "adapter_model.safetensors"))
    newest = first.run_dir / "checkpoints" / "step-000003"
    _garble(newest / ADAPTER_FILE)
    damaged = _tree(newest)
    with caplog.at_level(logging.WARNING):
        again = run()
    assert not again.reused and again.resumed_from == 2 and again.steps == 3
    said = f"{newest / ADAPTER_FILE}: hash mismatch"
    assert said in caplog.text
    assert (
        said in loggers[-1].tags["qerl.resume_fallback"]
        and "step-000003.damaged" in loggers[-1].tags["qerl.resume_fallback"]
    )
    assert _tree(newest.with_name("step-000003.damaged")) == damaged
    assert ckpt.verify_checkpoint(newest) is None  # step 3 written anew
    resumed = load_file(str(again.adapter_dir / "adapter_model.safetensors"))
    assert resumed.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(resumed[key], reference[key], rtol=0, atol=1e-6, msg=key)
