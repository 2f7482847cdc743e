"""Our sentencepiece model -> a `tokenizers` tokenizer.json that gives the same ids, built directly.

transformers' own converter assumes ids 0/1/2 are unk/bos/eos, ignores the normalizer spec and, in some
versions, rejects unigram models; so the pipeline is assembled here from the model file itself and
checked against sentencepiece on real text (`verify`). Only the settings `enlace tokenize` can produce are
accepted (identity normalization, whitespace kept as written, byte fallback); anything else is refused
with the reason, rather than converted into a tokenizer that disagrees.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import EnlaceError

SPACE = "\u2581"  # sentencepiece's visible space, "▁"
# ChatML's turn markers: user-defined pieces of our tokenizer (data/tokenize.py), control tokens in exports.
CHAT_MARKERS = ("<|im_start|>", "<|im_end|>")
# sentencepiece.ModelProto piece types.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}
# Edge cases every conversion is checked on besides the val split (see verify()).
EDGE_CASES = [
    "",
    " ",
    "ñ Ñ año España",
    "áéíóú ÁÉÍÓÚ ü ç",
    "¿Qué tal? ¡Muy bien!",
    "emoji 🙂👍🏽 y símbolos ∑ 中文 𝔘",
    "dos  espacios,   tres y    cuatro",
    " empieza con espacio y acaba con uno ",
    "línea\nsegunda\n\ntercera\r\ntab\tfin",
    "números 0 12 345 6789 3,14 1.000.000",
    "<|im_start|>user\nhola<|im_end|>\n<|im_start|>assistant\n",
    "texto<|im_end|>pegado<|im_start|>",
    "\u00a0espacio duro\u2009fino",
]


class TokenizerConversionError(EnlaceError):
    """The sentencepiece model cannot be turned into an exactly equal `tokenizers` tokenizer."""


@dataclass
class SentencePieceModel:
    """The parts of sentencepiece's ModelProto the conversion depends on."""

    pieces: list[tuple[str, float, int]] = field(default_factory=list)  # (piece, score, type)
    trainer: dict[str, Any] = field(default_factory=dict)
    normalizer: dict[str, Any] = field(default_factory=dict)

    @property
    def model_type(self) -> str:
        return MODEL_TYPES.get(self.trainer.get("model_type", 1), "?")

    def ids_of(self, kind: int) -> list[int]:
        return [i for i, (_, _, t) in enumerate(self.pieces) if t == kind]


# --- a minimal protobuf reader: the model file is a serialized sentencepiece.ModelProto ---------------
def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7


def _fields(buf: bytes):
    """(field number, wire type, value) of one message; length-delimited values stay bytes."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = buf[i : i + 8], i + 8
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i : i + n], i + n
        elif wire == 5:
            value, i = struct.unpack("<f", buf[i : i + 4])[0], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield num, wire, value


# Field numbers from sentencepiece_model.proto.
_TRAINER = {3: "model_type", 4: "vocab_size", 22: "split_by_whitespace", 24: "treat_whitespace_as_suffix"}
_TRAINER |= {25: "split_digits", 35: "byte_fallback", 26: "allow_whitespace_only_pieces"}
_NORMALIZER = {1: "name", 3: "add_dummy_prefix", 4: "remove_extra_whitespaces", 5: "escape_whitespaces"}


def read_model(path: Path) -> SentencePieceModel:
    try:
        buf = Path(path).read_bytes()
        m = SentencePieceModel()
        for num, _, value in _fields(buf):
            if num == 1:
                piece = {n: v for n, _, v in _fields(value)}
                m.pieces.append(
                    (piece[1].decode("utf-8"), float(piece.get(2, 0.0)), int(piece.get(3, NORMAL)))
                )
            elif num == 2:
                m.trainer = {_TRAINER[n]: v for n, _, v in _fields(value) if n in _TRAINER}
            elif num == 3:
                spec = {n: v for n, _, v in _fields(value) if n in _NORMALIZER}
                m.normalizer = {_NORMALIZER[n]: v.decode() if n == 1 else v for n, v in spec.items()}
    except (OSError, ValueError, IndexError, KeyError, UnicodeDecodeError, struct.error) as e:
        raise TokenizerConversionError(f"{path}: not a readable sentencepiece model ({e})") from None
    if not m.pieces:
        raise TokenizerConversionError(f"{path}: not a sentencepiece model (no pieces)")
    return m


def check_convertible(m: SentencePieceModel, source: str) -> None:
    """Refuse settings the `tokenizers` pipeline below does not reproduce exactly."""
    problems = []
    norm = m.normalizer
    if m.model_type not in ("unigram", "bpe"):
        problems.append(f"model type {m.model_type!r} (only unigram and bpe)")
    if norm.get("name", "nmt_nfkc") != "identity":
        problems.append(f"normalization {norm.get('name', 'nmt_nfkc')!r} (only 'identity')")
    if norm.get("remove_extra_whitespaces", 1):
        problems.append("remove_extra_whitespaces is on")
    if not norm.get("escape_whitespaces", 1) or not norm.get("add_dummy_prefix", 1):
        problems.append("escape_whitespaces/add_dummy_prefix off")
    if m.trainer.get("treat_whitespace_as_suffix", 0):
        problems.append("treat_whitespace_as_suffix is on")
    if not m.trainer.get("split_by_whitespace", 1):
        problems.append("split_by_whitespace is off")
    if not m.trainer.get("byte_fallback", 0) or len(m.ids_of(BYTE)) != 256:
        problems.append("no byte fallback (characters outside the vocabulary would become <unk>)")
    if len(m.ids_of(UNKNOWN)) != 1:
        problems.append("not exactly one <unk> piece")
    if problems:
        raise TokenizerConversionError(
            f"{source}: cannot convert to tokenizer.json exactly: " + "; ".join(problems)
        )


def bpe_merges(m: SentencePieceModel) -> list[tuple[str, str]]:
    """Merges in sentencepiece's priority order: a merge ranks as the score of the piece it makes.

    sentencepiece BPE joins the adjacent pair whose joined piece scores highest; `tokenizers` joins the
    pair with the lowest merge rank. Every way of splitting a normal piece into two vocabulary pieces is
    a merge, ranked by the joined piece's score, then by the left part's id, as sentencepiece breaks ties.
    """
    vocab = {p: i for i, (p, _, t) in enumerate(m.pieces) if t in (NORMAL, USER_DEFINED, UNKNOWN)}
    ranked = []
    for piece, score, t in m.pieces:
        if t != NORMAL:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[piece], vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build(model_file: Path):
    """The `tokenizers.Tokenizer` equal to the sentencepiece model (special tokens added, no post-processor)."""
    return build_from(read_model(model_file), str(model_file))


def build_from(m: SentencePieceModel, source: str):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    check_convertible(m, source)
    unk = m.ids_of(UNKNOWN)[0]
    if m.model_type == "unigram":
        # Control pieces are never produced from text: sentencepiece keeps them out of the lattice.
        vocab = [(p, s if t not in (CONTROL,) else 0.0) for p, s, t in m.pieces]
        model = models.Unigram(vocab, unk_id=unk, byte_fallback=True)
    else:
        vocab = {p: i for i, (p, _, _) in enumerate(m.pieces)}
        model = models.BPE(
            vocab=vocab,
            merges=bpe_merges(m),
            unk_token=m.pieces[unk][0],
            fuse_unk=True,
            byte_fallback=True,
            ignore_merges=True,  # a word that is a piece stays whole (user-defined symbols have no merges)
        )
    tok = Tokenizer(model)
    # The dummy prefix goes before the text, spaces become "▁"; words start at each "▁".
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    # sentencepiece finds user-defined symbols anywhere in the normalized text ("▁<|im_start|>user" is
    # "▁", "<|im_start|>", "user"). As added tokens they would be cut out before the dummy prefix is
    # added, so they stay vocabulary pieces and a pre-tokenizer isolates them instead.
    splits = []
    user = [m.pieces[i][0] for i in m.ids_of(USER_DEFINED)]
    if user:
        pattern = "|".join(re.escape(u) for u in sorted(user, key=len, reverse=True))
        splits.append(pre_tokenizers.Split(Regex(pattern), behavior="isolated"))
    splits.append(pre_tokenizers.Split(SPACE, behavior="merged_with_next"))
    if m.trainer.get("split_digits", 0):
        splits.append(pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace(SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    # Control pieces (<s>, </s>, <pad>) and <unk>: special tokens, as transformers expects them.
    specials = [AddedToken(m.pieces[i][0], special=True, normalized=False) for i in m.ids_of(CONTROL)]
    specials.append(AddedToken(m.pieces[unk][0], special=True, normalized=False))
    tok.add_special_tokens(specials)
    return tok


def verify(model_file: Path, tok, texts: list[str]) -> dict[str, int]:
    """Compare ids with sentencepiece on texts + EDGE_CASES, and decode(encode(t)) == t; raise on the first
    disagreement, quoting it. Texts are whole documents, as the shards encode them: sentencepiece's unigram
    sums path scores in float32, so its pieces for a word can depend on the text before it (a float64
    lattice, as in `tokenizers`, then disagrees); checking documents, not lines, catches that."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    all_texts = [*EDGE_CASES, *texts]
    ours = [e.ids for e in tok.encode_batch(all_texts, add_special_tokens=False)]
    ref = sp.encode(all_texts)
    n_tokens = 0
    for text, a, b in zip(all_texts, ours, ref, strict=True):
        if a != b:
            k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            raise TokenizerConversionError(
                f"{model_file}: tokenizer.json disagrees with sentencepiece on {text[:80]!r} at token {k}: "
                f"{[tok.id_to_token(i) for i in a[k : k + 3]]} != {[sp.id_to_piece(i) for i in b[k : k + 3]]}"
            )
        back = tok.decode(a, skip_special_tokens=False)
        if back != text or back != sp.decode(b):
            raise TokenizerConversionError(f"{model_file}: decoding {text[:80]!r} gives {back[:80]!r}")
        n_tokens += len(a)
    return {"texts": len(all_texts), "tokens": n_tokens}


def save(tok, path: Path) -> None:
    from ..io import atomic_write_text

    atomic_write_text(Path(path), json.dumps(json.loads(tok.to_str()), ensure_ascii=False, indent=1) + "\n")


def convert(model_file: Path, texts: list[str], out: Path) -> dict[str, Any]:
    """Build tokenizer.json from the model, check it on `texts` (the val split) and the edge cases, write it.

    Raises TokenizerConversionError (naming the text) when ids or decoding differ anywhere.
    """
    tok = build(model_file)
    kind = read_model(model_file).model_type
    try:
        checked = verify(model_file, tok, texts)
    except TokenizerConversionError as e:
        if kind != "unigram":
            raise
        raise TokenizerConversionError(
            f"{e}. sentencepiece's unigram sums path scores in float32 over a whole document, so exact "
            "equality with any other implementation is impossible in general; set data.tokenizer.type: bpe"
        ) from None
    save(tok, out)
    return {"type": kind, **checked}


def byte_tokenizer():
    """The smoke model's vocabulary as a tokenizer.json: id i is the byte i, no special tokens.

    A BPE with no merges whose vocabulary is the 256 byte-fallback pieces: every character falls back to
    its UTF-8 bytes, in order, and the decoder joins them back.
    """
    from tokenizers import Tokenizer, decoders, models

    vocab = {f"<0x{i:02X}>": i for i in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return tok
