"""The README's "Train on your own data" commands, end to end, in a project copy (smoke env):
``kedro run --pipelines=train`` on the user's JSONL (the issue's column names) with two reward
entries, then ``--pipelines=evaluate`` with the user's eval set beside the built-in ones.

One module fixture, two Kedro runs (about the smoke train's and evaluate's own cost, with
``train.steps=2``). A random tiny model earns no math reward, so the user's ``letter_fraction``
entry is what differs between samples; the check is that each entry is logged under its
name and that ``reward/mean`` is their weighted sum, step by step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.helpers.project import project_copy, run_kedro, tracking_uri

pytestmark = [pytest.mark.kedro_run, pytest.mark.vllm]

WEIGHTS = {"math": 1.0, "letter_fraction": 0.5}
#: the README's command (the smoke env and two steps added), and the user's eval set
TRAIN_PARAMS = ("data.train_source=file,data.train_file.path=my.jsonl,data.train_file.question=problem,"
                "data.train_file.answer=solution,train.steps=2")
EVAL_PARAMS = "data.eval_files.mine.path=my_eval.jsonl,data.eval_files.mine.question=problem,data.eval_files.mine.answer=solution"


def _problems(n: int, offset: int) -> str:
    return "".join(json.dumps({"problem": f"What is {a} + {a + 1}?", "solution": str(2 * a + 1)}) + "\n"
                   for a in range(offset, offset + n))


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
    root = project_copy(tmp_path_factory.mktemp("user_data") / "project", shared=["gsm8k/test.jsonl"])
    (root / "my.jsonl").write_text(_problems(8, 1))
    (root / "my_eval.jsonl").write_text(_problems(4, 20))
    smoke = root / "conf" / "smoke" / "parameters.yml"  # a list cannot be given with --params (it splits on commas)
    params = yaml.safe_load(smoke.read_text())
    params["train"].update(reward_fn=["math", "tests.helpers.rewards:letter_fraction"],
                           reward_weights=list(WEIGHTS.values()))
    smoke.write_text(yaml.safe_dump(params, sort_keys=False))
    run_kedro(root, "run", "--pipelines=train", "--env=smoke", f"--params={TRAIN_PARAMS},{EVAL_PARAMS}", timeout=900)
    run_kedro(root, "run", "--pipelines=evaluate", "--env=smoke", f"--params={EVAL_PARAMS}", timeout=900)
    return root


def test_user_jsonl_trains_with_two_rewards_and_is_evaluated_beside_the_built_in_sets(user_run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri(user_run))
    exp = client.get_experiment_by_name("qerl_pipeline")
    runs = {r.data.tags.get("qerl.role"): r for r in client.search_runs([exp.experiment_id])}
    train, evaluate = runs["train"], runs["evaluate"]

    # trained on the user's rows, as the data report says
    report = json.loads(Path(client.download_artifacts(train.info.run_id, "data/report.json", str(user_run / "dl"))).read_text())
    assert report["train"]["origin"] == "file:my.jsonl" and report["train"]["kept"] == 8 and report["train"]["dropped"] == 0
    assert report["eval"]["mine"]["kept"] == 4

    # each reward entry under its name, and reward/mean their weighted sum, at every step
    history = {name: {m.step: m.value for m in client.get_metric_history(train.info.run_id, name)}
               for name in ("reward/mean", "rewards/math/mean", "rewards/letter_fraction/mean")}
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
