"""data_prep as a real ``kedro run --pipelines=data_prep`` on the default parameters, on a machine without the Hub.

The run happens in a throw-away copy of the project (``project_copy``) with the offline sets
copied to ``shared/data`` beside it, so ``../shared/data`` resolves to that copy and the
checkout's data/ and mlflow.db are untouched. The Hub is out of reach as on a machine without
it: ``HF_HUB_OFFLINE`` is not set and ``HF_ENDPOINT`` points where nothing listens, so a Hub
call would show in the log as its client's retries. One Kedro run for the module: every eval
set of the default comes from its local copy, aime25's 30 problems among them, and the log
holds no warning.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import yaml

from tests.helpers.hub import closed_port_url
from tests.helpers.project import PROJECT, SHARED, project_copy, run_kedro

pytestmark = pytest.mark.kedro_run

#: The offline copies the default eval sets read, and their sizes (../shared/data/README.md).
EVAL_SETS = {
    "generator": None,
    "gsm8k": ("gsm8k/test.jsonl", 1319),
    "math500": ("math500/test.jsonl", 500),
    "aime24": ("aime24/test.jsonl", 30),
    "aime25": ("aime25/test.jsonl", 30),
    "amc23": ("amc23/test.jsonl", 40),
}
DEFAULTS = yaml.safe_load((PROJECT / "conf" / "base" / "parameters.yml").read_text())["data"]


def _latest(folder: Path) -> Path:
    """The newest version file of a Kedro versioned dataset folder."""
    versions = sorted(p for p in folder.iterdir() if p.is_dir())
    assert versions, f"no versions under {folder}"
    return versions[-1] / folder.name


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    project = project_copy(
        tmp_path_factory.mktemp("dataprep") / "project", shared=[spec[0] for spec in EVAL_SETS.values() if spec]
    )
    no_hub = {"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "HF_ENDPOINT": closed_port_url()}
    proc = run_kedro(project, "run", "--pipelines=data_prep", env=no_hub, timeout=600)
    return project, proc


def test_train_prompts_written_versioned(default_run):
    project, _ = default_run
    path = _latest(project / "data" / "05_model_input" / "train_prompts.json")
    records = json.loads(path.read_text())
    generator = DEFAULTS["generator"]
    assert len(records) == generator["n_train"] and len({r["id"] for r in records}) == len(records)
    assert {r["source"] for r in records} == {"generator"} and {r["split"] for r in records} == {"train"}
    assert {r["level"] for r in records} == set(generator["levels"])
    for r in records:
        assert r["messages"] == [
            {"role": "system", "content": DEFAULTS["system_prompt"]},
            {"role": "user", "content": r["question"]},
        ]


def test_every_default_eval_set_is_read_offline_aime25_among_them(default_run):
    project, _ = default_run
    evals = json.loads(_latest(project / "data" / "05_model_input" / "eval_prompts.json").read_text())
    assert list(evals) == DEFAULTS["eval_sources"] == list(EVAL_SETS)
    assert len(evals["generator"]) == DEFAULTS["generator"]["n_test"]
    for name, spec in EVAL_SETS.items():
        if spec:
            assert len(evals[name]) == spec[1], name
    train = json.loads(_latest(project / "data" / "05_model_input" / "train_prompts.json").read_text())
    assert not {r["question"] for r in train} & {r["question"] for r in evals["generator"]}
    assert all(r["gold"].lstrip("-").isdigit() for r in evals["gsm8k"])
    aime25 = [json.loads(line) for line in (SHARED / "data" / "aime25" / "test.jsonl").read_text().splitlines()]
    assert {r["id"]: r["gold"] for r in evals["aime25"]} == {
        f"aime25-{r['id']}": str(int(r["answer"])) for r in aime25
    }


def test_report_and_mlflow_metrics(default_run):
    project, _ = default_run
    report = json.loads(_latest(project / "data" / "08_reporting" / "data_prep_report.json").read_text())
    n_eval = DEFAULTS["generator"]["n_test"] + sum(spec[1] for spec in EVAL_SETS.values() if spec)
    assert report["totals"] == {
        "train_prompts": DEFAULTS["generator"]["n_train"],
        "eval_prompts": n_eval,
        "dropped_rows": 0,
        "unparsable_golds": 0,
        "skipped_sources": 0,
    }
    for name, spec in EVAL_SETS.items():
        if spec:
            assert report["eval"][name]["origin"] == f"local:../shared/data/{spec[0]}", name
    db = project / "mlflow.db"
    assert db.is_file(), "the MLflow run was not recorded in the embedded store"
    with sqlite3.connect(db) as con:
        metrics = dict(con.execute("SELECT key, value FROM latest_metrics").fetchall())
    assert metrics["data_prep_metrics.train_prompts"] == DEFAULTS["generator"]["n_train"]
    assert metrics["data_prep_metrics.eval.aime25.kept"] == 30


def test_the_log_on_a_machine_without_the_hub_holds_no_warning(default_run):
    """No Hub call and so no retry, no warning of the known-harmless kinds (MLflow's pyfunc type hints,
    kedro-mlflow's "Replacing dataset"), no warning at all."""
    _, proc = default_run
    log = proc.stdout
    assert "Completed 4 out of 4 tasks" in log, log[-3000:]
    for text in ("WARNING", "Warning", "Retrying", "Name or service not known", "Replacing dataset", "skipping"):
        assert text not in log, f"{text!r} in the log:\n{log}"


def test_a_malformed_row_stops_the_training_before_any_model_loads_naming_file_and_line(tmp_path):
    """A non-UTF-8 byte and a number for a question, in the user's file: ``kedro run --pipeline=train``
    stops in data prep, before the quantize node loads the model, and ends with one ``Error:`` block
    naming each row by file and 1-based line, not a traceback; no prompts are written."""
    project = project_copy(tmp_path / "project")
    good = json.dumps({"problem": "What is 1+1?", "solution": "2"})
    body = ("\n".join([good] * 4) + "\n").encode() + b'{"problem": "caf\xe9?", "solution": "3"}\n'
    body += json.dumps({"problem": 12345, "solution": "3"}).encode() + b"\n"
    (project / "mine.jsonl").write_bytes(body)
    proc = run_kedro(
        project,
        "run",
        "--pipeline=train",
        "--env",
        "smoke",
        "--params",
        "data.train_source=file,data.train_file.path=mine.jsonl,data.train_file.question=problem,"
        "data.train_file.answer=solution",
        check=False,
        timeout=600,
    )
    out = proc.stdout
    assert proc.returncode == 1, out
    assert "Traceback" not in out, out[-3000:]
    assert "Running node: prepare_train_prompts" in out and "Running node: quantize" not in out, out[-3000:]
    tail = out.strip().splitlines()[-3:]
    assert tail[0].startswith("Error: 2 malformed row(s)"), tail
    assert "mine.jsonl line 5" in tail[1] and "not UTF-8" in tail[1], tail
    assert "mine.jsonl line 6" in tail[2] and "expected text, got int 12345" in tail[2], tail
    assert not list((project / "data").rglob("train_prompts*.json*")), "prompts written despite the bad rows"
