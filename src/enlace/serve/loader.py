"""What `enlace serve` serves: one model, loaded once, with the text side it needs (prompt ids, chat template,
streamed decoding, stop ids).

Everything here reuses the loaders the other commands use: `hf.load.load_for_generation` for a Hugging Face
folder (with a LoRA adapter merged in), `eval.evaluate.load_trained_model` and the run's codec for one of
our pretraining runs, and the finetune layer's config for the default (its base model and adapter).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from ..errors import EnlaceError
from ..hf.tokenizer import Message


class TextStream(Protocol):
    def push(self, token_id: int) -> str: ...


@dataclass
class Served:
    """A loaded model and how text goes in and out of it."""

    name: str  # the model id clients send and /v1/models lists
    source: str  # what was loaded, in words (logs, /health)
    model: torch.nn.Module
    context: int  # the model's window in tokens: prompt plus completion must fit in it
    eos_ids: tuple[int, ...]
    encode_text: Callable[[str], list[int]]  # a plain prompt (/v1/completions)
    encode_chat: Callable[[list[Message]], list[int]] | None  # None: the model has no chat template
    stream: Callable[[list[int]], TextStream]  # a decoder of new tokens, given the prompt's ids
    weights: str = "fp32"
    device: str = "cpu"
    info: dict = field(default_factory=dict)


class _RunStream:
    """Text pieces of our own runs' tokens: the codec decodes the continuation after the prompt."""

    def __init__(self, codec, prompt_ids: list[int]):
        self.codec, self.prompt, self.ids, self.emitted = codec, list(prompt_ids), [], ""

    def push(self, token_id: int) -> str:
        from ..text import continuation

        self.ids.append(token_id)
        text = continuation(self.codec, self.prompt, self.ids)
        if text.endswith("\ufffd"):
            return ""  # a multi-byte character split across tokens: wait for the rest
        piece, self.emitted = text[len(self.emitted) :], text
        return piece


def _hf(model_dir: Path, adapter: Path | None, name: str, device: str) -> Served:
    from ..hf.load import load_for_generation
    from ..hf.tokenizer import StreamDecoder

    model, tok = load_for_generation(model_dir, adapter, device=device)

    def encode_text(text: str) -> list[int]:
        ids = tok.encode(text)
        return ids or ([tok.bos_id] if tok.bos_id is not None else [])

    def encode_chat(messages: list[Message]) -> list[int]:
        return tok.apply_chat_template(messages, add_generation_prompt=True)

    source = f"{model_dir}" + (f" with the LoRA adapter {adapter}" if adapter else "")
    return Served(
        name=name, source=source, model=model, context=model.cfg.seq_len, eos_ids=tok.eos_ids,
        encode_text=encode_text, encode_chat=encode_chat if tok.chat_template else None,
        stream=lambda _prompt: StreamDecoder(tok), device=device,
    )  # fmt: skip


def _run(run_dir: Path, name: str, device: str) -> Served:
    from .. import paths
    from ..eval.evaluate import load_trained_model
    from ..text import codec_for

    model, meta, ckpt = load_trained_model(run_dir, device)
    codec = codec_for(meta["config"]["train"]["loader"], paths.TOKENIZER)
    return Served(
        name=name, source=f"{ckpt} (a pretraining run: plain continuation, no chat template)", model=model,
        context=model.cfg.seq_len, eos_ids=tuple(codec.eos_ids), encode_text=codec.encode, encode_chat=None,
        stream=lambda prompt: _RunStream(codec, prompt), device=device,
    )  # fmt: skip


def _base_of_lora_run(run_dir: Path) -> Path:
    """The base model a LoRA run was trained on: its resolved config, else its adapter's own record."""
    cfg_path = run_dir / "config.json"
    if cfg_path.exists():
        base = json.loads(cfg_path.read_text(encoding="utf-8")).get("config", {}).get("finetune", {})
        if base.get("base_model"):
            return Path(base["base_model"])
    from ..finetune.lora import read_adapter_config

    recorded = read_adapter_config(run_dir / "adapter").get("base_model_name_or_path")
    if not recorded:
        raise EnlaceError(
            f"--model {run_dir}: cannot tell its base model; pass --model BASE --adapter ADAPTER"
        )
    return Path(recorded)


def resolve(model: str | None, adapter: str | None, default: Callable[[], tuple[Path, Path]]) -> tuple:
    """(kind, folder, adapter) for --model/--adapter; kind is "hf" or "run". No --model: `default()`."""
    if model is None:
        base, adapter_dir = default()
        if not (adapter_dir / "adapter_config.json").exists():
            raise EnlaceError(
                f"no fine-tuned assistant yet: {adapter_dir} not found; run `make run` (or `dvc repro "
                f"finetune`) first, or pass --model FOLDER (e.g. --model {base})"
            )
        if adapter is not None:
            adapter_dir = Path(adapter)
        return "hf", base, adapter_dir
    path = Path(model)
    if not path.exists():
        raise EnlaceError(f"--model {path}: no such folder")
    if not path.is_dir():
        raise EnlaceError(f"--model {path}: not a folder (a run folder or a Hugging Face model folder)")
    # A LoRA run (runs/finetune) keeps checkpoints/ too: its adapter tells it from a pretraining run.
    if (path / "adapter" / "adapter_config.json").exists() and not (path / "model.safetensors").exists():
        return "hf", _base_of_lora_run(path), Path(adapter) if adapter else path / "adapter"
    if (path / "checkpoints").is_dir():
        if adapter is not None:
            raise EnlaceError(
                f"--adapter applies to Hugging Face model folders; export the run first "
                f"(`enlace export --run-dir {path}`), then pass --model runs/export/hf"
            )
        return "run", path, None
    if (path / "config.json").exists():
        return "hf", path, Path(adapter) if adapter else None
    raise EnlaceError(
        f"--model {path}: neither a run folder (checkpoints/), a LoRA run (adapter/) nor a Hugging Face "
        "folder (config.json)"
    )


def default_name(kind: str, folder: Path, adapter: Path | None) -> str:
    """The model id: the folder's name, plus the adapter's run (runs/finetune/adapter -> "+finetune")."""
    name = folder.resolve().name
    if adapter is not None:
        a = adapter.resolve()
        name += "+" + (a.parent.name if a.name == "adapter" else a.name)
    return name


def load_served(
    model: str | None,
    adapter: str | None,
    default: Callable[[], tuple[Path, Path]],
    weights: str = "auto",
    device: str = "cpu",
    name: str | None = None,
) -> Served:
    from ..generate import decode_weights, resolve_decode_weights

    kind, folder, adapter_dir = resolve(model, adapter, default)
    name = name or default_name(kind, folder, adapter_dir)
    served = _hf(folder, adapter_dir, name, device) if kind == "hf" else _run(folder, name, device)
    served.weights = resolve_decode_weights(weights, device)
    decode_weights(served.model, served.weights, device)
    return served
