"""Llama (transformers' LlamaForCausalLM, llama.cpp's `llama`): our plain decoder, QK-norm off.

The plain-decoder functions here take the architecture's names, so Qwen3 (qwen3.py) reuses them.
llama.cpp's `llama` rotates interleaved pairs (2i, 2i+1) where we rotate halves (i, i + head_dim/2), so the
GGUF side permutes the rows of q_proj and k_proj.
"""

from __future__ import annotations

from typing import Any

import torch

from ...config.model import ModelConfig
from ...errors import UnsupportedModelError
from .common import LAYER_NAMES, Arch, gguf_eps, gguf_shape, gguf_vocab_size

NAME = "llama"
HF_ARCHITECTURE = "LlamaForCausalLM"


def _rope_theta(hf: dict[str, Any], problems: list[str]) -> float:
    # transformers 5 writes rope_parameters {rope_type, rope_theta}; 4.x wrote rope_theta and rope_scaling.
    params = hf.get("rope_parameters")
    if hf.get("rope_scaling"):
        problems.append(f"rope_scaling is set ({hf['rope_scaling']}); only plain RoPE is supported")
    if isinstance(params, dict):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            problems.append(f"rope_parameters.rope_type is {rope_type!r}; only 'default' is supported")
        extra = set(params) - {"rope_type", "type", "rope_theta"}
        if extra:
            problems.append(f"rope_parameters has unsupported keys {sorted(extra)}")
        if "rope_theta" in params:
            return float(params["rope_theta"])
    return float(hf.get("rope_theta", 10000.0))


# transformers' hidden_act names (ACT2FN) of the gated activations a plain decoder may have: SwiGLU, and
# the squared ReLU (its "relu2" is relu(x) ** 2). llama.cpp's llama and qwen3 graphs compute SwiGLU only.
HIDDEN_ACTS = {"silu": "silu", "relu2": "relu2"}


def _problems(hf: dict[str, Any], hf_arch: str) -> list[str]:
    """Everything in a plain-decoder config.json that our decoder would compute differently."""
    problems: list[str] = []
    archs = hf.get("architectures") or [hf_arch]
    if archs != [hf_arch]:
        problems.append(f"architectures {archs}; only {hf_arch} is supported for {hf.get('model_type')}")
    if hf.get("hidden_act", "silu") not in HIDDEN_ACTS:
        problems.append(f"hidden_act {hf.get('hidden_act')!r}; only {sorted(HIDDEN_ACTS)} are supported")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            problems.append(f"{flag} is true; our projections have no bias")
    if hf.get("use_sliding_window"):
        problems.append("use_sliding_window is true; only full attention is supported")
    if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
        problems.append("partial_rotary_factor != 1; only full-width RoPE is supported")
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in keys if k not in hf]
    if missing:
        problems.append(f"missing keys {missing}")
    return problems


def _check_head_dim(source: str, d: int, heads: int, head_dim: int) -> None:
    if d % heads or head_dim != d // heads:
        raise UnsupportedModelError(
            f"{source}: head_dim {head_dim} != hidden_size/num_attention_heads = {d}/{heads}; "
            "our attention derives head_dim from them"
        )


def parse_hf(hf: dict[str, Any], source: str, name: str | None, hf_arch: str, qk_norm: bool) -> ModelConfig:
    """A plain-decoder config.json as ModelConfig, or raise listing every problem."""
    problems = _problems(hf, hf_arch)
    theta = _rope_theta(hf, problems)
    if problems:
        raise UnsupportedModelError(f"{source}: unsupported model: " + "; ".join(problems))
    d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    _check_head_dim(source, d, heads, hf.get("head_dim") or d // heads)
    return ModelConfig(
        name=name or str(hf.get("_name_or_path") or hf.get("model_type")),
        vocab_size=int(hf["vocab_size"]),
        n_layer=int(hf["num_hidden_layers"]),
        n_head=heads,
        n_kv_head=int(hf.get("num_key_value_heads") or heads),
        d_model=d,
        seq_len=int(hf.get("max_position_embeddings", 2048)),
        ffn_hidden=int(hf["intermediate_size"]),
        rope_theta=theta,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=qk_norm,
        mlp_act=HIDDEN_ACTS[hf.get("hidden_act", "silu")],
    )


def build_hf(
    cfg: ModelConfig, model_type: str, hf_arch: str, special: tuple[Any, Any, Any], imported: bool
) -> dict[str, Any]:
    """The plain decoder's config.json; `special` is (bos, eos, pad)."""
    bos, eos, pad = special
    out: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "hidden_act": {v: k for k, v in HIDDEN_ACTS.items()}[cfg.mlp_act],
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": "float32",
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "use_cache": True,
    }
    if imported:  # import-gguf never wrote it (transformers' default is the same 0.0)
        del out["attention_dropout"]
    return out


def read_gguf(
    meta: dict[str, Any], tied: bool, source: str, name: str, arch: str, qk_norm: bool
) -> ModelConfig:
    """A plain-decoder GGUF's metadata as ModelConfig."""
    d, heads, head_dim = gguf_shape(meta, arch)
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise UnsupportedModelError(f"GGUF rope dimension {rope_dim} != head_dim {head_dim}")
    _check_head_dim(source, d, heads, head_dim)
    return ModelConfig(
        name=name,
        vocab_size=gguf_vocab_size(meta, arch),
        n_layer=int(meta[f"{arch}.block_count"]),
        n_head=heads,
        n_kv_head=int(meta.get(f"{arch}.attention.head_count_kv", heads) or heads),
        d_model=d,
        seq_len=int(meta.get(f"{arch}.context_length", 2048)),
        ffn_hidden=int(meta[f"{arch}.feed_forward_length"]),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=gguf_eps(meta, arch),
        tie_embeddings=tied,
        qk_norm=qk_norm,
    )


def no_extra_keys(w: Any, cfg: ModelConfig) -> None:
    """The plain decoder needs no GGUF keys beyond the common ones."""


def keep(cfg: ModelConfig, name: str, w: torch.Tensor) -> torch.Tensor:
    return w


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Reorder each head's rows from [half0, half1] to interleaved pairs, as llama.cpp's converter does."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo permute_qk (n_head = KV heads for k_proj)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _to_gguf_tensor(cfg: ModelConfig, name: str, w: torch.Tensor) -> torch.Tensor:
    if name.endswith("self_attn.q_proj.weight"):
        return permute_qk(w, cfg.n_head)
    if name.endswith("self_attn.k_proj.weight"):
        return permute_qk(w, cfg.n_kv_head)
    return w


def _from_gguf_tensor(cfg: ModelConfig, name: str, w: torch.Tensor) -> torch.Tensor:
    if name.endswith("self_attn.q_proj.weight"):
        return unpermute_qk(w, cfg.n_head)
    if name.endswith("self_attn.k_proj.weight"):
        return unpermute_qk(w, cfg.n_kv_head)
    return w


def from_hf(hf: dict[str, Any], source: str, name: str | None) -> ModelConfig:
    return parse_hf(hf, source, name, HF_ARCHITECTURE, qk_norm=False)


def to_hf(
    cfg: ModelConfig, bos: Any = None, eos: Any = None, pad: Any = None, imported: bool = False
) -> dict:
    return build_hf(cfg, NAME, HF_ARCHITECTURE, (bos, eos, pad), imported)


def from_gguf(meta: dict[str, Any], tied: bool, source: str, name: str) -> ModelConfig:
    return read_gguf(meta, tied, source, name, NAME, qk_norm=False)


ARCH = Arch(
    name=NAME,
    hf_model_type=NAME,
    hf_architecture=HF_ARCHITECTURE,
    summary="qk_norm off",
    from_hf=from_hf,
    to_hf=to_hf,
    from_gguf=from_gguf,
    write_gguf_keys=no_extra_keys,
    layer_names=LAYER_NAMES,
    to_gguf_tensor=_to_gguf_tensor,
    from_gguf_tensor=_from_gguf_tensor,
)
