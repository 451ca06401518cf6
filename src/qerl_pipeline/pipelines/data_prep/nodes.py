"""data_prep nodes: read the configured sources and write prompt records and a report.

Each node takes ``params:data`` as a ``DataConfig`` and is a plain function, usable outside Kedro.
Malformed rows (``data.prompts.row_problem``) fail the node or are dropped per
``data.on_bad_row``; either way each is named by id and source (and, in the user's sets, by
file and line), in the error or in the log and the report. The user's sets
(``data.train_source: file`` with ``data.train_file``, and ``data.eval_files``) are read by
``data.user_sets``; each eval file is prepared after ``data.eval_sources`` under its name. An
eval source that cannot be had is skipped with a warning (and listed under ``skipped`` in the
report) or fails the run, per ``data.on_missing_source``; the training source always fails.
Every such failure is a ``DataError``: the user's to fix, so ``kedro run`` ends with one
``Error:`` message instead of a traceback.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import click

from qerl_pipeline.config import DataConfig, SourceConfig
from qerl_pipeline.data.generator import generate_splits
from qerl_pipeline.data.prompts import UNPARSABLE_GOLD, BadRow, bad_rows_error, make_record, split_valid, system_prompt
from qerl_pipeline.data.sources import SourceUnavailable, load_source
from qerl_pipeline.data.user_sets import load_user_set

log = logging.getLogger(__name__)

GENERATOR = "generator"
#: ``data.train_source`` naming the user's training set, ``data.train_file``.
USER_FILE = "file"


def _generator_rows(cfg: DataConfig, split: str) -> list[dict[str, Any]]:
    problems = generate_splits(cfg.generator)[split]
    return [{"id": p.id, "question": p.question, "gold": str(p.answer), "level": p.level} for p in problems]


def _source_config(cfg: DataConfig, key: str, role: str) -> SourceConfig:
    if key not in cfg.sources:
        raise ValueError(
            f"data.{role}: source {key!r} has no entry under data.sources (known: {', '.join(cfg.sources)})"
        )
    return cfg.sources[key]


def _records(
    cfg: DataConfig, name: str, split: str, rows: list[dict[str, Any]], limit: int | None
) -> tuple[list[dict[str, Any]], list[BadRow], dict[str, Any]]:
    """Validate rows (up to ``limit`` good ones) and build prompt records plus a summary."""
    good, bad = split_valid(rows, name, limit)
    system = system_prompt(cfg.system_prompt)
    records = [
        make_record(
            id=r["id"],
            source=name,
            split=split,
            question=r["question"],
            gold=r["gold"],
            level=r["level"],
            system=system,
            style=cfg.prompt_style,
            messages=r.get("messages"),
        )
        for r in good
    ]
    summary = {
        "rows_read": len(rows),
        "kept": len(records),
        "dropped": len(bad),
        "unparsable_golds": sum(b.reason.startswith(UNPARSABLE_GOLD) for b in bad),
        "levels": {
            str(k): v for k, v in sorted(Counter(r["level"] for r in records).items(), key=lambda kv: str(kv[0]))
        },
    }
    forms = Counter(r["answer_form"] for r in rows if r.get("answer_form"))  # the user's sets: how each gold was read
    if forms:
        summary["answer_forms"] = dict(sorted(forms.items()))
    return records, bad, summary


class DataError(click.ClickException):
    """A fault in the user's data or sources, theirs to fix and not a bug in the code: for ``kedro run`` a click
    error, which its CLI prints as ``Error: <message>`` (exit code 1) without a traceback. Each subclass is also
    the builtin error its callers outside Kedro expect."""


class MalformedRows(DataError, ValueError):
    """Malformed rows with ``data.on_bad_row: fail``; the message lists each row."""

    def __init__(self, bad: list[BadRow]) -> None:
        super().__init__(bad_rows_error(bad))


class SourceMissing(DataError, RuntimeError):
    """The training source, or an eval source with ``data.on_missing_source: fail``, cannot be read."""


class NoUsableRows(DataError, ValueError):
    """The training source read, but every row was malformed (and dropped) or it was empty."""


def _report_bad(bad: list[BadRow], cfg: DataConfig) -> None:
    if not bad:
        return
    if cfg.on_bad_row == "fail":
        raise MalformedRows(bad)
    for b in bad[:50]:
        log.warning("dropped malformed row %s/%s%s: %s", b.source, b.id, f" ({b.where})" if b.where else "", b.reason)
    if len(bad) > 50:
        log.warning("... dropped %d more malformed rows (all listed in the data report)", len(bad) - 50)


def prepare_train_prompts(cfg: DataConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Training prompt records from ``data.train_source`` and a summary for the report.

    generator: its train split (``data.generator``). gsm8k/bigmath: ``data.sources.<name>_train``
    when that key exists (GSM8K's train split), else ``data.sources.<name>``; its ``limit``
    applies. file: the user's set ``data.train_file`` (``data.user_sets``). A missing training
    source always fails the run. In the train pipeline this node runs before the base model
    loads (tests/test_user_data.py checks the order), so a bad row stops the run before that.
    """
    name = cfg.train_source
    if name == GENERATOR:
        rows, origin, split, limit = (
            _generator_rows(cfg, "train"),
            f"generator(seed={cfg.generator.seed})",
            "train",
            None,
        )
    elif name == USER_FILE:
        try:
            rows, origin = load_user_set(name, "data.train_file", cfg.train_file, cfg.seed)
        except SourceUnavailable as err:
            raise SourceMissing(f"training source unavailable: data.train_file: {err}") from err
        split, limit = cfg.train_file.split, cfg.train_file.limit
    else:
        key = f"{name}_train" if f"{name}_train" in cfg.sources else name
        src = _source_config(cfg, key, "train_source")
        try:
            rows, origin = load_source(name, src, cfg.seed)
        except SourceUnavailable as err:
            raise SourceMissing(f"training source unavailable: {err}") from err
        split, limit = src.split, src.limit
    records, bad, summary = _records(cfg, name, split, rows, limit)
    _report_bad(bad, cfg)
    if not records:
        raise NoUsableRows(f"training source {name!r} ({origin}) gave no usable rows")
    summary.update(source=name, origin=origin, split=split, bad_rows=[b.as_dict() for b in bad])
    log.info("train prompts: %d from %s (%d dropped)", len(records), origin, len(bad))
    return records, summary


def prepare_eval_prompts(cfg: DataConfig) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """Eval prompt records keyed by source name (``data.eval_sources``) and a summary.

    'generator' is the generator's held-out split (disjoint from its train split). The user's
    sets (``data.eval_files``) follow ``data.eval_sources``, each under its name. Bad rows of
    every source are collected first, so a failing run lists them all at once.
    """
    out: dict[str, list[dict[str, Any]]] = {}
    summary: dict[str, Any] = {"sources": {}, "skipped": {}}
    all_bad: list[BadRow] = []
    for name in [*dict.fromkeys(cfg.eval_sources), *cfg.eval_files]:  # unique, in order
        if name == GENERATOR:
            rows, origin, split, limit = (
                _generator_rows(cfg, "test"),
                f"generator(seed={cfg.generator.seed})",
                "test",
                None,
            )
        else:
            user = cfg.eval_files.get(name)
            src = user or _source_config(cfg, name, "eval_sources")
            try:
                if user is not None:
                    rows, origin = load_user_set(name, f"data.eval_files.{name}", user, cfg.seed)
                else:
                    rows, origin = load_source(name, src, cfg.seed)
            except SourceUnavailable as err:
                if cfg.on_missing_source == "fail":
                    raise SourceMissing(f"eval source unavailable (data.on_missing_source: fail): {err}") from err
                log.warning("skipping eval source %r: %s", name, err)
                summary["skipped"][name] = str(err)
                continue
            split, limit = src.split, src.limit
        records, bad, s = _records(cfg, name, split, rows, limit)
        all_bad.extend(bad)
        s.update(origin=origin, split=split, bad_rows=[b.as_dict() for b in bad])
        summary["sources"][name] = s
        out[name] = records
        log.info("eval prompts %s: %d from %s (%d dropped)", name, len(records), origin, len(bad))
    _report_bad(all_bad, cfg)
    return out, summary


def build_data_report(train_summary: dict[str, Any], eval_summary: dict[str, Any], cfg: DataConfig) -> dict[str, Any]:
    """The data report: per-set counts (rows read, kept, dropped, of those with a gold math-verify cannot
    parse; for the user's sets the rows read in each answer form, ``answer_forms``), dropped rows (id, source,
    reason; file and line for the user's sets), skipped sources, settings."""
    dropped = train_summary["dropped"] + sum(s["dropped"] for s in eval_summary["sources"].values())
    return {
        "train": train_summary,
        "eval": eval_summary["sources"],
        "skipped_sources": eval_summary["skipped"],
        "totals": {
            "train_prompts": train_summary["kept"],
            "eval_prompts": sum(s["kept"] for s in eval_summary["sources"].values()),
            "dropped_rows": dropped,
            "unparsable_golds": train_summary.get("unparsable_golds", 0)
            + sum(s.get("unparsable_golds", 0) for s in eval_summary["sources"].values()),
            "skipped_sources": len(eval_summary["skipped"]),
        },
        "settings": {
            "seed": cfg.seed,
            "generator_seed": cfg.generator.seed,
            "on_bad_row": cfg.on_bad_row,
            "on_missing_source": cfg.on_missing_source,
            "system_prompt": system_prompt(cfg.system_prompt),
            "prompt_style": cfg.prompt_style,
        },
    }


def data_metrics(report: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Counts from the report as MLflow metrics (``{name: {"value", "step"}}``).

    kedro-mlflow prefixes them with the dataset name: ``data_prep_metrics.train_prompts``,
    ``data_prep_metrics.eval.gsm8k.kept``, ... and for the user's sets the rows read in each
    answer form, ``data_prep_metrics.train.answer_forms.gsm8k``, ``...eval.<name>.answer_forms.boxed``.
    """
    metrics = dict(report["totals"])
    metrics.update({f"eval.{name}.kept": s["kept"] for name, s in report["eval"].items()})
    for where, s in [("train", report["train"]), *((f"eval.{n}", s) for n, s in report["eval"].items())]:
        metrics.update({f"{where}.answer_forms.{form}": count for form, count in s.get("answer_forms", {}).items()})
    return {k: {"value": float(v), "step": 0} for k, v in metrics.items()}
