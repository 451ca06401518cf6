"""What MLflow's UI shows of the runs (tracking_view.py), on a real MLflow store (SQLite): the experiment's kind,
and prompts as dataset inputs, one dataset for the same prompts, logged once through the tracking journal."""

from __future__ import annotations

from qerl_pipeline.tracking_view import KIND_TAG, MODEL_DEVELOPMENT, TRAINING, dataset_input, mark_model_development

RECORDS = [
    {"id": str(i), "source": "gsm8k", "split": "train", "question": f"What is {i} plus {i}?", "gold": str(2 * i)}
    for i in range(6)
]


def test_the_same_prompts_are_one_dataset_and_other_prompts_another():
    one, again = dataset_input(RECORDS, "train_prompts"), dataset_input([dict(r) for r in RECORDS], "train_prompts")
    assert one == again and one["name"] == "gsm8k/train" and "train_prompts" in one["source"]
    assert dataset_input(RECORDS[:5], "train_prompts")["digest"] != one["digest"]
    changed = [{**r, "gold": "0"} if r["id"] == "3" else r for r in RECORDS]
    assert dataset_input(changed, "train_prompts")["digest"] != one["digest"]
    mixed = RECORDS[:3] + [{**r, "source": "math500", "split": "test"} for r in RECORDS[3:]]
    assert dataset_input(mixed, "train_prompts")["name"] == "gsm8k/train+math500/test"


def test_an_experiment_the_project_writes_opens_on_its_runs_and_a_users_kind_is_kept(sqlite_store):
    from mlflow.tracking import MlflowClient

    from qerl_pipeline.tracking import MlflowLogger

    client = MlflowClient()
    logger = MlflowLogger(experiment="view")  # a run of its own: its experiment is marked
    exp = client.get_run(logger.run_id).info.experiment_id
    assert client.get_experiment(exp).tags[KIND_TAG] == MODEL_DEVELOPMENT
    logger.end()
    mine = client.create_experiment("genai", tags={KIND_TAG: "genai_development"})
    mark_model_development(mine, client)
    assert client.get_experiment(mine).tags[KIND_TAG] == "genai_development"


def test_a_dataset_input_goes_through_the_journal_once(sqlite_store, tmp_path):
    from mlflow.tracking import MlflowClient

    from qerl_pipeline.tracking import MlflowLogger

    client = MlflowClient()
    run_id = client.create_run(client.create_experiment("inputs")).info.run_id
    logger = MlflowLogger(run_id=run_id)
    logger.keep_journal(tmp_path / "tracking_journal.jsonl", outage_s=60)
    for _ in range(2):  # a resumed or rerun step logs it again: MLflow keeps one per dataset and run
        logger.log_input(dataset_input(RECORDS, "train_prompts"), TRAINING)
    (got,) = client.get_run(run_id).inputs.dataset_inputs
    assert (
        got.dataset.name == "gsm8k/train" and got.dataset.digest == dataset_input(RECORDS, "train_prompts")["digest"]
    )
    assert [(t.key, t.value) for t in got.tags] == [("mlflow.data.context", "training")]
