"""One of our pretraining runs: its newest complete checkpoint, and the text codec it was trained on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .. import paths
from ..config import ModelConfig
from ..errors import CheckpointError
from ..hf.tokenizer import IncrementalDecoder
from ..model import Llama
from ..text import ByteCodec, SentencePieceCodec, codec_for


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


# Prompt ids a run's stream decodes before the new ones: the left context a first piece's leading space needs.
RUN_CONTEXT = 8


class RunStream(IncrementalDecoder):
    """Text pieces of our own runs' tokens: the codec decodes the continuation after the prompt."""

    def __init__(self, codec: ByteCodec | SentencePieceCodec, prompt_ids: list[int]):
        super().__init__(codec.decode, list(prompt_ids)[-RUN_CONTEXT:])
        self.codec = codec
