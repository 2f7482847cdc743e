"""Text <-> token ids for our own models: raw UTF-8 bytes (smoke) or the trained sentencepiece model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import DataError
from .manifest import verify_manifest


@dataclass
class ByteCodec:
    """The smoke model's vocabulary: the 256 byte values. No special tokens."""

    eos_ids: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class SentencePieceCodec:
    def __init__(self, model_file: Path):
        import sentencepiece as spm

        if not Path(model_file).exists():
            raise DataError(
                f"{model_file}: tokenizer not found; run `enlace tokenize` (or `dvc repro tokenize`) first"
            )
        verify_manifest(Path(model_file).parent, [Path(model_file).name])
        self.sp = spm.SentencePieceProcessor(model_file=str(model_file))
        self.eos_ids = (self.sp.eos_id(),) if self.sp.eos_id() >= 0 else ()

    def encode(self, text: str) -> list[int]:
        # Documents are separated by EOS in the shards, so a prompt starts right after one.
        prefix = list(self.eos_ids)
        return prefix + self.sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode([i for i in ids if i not in self.eos_ids])


def continuation(codec: ByteCodec | SentencePieceCodec, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The text the new tokens add after the prompt.

    Decoding the new tokens alone would drop the space a piece like "▁los" carries at the start of a
    decoded string ("La ciudad de" + "los" instead of " los"), so decode both and take the difference.
    """
    prompt = codec.decode(prompt_ids)
    return codec.decode(prompt_ids + new_ids)[len(prompt) :]


def codec_for(loader_kind: str, tokenizer_dir: Path) -> ByteCodec | SentencePieceCodec:
    if loader_kind == "bytes":
        return ByteCodec()
    return SentencePieceCodec(Path(tokenizer_dir) / "tokenizer.model")
