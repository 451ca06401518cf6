"""Prompt records: the paper's system prompt, chat messages, and row validation.

System prompt
-------------
``PAPER_SYSTEM_PROMPT`` is the instruction of the QeRL paper, App. E ("For problem
prompts, we append ... Solve the following math problem step by step. The reasoning
process and direct answer are enclosed within <think> </think> and <answer> </answer>
tags, respectively, ..."), with the same wording the released training code sends as the
system message for BigMath. By default (``data.prompt_style: system``) it is the system
message for every set (one format for training, rewards and evaluation);
``prompt_style: suffix`` appends it to the question in a single user turn instead, as
App. E words it. ``data.system_prompt`` replaces the text.

Prompt record (ARCHITECTURE.md), one per problem::

    {"id": str, "source": str, "split": str,
     "messages": [{"role": "system", "content": ...}, {"role": "user", "content": question}],
         # prompt_style suffix: [{"role": "user", "content": question + "\n" + instruction}]
     "question": str, "gold": str, "level": int | None}

A user's set may give a chat-format prompt instead of a question (``data.train_file.prompt``):
its messages are the record's, as they are (TRL's conversational prompts); ``question`` is
then the content of its last (user) message.

Validation
----------
A row is malformed when its question is missing/empty, its gold answer is missing/empty,
or math-verify cannot parse the gold (``rewards.extraction.gold_is_parseable``, the same
parser the reward uses, so a kept row can always score 1.0, and a gold it cannot parse is
never trained on or scored). ``split_valid`` returns the good records and a list of ``BadRow``
(id, source, reason, and for the user's sets where: file and 1-based line or row); the caller
fails or drops per ``data.on_bad_row`` and always reports them (``bad_rows_error`` formats
the failure).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from qerl_pipeline.rewards.extraction import gold_is_parseable

PAPER_SYSTEM_PROMPT = (
    "Solve the following math problem step by step. The reasoning process and direct answer are enclosed "
    "within <think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process here "
    "</think> <answer> answer here </answer>:\n"
    "<think>\n...\n</think>\n<answer>\n...\n</answer>"
)


def system_prompt(custom: str | None = None) -> str:
    """The configured system prompt, or the paper's when ``custom`` is None."""
    return PAPER_SYSTEM_PROMPT if custom is None else custom


def build_messages(question: str, system: str | None = None, style: str = "system") -> list[dict[str, str]]:
    """Chat messages for one problem.

    style "system": the instruction as the system message, the question as the user turn
    (the released code's BigMath prompts). "suffix": one user turn, the question followed
    by the instruction (App. E's wording: "we append the suffix").
    """
    instruction = system_prompt(system)
    if style == "system":
        return [{"role": "system", "content": instruction}, {"role": "user", "content": question}]
    if style == "suffix":
        return [{"role": "user", "content": f"{question}\n{instruction}"}]
    raise ValueError(f"data.prompt_style: unknown style {style!r}; allowed: system, suffix")


def make_record(
    *,
    id: str,
    source: str,
    split: str,
    question: str,
    gold: str,
    level: int | None = None,
    system: str | None = None,
    style: str = "system",
    messages: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """A prompt record (see the module docstring); ``messages``: a chat-format prompt of the user's, used as it is."""
    return {
        "id": str(id),
        "source": source,
        "split": split,
        "messages": [dict(m) for m in messages] if messages is not None else build_messages(question, system, style),
        "question": question,
        "gold": gold,
        "level": None if level is None else int(level),
    }


#: The start of the reason a row whose gold math-verify cannot parse is malformed (the data report counts them).
UNPARSABLE_GOLD = "gold answer math-verify cannot parse"


@dataclass(frozen=True)
class BadRow:
    """A malformed row, named by id and source, and for the user's sets by ``where`` (file and line or row)."""

    id: str
    source: str
    reason: str
    where: str | None = None

    def as_dict(self) -> dict[str, str]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def row_problem(row: dict[str, Any]) -> str | None:
    """Why a normalised row ``{question, gold, ...}`` is malformed, or None when it is fine."""
    if row.get("error"):
        return str(row["error"])
    question, gold = row.get("question"), row.get("gold")
    if question is None or not str(question).strip():
        return "missing question"
    if gold is None or not str(gold).strip():
        return "missing gold answer"
    if not gold_is_parseable(str(gold)):
        return f"{UNPARSABLE_GOLD}: {str(gold)[:80]!r}"
    return None


def split_valid(
    rows: list[dict[str, Any]], source: str, limit: int | None = None
) -> tuple[list[dict[str, Any]], list[BadRow]]:
    """Separate good rows from malformed ones (each bad row named by id and source).

    With ``limit``, stops once ``limit`` good rows are found: only the rows looked at
    are validated (and reported), so a large set with a small limit stays cheap.
    """
    good, bad = [], []
    for row in rows:
        if limit is not None and len(good) >= limit:
            break
        problem = row_problem(row)
        if problem is None:
            good.append(row)
        else:
            bad.append(BadRow(id=str(row.get("id")), source=source, reason=problem, where=row.get("where")))
    return good, bad


def bad_rows_error(bad: list[BadRow], limit: int = 20) -> str:
    """An error message listing malformed rows (first ``limit``, then a count)."""
    lines = [f"  {b.source}/{b.id}{f' ({b.where})' if b.where else ''}: {b.reason}" for b in bad[:limit]]
    if len(bad) > limit:
        lines.append(f"  ... and {len(bad) - limit} more")
    return f"{len(bad)} malformed row(s) (set data.on_bad_row: drop to drop and report them instead):\n" + "\n".join(
        lines
    )
