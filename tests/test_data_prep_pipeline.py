"""data_prep as a real `kedro run --pipeline=data_prep --env smoke`, offline.

The run happens in a throw-away copy of the project (tmp_path/project) with
tmp_path/shared/data beside it, so ``../shared/data`` resolves to copies and the real
project's data/ and mlflow.db are untouched. Only the config files data_prep reads are
copied (parameters, mlflow, the data_prep catalog): the test checks this pipeline, not
the other pipelines' catalogs. One Kedro run for the whole module.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[1]
SHARED_DATA = PROJECT.parent / "shared" / "data"

pytestmark = pytest.mark.kedro_run


def _latest(folder: Path) -> Path:
    """The newest version file of a Kedro versioned dataset folder."""
    versions = sorted(p for p in folder.iterdir() if p.is_dir())
    assert versions, f"no versions under {folder}"
    return versions[-1] / folder.name


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    if not (SHARED_DATA / "gsm8k" / "test.jsonl").is_file():
        pytest.skip(f"offline data copies not found at {SHARED_DATA}")
    root = tmp_path_factory.mktemp("dataprep")
    project, shared = root / "project", root / "shared" / "data" / "gsm8k"
    shared.mkdir(parents=True)
    shutil.copy(SHARED_DATA / "gsm8k" / "test.jsonl", shared / "test.jsonl")
    for rel in ("pyproject.toml", ".kedro.yml", "conf/base/parameters.yml", "conf/base/mlflow.yml",
                "conf/base/catalog.yml", "conf/base/catalog_data_prep.yml", "conf/smoke/parameters.yml",
                "conf/smoke/catalog_data_prep.yml"):
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(PROJECT / rel, project / rel)
    (project / "conf" / "local").mkdir()
    (project / "src").mkdir()  # the package itself is installed; Kedro only checks the folder exists
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(KEDRO_DISABLE_TELEMETRY="true", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    kedro = Path(sys.executable).parent / "kedro"
    proc = subprocess.run(
        [str(kedro), "run", "--pipeline=data_prep", "--env", "smoke"],
        cwd=project, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"kedro run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
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
    assert report["totals"] == {"train_prompts": 64, "eval_prompts": 32, "dropped_rows": 0, "skipped_sources": 0}
    assert report["eval"]["gsm8k"]["origin"].startswith("local:") and report["eval"]["gsm8k"]["rows_read"] == 1319
    db = project / "mlflow.db"
    assert db.is_file(), "the MLflow run was not recorded in the embedded store"
    with sqlite3.connect(db) as con:
        metrics = dict(con.execute("SELECT key, value FROM latest_metrics").fetchall())
    assert metrics["data_prep_metrics.train_prompts"] == 64 and metrics["data_prep_metrics.eval.gsm8k.kept"] == 16
