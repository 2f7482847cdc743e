"""Hugging Face config.json <-> our ModelConfig, refusing what our Llama cannot compute exactly.

Llama and Qwen3 map onto the plain decoder; Gemma 3 (gemma3_text, Gemma3ForCausalLM) onto the decoder with
its Gemma switches on (config/model.py)."""

from __future__ import annotations

from typing import Any

from ..config.model import ModelConfig
from ..errors import EnlaceError

SUPPORTED = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
GEMMA3 = ("gemma3_text", "Gemma3ForCausalLM")
# The switches that make our decoder Gemma 3's, all together (a partial set is no Hugging Face model).
GEMMA3_SWITCHES = {
    "norm_unit_offset": True,
    "sandwich_norm": True,
    "mlp_act": "gelu_tanh",
    "embed_scale": True,
    "qk_norm": True,
}


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


def _gemma3_rope(hf: dict[str, Any], problems: list[str]) -> tuple[float, float]:
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


def _from_gemma3(hf: dict[str, Any], source: str, name: str | None) -> ModelConfig:
    problems: list[str] = []
    archs = hf.get("architectures") or [GEMMA3[1]]
    if archs != [GEMMA3[1]]:
        problems.append(f"architectures {archs}; only {GEMMA3[1]} (text only) is supported")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        problems.append(f"hidden_activation {act!r}; only 'gelu_pytorch_tanh' is supported")
    for flag in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(flag) is not None:
            problems.append(f"{flag} is {hf[flag]}; soft-capping is not implemented")
    for flag in ("attention_bias", "use_bidirectional_attention"):
        if hf.get(flag):
            problems.append(f"{flag} is true; not supported")
    theta, local_theta = _gemma3_rope(hf, problems)
    every = _global_every(hf, problems)
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size", "head_dim") if k not in hf]  # fmt: skip
    if missing:
        problems.append(f"missing keys {missing}")
    if problems:
        raise UnsupportedModelError(f"{source}: unsupported model: " + "; ".join(problems))
    window = hf.get("sliding_window")
    return ModelConfig(
        name=name or str(hf.get("_name_or_path") or GEMMA3[0]),
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
        **GEMMA3_SWITCHES,
    )


def is_gemma3(cfg: ModelConfig) -> bool:
    """Whether cfg is Gemma 3's computation; a partial set of its switches has no Hugging Face model."""
    on = [getattr(cfg, k) == v for k, v in GEMMA3_SWITCHES.items()]
    if any(on) and not all(on):
        raise UnsupportedModelError(
            f"model {cfg.name}: Gemma switches {GEMMA3_SWITCHES} are only exportable all together "
            f"(got { ({k: getattr(cfg, k) for k in GEMMA3_SWITCHES}) })"
        )
    return all(on)


def from_hf_config(hf: dict[str, Any], source: str = "config.json", name: str | None = None) -> ModelConfig:
    """Map a LlamaForCausalLM, Qwen3ForCausalLM or Gemma3ForCausalLM config.json onto ModelConfig, or raise
    listing every problem."""
    if hf.get("model_type") == GEMMA3[0]:
        return _from_gemma3(hf, source, name)
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
    """The config.json transformers needs to load our Llama as LlamaForCausalLM (Qwen3 when QK-norm is on,
    Gemma3ForCausalLM with the Gemma switches)."""
    if is_gemma3(cfg):
        return _to_gemma3(cfg, bos_token_id, eos_token_id, pad_token_id)
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


def _to_gemma3(cfg: ModelConfig, bos: int | None, eos: int | None, pad: int | None) -> dict[str, Any]:
    layer_types = ["sliding_attention" if cfg.is_local(i) else "full_attention" for i in range(cfg.n_layer)]
    local_theta = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
    return {
        "architectures": [GEMMA3[1]],
        "model_type": GEMMA3[0],
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
        # transformers requires a window even when no layer is local; it is then never used.
        "sliding_window": cfg.sliding_window or cfg.seq_len,
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
