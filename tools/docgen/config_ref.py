"""The configuration reference: every pydantic model in the config package, as the sections a config file has.

The layers come first (a module-level LAYERS-style table of name -> model, or a typed whole-config model whose
fields are the sections), then any other top-level section, each followed by the models nested in it.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import pkgutil
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from .comments import class_comment, field_comments
from .markdown import cell, code, slug

ROOT = Path(__file__).resolve().parents[2]


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


def discriminators(model: type[BaseModel]) -> str:
    """'kind: deb' for a variant of a tagged union: its required single-value Literal fields."""
    tags = []
    for name, info in model.model_fields.items():
        tp = info.annotation
        if typing.get_origin(tp) is typing.Literal and len(typing.get_args(tp)) == 1 and info.is_required():
            tags.append(f"{name}: {typing.get_args(tp)[0]}")
    return ", ".join(tags)


def _section_of(info: FieldInfo) -> type[BaseModel] | None:
    """The model a field holds when it is one section (`train: TrainConfig`, or `| None`), else None."""
    models = nested_models(info.annotation)
    if len(models) == 1 and all(a is type(None) or a is models[0] for a in _union_args(info.annotation)):
        return models[0]
    return None


def _is_container(model: type[BaseModel], layers: dict[str, type[BaseModel]]) -> bool:
    """A typed whole config: a model holding two or more of the layers (its other fields are bookkeeping,
    not keys of a config file), or, without a layer table, a model whose every field is a section."""
    sections = [_section_of(f) for f in model.model_fields.values()]
    if layers:
        return model not in layers.values() and sum(s in layers.values() for s in sections) >= 2
    return bool(sections) and all(sections)


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
    containers = [m for m in models if _is_container(m, layers)]
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
            model = _section_of(info)
            if model is not None and all(model is not r[1] for r in roots):
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
                tag = discriminators(child)
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
