"""Qwen3 (transformers' Qwen3ForCausalLM, llama.cpp's `qwen3`): our plain decoder with QK-norm on.

transformers' Llama has no per-head q/k RMSNorm, so QK-norm on is exported as Qwen3. llama.cpp's `qwen3`
rotates halves (NeoX), as we do: no tensor is permuted.
"""

from __future__ import annotations

from typing import Any

from ...config.model import ModelConfig
from .common import LAYER_NAMES, Arch
from .llama import build_hf, keep, no_extra_keys, parse_hf, read_gguf

NAME = "qwen3"
HF_ARCHITECTURE = "Qwen3ForCausalLM"


def from_hf(hf: dict[str, Any], source: str, name: str | None) -> ModelConfig:
    return parse_hf(hf, source, name, HF_ARCHITECTURE, qk_norm=True)


def to_hf(
    cfg: ModelConfig, bos: Any = None, eos: Any = None, pad: Any = None, imported: bool = False
) -> dict:
    out = build_hf(cfg, NAME, HF_ARCHITECTURE, (bos, eos, pad), imported)
    out["use_sliding_window"] = False
    out["sliding_window"] = None
    return out


def from_gguf(meta: dict[str, Any], tied: bool, source: str, name: str) -> ModelConfig:
    return read_gguf(meta, tied, source, name, NAME, qk_norm=True)


ARCH = Arch(
    name=NAME,
    hf_model_type=NAME,
    hf_architecture=HF_ARCHITECTURE,
    summary="qk_norm on: transformers' Qwen3 has the per-head q/k RMSNorm",
    from_hf=from_hf,
    to_hf=to_hf,
    from_gguf=from_gguf,
    write_gguf_keys=no_extra_keys,
    layer_names=LAYER_NAMES,
    to_gguf_tensor=keep,
    from_gguf_tensor=keep,
)
