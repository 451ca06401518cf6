"""The README's "Train on your own data" commands, end to end, in a project copy (smoke env):
``kedro run --pipelines=train`` on a JSONL of GSM8K's train rows as published (``question``, and
``answer`` = a worked solution ending in ``#### N``), with no preprocessing and two reward
entries, then ``--pipelines=evaluate`` with the user's eval set beside the built-in ones: MATH-500
problems whose answer column is the full solution (the README's column names, ``\\boxed{}``
inside). Both files are copied from ../shared/data into the project copy.

One module fixture, two Kedro runs (about the smoke train's and evaluate's own cost, with
``train.steps=2``). Each gold is what the row's marker holds (``answer_format: auto``), and the
data report counts the forms. A random tiny model earns no math reward, so the user's
``letter_fraction`` entry is what differs between samples; the check is that each entry is
logged under its name and that ``reward/mean`` is their weighted sum, step by step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.helpers.project import SHARED, project_copy, run_kedro, tracking_uri

pytestmark = [pytest.mark.kedro_run, pytest.mark.vllm]

WEIGHTS = {"math": 1.0, "letter_fraction": 0.5}
#: the README's commands (the smoke env and two steps added): GSM8K's rows under their own column names, and
#: the user's eval set under the README's
TRAIN_PARAMS = "data.train_source=file,data.train_file.path=gsm8k_train.jsonl,train.steps=2"
EVAL_PARAMS = (
    "data.eval_files.mine.path=my_eval.jsonl,data.eval_files.mine.question=problem,"
    "data.eval_files.mine.answer=solution"
)
N_TRAIN, N_EVAL = 8, 4


def _rows(rel: str) -> list[dict]:
    return [json.loads(line) for line in (SHARED / "data" / rel).read_text().splitlines() if line.strip()]


def _gsm8k_train() -> list[dict]:
    """GSM8K's first train rows as published (the shared copy is: question, answer ending in ``#### N``)."""
    rows = _rows("gsm8k/train.jsonl")[:N_TRAIN]
    assert all(set(r) == {"question", "answer"} and "\n#### " in r["answer"] for r in rows)
    return rows


def _math_solutions() -> list[dict]:
    """Short MATH-500 problems with the full solution as the answer column (and the set's own answer,
    for the check)."""
    rows = [r for r in _rows("math500/test.jsonl") if len(r["problem"]) < 200 and len(r["solution"]) < 600][:N_EVAL]
    return [{"problem": r["problem"], "solution": r["solution"], "answer": r["answer"]} for r in rows]


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
    root = project_copy(tmp_path_factory.mktemp("user_data") / "project", shared=["gsm8k/test.jsonl"])
    _jsonl(root / "gsm8k_train.jsonl", _gsm8k_train())
    _jsonl(root / "my_eval.jsonl", _math_solutions())
    smoke = root / "conf" / "smoke" / "parameters.yml"  # a list cannot be given with --params (it splits on commas)
    params = yaml.safe_load(smoke.read_text())
    params["train"].update(
        reward_fn=["math", "tests.helpers.rewards:letter_fraction"], reward_weights=list(WEIGHTS.values())
    )
    smoke.write_text(yaml.safe_dump(params, sort_keys=False))
    run_kedro(root, "run", "--pipelines=train", "--env=smoke", f"--params={TRAIN_PARAMS},{EVAL_PARAMS}", timeout=900)
    run_kedro(root, "run", "--pipelines=evaluate", "--env=smoke", f"--params={EVAL_PARAMS}", timeout=900)
    return root


def _latest(folder: Path) -> Path:
    """The newest version file of a Kedro versioned dataset folder."""
    return sorted(p for p in folder.iterdir() if p.is_dir())[-1] / folder.name


def test_user_jsonl_trains_with_two_rewards_and_is_evaluated_beside_the_built_in_sets(user_run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri(user_run))
    exp = client.get_experiment_by_name("qerl_pipeline")
    runs = {r.data.tags.get("qerl.role"): r for r in client.search_runs([exp.experiment_id])}
    train, evaluate = runs["train"], runs["evaluate"]

    # trained on the user's rows as published, as the data report says: every gold read after its "####"
    report = json.loads(
        Path(client.download_artifacts(train.info.run_id, "data/report.json", str(user_run / "dl"))).read_text()
    )
    assert report["train"]["origin"] == "file:gsm8k_train.jsonl" and report["train"]["dropped"] == 0
    assert report["train"]["kept"] == N_TRAIN and report["train"]["answer_forms"] == {"gsm8k": N_TRAIN}
    assert report["eval"]["mine"]["kept"] == N_EVAL and report["eval"]["mine"]["answer_forms"] == {"boxed": N_EVAL}
    records = json.loads(_latest(user_run / "data" / "05_model_input" / "smoke" / "train_prompts.json").read_text())
    golds = {r["question"]: r["gold"] for r in records}
    assert {
        r["question"].strip(): r["answer"].rsplit("####", 1)[1].strip().replace(",", "") for r in _gsm8k_train()
    } == golds
    evals = json.loads(_latest(user_run / "data" / "05_model_input" / "smoke" / "eval_prompts.json").read_text())
    assert {r["question"]: r["gold"] for r in evals["mine"]} == {
        r["problem"].strip(): r["answer"] for r in _math_solutions()
    }

    # each reward entry under its name, and reward/mean their weighted sum, at every step
    history = {
        name: {m.step: m.value for m in client.get_metric_history(train.info.run_id, name)}
        for name in ("reward/mean", "rewards/math/mean", "rewards/letter_fraction/mean")
    }
    assert sorted(history["reward/mean"]) == [1, 2]
    for step, total in history["reward/mean"].items():
        parts = {n: history[f"rewards/{n}/mean"][step] for n in WEIGHTS}
        assert total == pytest.approx(sum(WEIGHTS[n] * v for n, v in parts.items()), abs=1e-9)
    assert any(v > 0 for v in history["rewards/letter_fraction/mean"].values())

    # evaluate: the user's set beside the built-in ones, for the trained policy and the base
    metrics = evaluate.data.metrics
    for policy in ("trained", "base"):
        for bench in ("generator", "gsm8k", "mine"):
            n = [v for k, v in metrics.items() if k.endswith(f"eval/{policy}/{bench}/n_problems")]
            assert n and n[0] > 0, (policy, bench, sorted(metrics)[:30])
