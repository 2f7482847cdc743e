"""Gemma 3 (transformers' Gemma3ForCausalLM, model_type gemma3_text; llama.cpp's `gemma3`): our decoder
with its Gemma switches on (config/model.py).

GGUF import: the file states the shape, the global RoPE base and the window, but not what llama.cpp
hard-codes for the architecture: the local layers' RoPE base (10k), the layer pattern (every 6th layer
global) and the attention scale (1/sqrt(head_dim), or 1/sqrt(d_model/n_head) for the 27B). Those are read
from the file when a newer converter writes them, else llama.cpp's values are used. GGUF export writes the
same keys and refuses an attention scale llama.cpp cannot state.

Tensors: llama.cpp names the four norms of a layer after their place and stores every norm weight (q/k norms
and the final norm included) as 1 + w, the scale its kernels multiply by; Hugging Face's Gemma (and ours)
stores w, so the GGUF side adds 1 on the way out and takes it off on the way in. Rotation is NeoX's, as ours.
The tokenizer and chat format live in hf/gguf_gemma.py.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...config.model import ModelConfig
from ...errors import GGUFExportError, UnsupportedModelError
from .. import gguf_gemma
from .common import LAYER_NAMES, Arch, gguf_eps, gguf_shape, gguf_vocab_size

NAME = "gemma3"
HF_MODEL_TYPE = "gemma3_text"
HF_ARCHITECTURE = "Gemma3ForCausalLM"
# The switches that make our decoder Gemma 3's, all together (a partial set is no Hugging Face model).
SWITCHES = {
    "norm_unit_offset": True,
    "sandwich_norm": True,
    "mlp_act": "gelu_tanh",
    "embed_scale": True,
    "qk_norm": True,
}
# llama.cpp's values for gemma3 when the file does not state them (see the module docstring).
LOCAL_ROPE_THETA = 10000.0
GLOBAL_EVERY = 6
# llama.cpp's gemma3: ffn_norm is the norm before the MLP, and two more norms wrap the attention and MLP outputs.
GGUF_LAYER_NAMES = {
    **LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def is_gemma3(cfg: ModelConfig) -> bool:
    """Whether cfg is Gemma 3's computation; a partial set of its switches has no Hugging Face model."""
    # qk_norm alone is Qwen3's: only the Gemma-only switches decide whether this is meant to be Gemma.
    on = [getattr(cfg, k) == v for k, v in SWITCHES.items() if k != "qk_norm"]
    if any(on) and not (all(on) and cfg.qk_norm):
        raise UnsupportedModelError(
            f"model {cfg.name}: Gemma switches {SWITCHES} are only exportable all together "
            f"(got { ({k: getattr(cfg, k) for k in SWITCHES}) })"
        )
    return all(on)


def _rope(hf: dict[str, Any], problems: list[str]) -> tuple[float, float]:
    """(global, local) RoPE bases. transformers 5 keys rope_parameters by layer type; 4.x wrote rope_theta
    and rope_local_base_freq."""
    params = hf.get("rope_parameters")
    if hf.get("rope_scaling"):
        problems.append(f"rope_scaling is set ({hf['rope_scaling']}); only plain RoPE is supported")
    if isinstance(params, dict) and "full_attention" in params:
        thetas = []
        for kind in ("full_attention", "sliding_attention"):
            p = params.get(kind) or {}
            if p.get("rope_type", "default") != "default" or set(p) - {"rope_type", "rope_theta"}:
                problems.append(f"rope_parameters.{kind} is {p}; only plain RoPE is supported")
            thetas.append(float(p.get("rope_theta", 10000.0)))
        return thetas[0], thetas[1]
    return float(hf.get("rope_theta", 1_000_000.0)), float(hf.get("rope_local_base_freq", 10000.0))


def _global_every(hf: dict[str, Any], problems: list[str]) -> int:
    """Gemma 3's layer pattern as one number: every n-th layer global, the others sliding."""
    n_layer = int(hf.get("num_hidden_layers", 0))
    types = hf.get("layer_types")
    every = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
    if types:
        first = next((i + 1 for i, t in enumerate(types) if t == "full_attention"), n_layer + 1)
        every = first
    expected = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n_layer)]
    if types and list(types) != expected:
        problems.append(f"layer_types {types} is not every {every}th layer global")
    return every


def _problems(hf: dict[str, Any]) -> list[str]:
    """Everything in a Gemma 3 config.json that our decoder would compute differently."""
    problems: list[str] = []
    archs = hf.get("architectures") or [HF_ARCHITECTURE]
    if archs != [HF_ARCHITECTURE]:
        problems.append(f"architectures {archs}; only {HF_ARCHITECTURE} (text only) is supported")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        problems.append(f"hidden_activation {act!r}; only 'gelu_pytorch_tanh' is supported")
    for flag in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(flag) is not None:
            problems.append(f"{flag} is {hf[flag]}; soft-capping is not implemented")
    for flag in ("attention_bias", "use_bidirectional_attention"):
        if hf.get(flag):
            problems.append(f"{flag} is true; not supported")
    return problems


def from_hf(hf: dict[str, Any], source: str, name: str | None) -> ModelConfig:
    """A Gemma 3 config.json as ModelConfig, or raise listing every problem."""
    problems = _problems(hf)
    theta, local_theta = _rope(hf, problems)
    every = _global_every(hf, problems)
    keys = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "vocab_size",
        "head_dim",
    )
    missing = [k for k in keys if k not in hf]
    if missing:
        problems.append(f"missing keys {missing}")
    if problems:
        raise UnsupportedModelError(f"{source}: unsupported model: " + "; ".join(problems))
    window = hf.get("sliding_window")
    return ModelConfig(
        name=name or str(hf.get("_name_or_path") or HF_MODEL_TYPE),
        vocab_size=int(hf["vocab_size"]),
        n_layer=int(hf["num_hidden_layers"]),
        n_head=int(hf["num_attention_heads"]),
        n_kv_head=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
        d_model=int(hf["hidden_size"]),
        seq_len=int(hf.get("max_position_embeddings", 32768)),
        ffn_hidden=int(hf["intermediate_size"]),
        rope_theta=theta,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        attn_head_dim=int(hf["head_dim"]),
        query_pre_attn_scalar=int(hf.get("query_pre_attn_scalar", hf["head_dim"])),
        sliding_window=int(window) if window else None,
        global_every=every,
        rope_local_theta=local_theta,
        **SWITCHES,
    )


def to_hf(
    cfg: ModelConfig, bos: Any = None, eos: Any = None, pad: Any = None, imported: bool = False
) -> dict:
    """Gemma3ForCausalLM's config.json."""
    layer_types = ["sliding_attention" if cfg.is_local(i) else "full_attention" for i in range(cfg.n_layer)]
    local_theta = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
    # transformers requires a window even when no layer is local; it is then never used. (import-gguf has
    # always written null there, and keeps doing so.)
    window = cfg.sliding_window if imported else cfg.sliding_window or cfg.seq_len
    return {
        "architectures": [HF_ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
        "sliding_window": window,
        "layer_types": layer_types,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_bidirectional_attention": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": "float32",
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "use_cache": True,
    }


def _every_from_flags(flags: list[bool], n_layer: int) -> int:
    """The one global-every-n pattern that a per-layer flag list spells, or refuse the file."""
    for every in range(1, n_layer + 1):
        if [(i + 1) % every != 0 for i in range(n_layer)] == [bool(f) for f in flags]:
            return every
    raise UnsupportedModelError(f"GGUF sliding-window layers {flags}: not one global layer every n")


def from_gguf(meta: dict[str, Any], tied: bool, source: str, name: str) -> ModelConfig:
    """A gemma3 GGUF's metadata as ModelConfig, llama.cpp's hard-coded values filling what it omits."""
    a = NAME
    d, heads, head_dim = gguf_shape(meta, a)
    n_layer = int(meta[f"{a}.block_count"])
    every = meta.get(f"{a}.attention.sliding_window_pattern", GLOBAL_EVERY)
    if not isinstance(every, int):  # a per-layer list of booleans (true: sliding), as newer converters write
        every = _every_from_flags(list(every), n_layer)
    window = meta.get(f"{a}.attention.sliding_window")
    window = int(window) if window else None  # absent or 0: every layer global (llama.cpp's reading)
    return ModelConfig(
        name=name,
        vocab_size=gguf_vocab_size(meta, a),
        n_layer=n_layer,
        n_head=heads,
        n_kv_head=int(meta.get(f"{a}.attention.head_count_kv", heads) or heads),
        d_model=d,
        seq_len=int(meta.get(f"{a}.context_length", 32768)),
        ffn_hidden=int(meta[f"{a}.feed_forward_length"]),
        rope_theta=float(meta.get(f"{a}.rope.freq_base", 1_000_000.0)),
        norm_eps=gguf_eps(meta, a),
        tie_embeddings=tied,
        attn_head_dim=head_dim,
        query_pre_attn_scalar=d // heads if meta.get("general.size_label") == "27B" else head_dim,
        sliding_window=window,
        global_every=every if window else 1,
        rope_local_theta=float(meta.get(f"{a}.rope.freq_base_swa", LOCAL_ROPE_THETA)),
        **SWITCHES,
    )


def write_gguf_keys(w: Any, cfg: ModelConfig) -> None:
    """The gemma3 keys llama.cpp reads beyond the common ones, and the checks for what it hard-codes."""
    # llama.cpp scales queries by 1/sqrt(head_dim), or 1/sqrt(d_model / n_head) for the 62-layer 27B,
    # with no key to say otherwise: refuse a model whose query_pre_attn_scalar disagrees.
    expected = cfg.d_model // cfg.n_head if cfg.n_layer == 62 else cfg.head_dim
    scalar = cfg.query_pre_attn_scalar or cfg.head_dim
    if not math.isclose(scalar, expected):
        raise GGUFExportError(
            f"model {cfg.name}: query_pre_attn_scalar {scalar}, but llama.cpp's gemma3 scales attention by "
            f"1/sqrt({expected}) for {cfg.n_layer} layers; not exportable as GGUF"
        )
    if cfg.sliding_window is not None:
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern(cfg.global_every)  # llama.cpp: every n-th layer global, as ours
    local = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
    w.add_rope_freq_base_swa(local)


def _to_gguf_tensor(cfg: ModelConfig, name: str, w: torch.Tensor) -> torch.Tensor:
    return w + 1.0 if name.endswith("norm.weight") else w


def _from_gguf_tensor(cfg: ModelConfig, name: str, w: torch.Tensor) -> torch.Tensor:
    return w - 1.0 if name.endswith("norm.weight") else w


ARCH = Arch(
    name=NAME,
    hf_model_type=HF_MODEL_TYPE,
    hf_architecture=HF_ARCHITECTURE,
    summary="Gemma 3: sandwich norms, GeGLU, QK-norm, local/global attention",
    from_hf=from_hf,
    to_hf=to_hf,
    from_gguf=from_gguf,
    write_gguf_keys=write_gguf_keys,
    layer_names=GGUF_LAYER_NAMES,
    to_gguf_tensor=_to_gguf_tensor,
    from_gguf_tensor=_from_gguf_tensor,
    gguf_tokenizer=gguf_gemma.tokenizer,
    gguf_vocab=gguf_gemma.vocab,
    chat_template=gguf_gemma.CHAT_TEMPLATE,
    stop_ids=gguf_gemma.stop_ids,
)
