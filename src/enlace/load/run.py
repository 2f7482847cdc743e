"""One of our pretraining runs: its newest complete checkpoint, and the text codec it was trained on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .. import paths
from ..config import ModelConfig
from ..errors import CheckpointError
from ..model import Llama
from ..text import ByteCodec, SentencePieceCodec, codec_for, continuation


def load_trained_model(
    run_dir: Path, device: torch.device | str = "cpu"
) -> tuple[Llama, dict[str, Any], Path]:
    """The newest complete checkpoint of a run, as an eval-mode model built from the config it saved."""
    from ..train.checkpoint import latest_checkpoint, load_model_tensors

    found = latest_checkpoint(Path(run_dir) / "checkpoints", device=device)
    if found is None:
        raise no_checkpoint(run_dir)
    path, tensors, meta = found
    model = Llama(ModelConfig.model_validate(meta["config"]["model"]))
    load_model_tensors(model, tensors["model"])
    return model.to(device).eval(), meta, path


def no_checkpoint(run_dir: Path) -> CheckpointError:
    """What to say of a run folder with nothing to load (or no folder at all, where a run is expected)."""
    root = Path(run_dir) / "checkpoints"
    return CheckpointError(
        f"{root}: no complete checkpoint; run `enlace pretrain` (or `dvc repro pretrain`) first"
    )


def run_codec(meta: dict[str, Any], tokenizer_dir: Path = paths.TOKENIZER) -> ByteCodec | SentencePieceCodec:
    """The codec of the run's loader (bytes, or the sentencepiece model of `enlace tokenize`)."""
    return codec_for(meta["config"]["train"]["loader"], tokenizer_dir)


class RunStream:
    """Text pieces of our own runs' tokens: the codec decodes the continuation after the prompt."""

    def __init__(self, codec: ByteCodec | SentencePieceCodec, prompt_ids: list[int]):
        self.codec, self.prompt, self.ids, self.emitted = codec, list(prompt_ids), [], ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = continuation(self.codec, self.prompt, self.ids)
        if text.endswith("\ufffd"):
            return ""  # a multi-byte character split across tokens: wait for the rest
        piece, self.emitted = text[len(self.emitted) :], text
        return piece
