"""A tiny Gemma 3 folder shaped like the one `enlace import-gguf --base gemma3-270m` writes (no tests here).

The real model is 268M parameters with a 262,144-entry vocabulary: too big for a fast test. This one keeps
what an export to GGUF must get right: Gemma's tokenizer layout (its real control tokens <pad> <eos> <bos>
<unk> <mask> <start_of_turn> <end_of_turn>, user-defined newline and space runs and HTML tags, 256 byte
pieces, then BPE pieces best first), its chat template and stop ids, and the Gemma switches of the decoder
(sandwich norms with random offsets, GeGLU, QK-norm, scaled embeddings, a sliding window shorter than the
prompts, two RoPE bases, grouped-query attention, a head_dim apart from d_model / n_head).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch

from enlace.config.model import ModelConfig
from enlace.hf import gguf_gemma, sp_convert
from enlace.hf.arch.gemma3 import NAME as GEMMA3
from enlace.hf.arch.gemma3 import SWITCHES as GEMMA3_SWITCHES
from enlace.hf.folder import save_hf_folder, write_model_manifest
from enlace.hf.gguf_import import tokenizer_config
from enlace.model import Llama
from enlace.scoring.token_bytes import TokenBytes

CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
USER = ["[multimodal]", "\n", "\n\n", "  ", "   ", "<table>", "</s>"]  # </s>: Gemma's HTML strikethrough
TURNS = ["<start_of_turn>", "<end_of_turn>"]
# Text the BPE pieces are learnt from: Spanish with accents, ñ, ¿ ¡ and digits (the test prompts' alphabet).
TEXTS = [
    "El niño de la casa mira una puerta antigua que está en el río.",
    "¿Qué hora es? La ciudad antigua abre una ventana al jardín.",
    "Son las 10:45 del 3 de mayo de 2024 y el perro cuenta una casa tranquila.",
    "El camino del pueblo lleva una mesa verde; ¡qué bien! El barco de la montaña.",
    "El pingüino, señor, recuerda el árbol. Hacemos hoy la cena con huevos y patatas.",
    "Eres un asistente que responde en español. Dime una palabra con ñ: año. ¿Y otra con ü?",
] * 8


def bpe_pieces(vocab_size: int) -> list[str]:
    """Normal pieces of a sentencepiece BPE model trained on TEXTS, best (highest score) first."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS), model_writer=buf, model_type="bpe", vocab_size=vocab_size,
        character_coverage=1.0, add_dummy_prefix=False, normalization_rule_name="identity",
        byte_fallback=False, bos_id=-1, eos_id=-1, unk_id=0, hard_vocab_limit=False, minloglevel=2,
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    normal = [i for i in range(sp.get_piece_size()) if not (sp.is_control(i) or sp.is_unknown(i))]
    return [sp.id_to_piece(i) for i in sorted(normal, key=lambda i: -sp.get_score(i))]


def gemma_meta(vocab_size: int = 300) -> dict:
    """GGUF metadata in Gemma 3's layout (control tokens first, then user-defined, bytes, BPE pieces)."""
    tokens = [*CONTROL, USER[0], *TURNS, *USER[1:], *(f"<0x{b:02X}>" for b in range(256))]
    types = [sp_convert.CONTROL] * 5 + [sp_convert.USER_DEFINED] + [sp_convert.CONTROL] * 2
    types += [sp_convert.USER_DEFINED] * (len(USER) - 1) + [sp_convert.BYTE] * 256
    pieces = [p for p in bpe_pieces(vocab_size) if p not in tokens]
    scores = [-1000.0] * (len(tokens) - 256) + [0.0] * 256 + [-float(r) for r in range(len(pieces))]
    return {
        "tokenizer.ggml.tokens": tokens + pieces,
        "tokenizer.ggml.token_type": types + [sp_convert.NORMAL] * len(pieces),
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "general.architecture": GEMMA3,
        f"{GEMMA3}.context_length": 256,
    }


def tiny_gemma_folder(folder: Path, seed: int = 0) -> Path:
    """A random tiny Gemma 3 with Gemma's tokenizer layout, saved as `enlace import-gguf` saves Gemma."""
    meta = gemma_meta()
    tok = gguf_gemma.tokenizer(meta)
    vocab = len(meta["tokenizer.ggml.tokens"])
    cfg = ModelConfig(
        name="tiny-gemma3", vocab_size=vocab, n_layer=4, n_head=4, n_kv_head=2, d_model=64,
        attn_head_dim=32, ffn_hidden=128, seq_len=256, norm_eps=1e-6, rope_theta=1_000_000.0,
        tie_embeddings=True, query_pre_attn_scalar=32, sliding_window=6, global_every=2,
        rope_local_theta=10_000.0, **GEMMA3_SWITCHES,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Llama(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)  # Gemma stores offsets from 1: the GGUF's 1 + w is exercised
            elif n.endswith("embed_tokens.weight"):
                p.normal_(0, 0.5)  # spread the tied head's logits: no near-ties in greedy decoding
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_hf_folder(
        model, folder, bos_token_id=2, eos_token_id=gguf_gemma.stop_ids(meta), pad_token_id=0, manifest=False
    )
    tok.save(str(folder / "tokenizer.json"))
    tok_cfg = tokenizer_config(meta)
    tok_cfg["chat_template"] = gguf_gemma.CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, ensure_ascii=False), encoding="utf-8")
    write_model_manifest(folder, "hf-model")  # last, over the tokenizer files too, as import-gguf writes it
    return folder


def gemma_token_bytes(folder: Path) -> TokenBytes:
    """UTF-8 bytes per token of a Gemma tokenizer.json: a piece's text ("▁" a space), a byte piece one byte,
    control tokens none (Gemma has no dummy prefix, so no first-piece rule)."""
    data = json.loads((Path(folder) / "tokenizer.json").read_text(encoding="utf-8"))
    special = {t["id"] for t in data["added_tokens"] if t["special"]}
    vocab = data["model"]["vocab"]
    lengths = np.zeros(len(vocab), dtype=np.int64)
    for piece, i in vocab.items():
        if i in special:
            continue
        is_byte = len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
        lengths[i] = 1 if is_byte else len(piece.replace(sp_convert.SPACE, " ").encode("utf-8"))
    return TokenBytes(lengths)
