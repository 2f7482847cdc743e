"""The `#` comments that explain config fields, read from the source with tokenize and ast.

A comment block right above a field (up to a blank line or code) and the comments on the field's own lines
explain it; a block that opens a class body explains the class. Nothing is imported or executed to read them,
so the config modules need no docstrings and no edits for the reference.
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

# Comments that talk to tools, not to readers.
PRAGMA = re.compile(r"^(fmt:|noqa|type:|pragma|isort:|ruff:)")


@dataclass
class _Source:
    classes: dict[str, ast.ClassDef]  # qualified name -> class node
    comments: dict[int, list[str]]  # line -> comment texts on it (without '#')
    comment_only: set[int]  # lines that hold nothing but a comment
    lines: list[str]


_sources: dict[str, _Source] = {}


def _read_source(path: str) -> _Source:
    if path not in _sources:
        text = Path(path).read_text(encoding="utf-8")
        classes: dict[str, ast.ClassDef] = {}

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    name = f"{prefix}{child.name}"
                    classes[name] = child
                    visit(child, f"{name}.")

        visit(ast.parse(text), "")
        comments: dict[int, list[str]] = {}
        comment_only: set[int] = set()
        code_lines: set[int] = set()
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                comments.setdefault(tok.start[0], []).append(tok.string.lstrip("#").strip())
            elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                code_lines.update(range(tok.start[0], tok.end[0] + 1))
        comment_only = {line for line in comments if line not in code_lines}
        _sources[path] = _Source(classes, comments, comment_only, text.splitlines())
    return _sources[path]


def _comments_of(node: ast.AnnAssign, src: _Source) -> str:
    """The comment block right above a field (up to a blank line or code) and the comments on its lines."""
    above: list[str] = []
    line = node.lineno - 1
    while line in src.comment_only:
        above = src.comments[line] + above
        line -= 1
    beside = [
        text
        for ln in range(node.lineno, (node.end_lineno or node.lineno) + 1)
        if ln not in src.comment_only
        for text in src.comments.get(ln, [])
    ]
    parts = [t for t in above + beside if t and not PRAGMA.match(t)]
    return " ".join(parts)


def _class_node(klass: type) -> tuple[ast.ClassDef, _Source] | None:
    try:
        path = inspect.getsourcefile(klass)
    except TypeError:
        return None
    if path is None:
        return None
    src = _read_source(path)
    node = src.classes.get(klass.__qualname__)
    return (node, src) if node is not None else None


def class_comment(model: type[BaseModel]) -> str:
    """A comment block that opens the class body (right under `class ...:`) speaks for the whole class."""
    found = _class_node(model)
    if found is None:
        return ""
    node, src = found
    first = node.body[0]
    start = first.lineno - 1
    while start in src.comment_only:
        start -= 1
    if start + 1 == first.lineno or not isinstance(first, ast.AnnAssign):
        return ""
    if not src.lines[start - 1].rstrip().endswith(":"):  # a blank line or code above the comment
        return ""
    lines = range(start + 1, first.lineno)
    return " ".join(t for ln in lines for t in src.comments[ln] if t and not PRAGMA.match(t))


def field_comments(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> its explanation, from the class that declares it (subclasses inherit their bases').

    A comment block that opens a class body belongs to the class (`class_comment`), not to its first field.
    """
    out: dict[str, str] = {}
    for klass in reversed(model.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, BaseModel)) or klass is BaseModel:
            continue
        found = _class_node(klass)
        if found is None:
            continue
        node, src = found
        opening = class_comment(klass)
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                text = _comments_of(stmt, src)
                if opening and stmt is node.body[0]:
                    text = text.removeprefix(opening).strip()
                out[stmt.target.id] = text
    return out
