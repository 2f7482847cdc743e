"""What every architecture module shares: the `Arch` entry, GGUF tensor names, the tied head, GGUF key reading.

Our module names already equal transformers' (LlamaForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM), so
the Hugging Face side of the state-dict adapter only handles the tied output head and checks that every
tensor is there with the right shape. The GGUF side renames tensors (`blk.N.attn_q` ...) through the
architecture's layer-name table and lets the architecture change a tensor's layout (its `to_gguf_tensor`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...config.model import ModelConfig
from ...errors import UnsupportedModelError, WeightsError

# Buffers older transformers versions saved; they are recomputed, not loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# GGUF tensor names -> Hugging Face names ("blk.N.<key>" -> "model.layers.N.<value>"), llama.cpp's llama/qwen3.
LAYER_NAMES = {
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
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_HF_GLOBAL = {v: k for k, v in GLOBAL_NAMES.items()}

Tensor = torch.Tensor


@dataclass(frozen=True)
class Arch:
    """One architecture: its names, its config and GGUF-metadata mappings and its state-dict adapter.

    `to_hf(cfg, bos, eos, pad, imported)` is the one config.json builder; `imported` keeps the exact bytes
    `import-gguf` has always written (their sha256 is the folder's fingerprint, which LoRA adapters record).
    The tokenizer hooks are None where the generic GGUF vocabulary code applies.
    """

    name: str  # ours, and llama.cpp's general.architecture
    hf_model_type: str
    hf_architecture: str
    summary: str  # what `enlace export` prints beside the architecture
    from_hf: Callable[[dict[str, Any], str, str | None], ModelConfig]
    to_hf: Callable[..., dict[str, Any]]
    from_gguf: Callable[[dict[str, Any], bool, str, str], ModelConfig]
    write_gguf_keys: Callable[[Any, ModelConfig], None]
    layer_names: dict[str, str]  # GGUF layer tensor name -> Hugging Face name
    to_gguf_tensor: Callable[[ModelConfig, str, Tensor], Tensor]
    from_gguf_tensor: Callable[[ModelConfig, str, Tensor], Tensor]
    gguf_tokenizer: Callable[[dict[str, Any]], Any] | None = None
    gguf_vocab: Callable[[Any], dict[str, Any]] | None = None
    chat_template: str | None = None
    stop_ids: Callable[[dict[str, Any]], list[int]] | None = None

    def hf_name(self, name: str) -> str:
        """A GGUF tensor's Hugging Face name."""
        base, _, suffix = name.rpartition(".")  # suffix: "weight" (or "bias")
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
        if m and m.group(2) in self.layer_names:
            return f"model.layers.{m.group(1)}.{self.layer_names[m.group(2)]}.{suffix}"
        if base in GLOBAL_NAMES:
            return f"{GLOBAL_NAMES[base]}.{suffix}"
        raise WeightsError(f"GGUF tensor {name!r} has no Llama counterpart")

    def gguf_name(self, name: str) -> str:
        """A Hugging Face tensor's GGUF name."""
        base, _, suffix = name.rpartition(".")
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", base)
        hf_layer = {v: k for k, v in self.layer_names.items()}
        if m and m.group(2) in hf_layer:
            return f"blk.{m.group(1)}.{hf_layer[m.group(2)]}.{suffix}"
        if base in _HF_GLOBAL:
            return f"{_HF_GLOBAL[base]}.{suffix}"
        raise WeightsError(f"tensor {name!r} has no GGUF counterpart")

    def to_gguf(self, cfg: ModelConfig, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """GGUF names and layout (rows still [out, in]; the writer reverses the shape into ggml order)."""
        return {self.gguf_name(n): self.to_gguf_tensor(cfg, n, w) for n, w in to_hf_state(cfg, state).items()}

    def from_gguf_state(self, cfg: ModelConfig, name: str, w: Tensor) -> tuple[str, Tensor]:
        """One GGUF tensor (already reshaped to [out, in]) under its Hugging Face name and layout."""
        hf = self.hf_name(name)
        return hf, self.from_gguf_tensor(cfg, hf, w)


def to_hf_state(cfg: ModelConfig, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The tensors a Hugging Face folder stores: a tied head is left out (transformers re-ties it)."""
    out = dict(state)
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def from_hf_state(
    cfg: ModelConfig, expected: dict[str, torch.Size], state: dict[str, Tensor], source: str
) -> dict[str, Tensor]:
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


def gguf_shape(meta: dict[str, Any], arch: str) -> tuple[int, int, int]:
    """(d_model, n_head, head_dim) of a GGUF; refuses RoPE scaling, which no architecture here computes."""
    if any(k.startswith(f"{arch}.rope.scaling") for k in meta):
        raise UnsupportedModelError(f"GGUF sets {arch}.rope.scaling.*; only plain RoPE is supported")
    d, heads = int(meta[f"{arch}.embedding_length"]), int(meta[f"{arch}.attention.head_count"])
    return d, heads, int(meta.get(f"{arch}.attention.key_length", d // heads))


def gguf_eps(meta: dict[str, Any], arch: str) -> float:
    """GGUF stores eps as float32 (9.999999747e-06); round back to the decimal it came from."""
    return float(f"{float(meta[f'{arch}.attention.layer_norm_rms_epsilon']):.6g}")


def gguf_vocab_size(meta: dict[str, Any], arch: str) -> int:
    return int(meta.get(f"{arch}.vocab_size", len(meta["tokenizer.ggml.tokens"])))
