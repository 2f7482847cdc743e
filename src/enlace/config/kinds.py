"""A `dtype: auto` hardware profile's CPU kinds, applied to a config: pure, the machine is not looked at here.

The runtime tells which kind this CPU is (enlace.runtime.resolve_run); `apply_kind` gives the config that kind
runs: the hardware layer with its dtype and compile decided, and the model/train values of the kind's recipe
for the selected train layer. Order, later wins: layer file < the kind's recipe < params.yaml `set:` <
`--set` and a command's flags, so what a user sets by hand is never replaced. `check_kinds` validates every
kind's config when the config is read, so a recipe that breaks a layer fails on every machine alike.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from ..errors import ConfigError
from .hardware import CPU_KINDS
from .layers import LAYERS, Config, set_dotted

RECIPE_MARK = "(kinds."  # provenance of a value a kind's recipe set: "<hardware file> (kinds.fp32)"


def recipe_for(cfg: Config, kind: str) -> dict[str, dict[str, Any]]:
    """The kind's recipes for the selected train and finetune layers, by layer name ({} where none)."""
    hw = cfg.layers["hardware"]
    if hw.kinds is None:
        return {}
    names = [cfg.layers[layer].name for layer in ("train", "finetune") if layer in cfg.layers]
    recipes = hw.kinds[kind].recipes
    return {name: dict(recipes[name]) for name in names if name in recipes}


def apply_kind(cfg: Config, kind: str) -> Config:
    """`cfg` as it runs on a CPU of `kind` (bf16 or fp32); a config without `dtype: auto` is returned as is."""
    hw = cfg.layers["hardware"]
    if kind not in CPU_KINDS:
        raise ValueError(f"CPU kind {kind!r}: one of {', '.join(CPU_KINDS)}")
    source = cfg.files.get("hardware", "hardware")
    mark = f"{source} {RECIPE_MARK}{kind})"
    provenance = dict(cfg.provenance)
    if hw.dtype != "auto":
        if hw.compile != "auto":
            return cfg
        # The dtype was set by hand: its kind's compile, none of the recipes (they fit the CPU, not a choice).
        provenance["hardware.compile"] = mark
        hw_kind = hw.kinds.get(hw.dtype) if hw.kinds else None
        update = {"compile": hw_kind.compile if hw_kind else False}
        layers = {**cfg.layers, "hardware": hw.model_copy(update=update)}
        return Config(layers=layers, provenance=provenance, files=cfg.files, eval=cfg.eval)
    compile_ = hw.compile if hw.compile != "auto" else hw.kinds[kind].compile
    layers = {**cfg.layers, "hardware": hw.model_copy(update={"dtype": kind, "compile": compile_})}
    if hw.compile == "auto":
        provenance["hardware.compile"] = mark
    provenance["hardware.dtype"] = mark
    changed: dict[str, dict[str, Any]] = {}
    came_from: dict[str, str] = {}  # layer -> the recipe (its selecting layer's name) that changed it
    for name, recipe in recipe_for(cfg, kind).items():
        for key, value in recipe.items():
            layer, rest = key.split(".", 1)
            if layer not in layers:
                continue  # a command that does not read this layer (e.g. `enlace estimate` and data)
            if provenance.get(key, "default") not in (cfg.files.get(layer), "default"):
                continue  # set in params.yaml or on the command line: the user's value wins
            raw = changed.setdefault(layer, layers[layer].model_dump(mode="json"))
            set_dotted(raw, rest, value)
            provenance[key] = mark
            came_from[layer] = name
    for layer, raw in changed.items():
        try:
            layers[layer] = LAYERS[layer].model_validate(raw)
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            where = ".".join([layer, *map(str, err["loc"])])
            msg = err["msg"].removeprefix("Value error, ")
            raise ConfigError(source, f"kinds.{kind}.recipes.{came_from[layer]}", f"{where}: {msg}") from None
    return Config(layers=layers, provenance=provenance, files=cfg.files, eval=cfg.eval)


def applied_recipe(cfg: Config) -> dict[str, Any]:
    """The values of `cfg` that a CPU kind's recipe set (dotted key -> value): what the run identity records."""
    d = cfg.to_dict()
    out: dict[str, Any] = {}
    for key, source in cfg.provenance.items():
        layer, _, rest = key.partition(".")
        if RECIPE_MARK in source and layer in ("model", "train", "finetune") and layer in d:
            value: Any = d[layer]
            for part in rest.split("."):
                value = value[part]
            out[key] = value
    return dict(sorted(out.items()))


def check_kinds(cfg: Config) -> None:
    """Every CPU kind's config passes the cross-layer checks: a recipe is checked on every machine."""
    from .checks import cross_layer_checks

    if cfg.layers.get("hardware") is None or cfg.layers["hardware"].dtype != "auto":
        return
    for kind in CPU_KINDS:
        resolved = apply_kind(cfg, kind)
        try:
            cross_layer_checks(resolved)
        except ConfigError as e:  # name the recipes that made the layers disagree
            names = ",".join(recipe_for(cfg, kind)) or "(none)"
            raise ConfigError(
                cfg.files.get("hardware", "hardware"), f"kinds.{kind}.recipes.{names}", f"gives {e}"
            ) from None
