"""The user's own data sets (``data.train_file``, ``data.eval_files``): each format, the column
mapping, bad rows named by file and line, golds math-verify cannot parse, config refusals.

Fast tier: no Kedro run, no engine. The Hub is unreachable here, so the Hub branch runs the
real loader with ``datasets.load_dataset`` (the Hub call) replaced by an in-memory Dataset.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from kedro.pipeline import Pipeline

from qerl_pipeline.config import ConfigError, DataConfig, QerlConfig, UserSetConfig, validate
from qerl_pipeline.data.user_sets import check_columns, column_problems, load_user_set
from qerl_pipeline.hooks import ParameterError, ValidateConfigHook
from qerl_pipeline.pipelines.data_prep.nodes import build_data_report, prepare_eval_prompts, prepare_train_prompts

#: The rows every format test writes: the issue's column names, an id and a level column.
ROWS = [
    {"uid": "a", "problem": "What is 2 + 3?", "solution": "5", "difficulty": "Level 1"},
    {"uid": "b", "problem": "What is 7 * 6?", "solution": "42", "difficulty": "Level 2"},
    {"uid": "c", "problem": "Half of 9?", "solution": "\\frac{9}{2}", "difficulty": "Level 3"},
]
MAPPING = {"question": "problem", "answer": "solution", "id": "uid", "level": "difficulty"}


def _jsonl(path: Path, rows: list[dict], extra_lines: list[str] = ()) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(line + "\n" for line in extra_lines))
    return path


def _csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def _parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _saved(path: Path, rows: list[dict], split: str | None = None) -> Path:
    ds = datasets.Dataset.from_list(rows)
    (datasets.DatasetDict({split: ds}) if split else ds).save_to_disk(str(path))
    return path


def _by_id(rows: list[dict]) -> dict[str, dict]:
    return {r["id"]: r for r in rows}


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet", "hf_disk", "hf_disk_dict"])
def test_each_format_reads_the_mapped_columns(tmp_path, fmt):
    writers = {
        "jsonl": lambda: _jsonl(tmp_path / "set.jsonl", ROWS),
        "csv": lambda: _csv(tmp_path / "set.csv", ROWS),
        "parquet": lambda: _parquet(tmp_path / "set.parquet", ROWS),
        "hf_disk": lambda: _saved(tmp_path / "set", ROWS),
        "hf_disk_dict": lambda: _saved(tmp_path / "set", ROWS, split="test"),
    }
    path = writers[fmt]()
    cfg = UserSetConfig(path=str(path), **MAPPING, **({"split": "test"} if fmt == "hf_disk_dict" else {}))
    assert cfg.file_format() == ("hf_disk" if fmt.startswith("hf_disk") else fmt)
    rows, origin = load_user_set("mine", "data.eval_files.mine", cfg, seed=0)
    assert origin.endswith(str(path))
    got = _by_id(rows)
    assert set(got) == {"mine-a", "mine-b", "mine-c"}
    for raw in ROWS:
        row = got[f"mine-{raw['uid']}"]
        assert row["question"] == raw["problem"] and row["gold"] == raw["solution"]
        assert row["level"] == int(raw["difficulty"].split()[-1])
        assert "error" not in row and "messages" not in row
    unit = "line" if fmt in ("jsonl", "csv") else "row"
    first = 1 + (fmt == "csv")  # the CSV's header is line 1
    assert (
        got["mine-a"]["where"] == f"{path} {unit} {first}" and got["mine-c"]["where"] == f"{path} {unit} {first + 2}"
    )


def test_hub_id_goes_through_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(hub_id, config=None, split=None, **kwargs):  # the Hub call, and only it, stands in
        calls.append((hub_id, config, split))
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = UserSetConfig(hub_id="someone/my-problems", hub_config="main", split="validation", **MAPPING)
    rows, origin = load_user_set("mine", "data.eval_files.mine", cfg, seed=0)
    assert calls == [("someone/my-problems", "main", "validation")]
    assert origin == "hub:someone/my-problems/main:validation"
    assert {r["gold"] for r in rows} == {"5", "42", "\\frac{9}{2}"}
    assert _by_id(rows)["mine-b"]["where"] == "someone/my-problems row 2"
    # a column the Hub set lacks is named by its parameter once the rows are there
    with pytest.raises(ValueError, match=r"data.eval_files.mine.answer: column 'gold' not in someone/my-problems"):
        load_user_set("mine", "data.eval_files.mine", cfg.model_copy(update={"answer": "gold"}), seed=0)

    def offline(*args, **kwargs):
        raise ConnectionError("Hub unreachable")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    data = DataConfig(train_source="file", train_file=cfg)
    with pytest.raises(
        RuntimeError, match=r"training source unavailable: data.train_file: loading someone/my-problems"
    ):
        prepare_train_prompts(data)


def test_default_columns_chat_prompts_and_golds(tmp_path):
    chat = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "What is 1 + 1?"}]
    path = _jsonl(
        tmp_path / "chat.jsonl",
        [
            {"prompt": chat, "answer": 2},  # a number as gold
            {"prompt": json.dumps(chat), "answer": "007"},  # a JSON string (as in a CSV cell); "007" -> "7"
            {"prompt": [{"role": "assistant", "content": "hi"}], "answer": "1"},  # last turn not the user's
            {"prompt": "just text", "answer": "1"},
            {"prompt": chat, "answer": [1, 2]},  # a list where the gold should be
        ],
    )
    rows, _ = load_user_set("chat", "data.train_file", UserSetConfig(path=str(path), prompt="prompt"), seed=0)
    got = _by_id(rows)
    assert got["chat-line1"]["messages"] == chat and got["chat-line1"]["question"] == "What is 1 + 1?"
    assert (
        got["chat-line1"]["gold"] == "2" and got["chat-line2"]["gold"] == "7" and got["chat-line2"]["messages"] == chat
    )
    assert "last message must be the user's" in got["chat-line3"]["error"]
    assert "not a list of messages" in got["chat-line4"]["error"]
    assert "answer: expected text or a number, got list" in got["chat-line5"]["error"]
    # as prompt records: the user's messages as they are (no system prompt added), question from the last turn
    data = DataConfig(
        train_source="file",
        train_file=UserSetConfig(path=str(path), prompt="prompt"),
        on_bad_row="drop",
        system_prompt="Ignored for chat prompts.",
    )
    records, summary = prepare_train_prompts(data)
    assert [r["messages"] for r in records] == [chat, chat] and summary["dropped"] == 3
    # default column names: question / answer
    plain = _jsonl(tmp_path / "plain.jsonl", [{"question": "1 + 2?", "answer": "3"}])
    rows, _ = load_user_set("p", "data.train_file", UserSetConfig(path=str(plain)), seed=0)
    assert rows[0]["question"] == "1 + 2?" and rows[0]["gold"] == "3" and rows[0]["id"] == "p-line1"


def test_bad_rows_named_by_file_and_line(tmp_path):
    path = _jsonl(
        tmp_path / "my.jsonl",
        ROWS[:2]
        + [
            {"problem": "No answer here", "solution": None},
            {"problem": 12345, "solution": "1"},  # a number where the question should be
            {"problem": "Gibberish gold?", "solution": "???"},  # math-verify cannot parse it
        ],
        extra_lines=["{not json"],
    )
    data = DataConfig(
        train_source="file", train_file=UserSetConfig(path=str(path), question="problem", answer="solution")
    )
    with pytest.raises(ValueError) as err:
        prepare_train_prompts(data)
    message = str(err.value)
    assert "4 malformed row(s)" in message
    for line, reason in (
        (3, "missing gold answer"),
        (4, "question: expected text"),
        (5, "math-verify cannot parse"),
        (6, "not a JSON object"),
    ):
        (hit,) = [m for m in message.splitlines() if f"({path} line {line})" in m]
        assert reason in hit, hit
    records, summary = prepare_train_prompts(data.model_copy(update={"on_bad_row": "drop"}))
    assert [r["question"] for r in sorted(records, key=lambda r: r["id"])] == [ROWS[0]["problem"], ROWS[1]["problem"]]
    assert summary["kept"] == 2 and summary["dropped"] == 4 and summary["unparsable_golds"] == 1
    assert {b["where"] for b in summary["bad_rows"]} == {f"{path} line {n}" for n in (3, 4, 5, 6)}


def test_a_training_file_with_no_usable_row_is_the_users_error_not_a_traceback(tmp_path):
    """Every row dropped (``on_bad_row: drop``): a ``NoUsableRows``, which ``kedro run``'s CLI prints as one
    ``Error:`` line (a click error, as the malformed rows' error is: tests/test_data_prep_pipeline.py runs that
    through ``kedro run``), still a ValueError for callers outside Kedro."""
    import click

    from qerl_pipeline.pipelines.data_prep.nodes import DataError, NoUsableRows

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"problem": "No answer", "solution": None}) + "\n" + "{not json\n")
    data = DataConfig(
        train_source="file",
        train_file=UserSetConfig(path=str(path), question="problem", answer="solution"),
        on_bad_row="drop",
    )
    with pytest.raises(NoUsableRows) as err:
        prepare_train_prompts(data)
    assert isinstance(err.value, ValueError) and isinstance(err.value, DataError)
    assert isinstance(err.value, click.ClickException)
    assert err.value.format_message() == f"training source 'file' (file:{path}) gave no usable rows", (
        err.value.format_message()
    )


def test_csv_rows_named_by_their_line_and_not_utf8(tmp_path):
    path = tmp_path / "my.csv"
    path.write_bytes(
        b'problem,solution\n"What is 1+1?",2\n"A question\non two lines",3\n"Bad \xff byte",4\n"x",5,extra\n'
    )
    cfg = UserSetConfig(path=str(path), question="problem", answer="solution")
    rows, _ = load_user_set("c", "data.train_file", cfg, seed=0)
    got = {r["where"]: r for r in rows}
    assert got[f"{path} line 2"]["gold"] == "2" and got[f"{path} line 3"]["question"] == "A question\non two lines"
    assert "not UTF-8" in got[f"{path} line 5"]["error"]
    assert "3 fields, the header 2" in got[f"{path} line 6"]["error"]


def test_unparsable_golds_are_reported_and_never_kept(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [{"q": "1+1?", "a": "2"}, {"q": "?", "a": "not a number at all ??"}])
    evals = _jsonl(tmp_path / "eval.jsonl", [{"q": "2+2?", "a": "4"}, {"q": "?", "a": "\\frac{"}])
    user = {"question": "q", "answer": "a"}
    data = DataConfig(
        train_source="file",
        train_file=UserSetConfig(path=str(train), **user),
        on_bad_row="drop",
        eval_sources=["generator"],
        eval_files={"mine": UserSetConfig(path=str(evals), **user)},
        generator={"n_train": 4, "n_test": 3},
    )
    records, train_summary = prepare_train_prompts(data)
    evals_out, eval_summary = prepare_eval_prompts(data)
    assert [r["gold"] for r in records] == ["2"] and [r["gold"] for r in evals_out["mine"]] == ["4"]
    assert list(evals_out) == ["generator", "mine"]  # the user's set beside the built-in ones
    report = build_data_report(train_summary, eval_summary, data)
    assert report["train"]["unparsable_golds"] == 1 and report["eval"]["mine"]["unparsable_golds"] == 1
    assert report["totals"]["unparsable_golds"] == 2 and report["totals"]["dropped_rows"] == 2
    assert report["eval"]["mine"]["kept"] == 1 and report["eval"]["mine"]["rows_read"] == 2
    with pytest.raises(
        ValueError, match=r"mine/mine-line2 \(.*eval.jsonl line 2\): gold answer math-verify cannot parse"
    ):
        prepare_eval_prompts(data.model_copy(update={"on_bad_row": "fail"}))


def test_ids_levels_and_limit(tmp_path):
    rows = [
        {"problem": f"{i} + 1?", "solution": str(i + 1), "uid": f"u{i % 4}", "difficulty": 1 + i % 2} for i in range(6)
    ]
    path = _jsonl(tmp_path / "my.jsonl", rows)
    cfg = UserSetConfig(path=str(path), **MAPPING)
    got, _ = load_user_set("m", "data.train_file", cfg, seed=0)
    assert sum("duplicate id" == r.get("error") for r in got) == 2  # u0 and u1 twice
    hard, _ = load_user_set("m", "data.train_file", cfg.model_copy(update={"levels": [2]}), seed=0)
    assert {r["level"] for r in hard} == {2} and len(hard) == 3
    data = DataConfig(train_source="file", train_file=cfg.model_copy(update={"id": None, "limit": 3}))
    records, summary = prepare_train_prompts(data)
    assert len(records) == 3 and summary["kept"] == 3
    again, _ = prepare_train_prompts(data)
    assert again == records  # the seeded shuffle: the same subset each time


def _gsm8k_rows(shared_data: Path, n: int) -> list[dict]:
    """The first ``n`` rows of GSM8K's train split as published: ``question``, ``answer`` = a worked solution ending
    in ``#### N``."""
    with open(shared_data / "gsm8k" / "train.jsonl") as fh:
        rows = [json.loads(next(fh)) for _ in range(n)]
    assert set(rows[0]) == {"question", "answer"} and all("\n#### " in r["answer"] for r in rows)
    return rows


def _after_marker(answer: str) -> str:
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def test_gsm8k_rows_as_published_train_as_they_are(tmp_path, shared_data):
    """A JSONL of GSM8K's rows with no preprocessing: each gold is the number after ``####`` (auto finds the
    marker), every row is kept, and the report counts the form; read plain, the worked solutions do not parse."""
    from qerl_pipeline.pipelines.data_prep.nodes import MalformedRows, data_metrics

    raw = _gsm8k_rows(shared_data, 200)
    path = _jsonl(tmp_path / "gsm8k_train.jsonl", raw)
    data = DataConfig(train_source="file", train_file=UserSetConfig(path=str(path)), eval_sources=["generator"])
    records, summary = prepare_train_prompts(data)
    assert summary["kept"] == 200 and summary["dropped"] == 0 and summary["answer_forms"] == {"gsm8k": 200}
    by_question = {r["question"]: r["gold"] for r in records}
    assert all(by_question[r["question"].strip()] == _after_marker(r["answer"]) for r in raw)
    report = build_data_report(summary, prepare_eval_prompts(data)[1], data)
    assert data_metrics(report)["train.answer_forms.gsm8k"]["value"] == 200.0
    first = _jsonl(tmp_path / "first40.jsonl", raw[:40])  # read plain, the whole worked solution is the gold
    plain = data.model_copy(update={"train_file": UserSetConfig(path=str(first), answer_format="plain")})
    with pytest.raises(
        MalformedRows, match=rf"\d+ malformed row\(s\).*\n.*{first} line \d+\): gold answer math-verify cannot"
    ):
        prepare_train_prompts(plain)


def test_a_boxed_solution_column_gives_the_boxed_answer(tmp_path, shared_data):
    """MATH-500's problems with the full solution as the answer column: each gold is the solution's last
    ``\\boxed{}`` and equals the set's own ``answer`` (math-verify), as a CSV too (text levels kept)."""
    from math_verify import verify

    from qerl_pipeline.rewards.extraction import parse_gold

    raw = [json.loads(line) for line in (shared_data / "math500" / "test.jsonl").read_text().splitlines()[:120]]
    rows = [
        {"problem": r["problem"], "solution": r["solution"], "level": f"Level {r['level']}", "uid": r["unique_id"]}
        for r in raw
    ]
    answers = {f"mine-{r['unique_id']}": r["answer"] for r in raw}
    for path in (_jsonl(tmp_path / "math.jsonl", rows), _csv(tmp_path / "math.csv", rows)):
        cfg = UserSetConfig(path=str(path), question="problem", answer="solution", id="uid", level="level")
        data = DataConfig(eval_sources=[], eval_files={"mine": cfg})
        evals, summary = prepare_eval_prompts(data)
        got = evals["mine"]
        assert len(got) == 120 and summary["sources"]["mine"]["answer_forms"] == {"boxed": 120}
        for rec in got:
            assert verify(list(parse_gold(answers[rec["id"]])), list(parse_gold(rec["gold"])), timeout_seconds=None), (
                rec
            )
            assert "\\boxed" not in rec["gold"] and rec["level"] in {1, 2, 3, 4, 5}
        assert sum(rec["gold"] == answers[rec["id"]] for rec in got) >= 119  # the box holds the answer as written


def test_answer_formats_row_by_row_and_malformed_markers_named_by_line(tmp_path):
    rows = [
        {"q": "a", "a": "4 + 5 = 9\n#### 9"},  # auto: gsm8k
        {"q": "b", "a": "So $x = \\boxed{\\frac{1}{2}}$."},  # auto: boxed
        {"q": "c", "a": 7.0},  # auto: plain ("7")
        {"q": "d", "a": "Work.\n#### ???"},  # the marker holds nothing math-verify parses
        {"q": "e", "a": "Work.\n####"},  # nothing after the marker
        {"q": "f", "a": "then \\boxed{3"},  # a box never closed
        {"q": "g", "a": "$\\boxed{1}$ and $\\boxed{2}$"},  # several boxes read together, as the reward reads them
    ]
    path = _jsonl(tmp_path / "mixed.jsonl", rows)
    cfg = UserSetConfig(path=str(path), question="q", answer="a")
    data = DataConfig(train_source="file", train_file=cfg, on_bad_row="drop")
    records, summary = prepare_train_prompts(data)
    assert {r["question"]: r["gold"] for r in records} == {"a": "9", "b": "\\frac{1}{2}", "c": "7", "g": "1,2"}
    assert summary["answer_forms"] == {"boxed": 2, "gsm8k": 2, "plain": 1}  # read in a form; e, f failed to
    reasons = {b["where"]: b["reason"] for b in summary["bad_rows"]}
    assert reasons[f"{path} line 4"] == "gold answer math-verify cannot parse: '???'"
    assert reasons[f"{path} line 5"].startswith("answer: nothing after '####' marker (answer_format gsm8k)")
    assert reasons[f"{path} line 6"].startswith("answer: no complete \\boxed{...} (answer_format boxed)")
    # a named format reads every row so: a row without its marker is malformed
    for fmt, line, reason in (("gsm8k", 2, "answer: no '####' marker"), ("boxed", 1, "answer: no \\boxed{...}")):
        only = data.model_copy(update={"train_file": cfg.model_copy(update={"answer_format": fmt})})
        _, summary = prepare_train_prompts(only)
        assert {b["where"]: b["reason"] for b in summary["bad_rows"]}[f"{path} line {line}"].startswith(reason), fmt
    with pytest.raises(
        ConfigError, match=r"data.train_file.answer_format: Input should be 'auto', 'plain', 'gsm8k' or"
    ):
        validate(
            {"data": {"train_source": "file", "train_file": {"path": str(path), "answer_format": "latex"}}}, QerlConfig
        )


@pytest.mark.parametrize(
    "data, field, expected",
    [
        ({"train_source": "file"}, "data", "train_file: data.train_source is 'file' but data.train_file is not set"),
        (
            {"train_source": "file", "train_file": {"path": "no/such.jsonl"}},
            "data",
            "train_file.path: no file or folder at 'no/such.jsonl'",
        ),
        (
            {"train_source": "file", "train_file": {"path": "{tmp}/notes.txt"}},
            "data",
            "train_file.format: cannot tell how to read",
        ),
        (
            {"train_source": "file", "train_file": {"path": "{tmp}/my.jsonl", "hub_id": "a/b"}},
            "data.train_file",
            "give exactly one of path",
        ),
        ({"train_source": "file", "train_file": {}}, "data.train_file", "give exactly one of path"),
        (
            {"train_source": "file", "train_file": {"path": "{tmp}/my.jsonl", "question": "q", "prompt": "p"}},
            "data.train_file",
            "question column or the prompt column, not both",
        ),
        (
            {"train_source": "file", "train_file": {"path": "{tmp}/my.jsonl", "levels": [1]}},
            "data.train_file",
            "needs the level column",
        ),
        (
            {"train_source": "file", "train_file": {"path": "{tmp}/my.jsonl", "colum": "x"}},
            "data.train_file.colum",
            "Extra inputs",
        ),
        ({"train_source": "files"}, "data.train_source", "'generator', 'gsm8k', 'bigmath' or 'file'"),
        ({"eval_files": {"mine": {"path": "{tmp}/gone.csv"}}}, "data", "eval_files.mine.path: no file or folder"),
        (
            {"eval_files": {"gsm8k": {"path": "{tmp}/my.jsonl"}}},
            "data",
            "eval_files.gsm8k: the name 'gsm8k' is a built-in",
        ),
        (
            {"train_source": "file", "train_file": {"path": "{tmp}/my.jsonl", "format": "hf_disk"}},
            "data",
            "train_file.format: hf_disk needs a folder",
        ),
    ],
)
def test_config_refuses_user_sets_naming_the_field(tmp_path, data, field, expected):
    _jsonl(tmp_path / "my.jsonl", ROWS)
    (tmp_path / "notes.txt").write_text("x")
    data = json.loads(json.dumps(data).replace("{tmp}", str(tmp_path)))
    with pytest.raises(ConfigError) as err:
        validate({"data": data}, QerlConfig)
    assert f"  {field}: " in str(err.value) and expected in str(err.value), str(err.value)


class _Context:
    def __init__(self, params):
        self.params = params


def test_run_start_refuses_an_unknown_column_before_any_node(tmp_path):
    """The hook (run start, before any node and any model) names the parameter, the file and its columns."""
    path = _jsonl(tmp_path / "my.jsonl", ROWS)
    params = {
        "data": {
            "train_source": "file",
            "train_file": {"path": str(path), "question": "problm", "answer": "solution"},
            "eval_files": {"mine": {"path": str(path), "question": "problem", "answer": "answer"}},
        }
    }
    hook = ValidateConfigHook()
    hook.after_context_created(_Context(params))
    with pytest.raises(ParameterError) as err:
        hook.before_pipeline_run(run_params={}, pipeline=Pipeline([]), catalog=None)
    text = err.value.format_message()
    assert (
        "data.train_file.question: column 'problm' not in" in text
        and "data.eval_files.mine.answer: column 'answer'" in text
    )
    assert "its columns: uid, problem, solution, difficulty" in text
    params["data"]["train_file"]["question"] = "problem"
    params["data"]["eval_files"]["mine"]["answer"] = "solution"
    assert column_problems(validate(params, QerlConfig).data) == []
    hook.before_pipeline_run(run_params={}, pipeline=Pipeline([]), catalog=None)  # the mapping fits: the run starts
    for path in (
        _csv(tmp_path / "s.csv", ROWS),
        _parquet(tmp_path / "s.parquet", ROWS),
        _saved(tmp_path / "saved", ROWS),
    ):
        with pytest.raises(
            ValueError,
            match=r"data.train_file.question: column 'question'; data.train_file.answer: "
            r"column 'answer' not in .*\(its columns: uid, problem, solution",
        ):
            check_columns("data.train_file", UserSetConfig(path=str(path)))


def test_train_pipeline_reads_the_training_data_before_any_model_loads():
    """``kedro run --pipelines=train`` runs the nodes in this order (SequentialRunner): the prompts, and so a
    bad row's error, come before the quantize node that loads the base model."""
    from qerl_pipeline.pipelines.train.pipeline import create_pipeline

    order = [n.name for n in create_pipeline().nodes]
    assert order.index("prepare_train_prompts") < order.index("quantize_base") < order.index("train_policy")
    assert order.index("prepare_eval_prompts") < order.index("quantize_base")
