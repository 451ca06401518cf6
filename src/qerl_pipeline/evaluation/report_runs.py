"""The compare report's input: the MLflow runs of the methods, one ``RunData`` per method and seed.

Inputs are MLflow runs only (read with ``MlflowClient``), so the same report can be rebuilt at
any time from the tracking store: by the compare pipeline's report node (right after it trained
and evaluated the methods, or alone with ``--nodes=build_comparison_report``), or by
``notebooks/compare_runs.ipynb`` (``load_runs``).

What a run must carry
---------------------
- the method: tag ``method`` (the train pipeline sets it), else the param ``method``
  (kedro-mlflow logs every parameter);
- training curves, per step: one of the names listed for each entry of ``CURVES``
  (the first name present wins, so a renamed metric needs one edit here);
- system numbers: the entries of ``SYSTEM``, each reduced over its steps (mean
  tokens/s, mean step time, max peak memory, last weight bytes);
- evaluation metrics as written by ``metrics.metric_dict``:
  ``eval/<policy>/<benchmark>/<name>`` with policy ``trained`` or ``base``;
- optionally the per-problem records (``eval/result.json`` or ``eval/records.json``), from
  which the intervals over seeds and problems are computed (``report_tables``);
- where the training was exported with its evaluation (``export/accuracy.py``): the 4-bit merged
  policy as one more policy, ``eval/merged_nvfp4/<benchmark>/<name>`` and its records in
  ``export/result.json``, which ``eval_records`` adds to the run's.

Runs are selected per method and seed: in a compare group (``GROUP_TAG``) the newest run of
each (method, seed), where the seed is the run's tag ``seed`` (compare sets it), else its
param ``train.seed``; outside a group the newest run per method. A missing method is
reported, never silently dropped.
"""

from __future__ import annotations

import ast
import json
import math
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

#: GROUP_TAG groups the runs of one compare invocation (value: the compare run's id); runs with
#: ROLE_TAG = compare (the compare pipeline's own run) are never method rows.
from qerl_pipeline import metric_names
from qerl_pipeline.config import METHODS
from qerl_pipeline.tracking import GROUP_TAG, ROLE_TAG, metric_history

#: Per-step training curves: key -> (title, the metric the trainer writes).
CURVES: dict[str, tuple[str, str]] = {
    "reward": ("Reward (mean over rollouts)", metric_names.REWARD_MEAN),
    "entropy": ("Policy entropy (nats/token)", metric_names.POLICY_ENTROPY),
    "accuracy": ("Training accuracy", metric_names.REWARD_ACCURACY),
    "sigma": ("AQN sigma", metric_names.AQN_SIGMA),
    "format": ("Format reward", metric_names.REWARD_FORMAT),
    "length": ("Completion length (tokens)", metric_names.COMPLETION_LENGTH),
    "stage": ("AQN stage", metric_names.AQN_STAGE),
}

#: System numbers: key -> (title, the metric, reduction over steps).
SYSTEM: dict[str, tuple[str, str, str]] = {
    "rollout_tokens_per_s": ("Rollout tokens/s", metric_names.ROLLOUT_TOKENS_PER_S, "mean"),
    "step_time_s": ("Step time (s)", metric_names.STEP_TIME_S, "mean"),
    "peak_memory_gib": ("Peak memory (GiB)", metric_names.PEAK_MEMORY_GB, "max"),
    "weight_mib": ("Base weight size (MiB)", metric_names.BASE_WEIGHT_MIB, "last"),
    "linear_bytes_ratio": ("Linear weight bytes / BF16", metric_names.LINEAR_BYTES_RATIO, "last"),
}

EVAL_METRIC = re.compile(r"^eval/(?P<policy>[^/]+)/(?P<benchmark>[^/]+)/(?P<name>[^/]+)$")
#: The report's method order: the method registry's (config.METHOD_SPECS).
METHOD_ORDER = METHODS


@dataclass
class RunData:
    """What the report needs of one method's run."""

    method: str
    run_id: str
    run_name: str = ""
    status: str = ""
    start_time: int = 0
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # latest value of every metric
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # curve/system metrics per step
    eval_run_id: str | None = None  # a separate evaluate run whose eval/ and base/ metrics were merged in
    seed: int | None = None  # tag ``seed`` (compare's), else param ``train.seed``
    records: list[dict[str, Any]] | None = None  # per-problem evaluation records (``eval/records.json``), if logged

    def curve(self, key: str) -> list[tuple[int, float]]:
        """Steps and values of a curve (``CURVES`` or ``SYSTEM`` key); empty if the run lacks it."""
        name = CURVES[key][1] if key in CURVES else SYSTEM[key][1]
        return sorted(self.history[name]) if self.history.get(name) else []

    def system(self, key: str) -> float:
        """A ``SYSTEM`` number reduced over its steps; nan if the run lacks it."""
        _, name, how = SYSTEM[key]
        values = [v for _, v in self.curve(key)]
        if not values and name in self.metrics:
            values = [self.metrics[name]]
        if not values:
            return math.nan
        if how == "mean":
            return sum(values) / len(values)
        if how == "max":
            return max(values)
        return values[-1]

    def eval_rows(self) -> list[dict[str, Any]]:
        """Evaluation metrics as rows {policy, benchmark, <name>: value}."""
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        for key, value in self.metrics.items():
            m = EVAL_METRIC.match(key)
            if m:
                row = rows.setdefault(
                    (m["policy"], m["benchmark"]), {"policy": m["policy"], "benchmark": m["benchmark"]}
                )
                row[m["name"]] = value
        return list(rows.values())


def _method_of(run) -> str | None:
    return run.data.tags.get("method") or run.data.params.get("method")


def _seed_of(run) -> int | None:
    for value in (run.data.tags.get("seed"), run.data.params.get("train.seed")):
        try:
            return int(value)
        except (TypeError, ValueError):
            continue
    return None


RECORDS_ARTIFACT = "eval/records.json"
RESULT_ARTIFACT = "eval/result.json"  # evaluator.RESULT_ARTIFACT: the whole result, records with their lists intact
#: An export's evaluation of its 4-bit merged policy, logged into the training's run (export/accuracy.py).
EXPORT_RESULT_ARTIFACT = "export/result.json"
#: That policy's name (and its folder's in an export): the merged policy quantized again to NVFP4.
DEPLOYED_4BIT = "merged_nvfp4"


def _cell(value: Any) -> Any:
    """A ``log_table`` cell: lists were written as their Python repr (``tracking._jsonable``); read them back."""
    if isinstance(value, str) and value.startswith("[") and value.endswith("]"):
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return value
    return value


def eval_records(client: MlflowClient, run_id: str) -> list[dict[str, Any]] | None:
    """The per-problem evaluation records logged into a run, or None.

    ``eval/result.json`` (compare branches: ``evaluator.log_evaluation`` with a key) when present,
    else the ``eval/records.json`` table (``tracking.MlflowLogger.log_table``: list cells as text,
    parsed back by ``_cell``); plus the records of an export's 4-bit policy (``export/result.json``).
    """
    records = None
    for artifact in (RESULT_ARTIFACT, RECORDS_ARTIFACT):
        records = _artifact_records(client, run_id, artifact)
        if records is not None:
            break
    exported = _artifact_records(client, run_id, EXPORT_RESULT_ARTIFACT)
    if exported:
        records = [*(records or []), *exported]
    return records


def _artifact_records(client: MlflowClient, run_id: str, artifact: str) -> list[dict[str, Any]] | None:
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = client.download_artifacts(run_id, artifact, tmp)
            data = json.loads(Path(path).read_text())
        except Exception:  # not logged (a metrics-only run)
            return None
    if isinstance(data, dict) and isinstance(data.get("records"), list):
        return data["records"]
    if isinstance(data, dict) and "columns" in data:
        return [{c: _cell(v) for c, v in zip(data["columns"], row, strict=True)} for row in data["data"]]
    if isinstance(data, list):
        return data
    return None


def _history_names() -> list[str]:
    return [name for _, name in CURVES.values()] + [name for _, name, _ in SYSTEM.values()]


def run_data(client: MlflowClient, run) -> RunData:
    """Fetch what the report needs of one MLflow run (histories only of the known curves)."""
    history = {}
    for name in _history_names():
        if name in run.data.metrics:
            history[name] = metric_history(client, run.info.run_id, name)
    return RunData(
        seed=_seed_of(run),
        records=eval_records(client, run.info.run_id) if _has_eval(run) else None,
        method=_method_of(run) or "?",
        run_id=run.info.run_id,
        run_name=run.info.run_name or "",
        status=run.info.status,
        start_time=int(run.info.start_time or 0),
        tags=dict(run.data.tags),
        params=dict(run.data.params),
        metrics=dict(run.data.metrics),
        history=history,
    )


def load_runs(
    experiment: str,
    methods: Sequence[str] = METHOD_ORDER,
    *,
    tracking_uri: str | None = None,
    group: str | None = None,
    run_ids: Sequence[str] | None = None,
    require_all: bool = True,
    client: MlflowClient | None = None,
) -> list[RunData]:
    """One row per method from the runs of ``experiment`` (by name), in ``methods`` order.

    ``group``: the newest run tagged ``GROUP_TAG = group`` (one compare invocation) per
    method and seed (rows in ``methods`` order, seeds ascending); ``run_ids``: exactly
    those runs. Neither: runs of separate ``kedro run``s, where training and evaluation
    are different MLflow runs: the newest run with training curves is paired with the
    newest run with ``eval/trained/...`` metrics (one run when it has both, as compare's
    runs do); the evaluation run's ``eval/`` and ``base/`` metrics are merged in and its
    id kept in ``RunData.eval_run_id``.

    Runs tagged ``ROLE_TAG = compare`` (the compare pipeline's own run) are never method
    rows. With ``require_all`` a method without a run raises an error naming it and what the
    experiment holds.
    """
    client = client or MlflowClient(tracking_uri=tracking_uri)
    if run_ids:
        runs = [client.get_run(r) for r in run_ids]
    else:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            raise ValueError(f"MLflow experiment {experiment!r} not found at {client.tracking_uri}")
        filt = f"tags.`{GROUP_TAG}` = '{group}'" if group else ""
        runs = client.search_runs(
            [exp.experiment_id], filter_string=filt, order_by=["attributes.start_time DESC"], max_results=5000
        )
    runs = [r for r in runs if r.data.tags.get(ROLE_TAG) != "compare"]
    chosen: dict[str, RunData] = {}
    if group or run_ids:
        per_seed: dict[str, dict] = {}
        for run in runs:
            method, seed = _method_of(run), _seed_of(run)
            mine = per_seed.setdefault(method, {})
            if method in methods and seed not in mine:
                mine[seed] = run_data(client, run)
        for method, by_seed in per_seed.items():
            if by_seed:
                chosen[method] = [by_seed[k] for k in sorted(by_seed, key=lambda x: (x is None, x or 0))]
    else:  # separate `kedro run`s: pair the newest training run with the newest evaluation run
        for method in methods:
            mine = [r for r in runs if _method_of(r) == method]
            trained = next((r for r in mine if _has_curves(r)), None)
            evaluated = next((r for r in mine if _has_eval(r)), None)
            if (trained or evaluated) is None:
                continue
            data = run_data(client, trained or evaluated)
            if trained is not None and evaluated is not None and evaluated.info.run_id != trained.info.run_id:
                _merge_eval(data, evaluated, client)
            chosen[method] = data
    missing = [m for m in methods if m not in chosen]
    if missing and require_all:
        seen = sorted({_method_of(r) or "?" for r in runs})
        raise ValueError(
            f"no MLflow run for method(s) {', '.join(missing)} in experiment {experiment!r}"
            + (f" group {group!r}" if group else "")
            + f"; runs found for: {', '.join(seen) or 'none'}"
        )
    return [r for m in methods if m in chosen for r in (chosen[m] if isinstance(chosen[m], list) else [chosen[m]])]


def _merge_eval(data: RunData, evaluated, client: MlflowClient | None = None) -> RunData:
    """Take the ``eval/`` and ``base/`` metrics (and, with ``client``, the records)
    of a separate evaluation run into ``data``."""
    data.metrics.update({k: v for k, v in evaluated.data.metrics.items() if k.startswith(("eval/", "base/"))})
    data.eval_run_id = evaluated.info.run_id
    if client is not None:
        data.records = eval_records(client, evaluated.info.run_id)
    return data


def load_selected(
    selection: dict[str, Any], *, client: MlflowClient | None = None, tracking_uri: str | None = None
) -> list[RunData]:
    """Rows for ``{method: [{"run_id", "eval_run_id" or None, "seed"}, ...]}`` (what compare records; one
    dict instead of the list: one run), in that order."""
    client = client or MlflowClient(tracking_uri=tracking_uri)
    out = []
    for method, entries in selection.items():
        for ids in [entries] if isinstance(entries, dict) else entries:
            data = run_data(client, client.get_run(ids["run_id"]))
            data.method = method
            if ids.get("seed") is not None:
                data.seed = int(ids["seed"])
            if ids.get("eval_run_id"):
                _merge_eval(data, client.get_run(ids["eval_run_id"]), client)
            out.append(data)
    return out


def selection(runs: Sequence[RunData]) -> dict[str, list[dict[str, Any]]]:
    """The inverse of ``load_selected``: which runs (one per seed) stand for which method."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        out.setdefault(r.method, []).append({"run_id": r.run_id, "eval_run_id": r.eval_run_id, "seed": r.seed})
    return out


def by_method(runs: Sequence[RunData]) -> dict[str, list[RunData]]:
    """The runs of each method (one per seed), methods in first-seen order."""
    out: dict[str, list[RunData]] = {}
    for r in runs:
        out.setdefault(r.method, []).append(r)
    return out


def _has_eval(run) -> bool:
    return any(k.startswith("eval/trained/") for k in run.data.metrics)


def _has_curves(run) -> bool:
    return CURVES["reward"][1] in run.data.metrics
