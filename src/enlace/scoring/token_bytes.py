"""How many UTF-8 bytes of text each token stands for: the denominator of bits per byte.

Bits per byte is only comparable across tokenizers when it divides by the bytes of the text actually
scored, token by token, rather than by a split's average bytes per token. Three vocabularies:
- raw bytes (the smoke model): every token is one byte;
- sentencepiece: a piece's text with the space marker "▁" as one space byte, "<0xNN>" byte-fallback
  pieces as one byte, control tokens (pad, bos, eos) and unknown as none. The marker of the first piece
  of a document is the dummy prefix sentencepiece adds, not text: after a document start it counts zero;
- Hugging Face byte-level BPE (SmolLM2): every character of a token's string is one byte (GPT-2's
  byte-to-unicode table), special tokens none.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DataError

SPACE_MARKER = "\u2581"  # sentencepiece's "▁"
_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


@dataclass(frozen=True)
class TokenBytes:
    """Bytes per token id, and the rule for sentencepiece's dummy prefix."""

    lengths: np.ndarray  # int64 [vocab]: UTF-8 bytes token id i stands for
    leading_space: np.ndarray | None = None  # bool [vocab]: the piece starts with the space marker
    doc_starts: tuple[int, ...] = ()  # ids after which a leading marker is the dummy prefix (eos)

    def count(self, inputs: np.ndarray, targets: np.ndarray) -> int:
        """Bytes of the targets; inputs[i] is the token before targets[i] (windows: y[i] follows x[i])."""
        targets = np.asarray(targets, dtype=np.int64)
        n = int(self.lengths[targets].sum())
        if self.leading_space is not None and self.doc_starts:
            after_start = np.isin(np.asarray(inputs, dtype=np.int64), self.doc_starts)
            n -= int((after_start & self.leading_space[targets]).sum())
        return n

    @classmethod
    def raw_bytes(cls, vocab_size: int = 256) -> TokenBytes:
        return cls(np.ones(vocab_size, dtype=np.int64))

    @classmethod
    def sentencepiece(cls, model_file: Path) -> TokenBytes:
        import sentencepiece as spm

        if not Path(model_file).exists():
            raise DataError(f"{model_file}: tokenizer not found; run `enlace tokenize` first")
        sp = spm.SentencePieceProcessor(model_file=str(model_file))
        n = sp.get_piece_size()
        lengths = np.zeros(n, dtype=np.int64)
        leading = np.zeros(n, dtype=bool)
        for i in range(n):
            if sp.is_control(i) or sp.is_unknown(i):
                continue
            if sp.is_byte(i):
                lengths[i] = 1
                continue
            piece = sp.id_to_piece(i)
            lengths[i] = len(piece.replace(SPACE_MARKER, " ").encode("utf-8"))
            leading[i] = piece.startswith(SPACE_MARKER)
        eos = sp.eos_id()
        return cls(lengths, leading, (eos,) if eos >= 0 else ())

    @classmethod
    def hugging_face(cls, tokenizer_json: Path) -> TokenBytes:
        """A fast tokenizer's tokenizer.json; byte-level BPE only (the one family whose bytes are exact)."""
        data = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
        decoders = data.get("decoder") or {}
        kinds = {d.get("type") for d in decoders.get("decoders", [decoders])}
        if "ByteLevel" not in kinds:
            raise DataError(
                f"{tokenizer_json}: bits per byte needs a byte-level BPE tokenizer (decoder {sorted(kinds)})"
            )
        byte_chars = set(_byte_to_unicode())
        vocab: dict[str, int] = dict(data["model"]["vocab"])
        special = {t["id"] for t in data.get("added_tokens", []) if t.get("special")}
        for t in data.get("added_tokens", []):
            vocab.setdefault(t["content"], t["id"])
        lengths = np.zeros(max(vocab.values()) + 1, dtype=np.int64)
        for token, i in vocab.items():
            if i in special:
                continue
            if not set(token) <= byte_chars:
                raise DataError(f"{tokenizer_json}: token {i} {token!r} is not in byte-level form")
            lengths[i] = len(token)
        return cls(lengths)


def _byte_to_unicode() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values (the characters byte-level BPE tokens use)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars
