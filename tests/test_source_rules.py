"""Rules of the source tree that a review would otherwise have to remember (docs/ARCHITECTURE.md).

* No module of ``src/qerl_pipeline`` over 600 lines, except ``config.py`` (the one schema).
* Comments and docstrings say what and why, not when: no issue numbers of this project, no
  dates, no "before this change" narrative (history lives in git and in docs/). Citations of
  other projects' issues (``vLLM #53888``) name their project and stay.
* No function of ``src/qerl_pipeline`` takes more than 10 parameters (``MAX_PARAMETERS``: every
  parameter a caller can pass, ``*args`` and ``**kwargs`` one each, a method's ``self``/``cls``
  not counted), except a Triton kernel, a function with a parameter annotated ``tl.constexpr``
  (its parameters are the launch's arguments, pointers, sizes and strides one by one). More than
  10 asks for a record (a dataclass or a config section) that groups them.
* A function of a ``pipelines/*/nodes.py`` takes at most 6 (``MAX_NODE_PARAMETERS``): its data and
  its typed sections, or the one config its pipeline gathers (``config.gather``), and parses or
  validates no section (``PARSING``): the config hook validated the tree once and hands the nodes
  its typed sections (``hooks.ValidateConfigHook.before_node_run``).
* No one-letter module alias in ``src/``, ``tests/`` or ``scripts/`` (``import x as T``,
  ``from x import y as D``): one letter says nothing of the module, and ``T`` is also the token
  dimension. Import the module by its name, or the names used from it.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "qerl_pipeline"
MAX_LINES = 600
MAX_PARAMETERS = 10
MAX_NODE_PARAMETERS = 6
#: What parses or validates a section; a node function calls none of them.
PARSING = {"parse", "validate", "model_validate", "model_validate_json", "validate_python", "TypeAdapter"}
EXEMPT = {"config.py"}

HISTORY = [
    re.compile(r"\bissues?\s*#?\d+", re.I),  # "issue #13", "issue 12"
    re.compile(r"(?<![\w\-.])\(#\d+\)"),  # a bare "(#13)"
    re.compile(r"\bissue\s+['\"]", re.I),  # issue 'Faster than TRL'
    re.compile(r"\b20\d\d-\d\d-\d\d\b"),  # a date
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
    long = {
        str(p.relative_to(SRC)): n
        for p in modules()
        if p.name not in EXEMPT and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_history_in_comments_or_docstrings():
    found = [hit for p in modules() for hit in history_in(p)]
    assert not found, "\n".join(found)


def test_the_history_check_sees_what_it_looks_for(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        '"""Design (issue #13).\n\nMeasured 2026-12-01."""\nx = 1  # previously 2, see (#7)\n'
        'y = "vLLM #53888 is a citation"\n'
    )
    found = [p.pattern for _, text in prose(f) for p in HISTORY if p.search(text)]
    assert len(found) == 4  # the issue number and the date, "previously" and the bare (#7); not the citation


# ------------------------------------------------------------------------- parameters
def parameter_count(fn: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> int:
    """The parameters a caller can pass (``MAX_PARAMETERS``'s count)."""
    a = fn.args
    names = [*a.posonlyargs, *a.args]
    bound = (
        in_class
        and names
        and names[0].arg in ("self", "cls")
        and not any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    )
    return len(names) - bool(bound) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)


def is_triton_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    a = fn.args
    return any(
        p.annotation is not None and ast.unparse(p.annotation) == "tl.constexpr"
        for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]
    )


def long_signatures(root: Path = SRC) -> list[str]:
    """Every function over ``MAX_PARAMETERS`` that is not a Triton kernel."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        tree = ast.parse(path.read_text())
        methods = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body}
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            n = parameter_count(fn, id(fn) in methods)
            if n > MAX_PARAMETERS and not is_triton_kernel(fn):
                found.append(f"{rel}:{fn.lineno}: {fn.name} takes {n} parameters")
    return found


def test_no_function_over_10_parameters():
    found = long_signatures()
    assert not found, "\n".join(found)


def node_rule_breaks(root: Path = SRC) -> list[str]:
    """Every function of a ``pipelines/*/nodes.py`` over ``MAX_NODE_PARAMETERS`` or calling one of ``PARSING``."""
    found = []
    for path in sorted((root / "pipelines").glob("*/nodes.py")):
        rel = str(path.relative_to(root))
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if (n := parameter_count(fn, False)) > MAX_NODE_PARAMETERS:
                found.append(f"{rel}:{fn.lineno}: {fn.name} takes {n} parameters")
            for call in ast.walk(fn):
                if isinstance(call, ast.Call):
                    name = getattr(call.func, "id", None) or getattr(call.func, "attr", None)
                    if name in PARSING:
                        found.append(f"{rel}:{call.lineno}: {fn.name} calls {name}")
    return found


def test_nodes_take_their_data_and_typed_sections_and_parse_none():
    found = node_rule_breaks()
    assert not found, "\n".join(found)


def test_the_parameter_checks_see_what_they_look_for(tmp_path):
    """Eleven parameters are refused; a method's self is not counted, **kwargs is; a Triton kernel is let through.
    A node function over six parameters, or one that parses a section, is refused."""
    root = tmp_path / "qerl_pipeline"
    (root / "pipelines" / "p").mkdir(parents=True)
    eleven = ", ".join(f"a{i}" for i in range(11))
    ten = ", ".join(f"a{i}" for i in range(10))
    (root / "lib.py").write_text(
        f"def wide({eleven}): pass\n"
        f"def fine({ten}): pass\n"
        f"def spread({ten}, **kw): pass\n"
        f"class C:\n    def __init__(self, {ten}): pass\n"
        f"def kernel({eleven}, BLOCK: tl.constexpr): pass\n"
    )
    (root / "pipelines" / "p" / "nodes.py").write_text(
        "def six(a, b, c, d, e, cfg): return cfg.x\n"
        "def seven(a, b, c, d, e, f, **sections): pass\n"
        "def reads(model): return parse(ModelConfig, model, 'model')\n"
        "def checks(model): return ModelConfig.model_validate(model)\n"
    )
    found = [line.split(": ", 1)[1] for line in long_signatures(root)]
    assert found == ["wide takes 11 parameters", "spread takes 11 parameters"], found
    found = [line.split(": ", 1)[1] for line in node_rule_breaks(root)]
    assert found == ["seven takes 7 parameters", "reads calls parse", "checks calls model_validate"], found


# ------------------------------------------------------------------------- module aliases
def one_letter_aliases(paths, root: Path = ROOT) -> list[str]:
    found = []
    for path in paths:
        for stmt in ast.walk(ast.parse(path.read_text())):
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                found += [
                    f"{path.relative_to(root)}:{stmt.lineno}: {ast.unparse(stmt)}"
                    for alias in stmt.names
                    if alias.asname and len(alias.asname) == 1
                ]
    return found


def test_no_one_letter_module_aliases():
    paths = sorted(p for top in ("src", "tests", "scripts") for p in (ROOT / top).rglob("*.py"))
    found = one_letter_aliases(paths)
    assert not found, "\n".join(found)


def test_the_alias_check_sees_what_it_looks_for(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "import numpy as np\nfrom qerl_pipeline import tracking as T\n\ndef g():\n"
        "    import torch.nn.functional as F\n\nfrom a import b as bee\n"
    )
    found = [line.split(": ", 1)[1] for line in one_letter_aliases([f], tmp_path)]
    assert found == ["from qerl_pipeline import tracking as T", "import torch.nn.functional as F"]
