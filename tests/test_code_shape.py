"""The shape of src/: no function over 80 lines, no import cycles between modules."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_LINES = 80
# Functions still over the limit, being split elsewhere: "<path under src>:<name>".
LONG_KNOWN: set[str] = set()
# Import cycles still there, each a set of modules that import each other (directly or through the others).
# None now; a new one fails the test.
CYCLES_KNOWN: list[frozenset[str]] = []


def long_functions() -> dict[str, int]:
    out: dict[str, int] = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_LINES:
                    out[f"{path.relative_to(SRC).as_posix()}:{node.name}"] = lines
    return out


def import_cycles() -> list[frozenset[str]]:
    """The strongly connected components of more than one module in enlace's import graph (imports inside
    functions and under TYPE_CHECKING included), by Tarjan's algorithm."""
    graph = grimp.build_graph("enlace")
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.find_modules_directly_imported_by(v)):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_function_is_over_80_lines():
    long = long_functions()
    new = {k: v for k, v in long.items() if k not in LONG_KNOWN}
    assert not new, f"functions over {MAX_LINES} lines (split them into named parts): {new}"
    # A known exception that got short must leave the list, so the list only shrinks.
    assert not LONG_KNOWN - set(long), f"no longer over {MAX_LINES} lines: {LONG_KNOWN - set(long)}"


def test_no_import_cycles():
    cycles = import_cycles()
    new = [sorted(c) for c in cycles if c not in CYCLES_KNOWN]
    assert not new, f"modules that import each other (move what both need into a third module): {new}"
    gone = [sorted(c) for c in CYCLES_KNOWN if c not in cycles]
    assert not gone, f"cycles no longer there: {gone}"


def test_a_long_function_is_found(tmp_path, monkeypatch):
    # The known cycles keep the cycle search honest (it must find them); this keeps the line count honest.
    (tmp_path / "enlace").mkdir()
    (tmp_path / "enlace" / "long.py").write_text("def f():\n" + "    x = 1\n" * MAX_LINES + "    return x\n")
    monkeypatch.setitem(globals(), "SRC", tmp_path)
    assert long_functions() == {"enlace/long.py:f": MAX_LINES + 2}
