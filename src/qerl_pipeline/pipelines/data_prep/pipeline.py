"""data_prep: sources -> prompt records (train, eval per source) and a data report.

Datasets written (conf/base/catalog_data_prep.yml; smoke runs write under ``.../smoke/``):

* ``train_prompts``: list of prompt records (versioned JSON), the training set
  (``data.train_source``; ``file``: the user's ``data.train_file``).
* ``eval_prompts``: ``{source_name: [prompt records]}`` (versioned JSON), one entry per
  available ``data.eval_sources`` (e.g. generator, gsm8k, math500, aime24, amc23), then one
  per set of the user's (``data.eval_files``).
* ``data_prep_report``: counts, dropped rows, skipped sources, settings (versioned JSON).
* ``data_prep_metrics``: the counts as metrics of the run's MLflow run (kedro-mlflow).
* ``train_data_summary`` / ``eval_data_summary``: each set's counts and dropped rows, joined
  into the report (JSON).

A prompt record is ``{id, source, split, messages, question, gold, level}`` (see
``qerl_pipeline.data.prompts``).
"""

from kedro.pipeline import Node, Pipeline

from qerl_pipeline.pipelines.data_prep.nodes import (
    build_data_report,
    data_metrics,
    prepare_eval_prompts,
    prepare_train_prompts,
)


def create_pipeline(**kwargs) -> Pipeline:
    """Wire the data_prep nodes."""
    return Pipeline(
        [
            Node(
                prepare_train_prompts,
                "params:data",
                ["train_prompts", "train_data_summary"],
                name="prepare_train_prompts",
            ),
            Node(
                prepare_eval_prompts, "params:data", ["eval_prompts", "eval_data_summary"], name="prepare_eval_prompts"
            ),
            Node(
                build_data_report,
                ["train_data_summary", "eval_data_summary", "params:data"],
                "data_prep_report",
                name="build_data_report",
            ),
            Node(data_metrics, "data_prep_report", "data_prep_metrics", name="log_data_metrics"),
        ],
        tags="data_prep",
    )
