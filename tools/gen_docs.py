"""Generate the reference pages of the docs site from the code itself.

    python tools/gen_docs.py           # write docs/reference/config.md and docs/reference/cli.md
    python tools/gen_docs.py --check   # exit 1, naming the stale pages, when they differ from the code

The configuration reference walks every pydantic model in `enlace.config` (each layer, then the models nested
in it) and reads each field's explanation from the `#` comments beside it in the source (tokenize + ast), so
the config files need no docstrings for it and whatever fields exist are listed, commented or not. The CLI
reference walks the argparse parser that `enlace` itself builds. `make docs` runs this before `mkdocs build`;
`tests/test_docs.py` fails when the committed pages are stale.
"""

from __future__ import annotations

import argparse
import ast
import enum
import importlib
import inspect
import io
import pkgutil
import re
import sys
import tokenize
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from enlace.io import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
CONFIG_PAGE = Path("docs/reference/config.md")
CLI_PAGE = Path("docs/reference/cli.md")
REGENERATE = "python tools/gen_docs.py (or make docs)"
# Comments that talk to tools, not to readers.
PRAGMA = re.compile(r"^(fmt:|noqa|type:|pragma|isort:|ruff:)")
USAGE_WIDTH = 100


# ---------------------------------------------------------------------------------------------------------
# Markdown helpers


def slug(text: str) -> str:
    """The anchor both Python-Markdown's toc (MkDocs) and GitHub give a plain-text heading."""
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def cell(text: str) -> str:
    """Text for a table cell: no line breaks, and nothing Markdown would read as a tag, a column or emphasis."""
    text = " ".join(text.split())
    return text.replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|").replace("*", "\\*")


def code(text: str) -> str:
    """An inline code span for a table cell.

    A pipe inside backticks splits a Python-Markdown table cell, and an escaped one shows its backslash there
    (GitHub hides it), so a span with a pipe is written as HTML, which both render the same.
    """
    text = " ".join(str(text).split())
    if not text:
        return ""
    if "|" in text:
        escaped = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "&#124;")
        return f"<code>{escaped}</code>"
    fence = "``" if "`" in text else "`"
    return f"{fence}{text}{fence}"


# ---------------------------------------------------------------------------------------------------------
# Comments beside fields, read from the source


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


def _package_models(node: ast.AnnAssign, src: _Source) -> str:
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
                text = _package_models(stmt, src)
                if opening and stmt is node.body[0]:
                    text = text.removeprefix(opening).strip()
                out[stmt.target.id] = text
    return out


# ---------------------------------------------------------------------------------------------------------
# The config models


def config_modules(package: str = "enlace.config") -> list[types.ModuleType]:
    pkg = importlib.import_module(package)
    mods = [pkg]
    for info in pkgutil.walk_packages(pkg.__path__, prefix=f"{package}."):
        mods.append(importlib.import_module(info.name))
    return mods


def _models_in(mods: list[types.ModuleType]) -> list[type[BaseModel]]:
    """Every pydantic model with fields defined in the config package, in source order, each once."""
    seen: dict[type, None] = {}
    for mod in mods:
        members = [
            obj
            for obj in vars(mod).values()
            if isinstance(obj, type)
            and issubclass(obj, BaseModel)
            and obj.__module__ == mod.__name__
            and obj.model_fields
        ]
        members.sort(key=lambda c: inspect.getsourcelines(c)[1])
        for obj in members:
            seen.setdefault(obj)
    return list(seen)


def _layer_table(mods: list[types.ModuleType]) -> dict[str, type[BaseModel]]:
    """The layers a params.yaml selects: a module-level dict of name -> model (resolve.LAYERS today)."""
    for mod in mods:
        for name, obj in vars(mod).items():
            if (
                name.isupper()
                and isinstance(obj, dict)
                and obj
                and all(isinstance(k, str) for k in obj)
                and all(isinstance(v, type) and issubclass(v, BaseModel) for v in obj.values())
            ):
                return dict(obj)
    return {}


def _attribute_names(mods: list[types.ModuleType]) -> dict[type, str]:
    """Model -> the attribute name another (non-pydantic) config class holds it under, e.g. Config.eval."""
    out: dict[type, str] = {}
    for mod in mods:
        for obj in vars(mod).values():
            if not isinstance(obj, type) or obj.__module__ != mod.__name__ or issubclass(obj, BaseModel):
                continue
            try:
                hints = typing.get_type_hints(obj)
            except Exception:  # a class whose annotations do not resolve says nothing about the config
                continue
            for attr, hint in hints.items():
                if isinstance(hint, type) and issubclass(hint, BaseModel):
                    out.setdefault(hint, attr)
    return out


def _walk_types(tp: Any) -> Iterator[Any]:
    yield tp
    for arg in typing.get_args(tp):
        yield from _walk_types(arg)


def nested_models(tp: Any) -> list[type[BaseModel]]:
    out: list[type[BaseModel]] = []
    for t in _walk_types(tp):
        if isinstance(t, type) and issubclass(t, BaseModel) and t not in out:
            out.append(t)
    return out


def _is_list(tp: Any) -> bool:
    return typing.get_origin(tp) in (list, tuple, set, frozenset)


def render_type(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return render_type(args[0])
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(render_type(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        inner = ", ".join("..." if a is Ellipsis else render_type(a) for a in args)
        return f"{name}[{inner}]" if inner else name
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp.__name__
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " | ".join(f'"{m.value}"' for m in tp)
    return getattr(tp, "__name__", str(tp))


_BOUNDS = [(annotated_types.Gt, ">", "gt"), (annotated_types.Ge, ">=", "ge")]
_BOUNDS += [(annotated_types.Lt, "<", "lt"), (annotated_types.Le, "<=", "le")]


def constraints(info: FieldInfo) -> list[str]:
    out: list[str] = []
    for meta in info.metadata:
        for kind, sign, attr in _BOUNDS:
            if isinstance(meta, kind):
                out.append(f"{sign} {yaml_value(getattr(meta, attr))}")
        if isinstance(meta, annotated_types.MinLen):
            out.append(f"at least {meta.min_length} long")
        if isinstance(meta, annotated_types.MaxLen):
            out.append(f"at most {meta.max_length} long")
    return out


def yaml_value(v: Any) -> str:
    """A default as it would be written in a YAML config file."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        text = format(v, ".10g")
        return f"{text}.0" if text.lstrip("-").isdigit() else text  # 16.0, not 16: the field is a float
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, enum.Enum):
        return yaml_value(v.value)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(yaml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(x)}" for k, x in v.items()) + "}"
    return str(v)


@dataclass
class Section:
    path: str  # where it sits in a config: "train.optimizer", "data.sources[]"
    model: type[BaseModel]
    intro: str = ""
    children: list[Section] = field(default_factory=list)


def _discriminators(model: type[BaseModel]) -> str:
    """'kind: deb' for a variant of a tagged union: its required single-value Literal fields."""
    tags = []
    for name, info in model.model_fields.items():
        tp = info.annotation
        if typing.get_origin(tp) is typing.Literal and len(typing.get_args(tp)) == 1 and info.is_required():
            tags.append(f"{name}: {typing.get_args(tp)[0]}")
    return ", ".join(tags)


def _is_container(model: type[BaseModel]) -> bool:
    """A model whose every field is one config section (a whole resolved config): its fields are the roots."""
    fields = list(model.model_fields.values())
    return bool(fields) and all(
        len(nested_models(f.annotation)) == 1
        and all(a is type(None) or a in nested_models(f.annotation) for a in _union_args(f.annotation))
        for f in fields
    )


def _union_args(tp: Any) -> tuple[Any, ...]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def _intro(key: str, package_doc: str = "") -> str:
    if (ROOT / "configs" / key).is_dir():
        return f"The `{key}` layer: one file per profile in `configs/{key}/`."
    return f"The `{key}` section. {package_doc}".strip()


def build_sections(package: str = "enlace.config") -> list[Section]:
    """The tree of sections: the layers first (in the order the package lists them), then the other
    top-level sections, each followed by the models nested in it."""
    mods = config_modules(package)
    models = _models_in(mods)
    layers = _layer_table(mods)
    attrs = _attribute_names(mods)
    containers = [m for m in models if _is_container(m)]
    referenced = {
        child
        for m in models
        if m not in containers
        for f in m.model_fields.values()
        for child in nested_models(f.annotation)
    }
    roots: list[tuple[str, type[BaseModel], str]] = [
        (name, model, _intro(name)) for name, model in layers.items()
    ]
    for container in containers:
        for name, info in container.model_fields.items():
            (model,) = nested_models(info.annotation)
            if all(model is not r[1] for r in roots):
                roots.append((name, model, _intro(name)))
    for model in models:
        if model in containers or model in referenced or any(model is r[1] for r in roots):
            continue
        if model.__name__.startswith("_") or any(m is not model and issubclass(m, model) for m in models):
            continue  # a base the documented variants inherit from: its fields appear in each of them
        key = attrs.get(model, model.__name__)
        doc = (inspect.getmodule(model).__doc__ or "").strip().splitlines()
        roots.append((key, model, _intro(key, doc[0] if doc else "")))
    placed: set[type] = set()

    def grow(path: str, model: type[BaseModel], intro: str) -> Section:
        placed.add(model)
        sec = Section(path, model, intro)
        for name, info in model.model_fields.items():
            many = _is_list(info.annotation) or (
                typing.get_origin(info.annotation) in (typing.Union, types.UnionType)
                and any(_is_list(a) for a in typing.get_args(info.annotation))
            )
            for child in nested_models(info.annotation):
                if child in placed:
                    continue
                child_path = f"{path}.{name}" + ("[]" if many else "")
                tag = _discriminators(child)
                sec.children.append(grow(f"{child_path} ({tag})" if tag else child_path, child, ""))
        return sec

    return [grow(key, model, intro) for key, model, intro in roots]


def _flatten(sections: list[Section]) -> Iterator[tuple[int, Section]]:
    def walk(sec: Section, depth: int) -> Iterator[tuple[int, Section]]:
        yield depth, sec
        for child in sec.children:
            yield from walk(child, depth + 1)

    for sec in sections:
        yield from walk(sec, 0)


def _docstring(model: type[BaseModel]) -> str:
    doc = model.__dict__.get("__doc__")
    return inspect.cleandoc(doc) if doc else ""


def config_reference(package: str = "enlace.config") -> str:
    sections = build_sections(package)
    flat = list(_flatten(sections))
    anchors = {sec.model: slug(sec.path) for _, sec in flat}
    package_models = set(_models_in(config_modules(package)))
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by tools/gen_docs.py from the pydantic models in src/enlace/config/: do not edit. -->",
        "",
        "Every field of every config layer and of the nested sections inside them, with its type, its default",
        "(**required** where there is none) and the comment that explains it in the source. A layer file",
        "(`configs/<layer>/<name>.yaml`) sets the fields of its layer; `--set layer.key=value` overrides one on",
        "the command line, and `enlace config show` prints the resolved values with where each came from",
        "(see [Configuration](../configuration.md)). Unknown keys are errors at every level. Types are strict:",
        "`int` takes no `true`, `bool` no `1`; a `float` field takes an integer.",
        "",
    ]
    for depth, sec in flat:
        out.append(f"{'#' * min(2 + depth, 4)} {sec.path}")
        out.append("")
        lead = " ".join(p for p in (sec.intro, f"Model `{sec.model.__name__}`.") if p)
        out.append(lead)
        # A private base (not a section of its own) speaks through the models built on it.
        bases = [
            b for b in reversed(sec.model.__mro__[1:]) if b.__name__.startswith("_") and b in package_models
        ]
        opening = [class_comment(b) for b in bases] + [class_comment(sec.model)]
        for text in (_docstring(sec.model), cell(" ".join(t for t in opening if t))):
            if text:
                out += ["", text]
        out += ["", "| field | type | default | explanation |", "|---|---|---|---|"]
        comments = field_comments(sec.model)
        for name, info in sec.model.model_fields.items():
            tp = render_type(info.annotation)
            limits = constraints(info)
            type_cell = code(tp) + (f" ({cell(', '.join(limits))})" if limits else "")
            links = [(c.__name__, anchors[c]) for c in nested_models(info.annotation) if c in anchors]
            if len(links) == 1 and links[0][0] == tp:
                type_cell = f"[`{tp}`](#{links[0][1]})"
            elif links:
                type_cell += " (" + ", ".join(f"[{name}](#{anchor})" for name, anchor in links) + ")"
            if info.is_required():
                default = "**required**"
            else:
                value = info.get_default(call_default_factory=True)
                default = "(section below)" if isinstance(value, BaseModel) else code(yaml_value(value))
            text = " ".join(t for t in (comments.get(name, ""), info.description or "") if t)
            out.append(f"| `{name}` | {type_cell} | {default} | {cell(text)} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------------------
# The CLI


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) in seen:  # an alias
                    continue
                seen.add(id(sub))
                out.append((name, helps.get(name, ""), sub))
    return out


def _usage_part(action: argparse.Action) -> str:
    value = _value(action)
    if not action.option_strings:  # positional
        name = value or action.dest
        if isinstance(action, argparse._SubParsersAction):
            name = f"{action.metavar or action.dest} ..."
        elif action.nargs == "?":
            name = f"[{name}]"
        elif action.nargs in ("*", "+"):
            name = f"{name} [{name} ...]" if action.nargs == "+" else f"[{name} ...]"
        return name
    if value and action.nargs == "?":
        value = f"[{value}]"
    elif value and action.nargs in ("*", "+"):
        value = f"{value} [{value} ...]" if action.nargs == "+" else f"[{value} ...]"
    text = f"{action.option_strings[0]} {value}".strip()
    return text if action.required else f"[{text}]"


def _usage(parser: argparse.ArgumentParser) -> str:
    """The usage line, written here rather than by argparse: argparse's wrapping and layout change between
    Python versions and terminals, and the page must not."""
    parts = ["[-h]"] if any(isinstance(a, argparse._HelpAction) for a in parser._actions) else []
    optional = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    positional = [a for a in parser._actions if not a.option_strings]
    parts += [_usage_part(a) for a in optional + positional if a.help != argparse.SUPPRESS]
    lead = f"usage: {parser.prog} "
    lines = [""]
    for part in parts:  # wrapped between parts, never inside one
        if lines[-1] and len(lead) + len(lines[-1]) + 1 + len(part) > USAGE_WIDTH:
            lines.append("")
        lines[-1] = f"{lines[-1]} {part}".strip()
    return "\n".join((lead if i == 0 else " " * len(lead)) + line for i, line in enumerate(lines)).rstrip()


def _names(action: argparse.Action) -> str:
    if action.option_strings:
        return ", ".join(action.option_strings)
    return action.metavar if isinstance(action.metavar, str) else action.dest


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if isinstance(action.metavar, tuple):
        return " ".join(action.metavar)
    if action.metavar is not None:
        return action.metavar
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        return "{" + ",".join(map(str, action.choices)) + "}"
    return action.dest.upper() if action.option_strings else ""


def _default(action: argparse.Action) -> str:
    d = action.default
    if d is None or d is argparse.SUPPRESS or action.nargs == 0 or d == []:
        return ""
    return code(d if isinstance(d, str) else repr(d))


def _shared_options(cli: types.ModuleType) -> list[argparse.Action]:
    """The options every config-reading command shares (cli.common_parser), documented once."""
    make = getattr(cli, "common_parser", None)
    if make is None:
        return []
    return [a for a in make()._actions if not isinstance(a, argparse._HelpAction)]


def _action_key(a: argparse.Action) -> tuple:
    return (tuple(a.option_strings), a.dest, str(a.default), a.help)


def _options_table(parser: argparse.ArgumentParser, actions: list[argparse.Action]) -> list[str]:
    rows = ["| argument | value | default | what it does |", "|---|---|---|---|"]
    formatter = parser._get_formatter()
    expand = getattr(formatter, "_expand_help", lambda action: action.help)  # fills in %(default)s
    for a in actions:
        text = expand(a) if a.help else ""
        rows.append(f"| {code(_names(a))} | {code(_value(a))} | {_default(a)} | {cell(text)} |")
    return rows


def cli_reference(module: str = "enlace.cli") -> str:
    cli = importlib.import_module(module)
    parser: argparse.ArgumentParser = cli.build_parser()
    shared = _shared_options(cli)
    shared_keys = {_action_key(a) for a in shared}
    out = [
        "# CLI reference",
        "",
        "<!-- Generated by tools/gen_docs.py from the `enlace` command's argparse parser: do not edit. -->",
        "",
        "Every `enlace` command and its options, as `enlace COMMAND --help` prints them. User errors exit with",
        "status 2 and one line naming what and where.",
        "",
        "```text",
        _usage(parser),
        "```",
        "",
    ]
    if parser.description:
        out += [cell(parser.description), ""]
    commands = []

    def collect(p: argparse.ArgumentParser, path: str, text: str) -> None:
        subs = _subparsers(p)
        if path:
            commands.append((path, text, p, bool(subs)))
        for name, sub_text, sub in subs:
            collect(sub, f"{path} {name}".strip(), sub_text)

    collect(parser, "", "")
    out += ["| command | what it does |", "|---|---|"]
    for path, text, _, _ in commands:
        out.append(f"| [{code('enlace ' + path)}](#{slug('enlace ' + path)}) | {cell(text)} |")
    out.append("")
    if shared:
        out += [
            "## Config options",
            "",
            "Commands that read the full config take these options: which params file, which file per",
            "layer, and overrides. See [Configuration](../configuration.md).",
            "",
        ]
        out += _options_table(parser, shared) + [""]
    for path, text, p, has_subs in commands:
        out += [f"## enlace {path}", ""]
        if text:
            out += [cell(text), ""]
        out += ["```text", _usage(p), "```", ""]
        # Only a command that takes every shared option points to them; one that takes some lists its own.
        takes_shared = bool(shared_keys) and shared_keys <= {_action_key(a) for a in p._actions}
        actions = [
            a
            for a in p._actions
            if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
            and not (takes_shared and _action_key(a) in shared_keys)
        ]
        if actions:
            out += _options_table(p, actions) + [""]
        if takes_shared:
            out += ["Also takes the [config options](#config-options).", ""]
        if not actions and not takes_shared and not has_subs:
            out += ["No options.", ""]
    return "\n".join(out).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------------------


def pages() -> dict[Path, str]:
    return {CONFIG_PAGE: config_reference(), CLI_PAGE: cli_reference()}


def stale(root: Path = ROOT) -> list[Path]:
    """The reference pages whose committed text differs from what the code generates now."""
    out = []
    for rel, text in pages().items():
        path = root / rel
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            out.append(rel)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 when a page is stale")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale()
        for rel in bad:
            print(f"error: {rel} is stale; regenerate it with {REGENERATE}", file=sys.stderr)
        return 1 if bad else 0
    for rel, text in pages().items():
        path = ROOT / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            atomic_write_text(path, text)
            print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
