"""The user's own data sets (``data.train_file``, ``data.eval_files``): read, checked, normalised.

Where a set comes from (``UserSetConfig``): ``path``, read by its format (JSON Lines, CSV with
a header line, Parquet, or a folder written by ``datasets``' ``save_to_disk``), or ``hub_id``
(``sources.load_hub_rows``, i.e. ``datasets.load_dataset``). Its columns are named by the
config (``question`` or ``prompt``, ``answer``, optional ``id`` and ``level``):
``check_columns`` refuses a column the set does not have before anything is trained, naming
the parameter (``data.train_file.question``) and the columns the set has; the run's start
calls it (hooks.py) for every file and folder, and the loader again for every source.

Each row becomes ``{id, question, gold, level, where, answer_form}`` (plus ``messages`` for a
chat-format prompt, plus ``error`` when it cannot be read), the built-in sources' shape, so validation
(``prompts.split_valid``: question, gold, math-verify can parse the gold), ``data.on_bad_row``
and the data report treat both alike. ``where`` names the row for the user: ``<file> line N``
(1-based; JSONL, CSV: the line the record starts on) or ``<file|hub id> row N`` (Parquet,
folders, the Hub). Ids: the ``id`` column as ``<name>-<value>``, else ``<name>-line<N>`` /
``<name>-row<N>``.

Golds: sets are published with the gold in one of a few forms, so the answer column is read
per ``answer_format`` (``read_gold``): as it is (plain), after GSM8K's ``####`` (gsm8k: the
built-in gsm8k source's reading, ``sources.gsm8k_gold``), or from the last ``\\boxed{}`` of a
solution (boxed: the reward's reading of boxes, ``rewards.extraction.box_group``); ``auto``
picks per row the marker form whose marker the cell holds, else plain (``answer_form``). Each
row keeps the form it was read in (``answer_form``), which the data report counts. A marker
form without its marker is a malformed row; what the marker holds is checked as every gold is
(math-verify must parse it). The gold is then normalised as the generic built-in kind's
(``number_text``: "025" -> "25", 3.0 -> "3"). Then duplicate ids, ``levels`` and the seeded
shuffle as for every source (``sources.finish_rows``).
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

from qerl_pipeline.config import DataConfig, UserSetConfig
from qerl_pipeline.data.sources import (
    GSM8K_MARKER,
    SourceUnavailable,
    _level,
    _question,
    finish_rows,
    gsm8k_gold,
    hub_failure,
    load_hub_rows,
    number_text,
    read_jsonl,
)
from qerl_pipeline.rewards.extraction import box_group

log = logging.getLogger(__name__)

BOXED = "\\boxed"
#: Rows of a JSONL file looked at for its columns (``columns``).
JSONL_HEAD_ROWS = 100
_ROLES = ("system", "user", "assistant")


# ------------------------------------------------------------------------ reading
def _csv_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a CSV file with a header line, each with ``__line__`` (the 1-based line its record starts on).

    Read with ``surrogateescape``: a row with bytes that are not UTF-8 is one bad row, not a failed file.
    """
    rows = []
    with open(path, newline="", encoding="utf-8", errors="surrogateescape") as fh:
        reader = csv.DictReader(fh)
        header = reader.fieldnames or []
        end = reader.line_num  # the header's last line
        for row in reader:
            start, end = end + 1, reader.line_num
            row = dict(row)
            if None in row:  # more fields than the header
                extra = row.pop(None)
                row["__error__"] = (
                    f"line {start} of {path} has {len(header) + len(extra)} fields, the header {len(header)}"
                )
            elif any(isinstance(v, str) and _not_utf8(v) for v in row.values()):
                row["__error__"] = f"line {start} of {path} is not UTF-8"
            row["__line__"] = start
            rows.append(row)
    return rows


def _not_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _disk_dataset(cfg: UserSetConfig):
    """The ``datasets`` Dataset saved at ``cfg.path`` (a DatasetDict: its ``cfg.split``)."""
    import datasets

    ds = datasets.load_from_disk(str(Path(cfg.path).expanduser()))
    if isinstance(ds, datasets.DatasetDict):
        if cfg.split not in ds:
            raise ValueError(
                f"{cfg.path} is a DatasetDict without split {cfg.split!r} (it has {', '.join(ds)}): "
                "set split to one of them"
            )
        ds = ds[cfg.split]
    return ds


def read_user_rows(cfg: UserSetConfig) -> tuple[list[dict[str, Any]], str, str]:
    """Raw rows of a user set, where they came from, and how rows are counted there ('line' or 'row').

    Every row carries ``__line__`` (1-based line, or row number). A Hub set that cannot be
    loaded raises ``SourceUnavailable``; a file that cannot be read at all, ValueError naming it.
    """
    kind = cfg.file_format()
    if cfg.path is not None and (cfg.where_problem() or kind is None):
        raise ValueError(cfg.where_problem() or f"path: {cfg.path!r} cannot be read")
    if kind is None:
        try:
            rows = load_hub_rows(cfg.hub_id, cfg.hub_config, cfg.split)
        except Exception as err:  # offline, unknown id, missing split: all mean "unavailable"
            raise SourceUnavailable(
                f"loading {cfg.hub_id} (config {cfg.hub_config}, split {cfg.split}) {hub_failure(err)} (save it with "
                "datasets' save_to_disk where the Hub is reachable and give that folder as path)"
            ) from err
        origin = f"hub:{cfg.hub_id}{'/' + cfg.hub_config if cfg.hub_config else ''}:{cfg.split}"
        return [{**row, "__line__": n} for n, row in enumerate(rows, start=1)], origin, "row"
    path = Path(cfg.path).expanduser()
    if kind == "jsonl":
        return read_jsonl(path), f"file:{path}", "line"
    if kind == "csv":
        return _csv_rows(path), f"file:{path}", "line"
    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            rows = pq.read_table(path).to_pylist()
        else:
            rows = [dict(row) for row in _disk_dataset(cfg)]
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} cannot be read as {kind}: {type(err).__name__}: {str(err)[:300]}") from err
    return (
        [{**row, "__line__": n} for n, row in enumerate(rows, start=1)],
        f"{'file' if kind == 'parquet' else 'folder'}:{path}",
        "row",
    )


def columns(cfg: UserSetConfig) -> list[str] | None:
    """The columns of a user set, read cheaply (a header, a schema, the first rows); None for a Hub set."""
    kind = cfg.file_format()
    if cfg.path is None or cfg.where_problem():
        return None  # a Hub set: its columns are known once loaded; a path problem: refused by the config
    path = Path(cfg.path).expanduser()
    if kind == "jsonl":
        keys: dict[str, None] = {}
        with open(path, "rb") as fh:
            for n, raw in enumerate(fh):
                if n >= JSONL_HEAD_ROWS:
                    break
                try:
                    row = json.loads(raw)
                except ValueError:
                    continue  # a bad line is reported with its line number when the rows are read
                if isinstance(row, dict):
                    keys.update(dict.fromkeys(row))
        return list(keys)
    if kind == "csv":
        with open(path, newline="", encoding="utf-8", errors="replace") as fh:
            return list(next(csv.reader(fh), []))
    if kind == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    return list(_disk_dataset(cfg).column_names)


def check_columns(field: str, cfg: UserSetConfig, have: list[str] | None = None) -> None:
    """Raise ValueError naming ``<field>.<key>`` for each mapped column the set lacks (``have``: its columns)."""
    have = columns(cfg) if have is None else have
    if have is None:
        return
    missing = [f"{field}.{key}: column {col!r}" for key, col in cfg.columns().items() if col not in have]
    if missing:
        where = cfg.path or cfg.hub_id
        raise ValueError(
            f"{'; '.join(missing)} not in {where} (its columns: {', '.join(map(str, have)) or 'none'}); "
            f"name the set's columns with {field}.question (or .prompt), .answer, .id, .level"
        )


# -------------------------------------------------------------------- normalising
def _messages(value: Any) -> list[dict[str, str]]:
    """A chat-format prompt: a list of ``{role, content}`` (a JSON string in a CSV cell)
    ending with the user's turn."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as err:
            raise TypeError(f"prompt: not a list of messages nor JSON for one ({err})") from None
    if not isinstance(value, list) or not value:
        raise TypeError(f"prompt: expected a non-empty list of {{role, content}} messages, got {type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
            raise TypeError(f"prompt: message {i} is not {{role: system|user|assistant, content: text}}: {m!r:.80}")
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] != "user":
        raise TypeError(f"prompt: the last message must be the user's, got {out[-1]['role']!r}")
    return out


def answer_form(value: Any, answer_format: str) -> str:
    """The form an answer cell is read in: ``answer_format``, or for ``auto`` the marker form when
    the cell holds its marker (``####``: gsm8k, ``\\boxed``: boxed), else plain."""
    if answer_format != "auto":
        return answer_format
    text = str(value)
    return "gsm8k" if GSM8K_MARKER in text else "boxed" if BOXED in text else "plain"


def read_gold(value: Any, form: str) -> str | None:
    """The gold of an answer cell read in ``form`` (``answer_form``), normalised as ``number_text``.

    gsm8k: ``sources.gsm8k_gold`` (the built-in gsm8k source's reading); boxed: the last box with
    the boxes read together with it (``rewards.extraction.box_group``, the reward's reading of a
    completion). TypeError for a cell that is not text or a number; ValueError for a marker form
    whose marker is missing or empty.
    """
    if value is not None and not isinstance(value, (str, int, float)):
        raise TypeError(f"answer: expected text or a number, got {type(value).__name__} {value!r:.40}")
    if value is None or form == "plain":
        return number_text(value)
    text = str(value)
    if form == "gsm8k":
        gold = gsm8k_gold(text)
        if gold is None:
            where = "nothing after" if GSM8K_MARKER in text else "no"
            raise ValueError(f"answer: {where} {GSM8K_MARKER!r} marker (answer_format gsm8k): {text[-80:]!r}")
        return number_text(gold)
    boxes = box_group(text)
    if boxes is None or not boxes[0].strip():
        what = "an empty" if boxes is not None else "no complete" if BOXED in text else "no"
        raise ValueError(f"answer: {what} \\boxed{{...}} (answer_format boxed): {text[-80:]!r}")
    return number_text(boxes[0])


def normalise_user_row(name: str, cfg: UserSetConfig, row: dict[str, Any], where: str, unit: str) -> dict[str, Any]:
    """One raw row -> ``{id, question, gold, level, where, answer_form}`` (+ ``messages``, + ``error``:
    module docstring)."""
    n = row.get("__line__")
    raw_id = row.get(cfg.id) if cfg.id else None
    rid = f"{name}-{raw_id}" if raw_id is not None and str(raw_id).strip() else f"{name}-{unit}{n}"
    out: dict[str, Any] = {"id": rid, "question": None, "gold": None, "level": None, "where": f"{where} {unit} {n}"}
    if "__error__" in row:
        return {**out, "id": f"{name}-{unit}{n}", "error": row["__error__"]}
    try:
        if cfg.prompt is not None:
            messages = _messages(row.get(cfg.prompt))
            out.update(messages=messages, question=messages[-1]["content"].strip())
        else:
            out["question"] = _question(row.get(cfg.columns()["question"]))
        value = row.get(cfg.answer)
        form = answer_form(value, cfg.answer_format) if value is not None else None
        out["gold"] = read_gold(value, form or "plain")
        if form is not None:
            out["answer_form"] = form
        out["level"] = _level(row.get(cfg.level)) if cfg.level else None
    except TypeError as err:
        return {**out, "error": f"unreadable field: {err}"}
    except ValueError as err:  # a marker form without its marker
        return {**out, "error": str(err)}
    return out


def load_user_set(name: str, field: str, cfg: UserSetConfig, seed: int) -> tuple[list[dict[str, Any]], str]:
    """Normalised rows of the user set ``name`` (config at ``field``, e.g. ``data.train_file``) and their origin.

    The mapped columns are checked first (ValueError naming ``<field>.<key>``); duplicate ids,
    ``levels`` and the seeded shuffle as every source's (``sources.finish_rows``). ``limit``
    is applied by the caller after validation.
    """
    check_columns(field, cfg)
    raw, origin, unit = read_user_rows(cfg)
    if cfg.hub_id is not None and raw:
        check_columns(
            field, cfg, list(dict.fromkeys(k for row in raw[:JSONL_HEAD_ROWS] for k in row if k != "__line__"))
        )
    where = cfg.path or cfg.hub_id
    rows = finish_rows(name, [normalise_user_row(name, cfg, row, where, unit) for row in raw], cfg.levels, seed)
    log.info("user set %s: %d rows from %s", name, len(rows), origin)
    return rows, origin


def column_problems(data: DataConfig) -> list[str]:
    """``check_columns``' message for each of the user's sets in use whose columns do not match (files and folders)."""
    problems = []
    for field, (_, cfg) in data.user_sets().items():
        try:
            check_columns(field, cfg)
        except ValueError as err:
            problems.append(str(err))
    return problems
