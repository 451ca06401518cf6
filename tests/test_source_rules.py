"""Rules of the source tree that a review would otherwise have to remember (docs/ARCHITECTURE.md).

* No module of ``src/qerl_pipeline`` over 600 lines, except ``config.py`` (the one schema).
* Comments and docstrings say what and why, not when: no issue numbers of this project, no
  dates, no "before this change" narrative (history lives in git and in docs/). Citations of
  other projects' issues (``vLLM #53888``) name their project and stay.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "qerl_pipeline"
MAX_LINES = 600
EXEMPT = {"config.py"}

HISTORY = [
    re.compile(r"\bissues?\s*#?\d+", re.I),          # "issue #13", "issue 12"
    re.compile(r"(?<![\w\-.])\(#\d+\)"),               # a bare "(#13)"
    re.compile(r"\bissue\s+['\"]", re.I),             # issue 'Faster than TRL'
    re.compile(r"\b20\d\d-\d\d-\d\d\b"),              # a date
    re.compile(r"\b(before this change|previously|until now|this session|last round)\b", re.I),
]


def modules():
    return sorted(p for p in SRC.rglob("*.py"))


def prose(path: Path) -> list[tuple[int, str]]:
    """The comments and string literals of a module (docstrings among them), with their lines."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            out.append((tok.start[0], tok.string))
    return out


def history_in(path: Path) -> list[str]:
    found = []
    for line, text in prose(path):
        for pattern in HISTORY:
            m = pattern.search(text)
            if m:
                found.append(f"{path.relative_to(SRC)}:{line}: {m.group(0)!r}")
    return found


def test_no_module_over_600_lines():
    long = {str(p.relative_to(SRC)): n for p in modules()
            if p.name not in EXEMPT and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_history_in_comments_or_docstrings():
    found = [hit for p in modules() for hit in history_in(p)]
    assert not found, "\n".join(found)


def test_the_history_check_sees_what_it_looks_for(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('"""Design (issue #13).\n\nMeasured 2026-12-01."""\nx = 1  # previously 2, see (#7)\n'
                 'y = "vLLM #53888 is a citation"\n')
    found = [p.pattern for _, text in prose(f) for p in HISTORY if p.search(text)]
    assert len(found) == 4  # the issue number and the date, "previously" and the bare (#7); not the citation
