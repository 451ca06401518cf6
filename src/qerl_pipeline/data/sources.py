"""Reading each data source and normalising its rows to ``{id, question, gold, level}``.

Where a source comes from (``SourceConfig``): ``<local_path>/<local_split or split>.jsonl``
when the folder ``local_path`` exists (relative paths are taken from the working
directory, the project root under ``kedro run``), else the Hub through
``datasets.load_dataset(hub_id, hub_config, split=split)``. A local copy therefore
replaces any Hub set by a config override, with no code change. When neither can be had
(no folder, no ``hub_id``, or the Hub load fails: offline, unknown id) ``load_source``
raises ``SourceUnavailable`` with the reason; the data_prep nodes decide (training
source: fail; eval sources: ``data.on_missing_source``). Whether the Hub can be reached is
decided once, before the first Hub load (``hub.offline_reason``): offline, a Hub set comes
from ``datasets``' local cache or not at all, with no retries.

How rows are normalised (``kind``, found from the Hub id, else from the source name):

========  ===============================================  =====================================
kind      question / gold fields                            gold normalisation
========  ===============================================  =====================================
gsm8k     question / answer                                 text after ``####``, commas removed
math500   problem / answer (level 1..5 kept)                as is (LaTeX)
aime      problem (or question) / answer                    integer text: "025" -> "25"
amc       problem (or question) / answer (a float: 3.0)     integral float -> "3"
bigmath   prompt (or problem) / solution (or answer)        as is; level from the config read
generic   question|problem|prompt / answer|solution|gold    as is
========  ===============================================  =====================================

BigMath (``open-r1/Big-Math-RL-Verified-Processed``, split ``train``, columns
``prompt, solution, source, domain, llama8b_solve_rate``) is published as configs
``all``, ``level_1`` .. ``level_5``, ``level_3_4_5``, ``level_4_5``, ... The rows carry no
level column, so with ``levels: [3, 4, 5]`` we load ``level_3``, ``level_4`` and
``level_5`` and tag each row with its level (the paper trains 7B/14B on levels 3-5 and
32B on 4-5); with ``levels: null`` we load ``hub_config`` (default ``all``). Local copies
and MATH-500 are filtered on their ``level`` column instead.

A row that cannot be read (bad JSON line, a field of the wrong type) becomes a row with
an ``error`` so validation reports it by id and source instead of crashing. Row ids
(``<name>-<split>-<n>``, without an id column) number the rows from 0 and stay so: evaluation
order and its reuse hash them. A row of a local file also carries ``where``, its file and
1-based line, which every bad-row message shows.
Order: rows are shuffled with ``random.Random(f"{seed}:{name}")`` (deterministic), so
``limit`` keeps a fixed, unbiased subset.
"""

from __future__ import annotations

import json
import logging
import random
import re
from pathlib import Path
from typing import Any

from qerl_pipeline.config import SourceConfig
from qerl_pipeline.hub import offline_reason

log = logging.getLogger(__name__)

KIND_BY_HUB_ID = {
    "openai/gsm8k": "gsm8k",
    "huggingfaceh4/math-500": "math500",
    "huggingfaceh4/aime_2024": "aime",
    "math-ai/aime25": "aime",
    "math-ai/amc23": "amc",
    "open-r1/big-math-rl-verified-processed": "bigmath",
}
KIND_BY_NAME_PREFIX = (
    ("gsm8k", "gsm8k"),
    ("math500", "math500"),
    ("aime", "aime"),
    ("amc", "amc"),
    ("bigmath", "bigmath"),
)
_INT_TEXT = re.compile(r"^[+-]?\d+(?:\.0*)?$")


class SourceUnavailable(RuntimeError):
    """A source has neither a local copy nor a reachable Hub set; the message says why."""


def source_kind(name: str, cfg: SourceConfig) -> str:
    """How to normalise a source's rows: from its Hub id, else its name, else 'generic'."""
    if cfg.hub_id and cfg.hub_id.lower() in KIND_BY_HUB_ID:
        return KIND_BY_HUB_ID[cfg.hub_id.lower()]
    for prefix, kind in KIND_BY_NAME_PREFIX:
        if name.lower().startswith(prefix):
            return kind
    return "generic"


# ------------------------------------------------------------------------ reading
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file; an unreadable line becomes ``{"__error__": ..., "__line__": n}``."""
    rows = []
    with open(path, "rb") as fh:  # decoded per line: one bad byte costs its row, not the file
        for n, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                rows.append(
                    {
                        "__error__": f"line {n} of {path} is not UTF-8 ({err.reason} at byte {err.start} of the line)",
                        "__line__": n,
                    }
                )
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError(f"expected a JSON object, got {type(row).__name__}")
            except ValueError as err:
                row = {"__error__": f"line {n} of {path} is not a JSON object: {err}"}
            row.setdefault("__line__", n)
            rows.append(row)
    return rows


def load_hub_rows(hub_id: str, hub_config: str | None, split: str) -> list[dict[str, Any]]:
    """Rows of a Hub dataset split (``datasets.load_dataset``); raises on any failure.

    Whether the Hub can be reached is settled first (``hub.offline_reason``): offline, ``datasets``
    reads its local cache only, without retrying the Hub.
    """
    offline_reason()
    import datasets

    ds = datasets.load_dataset(hub_id, hub_config, split=split)
    return [dict(row) for row in ds]


def _local_file(cfg: SourceConfig) -> Path | None:
    if not cfg.local_path:
        return None
    folder = Path(cfg.local_path).expanduser()
    if not folder.is_dir():
        return None
    return folder / f"{cfg.local_split or cfg.split}.jsonl"


def read_raw(name: str, cfg: SourceConfig) -> tuple[list[dict[str, Any]], str]:
    """Raw rows and where they came from (``local:<file>`` or ``hub:<id>[/<config>]:<split>``)."""
    path = _local_file(cfg)
    if path is not None:
        if not path.is_file():
            raise SourceUnavailable(f"source {name!r}: folder {cfg.local_path} exists but has no {path.name}")
        return read_jsonl(path), f"local:{path}"
    where = f"no local folder at {cfg.local_path!r}" if cfg.local_path else "no local_path"
    if not cfg.hub_id:
        raise SourceUnavailable(f"source {name!r}: {where} and no hub_id")
    kind = source_kind(name, cfg)
    try:
        if kind == "bigmath" and cfg.levels:
            rows = []
            for level in sorted(set(cfg.levels)):
                part = load_hub_rows(cfg.hub_id, f"level_{level}", cfg.split)
                rows.extend({**row, "level": level} for row in part)
            return rows, f"hub:{cfg.hub_id}/level_{'_'.join(map(str, sorted(set(cfg.levels))))}:{cfg.split}"
        rows = load_hub_rows(cfg.hub_id, cfg.hub_config, cfg.split)
    except Exception as err:  # offline, unknown id, missing config: all mean "unavailable"
        raise SourceUnavailable(
            f"source {name!r}: {where}, and loading {cfg.hub_id} (config {cfg.hub_config}, split {cfg.split}) "
            f"{hub_failure(err)} (a local copy: set data.sources.{name}.local_path to a folder with "
            f"{cfg.local_split or cfg.split}.jsonl)"
        ) from err
    return rows, f"hub:{cfg.hub_id}{'/' + cfg.hub_config if cfg.hub_config else ''}:{cfg.split}"


def hub_failure(err: BaseException) -> str:
    """Why a Hub load failed, for a ``SourceUnavailable`` message: the Hub is offline (and why), or the error."""
    offline = offline_reason()
    if offline is not None:
        return f"is not in the local cache and the Hub is offline ({offline})"
    return f"from the Hub failed: {type(err).__name__}: {str(err)[:300]}"


# -------------------------------------------------------------------- normalising
def number_text(value: Any) -> str | None:
    """A gold answer as text; integral numbers lose '.0' and leading zeros ("025" -> "25", 3.0 -> "3")."""
    if value is None or isinstance(value, bool):
        return None if value is None else str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    text = str(value).strip()
    if _INT_TEXT.match(text):
        return str(int(float(text))) if "." in text else str(int(text))
    return text


def _first(row: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if row.get(key) is not None:
            return row[key]
    return None


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, int, float)):
        raise TypeError(f"expected text, got {type(value).__name__}")
    return str(value).strip()


def _question(value: Any) -> str | None:
    """A question is text: a number or a list where the question should be is a malformed row."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"question: expected text, got {type(value).__name__} {value!r:.40}")
    return _text(value)


#: What ends a GSM8K worked solution and precedes its final answer ("... #### 72").
GSM8K_MARKER = "####"


def gsm8k_gold(answer: Any) -> str | None:
    """The gold of a GSM8K-style solution: the text after its last ``####``, commas and ``$`` removed; None
    without the marker or with nothing after it (the built-in gsm8k source and the user's ``answer_format: gsm8k``)."""
    if answer is None or GSM8K_MARKER not in str(answer):
        return None
    return str(answer).split(GSM8K_MARKER)[-1].strip().replace(",", "").replace("$", "").strip() or None


def _level(value: Any) -> int | None:
    if value is None:
        return None
    match = re.search(r"\d+", str(value))  # MATH levels may be "Level 3"
    return int(match.group()) if match else None


def normalise_row(kind: str, name: str, split: str, index: int, row: dict[str, Any]) -> dict[str, Any]:
    """One raw row -> ``{id, question, gold, level}`` (plus ``error`` when it cannot be read)."""
    raw_id = _first(row, "unique_id", "id")
    rid = f"{name}-{split}-{index:05d}" if raw_id is None else f"{name}-{raw_id}"
    if "__error__" in row:
        return {
            "id": f"{name}-line{row.get('__line__', index)}",
            "question": None,
            "gold": None,
            "level": None,
            "error": row["__error__"],
        }
    try:
        if kind == "gsm8k":
            question, gold, level = _question(row.get("question")), gsm8k_gold(row.get("answer")), None
        elif kind == "math500":
            question, gold, level = _question(row.get("problem")), _text(row.get("answer")), _level(row.get("level"))
        elif kind in ("aime", "amc"):
            question = _question(_first(row, "problem", "question"))
            gold, level = number_text(row.get("answer")), None
        elif kind == "bigmath":
            question = _question(_first(row, "prompt", "problem"))
            gold, level = _text(_first(row, "solution", "answer")), _level(row.get("level"))
        else:
            question = _question(_first(row, "question", "problem", "prompt"))
            gold, level = number_text(_first(row, "answer", "solution", "gold")), _level(row.get("level"))
    except TypeError as err:
        return {"id": rid, "question": None, "gold": None, "level": None, "error": f"unreadable field: {err}"}
    return {"id": rid, "question": question, "gold": gold, "level": level}


def load_source(name: str, cfg: SourceConfig, seed: int) -> tuple[list[dict[str, Any]], str]:
    """Normalised rows of one source (level-filtered, seeded shuffle) and their origin.

    Duplicate ids are renamed ``<id>#dupN`` and flagged with an ``error`` so validation
    reports them. ``limit`` is applied by the caller after validation.
    """
    raw, origin = read_raw(name, cfg)
    kind = source_kind(name, cfg)
    rows = [normalise_row(kind, name, cfg.split, i, row) for i, row in enumerate(raw)]
    if origin.startswith("local:"):  # a bad row is named by its file and 1-based line too (its id counts rows from 0)
        for row, raw_row in zip(rows, raw, strict=True):
            row["where"] = f"{origin.removeprefix('local:')} line {raw_row['__line__']}"
    rows = finish_rows(name, rows, cfg.levels, seed)
    log.info("source %s: %d rows from %s (kind %s)", name, len(rows), origin, kind)
    return rows, origin


def finish_rows(name: str, rows: list[dict[str, Any]], levels: list[int] | None, seed: int) -> list[dict[str, Any]]:
    """Normalised rows with duplicate ids flagged (``<id>#dupN``, an ``error``), kept to ``levels``,
    shuffled by seed."""
    seen: dict[str, int] = {}
    for row in rows:
        count = seen.get(row["id"], 0)
        seen[row["id"]] = count + 1
        if count:
            row["id"] = f"{row['id']}#dup{count}"
            row.setdefault("error", "duplicate id")
    if levels:
        if not any(row.get("level") is not None for row in rows):
            log.warning("source %r: levels %s set but its rows carry no level; keeping all rows", name, levels)
        else:
            rows = [row for row in rows if row.get("level") in levels]  # unknown level: dropped
    random.Random(f"{seed}:{name}").shuffle(rows)
    return rows
