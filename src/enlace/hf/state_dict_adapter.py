"""Our state dict <-> Hugging Face's and llama.cpp's, in one place (torchtitan's `state_dict_adapter` idea).

Our module names already equal transformers' LlamaForCausalLM / Qwen3ForCausalLM names, so the Hugging Face
side only has to handle the tied output head and check that every tensor is there with the right shape.
The GGUF side renames tensors (`blk.N.attn_q` ...) and, for llama.cpp's `llama` architecture only, permutes
the rows of q_proj/k_proj: llama.cpp rotates interleaved pairs (2i, 2i+1) where we rotate halves
(i, i + head_dim/2). Its `qwen3` and `gemma3` architectures use the half-split (NeoX) rotation, so nothing
is permuted there. Its `gemma3` names the four norms of a layer after their place and stores every norm
weight (q/k norms and the final norm included) as 1 + w, the scale its kernels multiply by; Hugging Face's
Gemma (and ours) stores w, so the GGUF side adds 1 on the way out and takes it off on the way in.
"""

from __future__ import annotations

import re

import torch

from ..config.model import ModelConfig
from ..errors import EnlaceError
from .config import is_gemma3

# Buffers older transformers versions saved; they are recomputed, not loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# GGUF tensor names -> Hugging Face names ("blk.N.<key>" -> "model.layers.N.<value>").
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# llama.cpp's gemma3: ffn_norm is the norm before the MLP, and two more norms wrap the attention and MLP outputs.
GEMMA3_LAYER_NAMES = {
    **GGUF_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_HF_LAYER = {v: k for k, v in GGUF_LAYER_NAMES.items()}
_HF_GEMMA3_LAYER = {v: k for k, v in GEMMA3_LAYER_NAMES.items()}
_HF_GLOBAL = {v: k for k, v in GGUF_GLOBAL_NAMES.items()}


class WeightsError(EnlaceError):
    """A checkpoint's tensors do not match the model its config describes."""


def gguf_arch(cfg: ModelConfig) -> str:
    """llama.cpp's architecture for our config: Gemma 3's switches are `gemma3`, QK-norm alone is Qwen3's,
    otherwise plain Llama."""
    if is_gemma3(cfg):  # raises on a partial set of Gemma switches
        return "gemma3"
    return "qwen3" if cfg.qk_norm else "llama"


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Reorder each head's rows from [half0, half1] to interleaved pairs, as llama.cpp's converter does."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo permute_qk (n_head = KV heads for k_proj)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def to_hf(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors a Hugging Face folder stores: a tied head is left out (transformers re-ties it)."""
    out = dict(state)
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def from_hf(
    cfg: ModelConfig, expected: dict[str, torch.Size], state: dict[str, torch.Tensor], source: str
) -> dict[str, torch.Tensor]:
    """The tensors to load into our model; raise listing every missing, unexpected or misshapen tensor."""
    expected = dict(expected)
    if cfg.tie_embeddings:
        expected.pop("lm_head.weight", None)
    state = {k: v for k, v in state.items() if not k.endswith(IGNORED_SUFFIXES)}
    if cfg.tie_embeddings and "lm_head.weight" in state:
        # Some exporters store the tied head anyway; it must be the embedding, or the model is not tied.
        head = state.pop("lm_head.weight")
        emb = state.get("model.embed_tokens.weight")
        if emb is not None and not torch.equal(head, emb):
            raise WeightsError(
                f"{source}: tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight"
            )
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = sorted(
        f"{k}: {tuple(state[k].shape)} != {tuple(s)}"
        for k, s in expected.items()
        if k in state and tuple(state[k].shape) != tuple(s)
    )
    if missing or unexpected or shapes:
        parts = [
            f"{label} {items}"
            for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", shapes))
            if items
        ]
        raise WeightsError(f"{source}: weights do not match config.json: " + "; ".join(parts))
    return state


def hf_name(name: str, arch: str = "llama") -> str:
    base, _, suffix = name.rpartition(".")  # suffix: "weight" (or "bias")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    layer_names = GEMMA3_LAYER_NAMES if arch == "gemma3" else GGUF_LAYER_NAMES
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{suffix}"
    if base in GGUF_GLOBAL_NAMES:
        return f"{GGUF_GLOBAL_NAMES[base]}.{suffix}"
    raise WeightsError(f"GGUF tensor {name!r} has no Llama counterpart")


def gguf_name(name: str, arch: str = "llama") -> str:
    base, _, suffix = name.rpartition(".")
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", base)
    layer_names = _HF_GEMMA3_LAYER if arch == "gemma3" else _HF_LAYER
    if m and m.group(2) in layer_names:
        return f"blk.{m.group(1)}.{layer_names[m.group(2)]}.{suffix}"
    if base in _HF_GLOBAL:
        return f"{_HF_GLOBAL[base]}.{suffix}"
    raise WeightsError(f"tensor {name!r} has no GGUF counterpart")


def to_gguf(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GGUF names and layout (rows still [out, in]; the writer reverses the shape into ggml order)."""
    arch = gguf_arch(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, w in to_hf(cfg, state).items():
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w + 1.0
        elif arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            w = permute_qk(w, cfg.n_head)
        elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
            w = permute_qk(w, cfg.n_kv_head)
        out[gguf_name(name, arch)] = w
    return out


def from_gguf(arch: str, n_head: int, n_kv_head: int, name: str, w: torch.Tensor) -> tuple[str, torch.Tensor]:
    """One GGUF tensor (already reshaped to [out, in]) under its Hugging Face name and layout."""
    hf = hf_name(name, arch)
    if arch == "gemma3" and hf.endswith("norm.weight"):
        return hf, w - 1.0
    if arch == "llama" and hf.endswith("self_attn.q_proj.weight"):
        w = unpermute_qk(w, n_head)
    elif arch == "llama" and hf.endswith("self_attn.k_proj.weight"):
        w = unpermute_qk(w, n_kv_head)
    return hf, w
