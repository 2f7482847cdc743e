"""A config: its validated layers, where each value came from, and the helpers on dotted keys.

The layer schemas and this type sit below config/resolve.py (which reads the files), config/checks.py
and config/kinds.py, so those import it without importing each other.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from .data import DataConfig
from .extra import EvalConfig
from .finetune import FinetuneConfig
from .hardware import HardwareConfig
from .model import ModelConfig
from .train import TrainConfig

# Every layer a params.yaml `config:` block can select: configs/<layer>/<name>.yaml.
LAYERS: dict[str, type[BaseModel]] = {
    "hardware": HardwareConfig,
    "model": ModelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "finetune": FinetuneConfig,
}


@dataclass(frozen=True)
class Config:
    layers: dict[str, BaseModel]
    provenance: dict[str, str]  # dotted key -> where the value came from
    files: dict[str, str]  # layer -> file it was read from
    eval: EvalConfig = field(default_factory=EvalConfig)

    def _layer(self, name: str) -> Any:
        if name not in self.layers:
            raise AttributeError(f"this config has no {name} layer (it has {', '.join(self.layers)})")
        return self.layers[name]

    # Typed access to each layer; a command reads only some (finetune: hardware and finetune).
    @property
    def hardware(self) -> HardwareConfig:
        return self._layer("hardware")

    @property
    def model(self) -> ModelConfig:
        return self._layer("model")

    @property
    def train(self) -> TrainConfig:
        return self._layer("train")

    @property
    def data(self) -> DataConfig:
        return self._layer("data")

    @property
    def finetune(self) -> FinetuneConfig:
        return self._layer("finetune")

    def to_dict(self) -> dict[str, Any]:
        return {name: layer.model_dump(mode="json") for name, layer in self.layers.items()}

    def section_hash(self, *names: str) -> str:
        """Hash of some layers only: resume compares model/data/optimizer hashes separately."""
        d = self.to_dict()
        return stable_hash({n: d[n] for n in names if n in d})

    @property
    def hash(self) -> str:
        return stable_hash(self.to_dict())


def stable_hash(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def set_dotted(d: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for p in parts[:-1]:
        nxt = d.get(p)
        if not isinstance(nxt, dict):
            nxt = d[p] = {}
        d = nxt
    d[parts[-1]] = value
