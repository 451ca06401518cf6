"""export nodes: find the training, write its export folder, score the 4-bit policy, report and register it.

The work is the ``export`` package (``folders``, ``accuracy``, ``registry``); these nodes find what to
export and shape the datasets:

* ``export_policy``: the ``exports`` dataset's save, ``{<method>: folder}`` standalone (the training of
  ``params:method`` whose seed is ``train.seed``), ``{seed-<k>: folder}`` in a compare branch (every seed
  of ``compare.seeds``, with ``export.in_compare``). Each folder is built atomically in the training's
  run folder (``<run_dir>/export``) and moved into the dataset by the catalog. A missing training is an
  ``adapter.MissingTraining`` (one ``Error:`` line naming it and the command that makes it), raised
  before any model loads; a base that is not the one the training used (its fingerprint differs from
  the one the training logged) an ``export.ExportInputError``.
* ``evaluate_exports``: ``export_eval_result``, ``trained`` (+ ``base``) and ``merged_nvfp4`` per seed on
  the ``evaluate`` section's problems (``export.accuracy``), unless ``export.evaluate`` is off.
* ``report_exports``: ``export_report``, the exports (folders, load commands, 4-bit weight error), the
  accuracies with intervals and the 4-bit cost; logged into each training's MLflow run (metrics
  ``eval/merged_nvfp4/...`` and ``export/...``, ``export/export.json``) with a registered model version
  (``export.register_model``).

A compare branch whose method ``compare.methods`` leaves out, or any branch while ``export.in_compare``
is off, exports nothing: ``export_policy`` logs why (once per branch), every node returns an empty
marker (``config.SKIPPED_BRANCH``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from qerl_pipeline.adapter import adapter_meta, trained_adapter
from qerl_pipeline.config import SKIPPED_BRANCH, ModelConfig, QerlConfig, compare_branch
from qerl_pipeline.datasets.hf_model_folder import folder_of
from qerl_pipeline.evaluation.evaluator import EvalResult
from qerl_pipeline.evaluation.seeds import accuracy_rows, evaluate_config, flatten_prompts
from qerl_pipeline.export import ExportInputError
from qerl_pipeline.export.accuracy import (
    QUANTIZED,
    TRAINED,
    cost_rows,
    cost_sentence,
    evaluate_export,
    log_cost,
    seed_rows,
)
from qerl_pipeline.export.folders import MERGED, base_folder, read_manifest, write_export
from qerl_pipeline.export.registry import register_export, registered_name, training_fingerprint
from qerl_pipeline.quantization.store import fingerprint_diff, stored_fingerprint
from qerl_pipeline.tracking import MlflowLogger, label_run, run_name, scalar_metrics

log = logging.getLogger(__name__)


def _trainings(trained_adapters: Any, cfg: QerlConfig, branch: bool) -> tuple[dict[str, tuple[int | None, Path]], str]:
    """``({dataset key: (seed, adapter folder)}, "")`` of the trainings to export, or ``({}, why none)``."""
    root, method, want = folder_of(trained_adapters), cfg.method, cfg.train.seed
    if not branch:
        adapter = trained_adapter(root, method, want_seed=want)
        return {method: (adapter_meta(adapter).get("seed", want), adapter)}, ""
    seeds, skipped = compare_branch(cfg.compare, method)
    if skipped:
        return {}, skipped
    if not cfg.export.in_compare:
        return {}, f"compare.{method}: export.in_compare is off, not exported"
    return {f"seed-{s}": (s, trained_adapter(root, method, s)) for s in seeds}, ""


def _check_base(adapter: Path, base_dir: Path) -> None:
    """Refuse a base whose fingerprint differs from the one the training logged (warn where it cannot be told)."""
    meta = adapter_meta(adapter)
    recorded, current = training_fingerprint(meta.get("mlflow_run_id")), stored_fingerprint(base_dir)
    if recorded is None or current is None:
        log.warning(
            "export %s: cannot tell whether %s is the base the training used (no fingerprint %s); exporting over it",
            adapter,
            base_dir,
            "in its run" if recorded is None else "stamp in the base",
        )
        return
    if recorded.get("digest") != current.get("digest"):
        diff = "; ".join(fingerprint_diff(recorded, current)[:3])
        raise ExportInputError(
            f"the base {base_dir} is not the one {adapter} was trained on (fingerprint: {diff}); "
            "quantize with the training's settings again, or train again on this base"
        )


def _stage(adapter: Path) -> Path:
    """Where an export is built before the catalog moves it away: ``<run_dir>/export`` of its training, else
    ``.<adapter>.export`` beside the adapter (the same filesystem as the datasets, so the move is a rename)."""
    run_dir = adapter_meta(adapter).get("run_dir")
    if run_dir and Path(run_dir).is_dir():
        return Path(run_dir) / "export"
    return adapter.parent / f".{adapter.name}.export"


def export_policy(
    trained_adapters: Any, base: Any, cfg: QerlConfig, compare_group: dict | None = None
) -> dict[str, str]:
    """Write the export of each training to export (module docstring); the ``exports`` dataset's save.

    ``base``: the folder of bases (``existing_base_models``, standalone) or the method's base folder (compare);
    ``cfg``: the ``export_config`` the pipeline gathers."""
    method, ec, qc = cfg.method, cfg.export, cfg.quantize
    targets, why = _trainings(trained_adapters, cfg, bool(compare_group))
    if why:
        log.info(why)
        return {}
    base_dir = base_folder(folder_of(base), method)
    out = {}
    for key, (_, adapter) in targets.items():
        _check_base(adapter, base_dir)
        stage = _stage(adapter)
        write_export(adapter, base_dir, stage, dtype=ec.dtype, ignore=qc.ignore, quantize=qc.model_dump())
        log.info("export of %s (%s) written to %s", method, key, stage)
        out[key] = str(stage)
    return out


def evaluate_exports(
    exports: Any, trained_adapters: Any, base: Any, eval_prompts: Any, cfg: QerlConfig, eval_result: Any = None
) -> dict[str, Any]:
    """``trained`` (+ ``base``) and ``merged_nvfp4`` of every exported training (``export.accuracy``).

    ``eval_result``: a compare branch's evaluation (given in a branch only), which orders this node after it, so
    its logged evaluation of ``trained`` is reused."""
    method = cfg.method
    targets, why = _trainings(trained_adapters, cfg, eval_result is not None)
    if not why and not cfg.export.evaluate:
        why = f"export.evaluate is off: {QUANTIZED} of {method} not scored"
        log.info(why)
    if why:  # a branch that exports nothing: export_policy said why
        return {**EvalResult(records=[]).as_dict(), SKIPPED_BRANCH: why}
    root = folder_of(exports)
    result = evaluate_export(
        method,
        base_folder(folder_of(base), method),
        {s: a for s, a in targets.values()},
        {s: root / key for key, (s, _) in targets.items()},
        flatten_prompts(eval_prompts),
        evaluate_config(cfg.evaluate, cfg.data),
        cfg.reward,
        cfg.model,
        cfg.rollout,
    )
    return result.as_dict()


def _accuracy_tags(records: list[dict[str, Any]], seed: Any) -> dict[str, float]:
    """``eval/<policy>/<benchmark>/pass1`` of ``trained`` and ``merged_nvfp4`` for one seed
    (a model version's tags)."""
    out = {}
    for policy in (TRAINED, QUANTIZED):
        for row in seed_rows(records, seed, policy):
            out[f"eval/{policy}/{row['benchmark']}/pass1"] = round(float(row["pass1"]), 4)
    return out


def report_exports(
    export_eval_result: dict[str, Any],
    exports: Any,
    trained_adapters: Any,
    cfg: QerlConfig,
    compare_group: dict | None = None,
) -> dict[str, Any]:
    """The ``export_report``; each export logged into its training's run and registered (module docstring)."""
    method, ec, model = cfg.method, cfg.export, cfg.model
    targets, why = _trainings(trained_adapters, cfg, bool(compare_group))
    if why:
        return {"method": method, SKIPPED_BRANCH: why}
    evaluated = not export_eval_result.get(SKIPPED_BRANCH)
    records = export_eval_result.get("records", []) if evaluated else []
    root, name = folder_of(exports), registered_name(ec.registered_name, model, method)
    entries = []
    for key, (seed, _) in targets.items():
        folder = root / key
        manifest = read_manifest(folder)
        run_id = manifest.get("training_run_id")
        entry = {
            "seed": seed,
            "folder": str(folder),
            "training_run_id": run_id,
            "folders": manifest.get("folders", {}),
            "weight_error": manifest.get("weight_error", {}),
        }
        if run_id:
            logger = MlflowLogger(run_id=run_id)
            for fmt_name, err in entry["weight_error"].items():
                logger.log_metrics(scalar_metrics(err, f"export/{fmt_name}/"), step=0)
            logger.log_text(json.dumps(manifest, indent=1, default=str), "export/export.json")
            if records:
                log_cost(run_id, records, seed)
        else:
            log.warning("export %s: its training has no MLflow run id; logging into this run instead", folder)
        if ec.register_model:
            tags = {
                "method": method,
                "seed": seed,
                "qerl.trained_run_id": run_id,
                "export.dtype": ec.dtype,
                "model": manifest.get("model"),
                **_accuracy_tags(records, seed),
            }
            entry["registered"] = register_export(
                folder / MERGED, run_id or MlflowLogger().run_id, name, tags, log_weights=ec.log_weights
            )
        entries.append(entry)
    rows = cost_rows(records) if records else []
    report = {
        "method": method,
        "model": model.name,
        "dtype": ec.dtype,
        "exports": entries,
        "evaluated": bool(records),
        "cost_4bit": rows,
        "cost_4bit_text": [cost_sentence(r) for r in rows],
        "accuracy": accuracy_rows(records) if records else [],
        "skipped": export_eval_result.get("skipped", []),
    }
    if not compare_group:
        _label_export_run(method, model, entries[0] if entries else {})
    return report


def _label_export_run(method: str, model: ModelConfig, entry: dict[str, Any]) -> None:
    """Name and tag the ``kedro run``'s own MLflow run as an export's, unless it is the training's run itself
    (``--pipelines=train,export`` in one run: it stays the training's)."""
    run_id = entry.get("training_run_id")
    if run_id and MlflowLogger().run_id == run_id:
        return
    label_run(
        run_name("export", method, model, entry.get("seed")),
        "export",
        {"method": method, **({"qerl.trained_run_id": run_id} if run_id else {})},
    )
