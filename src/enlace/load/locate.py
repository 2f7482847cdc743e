"""What a model path is: one of our pretraining runs, a LoRA run, a Hugging Face folder, a GGUF file or an
assistant spec (a base aligned in context by a preamble, configs/assistant/*.yaml).

The one place that tells them apart, so that every command accepts the same paths and refuses a bad one
with the same one-line error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError

KINDS = ("run", "hf", "gguf", "preamble")
WHAT = "a run folder, a Hugging Face model folder, a .gguf file or an assistant spec (.yaml)"


@dataclass(frozen=True)
class ModelRef:
    """A located model: its kind, the path to open, and the LoRA adapter to merge in (or None)."""

    # "run": our pretraining run (checkpoints/); "hf": a Hugging Face folder; "gguf": a GGUF file; "preamble":
    # an assistant spec (load/preamble.py)
    kind: str
    path: Path  # the run folder, the Hugging Face folder (a LoRA run's base), the GGUF file or the spec
    adapter: Path | None = None
    adapter_scale: float = 1.0  # the adapter's delta B A times this (llama.cpp's --lora-scaled)


def check_model_folder(model_dir: Path, flag: str = "--model") -> Path:
    """Refuse a missing folder, or a file, by name before anything tries to read inside it."""
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise ModelError(f"{flag} {model_dir}: no such folder")
    if not model_dir.is_dir():
        raise ModelError(f"{flag} {model_dir}: not a folder (expected a Hugging Face model folder)")
    return model_dir


def base_of_lora_run(run_dir: Path, flag: str = "--model") -> Path:
    """The base model a LoRA run was trained on: its resolved config, else its adapter's own record."""
    cfg_path = run_dir / "config.json"
    if cfg_path.exists():
        base = json.loads(cfg_path.read_text(encoding="utf-8")).get("config", {}).get("finetune", {})
        if base.get("base_model"):
            return Path(base["base_model"])
    from ..lora import read_adapter_config

    recorded = read_adapter_config(run_dir / "adapter").get("base_model_name_or_path")
    if not recorded:
        raise ModelError(f"{flag} {run_dir}: cannot tell its base model; pass --model BASE --adapter ADAPTER")
    return Path(recorded)


def locate(path: str | Path, adapter: str | Path | None = None, flag: str = "--model") -> ModelRef:
    """Tell what `path` is (flag names it in errors); a LoRA run (runs/finetune) is its base plus adapter/."""
    path = Path(path)
    chosen = Path(adapter) if adapter is not None else None
    if not path.exists():
        raise ModelError(f"{flag} {path}: no such folder or file ({WHAT})")
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in (".yaml", ".yml"):
            # An adapter goes on the spec's base: one trained in the preamble's format (finetune.preamble).
            return ModelRef("preamble", path, chosen)
        if suffix != ".gguf":
            raise ModelError(f"{flag} {path}: not a folder ({WHAT})")
        return ModelRef("gguf", path, chosen)
    # A LoRA run keeps checkpoints/ too: its adapter tells it from a pretraining run.
    if (path / "adapter" / "adapter_config.json").exists() and not (path / "model.safetensors").exists():
        return ModelRef("hf", base_of_lora_run(path, flag), chosen or path / "adapter")
    if (path / "checkpoints").is_dir():
        if chosen is not None:
            raise ModelError(
                f"--adapter applies to Hugging Face model folders; export the run first "
                f"(`enlace export --run-dir {path}`), then pass --model runs/export/hf"
            )
        return ModelRef("run", path)
    if (path / "config.json").exists():
        return ModelRef("hf", path, chosen)
    raise ModelError(
        f"{flag} {path}: neither a run folder (checkpoints/), a LoRA run (adapter/), a Hugging Face folder "
        "(config.json) nor a .gguf file"
    )
