"""data_prep as a real `kedro run --pipeline=data_prep --env smoke`, offline.

The run happens in a throw-away copy of the project (conftest's ``project_copy``) with the
gsm8k test split copied to ``shared/data`` beside it, so ``../shared/data`` resolves to that
copy and the checkout's data/ and mlflow.db are untouched. One Kedro run for the module.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from tests.helpers.project import project_copy, run_kedro

pytestmark = pytest.mark.kedro_run


def _latest(folder: Path) -> Path:
    """The newest version file of a Kedro versioned dataset folder."""
    versions = sorted(p for p in folder.iterdir() if p.is_dir())
    assert versions, f"no versions under {folder}"
    return versions[-1] / folder.name


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    project = project_copy(tmp_path_factory.mktemp("dataprep") / "project", shared=["gsm8k/test.jsonl"])
    proc = run_kedro(project, "run", "--pipeline=data_prep", "--env", "smoke", timeout=600)
    return project, proc


def test_train_prompts_written_versioned(smoke_run):
    project, _ = smoke_run
    path = _latest(project / "data" / "05_model_input" / "smoke" / "train_prompts.json")
    records = json.loads(path.read_text())
    assert len(records) == 64  # conf/smoke: generator n_train 64
    assert {r["source"] for r in records} == {"generator"} and {r["split"] for r in records} == {"train"}
    assert {r["level"] for r in records} == {1, 2}
    assert len({r["id"] for r in records}) == 64
    for r in records:
        assert r["messages"][0]["role"] == "system" and "<answer>" in r["messages"][0]["content"]
        assert r["messages"][1] == {"role": "user", "content": r["question"]}
    assert not (project / "data" / "05_model_input" / "train_prompts.json").exists()  # smoke writes under smoke/


def test_eval_prompts_per_source(smoke_run):
    project, _ = smoke_run
    evals = json.loads(_latest(project / "data" / "05_model_input" / "smoke" / "eval_prompts.json").read_text())
    assert list(evals) == ["generator", "gsm8k"]
    assert len(evals["generator"]) == 16 and len(evals["gsm8k"]) == 16  # n_test 16; gsm8k limit 16
    train = json.loads(_latest(project / "data" / "05_model_input" / "smoke" / "train_prompts.json").read_text())
    assert not {r["question"] for r in train} & {r["question"] for r in evals["generator"]}
    assert all(r["gold"].lstrip("-").isdigit() for r in evals["gsm8k"])


def test_report_and_mlflow_metrics(smoke_run):
    project, _ = smoke_run
    report = json.loads(_latest(project / "data" / "08_reporting" / "smoke" / "data_prep_report.json").read_text())
    assert report["totals"] == {"train_prompts": 64, "eval_prompts": 32, "dropped_rows": 0, "unparsable_golds": 0,
                                "skipped_sources": 0}
    assert report["eval"]["gsm8k"]["origin"].startswith("local:") and report["eval"]["gsm8k"]["rows_read"] == 1319
    db = project / "mlflow.db"
    assert db.is_file(), "the MLflow run was not recorded in the embedded store"
    with sqlite3.connect(db) as con:
        metrics = dict(con.execute("SELECT key, value FROM latest_metrics").fetchall())
    assert metrics["data_prep_metrics.train_prompts"] == 64 and metrics["data_prep_metrics.eval.gsm8k.kept"] == 16


def test_a_malformed_row_stops_the_training_before_any_model_loads_naming_file_and_line(tmp_path):
    """A non-UTF-8 byte and a number for a question, in the user's file: ``kedro run --pipeline=train``
    stops in data prep, before the quantize node loads the model, and ends with one ``Error:`` block
    naming each row by file and 1-based line, not a traceback; no prompts are written."""
    project = project_copy(tmp_path / "project")
    good = json.dumps({"problem": "What is 1+1?", "solution": "2"})
    body = ("\n".join([good] * 4) + "\n").encode() + b'{"problem": "caf\xe9?", "solution": "3"}\n'
    body += json.dumps({"problem": 12345, "solution": "3"}).encode() + b"\n"
    (project / "mine.jsonl").write_bytes(body)
    proc = run_kedro(project, "run", "--pipeline=train", "--env", "smoke", "--params",
                     "data.train_source=file,data.train_file.path=mine.jsonl,data.train_file.question=problem,"
                     "data.train_file.answer=solution", check=False, timeout=600)
    out = proc.stdout
    assert proc.returncode == 1, out
    assert "Traceback" not in out, out[-3000:]
    assert "Running node: prepare_train_prompts" in out and "Running node: quantize" not in out, out[-3000:]
    tail = out.strip().splitlines()[-3:]
    assert tail[0].startswith("Error: 2 malformed row(s)"), tail
    assert "mine.jsonl line 5" in tail[1] and "not UTF-8" in tail[1], tail
    assert "mine.jsonl line 6" in tail[2] and "expected text, got int 12345" in tail[2], tail
    assert not list((project / "data").rglob("train_prompts*.json*")), "prompts written despite the bad rows"
