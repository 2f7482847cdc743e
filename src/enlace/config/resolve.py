"""Resolve the layered config: params.yaml picks one file per layer, then overrides apply.

Order, later wins: layer file < params.yaml `set:` < command-line `--set`. Every leaf value remembers
where it came from, so errors and `enlace config show` can name the file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ..errors import ConfigError
from .checks import cross_layer_checks
from .extra import EvalConfig
from .kinds import check_kinds
from .layers import LAYERS, Config, flatten, set_dotted, stable_hash

__all__ = ["LAYERS", "Config", "build_config", "flatten", "load_config", "set_dotted", "stable_hash"]

PRETRAIN_LAYERS = ("hardware", "model", "train", "data")
DEFAULT_PARAMS = "params.yaml"
CONFIG_DIR = "configs"


class _Loader(yaml.SafeLoader):
    """PyYAML follows YAML 1.1, which reads `3e-4` (no dot) as a string; YAML 1.2, DVC's ruamel and every
    user mean a float. Config numbers are strictly typed, so the string would be refused."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # safe: _Loader is a SafeLoader


def _yaml_error(e: yaml.YAMLError, text: str) -> str:
    """Where the mistake is, not only where the parser noticed it: an unclosed quote, bracket or key is
    reported at the end of the construct, so point at the line that opened it and quote that line."""
    problem = getattr(e, "problem", None) or str(e)
    noticed = getattr(e, "problem_mark", None)
    opened = getattr(e, "context_mark", None)
    context = getattr(e, "context", None) or ""
    # "while parsing a block mapping" names the enclosing mapping: the bad line is the one noticed.
    mark = opened if opened is not None and "block" not in context else noticed
    if mark is None:
        return f"not valid YAML: {problem}"
    lines = text.splitlines()
    quoted = lines[mark.line].strip() if mark.line < len(lines) else ""
    where = (
        f"; noticed at line {noticed.line + 1}" if noticed is not None and noticed.line != mark.line else ""
    )
    return f"not valid YAML at line {mark.line + 1}: {quoted!r} ({problem}{where})"


def _read_yaml(path: Path, what: str) -> dict[str, Any]:
    """One YAML mapping from a file; every way it can be unreadable is a one-line ConfigError."""
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(str(path), what, "file not found") from None
    except IsADirectoryError:
        raise ConfigError(str(path), what, "is a folder, expected a YAML file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            str(path), what, f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})"
        ) from None
    except OSError as e:
        raise ConfigError(str(path), what, f"cannot read: {e.strerror or e}") from None
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(str(path), what, _yaml_error(e, text)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), what, f"expected a mapping of keys to values, got {type(data).__name__}")
    return data


def read_params(params: str | Path = DEFAULT_PARAMS) -> dict[str, Any]:
    """params.yaml as a dict. A missing file is an error when named explicitly; the default one may be
    absent when every layer is selected on the command line."""
    path = Path(params)
    if str(params) == DEFAULT_PARAMS and not path.exists():
        return {}
    return _read_yaml(path, "params")


def layer_path(layer: str, selector: str, root: Path) -> Path:
    """A layer is selected by name (configs/<layer>/<name>.yaml) or by an explicit .yaml path."""
    if selector.endswith((".yaml", ".yml")) or "/" in selector:
        p = Path(selector)
        return p if p.is_absolute() else root / p
    return root / CONFIG_DIR / layer / f"{selector}.yaml"


def parse_set(items: list[str] | None) -> dict[str, Any]:
    """`--set train.max_steps=100` -> {"train.max_steps": 100}; values are parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError("--set", item, "expected section.key=value")
        key, raw = item.split("=", 1)
        try:
            out[key.strip()] = parse_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError:
            out[key.strip()] = raw
    return out


def _source_for(loc: tuple[Any, ...], layer: str, provenance: dict[str, str], default: str) -> str:
    """The file that set the value at `loc`, or the closest enclosing key that has one."""
    parts = [str(p) for p in loc]
    for n in range(len(parts), 0, -1):
        key = ".".join([layer, *parts[:n]])
        if key in provenance:
            return provenance[key]
        prefixed = [v for k, v in provenance.items() if k.startswith(key + ".")]
        if prefixed and all(v == prefixed[0] for v in prefixed):
            return prefixed[0]
    return default


def _validation_error(
    e: ValidationError, layer: str, provenance: dict[str, str], default: str
) -> ConfigError:
    err = e.errors(include_url=False)[0]
    # Union members' tags are not keys: data sources' kinds, and `compile: true|false|auto`'s bool.
    tags = ("deb", "url", "hf", "local", "bool", "literal['auto']")
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p in tags))
    path = ".".join([layer, *map(str, loc)])
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(LAYERS[layer], loc[:-1])
        msg = "unknown key" + (f"; allowed: {', '.join(allowed)}" if allowed else "")
    elif err["type"] == "missing":
        msg = "required field is missing"
    elif "input" in err and err["type"] not in ("value_error",):
        msg = f"{msg} (got {err['input']!r})"
    msg = msg.removeprefix("Value error, ")
    return ConfigError(_source_for(loc, layer, provenance, default), path, msg)


def _allowed_keys(schema: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    for part in loc:
        f = schema.model_fields.get(str(part)) if isinstance(part, str) else None
        ann = getattr(f, "annotation", None) if f else None
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            schema = ann
        elif isinstance(part, int):
            continue
        else:
            return []
    return sorted(schema.model_fields)


def load_config(
    params: str | Path = DEFAULT_PARAMS,
    layers: tuple[str, ...] = PRETRAIN_LAYERS,
    select: dict[str, str] | None = None,
    overrides: list[str] | None = None,
    check_cross: bool = True,
    flags: dict[str, tuple[str, Any]] | None = None,
    stage: str | None = None,
) -> Config:
    """Read params.yaml, the selected layer files and the overrides; validate; run cross-layer checks.

    `stage` names a params.yaml section (such as `smoke`) whose layer names replace `config`'s and whose
    own `set:` applies after the top-level one; `select` (the command line's layer options) wins over both.

    `flags` are a command's own options, dotted key -> (flag name, value): applied after `--set`, and
    errors name the flag the user typed.
    """
    # Long: the resolution order reads top to bottom (select the layer files, read them, apply the overrides in order, validate).
    params_path = Path(params)
    root = params_path.parent
    p = read_params(params)
    selected = dict(p.get("config") or {})
    stage_section = dict(p.get(stage) or {}) if stage else {}
    stage_sets = stage_section.pop("set", None) or {}
    selected.update({k: v for k, v in stage_section.items() if v})
    selected.update({k: v for k, v in (select or {}).items() if v})

    raw: dict[str, dict[str, Any]] = {}
    provenance: dict[str, str] = {}
    files: dict[str, str] = {}
    for layer in layers:
        if layer not in selected:
            if not params_path.exists():  # the real cause: no params file to select from
                raise ConfigError(str(params_path), "params", "file not found")
            raise ConfigError(
                str(params_path),
                f"config.{layer}",
                f"no {layer} config selected; name a file from {CONFIG_DIR}/{layer}/",
            )
        path = layer_path(layer, str(selected[layer]), root)
        rel = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
        files[layer] = rel
        raw[layer] = _read_yaml(path, layer)
        for k in flatten(raw[layer]):
            provenance[f"{layer}.{k}"] = rel

    set_sources = [(f"{params_path.name} (set)", p.get("set") or {})]
    if stage:
        set_sources.append((f"{params_path.name} ({stage}.set)", stage_sets))
    set_sources.append(("--set", parse_set(overrides)))
    set_sources += [(flag, {key: value}) for key, (flag, value) in (flags or {}).items()]
    for source, sets in set_sources:
        if not isinstance(sets, dict):
            raise ConfigError(source, "set", "expected a mapping of section.key to value")
        for key, value in sets.items():
            layer = str(key).split(".", 1)[0]
            if "." not in str(key) or layer not in LAYERS:
                raise ConfigError(
                    source, str(key), f"expected section.key with section one of: {', '.join(LAYERS)}"
                )
            if layer not in layers:
                if source == "--set":  # typed for this command, which would silently ignore it
                    raise ConfigError(
                        source, str(key), f"this command reads only the {', '.join(layers)} config"
                    )
                continue  # params.yaml's `set:` serves every command; this one does not read that layer
            set_dotted(raw[layer], str(key).split(".", 1)[1], value)
            provenance[str(key)] = source
            for k in list(provenance):
                if k.startswith(f"{key}.") and provenance[k] != source:
                    del provenance[k]

    try:
        ev = EvalConfig.model_validate(p.get("eval") or {})
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        raise ConfigError(str(params_path), "eval." + ".".join(map(str, err["loc"])), err["msg"]) from None
    return build_config(raw, provenance=provenance, files=files, eval=ev, check_cross=check_cross)


def build_config(
    layers: dict[str, Any],
    *,
    provenance: dict[str, str] | None = None,
    files: dict[str, str] | None = None,
    eval: EvalConfig | None = None,
    check_cross: bool = False,
) -> Config:
    """The one way a Config is made (load_config, a checkpoint's saved config, gpu-check, the tests): each
    layer (a dict or an already validated model) is validated against its schema, errors name the file the
    value came from, and every value gets a provenance."""
    provenance = dict(provenance or {})
    files = dict(files or {})
    built: dict[str, BaseModel] = {}
    for layer, raw in layers.items():
        try:
            built[layer] = LAYERS[layer].model_validate(raw)
        except ValidationError as e:
            raise _validation_error(e, layer, provenance, files.get(layer, "config")) from None
        for k in flatten(built[layer].model_dump(mode="json")):
            provenance.setdefault(f"{layer}.{k}", "default")
    cfg = Config(layers=built, provenance=provenance, files=files, eval=eval or EvalConfig())
    if check_cross:
        cross_layer_checks(cfg)
        check_kinds(cfg)
    return cfg


def show(cfg: Config) -> str:
    """The resolved config as YAML, each value annotated with the layer it came from."""
    lines: list[str] = [f"# config hash: {cfg.hash}"]

    def emit(d: dict[str, Any], prefix: str, indent: int) -> None:
        for k, v in d.items():
            key = f"{prefix}{k}"
            pad = "  " * indent
            if isinstance(v, dict) and v:
                lines.append(f"{pad}{k}:")
                emit(v, key + ".", indent + 1)
            else:
                scalar = (
                    json.dumps(v, ensure_ascii=False)
                    if isinstance(v, (list, dict, str))
                    else yaml.safe_dump(v).strip().removesuffix("\n...")
                )
                lines.append(f"{pad}{k}: {scalar}  # {cfg.provenance.get(key, 'default')}")

    emit(cfg.to_dict(), "", 0)
    return "\n".join(lines) + "\n"


def save_resolved(cfg: Config, path: Path) -> None:
    """Every output that depends on a config carries the resolved config and its hash beside it."""
    from ..io import atomic_write_json

    atomic_write_json(path, {"hash": cfg.hash, "files": cfg.files, "config": cfg.to_dict()})
