"""Data sources: parsing the offline copies, malformed rows, missing sources, the Hub path.

The offline copies live in ../shared/data (read-only); each test copies what it needs
into tmp_path. The Hub is unreachable here, so the Hub path is exercised by replacing
``load_hub_rows`` (the one function that calls ``datasets.load_dataset``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qerl_pipeline.config import DataConfig, SourceConfig
from qerl_pipeline.data import sources
from qerl_pipeline.data.prompts import PAPER_SYSTEM_PROMPT, bad_rows_error, split_valid
from qerl_pipeline.data.sources import SourceUnavailable, load_source, number_text, read_raw
from qerl_pipeline.pipelines.data_prep.nodes import DataError, prepare_eval_prompts, prepare_train_prompts

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture
def local(tmp_path, shared_data) -> Path:
    """A writable copy of the offline sets (gsm8k test only: the train file is large)."""
    for rel in ("gsm8k/test.jsonl", "math500/test.jsonl", "aime24/test.jsonl", "amc23/test.jsonl"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SHARED_DATA / rel, tmp_path / rel)
    return tmp_path


def _raw_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_gsm8k_gold_after_hashes_commas_stripped(local):
    rows, origin = load_source(
        "gsm8k", SourceConfig(hub_id="openai/gsm8k", split="test", local_path=str(local / "gsm8k")), 0
    )
    assert origin.startswith("local:") and len(rows) == 1319
    raw = _raw_lines(local / "gsm8k" / "test.jsonl")
    by_id = {r["id"]: r for r in rows}
    first = by_id["gsm8k-test-00000"]
    assert first["question"] == raw[0]["question"].strip() and first["gold"] == "18"  # Janet's ducks
    with_comma = [i for i, r in enumerate(raw) if "," in r["answer"].split("####")[-1]]
    assert with_comma, "the test set has golds with thousands separators"
    i = with_comma[0]
    assert by_id[f"gsm8k-test-{i:05d}"]["gold"] == raw[i]["answer"].split("####")[-1].strip().replace(",", "")
    assert all(r["level"] is None for r in rows)
    good, bad = split_valid(rows, "gsm8k")
    assert len(good) == 1319 and not bad


def test_math500_answer_and_level(local):
    rows, _ = load_source("math500", SourceConfig(split="test", local_path=str(local / "math500")), 0)
    assert len(rows) == 500
    raw = {r["unique_id"]: r for r in _raw_lines(local / "math500" / "test.jsonl")}
    for row in rows[:50]:
        src = raw[row["id"].removeprefix("math500-")]
        assert (
            row["gold"] == src["answer"] and row["question"] == src["problem"].strip() and row["level"] == src["level"]
        )
    good, bad = split_valid(rows, "math500")
    assert len(good) == 500 and not bad  # every MATH-500 gold parses (bare LaTeX wrapped as boxed)
    only_hard, _ = load_source("math500", SourceConfig(split="test", local_path=str(local / "math500"), levels=[5]), 0)
    assert only_hard and all(r["level"] == 5 for r in only_hard) and len(only_hard) < 500


def test_aime24_local_split_and_integer_golds(local):
    cfg = SourceConfig(
        hub_id="HuggingFaceH4/aime_2024", split="train", local_split="test", local_path=str(local / "aime24")
    )
    rows, origin = load_source("aime24", cfg, 0)
    assert origin.endswith("test.jsonl") and len(rows) == 30
    raw = {f"aime24-{r['id']}": r for r in _raw_lines(local / "aime24" / "test.jsonl")}
    for row in rows:
        assert row["gold"] == str(int(raw[row["id"]]["answer"]))  # "025" -> "25"
    assert any(r["answer"].startswith("0") for r in raw.values())


def test_amc23_float_answers_become_integers(local):
    rows, _ = load_source("amc23", SourceConfig(hub_id="math-ai/amc23", local_path=str(local / "amc23")), 0)
    assert len(rows) == 40
    raw = {f"amc23-{r['id']}": r for r in _raw_lines(local / "amc23" / "test.jsonl")}
    for row in rows:
        value = raw[row["id"]]["answer"]
        assert isinstance(value, float) and row["gold"] == str(int(value))
    assert "." not in "".join(r["gold"] for r in rows)


def test_number_text():
    assert number_text(3.0) == "3" and number_text(2.5) == "2.5" and number_text("025") == "25"
    assert number_text("-7.00") == "-7" and number_text("\\frac{1}{2}") == "\\frac{1}{2}" and number_text(None) is None


def test_seeded_shuffle_is_deterministic(local):
    cfg = SourceConfig(local_path=str(local / "amc23"))
    a, _ = load_source("amc23", cfg, 1)
    b, _ = load_source("amc23", cfg, 1)
    c, _ = load_source("amc23", cfg, 2)
    assert [r["id"] for r in a] == [r["id"] for r in b] != [r["id"] for r in c]


def test_malformed_rows_named_by_id_and_source(tmp_path, local):
    folder = tmp_path / "broken"
    folder.mkdir()
    lines = (local / "gsm8k" / "test.jsonl").read_text().splitlines()[:5]
    lines.append(json.dumps({"question": "No gold here", "answer": "It is 5."}))  # no ####
    lines.append(json.dumps({"question": "", "answer": "#### 4"}))  # no question
    lines.append(json.dumps({"question": "Gibberish gold?", "answer": "#### ???"}))  # unparseable gold
    lines.append("{not json")  # unreadable line
    (folder / "test.jsonl").write_text("\n".join(lines) + "\n")
    rows, _ = load_source("mygsm", SourceConfig(hub_id="openai/gsm8k", local_path=str(folder)), 0)
    good, bad = split_valid(rows, "mygsm")
    assert len(good) == 5
    reasons = {b.id: b.reason for b in bad}
    assert all(b.source == "mygsm" for b in bad)
    assert reasons == {
        "mygsm-test-00005": "missing gold answer",
        "mygsm-test-00006": "missing question",
        "mygsm-test-00007": "gold answer math-verify cannot parse: '???'",
        "mygsm-line9": reasons["mygsm-line9"],
    }
    assert "line 9" in reasons["mygsm-line9"] and "not a JSON object" in reasons["mygsm-line9"]

    data = DataConfig(
        train_source="gsm8k",
        sources={"gsm8k": SourceConfig(hub_id="openai/gsm8k", local_path=str(folder))},
        on_bad_row="fail",
    )
    with pytest.raises(ValueError) as err:
        prepare_train_prompts(data)
    message = str(err.value)
    assert "4 malformed row(s)" in message
    for rid in ("gsm8k-test-00005", "gsm8k-test-00006", "gsm8k-test-00007", "gsm8k-line9"):
        assert f"gsm8k/{rid}" in message

    records, summary = prepare_train_prompts(data.model_copy(update={"on_bad_row": "drop"}))
    assert len(records) == 5 and summary["dropped"] == 4
    assert {b["id"] for b in summary["bad_rows"]} == {
        "gsm8k-test-00005",
        "gsm8k-test-00006",
        "gsm8k-test-00007",
        "gsm8k-line9",
    }


def test_prompt_records(local):
    data = DataConfig(
        train_source="generator",
        eval_sources=["gsm8k", "amc23"],
        sources={
            "gsm8k": SourceConfig(local_path=str(local / "gsm8k"), limit=7),
            "amc23": SourceConfig(local_path=str(local / "amc23")),
        },
    )
    evals, summary = prepare_eval_prompts(data)
    assert list(evals) == ["gsm8k", "amc23"] and len(evals["gsm8k"]) == 7 and len(evals["amc23"]) == 40
    rec = evals["gsm8k"][0]
    assert set(rec) == {"id", "source", "split", "messages", "question", "gold", "level"}
    assert rec["source"] == "gsm8k" and rec["split"] == "test"
    assert rec["messages"] == [
        {"role": "system", "content": PAPER_SYSTEM_PROMPT},
        {"role": "user", "content": rec["question"]},
    ]
    assert "<think>" in PAPER_SYSTEM_PROMPT and "<answer>" in PAPER_SYSTEM_PROMPT
    again, _ = prepare_eval_prompts(data)
    assert again == evals  # deterministic given the seed
    custom, _ = prepare_eval_prompts(data.model_copy(update={"system_prompt": "Be brief."}))
    assert custom["amc23"][0]["messages"][0] == {"role": "system", "content": "Be brief."}
    suffix, _ = prepare_eval_prompts(data.model_copy(update={"prompt_style": "suffix"}))
    rec = suffix["amc23"][0]
    assert rec["messages"] == [{"role": "user", "content": rec["question"] + "\n" + PAPER_SYSTEM_PROMPT}]


def test_missing_eval_source_skipped_or_fails(tmp_path, local, caplog):
    sources_cfg = {
        "amc23": SourceConfig(local_path=str(local / "amc23")),
        "aime25": SourceConfig(local_path=str(tmp_path / "nowhere")),  # no folder, no hub_id
    }
    data = DataConfig(eval_sources=["amc23", "aime25"], sources=sources_cfg)
    with caplog.at_level("WARNING"):
        evals, summary = prepare_eval_prompts(data)
    assert list(evals) == ["amc23"] and "aime25" in summary["skipped"]
    assert "no local folder" in summary["skipped"]["aime25"]
    assert any("aime25" in r.message and "no local folder" in r.message for r in caplog.records)
    with pytest.raises(DataError, match="aime25"):
        prepare_eval_prompts(data.model_copy(update={"on_missing_source": "fail"}))
    # the training source always fails, whatever on_missing_source says
    train = DataConfig(train_source="gsm8k", sources={"gsm8k": SourceConfig(local_path=str(tmp_path / "nowhere"))})
    with pytest.raises(RuntimeError, match="training source unavailable") as err:
        prepare_train_prompts(train)
    assert isinstance(err.value, DataError)  # kedro run prints it as one "Error:" line, no traceback


def test_hub_unreachable_is_unavailable(monkeypatch, tmp_path):
    """Offline (HF_HUB_OFFLINE, as in these tests), a set the cache does not hold is unavailable, saying why;
    tests/test_hub.py: the same when the Hub is found unreachable, and a reachable Hub's error."""

    def offline(hub_id, hub_config, split):
        raise ConnectionError("Couldn't reach 'math-ai/aime25' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sources, "load_hub_rows", offline)
    with pytest.raises(
        SourceUnavailable, match=r"not in the local cache and the Hub is offline \(HF_HUB_OFFLINE is set\)"
    ):
        read_raw("aime25", SourceConfig(hub_id="math-ai/aime25", split="test", local_path=str(tmp_path / "absent")))


def test_hub_path_bigmath_levels_and_gsm8k(monkeypatch):
    calls = []

    def fake_hub(hub_id, hub_config, split):  # stands in for datasets.load_dataset (no Hub here)
        calls.append((hub_id, hub_config, split))
        if hub_id == "openai/gsm8k":
            return [{"question": "1+1?", "answer": "1 + 1 = 2\n#### 2"}]
        level = int(hub_config.split("_")[1])
        return [
            {
                "prompt": f"Level {level} problem {i}",
                "solution": f"\\frac{{{level}}}{{{i + 2}}}",
                "source": "x",
                "domain": ["Algebra"],
                "llama8b_solve_rate": 0.5,
            }
            for i in range(3)
        ]

    monkeypatch.setattr(sources, "load_hub_rows", fake_hub)
    rows, origin = load_source(
        "bigmath",
        SourceConfig(
            hub_id="open-r1/Big-Math-RL-Verified-Processed", hub_config="all", split="train", levels=[4, 3, 5]
        ),
        0,
    )
    assert calls == [("open-r1/Big-Math-RL-Verified-Processed", f"level_{k}", "train") for k in (3, 4, 5)]
    assert origin == "hub:open-r1/Big-Math-RL-Verified-Processed/level_3_4_5:train"
    assert sorted(r["level"] for r in rows) == [3, 3, 3, 4, 4, 4, 5, 5, 5]
    assert {r["question"] for r in rows} >= {"Level 3 problem 0", "Level 5 problem 2"}
    assert all(r["gold"].startswith("\\frac") for r in rows)
    rows, origin = load_source("gsm8k", SourceConfig(hub_id="openai/gsm8k", hub_config="main", split="test"), 0)
    assert calls[-1] == ("openai/gsm8k", "main", "test") and rows[0]["gold"] == "2"
    data = DataConfig(
        train_source="bigmath",
        sources={
            "bigmath": SourceConfig(
                hub_id="open-r1/Big-Math-RL-Verified-Processed", split="train", levels=[4, 5], limit=4
            )
        },
    )
    records, summary = prepare_train_prompts(data)
    assert len(records) == 4 and all(r["level"] in (4, 5) and r["source"] == "bigmath" for r in records)


def test_a_non_utf8_line_and_a_number_for_a_question_are_bad_rows_named_by_file_and_line(tmp_path, local):
    """One bad byte costs its row, not the file (the reason names the file and the 1-based line),
    and a question that is not text is a malformed row, not a prompt."""
    folder = tmp_path / "bytes"
    folder.mkdir()
    good = (local / "gsm8k" / "test.jsonl").read_text().splitlines()[:3]
    body = "\n".join(good).encode() + b'\n{"question": "caf\xe9?", "answer": "#### 4"}\n'
    body += json.dumps({"question": 12345, "answer": "#### 4"}).encode() + b"\n"
    (folder / "test.jsonl").write_bytes(body)
    rows, _ = load_source("mygsm", SourceConfig(hub_id="openai/gsm8k", local_path=str(folder)), 0)
    good_rows, bad = split_valid(rows, "mygsm")
    assert len(good_rows) == 3
    reasons = {b.id: b.reason for b in bad}
    assert set(reasons) == {"mygsm-line4", "mygsm-test-00004"}, reasons
    assert (
        "line 4 of " + str(folder / "test.jsonl") in reasons["mygsm-line4"] and "not UTF-8" in reasons["mygsm-line4"]
    )
    assert "question: expected text, got int 12345" in reasons["mygsm-test-00004"]


def test_a_bad_row_of_a_local_file_names_the_file_and_its_1_based_line_and_ids_keep_counting_from_0(tmp_path, local):
    """Ids stay ``<name>-<split>-<n>`` from 0 (evaluation order and reuse hash them); the message says where the
    row is in the file: a blank line is skipped by ids but counted by lines."""
    folder = tmp_path / "lines"
    folder.mkdir()
    good = (local / "gsm8k" / "test.jsonl").read_text().splitlines()[:2]
    (folder / "test.jsonl").write_text("\n".join([good[0], "", good[1], json.dumps({"question": "no gold?"})]) + "\n")
    rows, _ = load_source("mygsm", SourceConfig(hub_id="openai/gsm8k", local_path=str(folder)), 0)
    good_rows, bad = split_valid(rows, "mygsm")
    assert sorted(r["id"] for r in good_rows) == ["mygsm-test-00000", "mygsm-test-00001"]
    assert [(b.id, b.reason) for b in bad] == [("mygsm-test-00002", "missing gold answer")]
    assert f"mygsm/mygsm-test-00002 ({folder / 'test.jsonl'} line 4): missing gold answer" in bad_rows_error(bad)
