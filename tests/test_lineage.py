"""Lineage you can browse: the adapter is a dataset from train to evaluate; compare is one branch per method.

Fast tier: the pipeline objects themselves and the typed sections its nodes get (no Kedro session).
Integration tier: the graph ``kedro viz build`` writes (build/api/pipelines/*), which is what a user browses.
"""

from __future__ import annotations

import json

import pytest

from qerl_pipeline.config import METHOD_FORMAT, METHODS, QerlConfig, validate
from tests.helpers.project import PROJECT as ROOT
from tests.helpers.project import project_copy, run_kedro


def _producer(pipe, dataset):
    (node,) = [n for n in pipe.nodes if dataset in n.outputs]
    return node


def _consumers(pipe, dataset):
    return [n for n in pipe.nodes if dataset in n.inputs]


def test_train_writes_the_adapter_dataset_that_evaluate_reads():
    from qerl_pipeline.pipelines.evaluate.pipeline import create_pipeline as evaluate
    from qerl_pipeline.pipelines.train.pipeline import create_pipeline as train

    assert _producer(train(), "trained_adapters").name == "train_policy"
    assert [n.name for n in _consumers(evaluate(), "trained_adapters")] == ["evaluate_policies"]
    # and the base: quantize's dataset, read by both
    assert _producer(train(), "base_model").name == "select_base"
    assert "base_model" in _consumers(evaluate(), "base_model")[0].inputs


def test_export_reads_the_trained_adapters_and_writes_its_folders_as_datasets():
    from qerl_pipeline.pipelines.export.pipeline import create_pipeline as export
    from qerl_pipeline.pipelines.train.pipeline import create_pipeline as train

    pipe = export()
    assert _producer(train(), "trained_adapters").name == "train_policy"
    node = _producer(pipe, "exports")
    assert node.name == "export_policy" and {"trained_adapters", "existing_base_models"} <= set(node.inputs)
    assert _producer(pipe, "export_eval_result").name == "evaluate_export"
    assert {"exports", "eval_prompts"} <= set(_producer(pipe, "export_eval_result").inputs)
    assert {"exports", "export_eval_result"} <= set(_producer(pipe, "export_report").inputs)
    # train + export in one run: the export comes after the training that writes its input
    combined = train() + pipe
    order = [n.name for n in combined.nodes]
    assert order.index("train_policy") < order.index("export_policy") < order.index("evaluate_export")


def test_compare_has_one_branch_per_method_on_shared_bases():
    from qerl_pipeline.pipelines.compare.pipeline import create_pipeline

    pipe = create_pipeline()
    for m in METHODS:
        ns = f"compare.{m}"
        mine = [n for n in pipe.nodes if n.namespace == ns]
        assert sorted(n.name for n in mine) == sorted(
            f"{ns}.{x}"
            for x in (
                "training_config",
                "train_policy",
                "evaluation_config",
                "evaluate_policies",
                "export_config",
                "evaluation_outputs",
                "export_policy",
                "evaluate_export",
                "report_export",
            )
        )
        train = _producer(pipe, f"{ns}.trained_adapters")
        assert train.name == f"{ns}.train_policy"
        assert f"base_{METHOD_FORMAT[m]}" in train.inputs
        # the branch is its method's registration: the method bound into its nodes, no parameter of its own
        assert all(not i.startswith(f"params:{ns}") for n in mine for i in n.inputs), [n.inputs for n in mine]
        configs = [n for n in mine if n.name.endswith("_config")]
        assert len(configs) == 3 and all(n.func.keywords == {"method": m} for n in configs)
        assert sorted(n.name for n in _consumers(pipe, f"{ns}.trained_adapters")) == sorted(
            f"{ns}.{x}" for x in ("evaluate_policies", "export_policy", "evaluate_export", "report_export")
        )
        assert f"{ns}.eval_accuracy" in _producer(pipe, "compare_runs").inputs
        # the branch's export: on its base, after its evaluation (reused), before the report
        export = _producer(pipe, f"{ns}.exports")
        assert export.name == f"{ns}.export_policy" and f"base_{METHOD_FORMAT[m]}" in export.inputs
        assert f"{ns}.eval_result" in _producer(pipe, f"{ns}.export_eval_result").inputs
        assert f"{ns}.export_report" in _producer(pipe, "compare_runs").inputs
    # one quantize node per format, shared by the methods on it
    for fmt in set(METHOD_FORMAT.values()):
        assert _producer(pipe, f"base_{fmt}").name == f"quantize_{fmt}"
    users = [n.namespace for n in _consumers(pipe, "base_nvfp4") if n.name.endswith("train_policy")]
    assert sorted(users) == ["compare.qerl", "compare.qerl_noaqn"]
    # every parameter the pipeline reads is part of the validated config
    cfg = validate({}, QerlConfig).model_dump()
    for name in sorted({i for n in pipe.nodes for i in n.inputs if i.startswith("params:")}):
        value = cfg
        for part in name.removeprefix("params:").split("."):
            assert isinstance(value, dict) and part in value, name
            value = value[part]


def test_a_compare_branch_entry_is_an_unknown_key_naming_it():
    """A branch is its method's registration: the old ``compare.<method>: {method: ...}`` entries are refused."""
    from qerl_pipeline.config import ConfigError

    with pytest.raises(ConfigError, match=r"compare\.qlora"):
        validate({"compare": {"qlora": {"method": "qlora"}}}, QerlConfig)


@pytest.mark.kedro_run
def test_kedro_viz_graph(tmp_path):
    """``kedro viz build``: train -> trained_adapters -> evaluate and export; the parameters the training reads
    drawn into its config's node; one train and one evaluate node per method."""
    root = project_copy(tmp_path / "project")
    run_kedro(root, "viz", "build", timeout=300)

    def graph(name):
        data = json.loads((root / "build" / "api" / "pipelines" / name).read_text())
        return {n["id"]: n for n in data["nodes"]}, data["edges"]

    nodes, edges = graph("train")
    (adapters,) = [i for i, n in nodes.items() if n["name"] == "trained_adapters" and n["type"] == "data"]
    (train,) = [i for i, n in nodes.items() if n["name"] == "train_policy" and n["type"] == "task"]
    assert {"source": train, "target": adapters} in edges
    # the parameters the training reads feed the node that gathers its config, which feeds the training
    (config,) = [i for i, n in nodes.items() if n["name"] == "training_config" and n["type"] == "task"]
    (gathered,) = [i for i, n in nodes.items() if n["name"] == "training_config" and n["type"] == "data"]
    read = {nodes[e["source"]]["name"].removeprefix("params:") for e in edges if e["target"] == config}
    assert {"method", "model", "optim", "aqn", "grpo"} <= read, read
    assert {"source": config, "target": gathered} in edges and {"source": gathered, "target": train} in edges
    enodes, eedges = graph("evaluate")
    (evaluate,) = [i for i, n in enodes.items() if n["name"] == "evaluate_policies" and n["type"] == "task"]
    assert {"source": adapters, "target": evaluate} in eedges  # the same dataset id in both graphs

    xnodes, xedges = graph("export")  # the export reads the same adapter dataset and writes its folders as one
    (export,) = [i for i, n in xnodes.items() if n["name"] == "export_policy" and n["type"] == "task"]
    (exports,) = [i for i, n in xnodes.items() if n["name"] == "exports" and n["type"] == "data"]
    assert {"source": adapters, "target": export} in xedges and {"source": export, "target": exports} in xedges

    cnodes, _ = graph("compare")
    tasks = [n for n in cnodes.values() if n["type"] == "task"]
    for kind in ("train_policy", "evaluate_policies"):
        spaces = sorted(
            ns for n in tasks if n["name"] == kind for ns in (n.get("modular_pipelines") or []) if ns.count(".") == 1
        )
        assert spaces == sorted(f"compare.{m}" for m in METHODS), (kind, spaces)


def test_the_nodes_get_the_validated_sections_and_the_catalog_keeps_them_as_written(tmp_path):
    """The config hook validates the tree once and hands each node's ``params:`` inputs as that typed tree holds
    them; the catalog (what kedro-mlflow logs as the run's parameters) keeps the values as written, as
    ``QerlContext`` does not let Kedro build the sections a second time."""
    from kedro.config import OmegaConfigLoader
    from kedro.framework.hooks.manager import _NullPluginManager
    from kedro.framework.project import configure_project, pipelines

    from qerl_pipeline.config import CompareConfig, ModelConfig
    from qerl_pipeline.hooks import QerlContext, ValidateConfigHook

    configure_project("qerl_pipeline")
    runtime = {"compare": {"seeds": "3 4"}, "model": {"source": "random"}}
    loader = OmegaConfigLoader(str(ROOT / "conf"), base_env="base", default_run_env="local", runtime_params=runtime)
    context = QerlContext(
        project_path=ROOT,
        config_loader=loader,
        env=None,
        package_name="qerl_pipeline",
        hook_manager=_NullPluginManager(),
        runtime_params=runtime,
    )
    catalog = context.catalog
    assert catalog.load("params:model")["source"] == "random" and catalog.load("params:compare.seeds") == "3 4"
    hook = ValidateConfigHook()
    hook._context = context  # after_context_created's (which also tries the tracking store)
    pipe = pipelines["compare"]
    hook.before_pipeline_run({}, pipe, catalog)
    (node,) = [n for n in pipe.nodes if n.name == "compare.lora.training_config"]
    inputs = {name: catalog.load(name) for name in node.inputs}
    typed = hook.before_node_run(node, inputs)
    assert set(typed) == set(node.inputs) and isinstance(typed["params:model"], ModelConfig)
    assert typed["params:model"].source == "random" and isinstance(inputs["params:model"], dict)
    (train,) = [n for n in pipe.nodes if n.name == "compare.lora.train_policy"]
    (compare,) = hook.before_node_run(train, {"params:compare": {}, "train_prompts": []}).items()  # not the data
    assert compare[0] == "params:compare" and isinstance(compare[1], CompareConfig) and compare[1].seeds == [3, 4]
    # a node run without its bundling node (--nodes, --from-nodes) reads the config gathered from this run's
    hook.before_pipeline_run({}, pipelines["evaluate"].only_nodes("evaluate_policies"), catalog)
    cfg = catalog.load("evaluation_config")
    assert cfg.method == "qerl" and cfg.model.source == "random" and cfg.evaluate == hook._config.evaluate
