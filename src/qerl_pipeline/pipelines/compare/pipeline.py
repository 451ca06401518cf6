"""compare: every method trained and evaluated on one config, one branch per method, then one report.

Declared, so ``kedro viz`` shows the experiment:

* data_prep (prompts and eval sets, shared);
* ``open_compare_run`` -> ``compare_group`` (the compare's MLflow run, parent of the branches');
* one quantize node per base format, ``quantize_<fmt>`` -> ``base_<fmt>``, shared by the methods
  on it (qerl and qerl_noaqn share ``base_nvfp4``), reused when its fingerprint matches;
* per method a branch in Kedro namespace ``compare.<method>``: the train pipeline's template
  (``compare.<method>.train_policy`` -> ``compare.<method>.trained_adapters``,
  ``compare.<method>.train_summary``), the evaluate pipeline's template
  (``compare.<method>.evaluate_policies`` -> ``...eval_records``, ``...eval_accuracy``) and the export
  pipeline's (``...export_policy`` -> ``...exports``, ``...export_report``; it exports and scores the
  4-bit merged policy of every seed only with ``export.in_compare``, off by default: on CPU each
  export is another engine start and evaluation per method and seed). Every parameter section is
  shared; the branch's method is bound into its config nodes (``train.pipeline.with_method``), so a method is
  its registration (``config.register_method``), with no ``compare.<method>`` entry in parameters.yml;
* ``build_comparison_report``, joining the branches: means and 95% intervals over the seeds and
  the paper's claims put to the data (``evaluation/report.py``, ``evaluation/stats.py``). Every
  file of the report is one of its outputs, a catalog dataset ``compare_report_<stem>_<ext>``
  (``report_outputs``), besides ``compare_runs``, ``compare_accuracy`` and ``compare_summary``.

Seeds (``compare.seeds``): the pipeline's shape does not depend on them (Kedro builds it before
parameters are known). Each branch's nodes train and evaluate every seed in turn: one run
folder ``<train.output_dir>/compare/seed-<k>/<method>``, one adapter ``seed-<k>/`` in the
branch's ``trained_adapters`` folder and one child MLflow run (tagged ``seed``) per method and
seed. A seed sets ``train.seed``, ``rollout.seed`` and ``aqn.seed`` of its training
(``train/nodes.py::seeded``); the base, the prompts and the evaluation are the same
for every seed. The base alone is evaluated once per branch, not once per seed.

Methods (``compare.methods``): what the compare trains, evaluates and reports. Every branch
stays in the pipeline, so ``kedro viz`` and the lineage are the same whatever the list; the
nodes of a branch whose method is not listed train and evaluate nothing: they log
``compare.<method>: not in compare.methods, skipped`` and write a marker (``config.SKIPPED_BRANCH``:
its ``train_summary`` and ``eval_result`` hold that sentence under ``skipped``; its adapter
folder gets no new ``seed-<k>/``) that the evaluation's outputs and the report understand:
no run folder, no MLflow run, no engine start for it. Skipping inside the nodes, rather than
leaving the branches out of the pipeline, is what Kedro allows: ``register_pipelines`` takes
no arguments (Kedro calls it while it creates the context), so a pipeline that depended on
``compare.methods`` would need its own config loading outside Kedro's, would ignore
``kedro run --params compare.methods=...`` and would make ``kedro viz`` draw a different
experiment per config. The bases are still made (or reused) for every format: the
``quantize_<fmt>`` nodes' outputs are model folders, which cannot be written as a marker,
and a base is reused by fingerprint once made.

Run one branch alone with Kedro's selection options, e.g. ``kedro run --pipelines=compare
--namespaces=compare.qlora`` (its inputs, the prompts, ``compare_group`` and its base, are
persisted by an earlier compare run), then ``--nodes=build_comparison_report``.

Resume: a compare that was killed is resumed by running it again with the same config.
Each (method, seed) training resumes its own run folder: a finished one is reused as it is
(no training; its evaluation is read back from its run when the adapter is the one
evaluated), the interrupted one resumes from its newest checkpoint into its own MLflow run,
the others start. Bases are reused by fingerprint.

The report again, from the runs the branches' persisted summaries name (nothing is trained):
``kedro run --pipelines=compare --nodes=build_comparison_report``.
"""

import warnings

from kedro.pipeline import Node, Pipeline, pipeline

from qerl_pipeline.config import COMPARE_METHODS, METHOD_FORMAT
from qerl_pipeline.evaluation.report import REPORT_FILES
from qerl_pipeline.pipelines.compare.nodes import build_report, open_compare
from qerl_pipeline.pipelines.data_prep.pipeline import create_pipeline as data_prep
from qerl_pipeline.pipelines.evaluate.pipeline import SECTIONS as EVAL_SECTIONS
from qerl_pipeline.pipelines.evaluate.pipeline import evaluation_nodes
from qerl_pipeline.pipelines.export.pipeline import SECTIONS as EXPORT_SECTIONS
from qerl_pipeline.pipelines.export.pipeline import export_nodes
from qerl_pipeline.pipelines.quantize.pipeline import format_nodes
from qerl_pipeline.pipelines.train.pipeline import COMPARE_PARAM, training_nodes
from qerl_pipeline.pipelines.train.pipeline import SECTIONS as TRAIN_SECTIONS

#: Parameters every branch shares (all: its method is bound), compare's section included.
SHARED_PARAMS = sorted({f"params:{s}" for s in (*TRAIN_SECTIONS, *EVAL_SECTIONS, *EXPORT_SECTIONS)} | {COMPARE_PARAM})
#: The report nodes' outputs (``nodes.report_outputs``'s keys) -> datasets; ``<stem>.<ext>`` ->
#: ``compare_report_<stem>_<ext>``.
OUTPUTS = {
    "runs": "compare_runs",
    "accuracy_table": "compare_accuracy",
    "summary": "compare_summary",
    **{name: "compare_report_" + name.replace(".", "_") for name in REPORT_FILES},
}


def namespace(method: str) -> str:
    """The Kedro namespace of a method's branch."""
    return f"compare.{method}"


def _group() -> Pipeline:
    return Pipeline(
        [
            Node(
                open_compare,
                ["params:model", "params:train"],
                "compare_group",
                name="open_compare_run",
            )
        ]
    )


def branch(method: str) -> Pipeline:
    """The train + evaluate templates for ``method`` in its namespace, on its format's shared base."""
    return pipeline(
        training_nodes(method) + evaluation_nodes(method) + export_nodes(method),
        namespace=namespace(method),
        inputs={
            "train_prompts": "train_prompts",
            "eval_prompts": "eval_prompts",
            "compare_group": "compare_group",
            "data_prep_report": "data_prep_report",
            "base_model": f"base_{METHOD_FORMAT[method]}",
        },
        parameters={p: p for p in SHARED_PARAMS},
        tags=["compare", method],
    )


def create_pipeline(**kwargs) -> Pipeline:
    """data_prep + the compare run + a base per format + a branch per method + the report."""
    bases = format_nodes(sorted({METHOD_FORMAT[m] for m in COMPARE_METHODS}))
    branches = sum((branch(m) for m in COMPARE_METHODS), Pipeline([]))
    report_inputs = {"compare_group": "compare_group", "compare": "params:compare", "tracking": "params:tracking"}
    for m in COMPARE_METHODS:
        report_inputs[f"{m}_summary"] = f"{namespace(m)}.train_summary"
        report_inputs[f"{m}_accuracy"] = f"{namespace(m)}.eval_accuracy"
        report_inputs[f"{m}_export"] = f"{namespace(m)}.export_report"
    with warnings.catch_warnings():  # the branches' dataset names are namespaced (dotted) by design
        warnings.filterwarnings("ignore", message="One or more dataset names contain")
        report = Pipeline([Node(build_report, report_inputs, OUTPUTS, name="build_comparison_report")], tags="compare")
    return data_prep() + _group() + bases + branches + report
