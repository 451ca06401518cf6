"""compare.seeds and compare.methods without running anything: the config, what a seed sets, a pipeline
shape that ignores both lists, and the nodes of a branch compare.methods leaves out doing nothing.

The runs themselves (10 trainings of 5 methods x 2 seeds, killed and resumed; a compare of one
method) are tests/test_compare_pipeline.py's; the statistics are tests/test_stats.py's.
"""

from __future__ import annotations

import pytest

from qerl_pipeline.config import METHODS, ConfigError, QerlConfig, validate


def test_seeds_default_and_duplicates_refused():
    assert validate({}, QerlConfig).compare.seeds == [0]
    assert validate({"compare": {"seeds": [3, 1]}}, QerlConfig).compare.seeds == [3, 1]
    with pytest.raises(ConfigError, match="seeds"):
        validate({"compare": {"seeds": [0, 0]}}, QerlConfig)
    with pytest.raises(ConfigError, match="seeds"):
        validate({"compare": {"seeds": []}}, QerlConfig)


def test_a_seed_sets_the_three_random_streams_of_a_training_and_nothing_else():
    from qerl_pipeline.pipelines.train.nodes import seeded

    cfg = validate({"train": {"steps": 3}, "data": {"seed": 42}, "model": {"source": "random"}}, QerlConfig)
    out = seeded(cfg, 7)
    assert (out.train.seed, out.rollout.seed, out.aqn.seed, out.data.seed, out.model.random_init.seed) == (
        7,
        7,
        7,
        42,
        0,
    )
    assert out.train.steps == 3 and out.data == cfg.data and out.model == cfg.model  # same prompts, same base
    assert (cfg.train.seed, cfg.rollout.seed, cfg.aqn.seed) == (0, 0, 0)  # the shared config is not changed in place


def test_the_pipeline_reads_the_seeds_as_a_parameter_of_every_branch():
    """The shape is fixed before parameters are known: each branch's nodes loop over ``compare.seeds``."""
    from qerl_pipeline.pipelines.compare.pipeline import create_pipeline

    pipe = create_pipeline()
    for m in METHODS:
        train, evaluate = (
            next(n for n in pipe.nodes if n.name == f"compare.{m}.{x}") for x in ("train_policy", "evaluate_policies")
        )
        config = next(n for n in pipe.nodes if n.name == f"compare.{m}.evaluation_config")
        assert "params:compare" in train.inputs and "params:compare" in config.inputs


def test_methods_choose_the_branches_and_take_a_space_separated_string():
    """``kedro run --params`` splits on commas: several methods (or seeds) come as one space-separated string."""
    from qerl_pipeline.config import CompareConfig, compare_branch

    assert CompareConfig.model_validate({"methods": "qerl lora", "seeds": "0 1 2"}).seeds == [0, 1, 2]
    assert validate({"compare": {"methods": "qerl lora"}}, QerlConfig).compare.methods == ["qerl", "lora"]
    for bad, field in (
        ([], "compare.methods"),
        ("qerl qerl", "methods: each method once"),
        ("qerl bogus", r"compare\.methods\.1"),
    ):
        with pytest.raises(ConfigError, match=field):
            validate({"compare": {"methods": bad}}, QerlConfig)
    assert compare_branch(CompareConfig(methods="qerl lora", seeds="3 4"), "lora") == ([3, 4], "")
    why = "compare.qlora: not in compare.methods, skipped"
    assert compare_branch(CompareConfig(methods=["qerl", "lora"]), "qlora") == ([0], why)
    assert compare_branch(CompareConfig(), "qlora") == ([0], "")  # the default: every branch runs


def test_the_pipeline_reads_the_methods_as_a_parameter_of_every_branch():
    from qerl_pipeline.pipelines.compare.pipeline import create_pipeline

    pipe = create_pipeline()
    for m in METHODS:
        for x in ("train_policy", "evaluation_config", "export_config"):
            node = next(n for n in pipe.nodes if n.name == f"compare.{m}.{x}")
            assert "params:compare" in node.inputs, node.name


def test_a_branch_left_out_of_methods_trains_and_evaluates_nothing(tmp_path, caplog):
    """The nodes of a branch not in compare.methods return the ``skipped`` marker at once: no base, adapter,
    run folder or engine is touched (the paths given do not exist), and the report refuses to read it as a run."""
    import logging

    from qerl_pipeline.config import CompareConfig, TrackingConfig
    from qerl_pipeline.pipelines.compare.nodes import build_report
    from qerl_pipeline.pipelines.evaluate.nodes import eval_outputs, run_evaluation
    from qerl_pipeline.pipelines.train.nodes import train_policy

    missing = tmp_path / "nothing-here"
    group = {"run_id": "r0", "experiment_id": "0"}
    cfg = validate({"method": "qlora", "train": {"output_dir": str(missing)}}, QerlConfig)
    compare = CompareConfig(seeds="0 1", methods="qerl lora")
    with caplog.at_level(logging.INFO):
        adapters, summary = train_policy([], str(missing), cfg, compare_group=group, compare=compare)
        result = run_evaluation(
            {}, str(missing), str(missing), cfg.model_copy(update={"compare": compare}), compare_group=group
        )
    why = "compare.qlora: not in compare.methods, skipped"
    assert adapters == {} and summary == {"method": "qlora", "skipped": why, "seeds": [], "runs": []}
    assert result["skipped"] == why and result["records"] == []
    assert caplog.text.count(why) == 2 and not missing.exists()
    records, table, metrics = eval_outputs(result)
    assert records == [] and metrics == {} and table.to_dict(orient="list") == {"skipped": [why]}
    with pytest.raises(ValueError, match="compare.methods lists 'qlora', but its branch's train_summary says"):
        build_report(
            group, CompareConfig(methods=["qlora"]), TrackingConfig(), qlora_summary=summary, qlora_accuracy=table
        )


def test_the_report_is_built_one_way():
    """The compare pipeline's report node is the one report path (no second pipeline builds it from MLflow runs);
    an older config's compare.reuse_group, that path's option, gets the unknown-key error."""
    from kedro.framework.project import configure_project

    configure_project("qerl_pipeline")
    from qerl_pipeline.pipeline_registry import register_pipelines

    registered = register_pipelines()
    assert "compare_report" not in registered
    builders = {n.name for p in registered.values() for n in p.nodes if "compare_report_report_html" in n.outputs}
    assert builders == {"build_comparison_report"}
    with pytest.raises(ConfigError, match=r"compare\.reuse_group: Extra inputs are not permitted"):
        validate({"compare": {"reuse_group": "0123"}}, QerlConfig)
