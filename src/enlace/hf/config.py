"""Hugging Face config.json <-> our ModelConfig, refusing what our Llama cannot compute exactly."""

from __future__ import annotations

from typing import Any

from ..config.model import ModelConfig
from ..errors import EnlaceError

SUPPORTED = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class UnsupportedModelError(EnlaceError):
    """The checkpoint uses a feature our Llama does not implement; loading it would give wrong logits."""


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


def from_hf_config(hf: dict[str, Any], source: str = "config.json", name: str | None = None) -> ModelConfig:
    """Map a LlamaForCausalLM (or Qwen3ForCausalLM) config.json onto ModelConfig, or raise listing every problem."""
    problems: list[str] = []
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        problems.append(f"model_type {model_type!r} is not one of {sorted(SUPPORTED)}")
    archs = hf.get("architectures") or [SUPPORTED.get(model_type or "", "")]
    if any(a not in SUPPORTED.values() for a in archs):
        problems.append(f"architectures {archs} are not one of {sorted(SUPPORTED.values())}")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf.get('hidden_act')!r}; only 'silu' (SwiGLU) is supported")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            problems.append(f"{flag} is true; our projections have no bias")
    if hf.get("use_sliding_window"):
        problems.append("use_sliding_window is true; only full attention is supported")
    if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
        problems.append("partial_rotary_factor != 1; only full-width RoPE is supported")
    theta = _rope_theta(hf, problems)
    missing = [
        k
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        )
        if k not in hf
    ]
    if missing:
        problems.append(f"missing keys {missing}")
    if problems:
        raise UnsupportedModelError(f"{source}: unsupported model: " + "; ".join(problems))

    d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or d // heads
    if d % heads or head_dim != d // heads:
        raise UnsupportedModelError(
            f"{source}: head_dim {head_dim} != hidden_size/num_attention_heads = {d}/{heads}; "
            "our attention derives head_dim from them"
        )
    return ModelConfig(
        name=name or str(hf.get("_name_or_path") or model_type),
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
        qk_norm=model_type == "qwen3",
    )


def to_hf_config(
    cfg: ModelConfig,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> dict[str, Any]:
    """The config.json transformers needs to load our Llama as LlamaForCausalLM (Qwen3 when QK-norm is on)."""
    model_type = "qwen3" if cfg.qk_norm else "llama"
    out: dict[str, Any] = {
        "architectures": [SUPPORTED[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
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
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "use_cache": True,
    }
    if model_type == "qwen3":
        out["use_sliding_window"] = False
        out["sliding_window"] = None
    return out
