"""The import layers of ``src/qerl_pipeline`` (docs/ARCHITECTURE.md, "Layers"), checked with ``ast``.

Every import of a project module counts, at module level and inside functions: a module may
import its own layer or a lower one, never a higher one, and no set of modules imports each
other in a cycle. The layer table is read from docs/ARCHITECTURE.md, so the document and the
check cannot drift; a module the table does not place fails too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "qerl_pipeline"


def layers() -> dict[str, int]:
    """``{prefix: layer}`` from the "Layers" table of docs/ARCHITECTURE.md (higher imports lower)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    out: dict[str, int] = {}
    for level, names in re.findall(r"^\|\s*(\d+)\s*\|([^|]+)\|", section, flags=re.M):
        for name in re.findall(r"`([\w.]+)`", names):
            out[name] = int(level)
    assert out, "docs/ARCHITECTURE.md has no layer table"
    return out


def modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / PACKAGE).rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports anywhere in its file."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != PACKAGE and t != name:
                out.add(t)
    return out


def layer_of(module: str, table: dict[str, int]) -> int | None:
    rel = module.removeprefix(PACKAGE + ".")
    best = None
    for prefix, level in table.items():
        if rel == prefix or rel.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, level)
    return None if best is None else best[1]


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def test_every_module_has_a_layer():
    table = layers()
    missing = sorted(m for m in modules() if m != PACKAGE and layer_of(m, table) is None)
    assert not missing, f"modules docs/ARCHITECTURE.md's layer table does not place: {missing}"


def test_no_module_imports_a_higher_layer():
    table = layers()
    upward = []
    for module, targets in graph().items():
        if module == PACKAGE:
            continue
        own = layer_of(module, table)
        for t in sorted(targets):
            if own is not None and (layer_of(t, table) or 0) > own:
                upward.append(f"{module} (layer {own}) imports {t} (layer {layer_of(t, table)})")
    assert not upward, "\n".join(upward)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_the_checks_see_what_they_look_for(tmp_path):
    """The cycle finder and the upward rule catch a planted cycle and a planted upward import."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    table = {"rl": 5, "config": 1}
    assert layer_of("qerl_pipeline.rl.trainer", table) == 5 and layer_of("qerl_pipeline.config", table) == 1
    known = {"qerl_pipeline.config": tmp_path / "config.py", "qerl_pipeline.rl.trainer": tmp_path / "trainer.py"}
    known["qerl_pipeline.config"].write_text("def f():\n    from qerl_pipeline.rl import trainer\n")
    assert imports("qerl_pipeline.config", known["qerl_pipeline.config"], known) == {"qerl_pipeline.rl.trainer"}
