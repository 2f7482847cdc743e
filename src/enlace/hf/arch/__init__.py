"""One module per architecture, and the registry that finds it (torchtitan's models/<name>/, litgpt's
name_to_config).

Each of llama.py, qwen3.py and gemma3.py holds its ModelConfig <-> config.json mapping (the one builder and
the parser), its ModelConfig <-> GGUF metadata mapping and its state-dict adapter, as one `Arch`. Callers
find it by config.json's model_type, by GGUF's general.architecture, or by a ModelConfig's switches.
"""

from __future__ import annotations

from typing import Any

from ...config.model import ModelConfig
from ...errors import UnsupportedModelError
from . import gemma3, llama, qwen3
from .common import Arch

ARCHS: dict[str, Arch] = {a.name: a for a in (llama.ARCH, qwen3.ARCH, gemma3.ARCH)}
_BY_MODEL_TYPE = {a.hf_model_type: a for a in ARCHS.values()}


def for_hf(hf: dict[str, Any], source: str = "config.json") -> Arch:
    """The architecture a config.json's model_type names."""
    model_type = hf.get("model_type")
    arch = _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        raise UnsupportedModelError(
            f"{source}: unsupported model: model_type {model_type!r} is not one of {sorted(_BY_MODEL_TYPE)}"
        )
    return arch


def for_gguf(meta: dict[str, Any]) -> Arch:
    """The architecture a GGUF's general.architecture names."""
    name = meta.get("general.architecture")
    if name not in ARCHS:
        names = [repr(n) for n in ARCHS]
        supported = f"{', '.join(names[:-1])} and {names[-1]}"
        raise UnsupportedModelError(f"GGUF architecture {name!r}; only {supported} are supported")
    return ARCHS[name]


def for_config(cfg: ModelConfig) -> Arch:
    """Gemma 3's switches (all of them; a partial set is refused) are gemma3, QK-norm alone is Qwen3's,
    otherwise plain Llama. Switches no architecture has (value embeddings, soft-capped logits) are refused."""
    foreign = [k for k in ("value_embeds", "logit_softcap") if getattr(cfg, k) not in (False, None)]
    if foreign:
        raise UnsupportedModelError(
            f"model {cfg.name}: {', '.join(foreign)} set; no Hugging Face or GGUF architecture ENLACE "
            "exports has it (an ablation switch: such a run is trained, evaluated and sampled here only)"
        )
    if gemma3.is_gemma3(cfg):
        return gemma3.ARCH
    return qwen3.ARCH if cfg.qk_norm else llama.ARCH


def from_hf_config(hf: dict[str, Any], source: str = "config.json", name: str | None = None) -> ModelConfig:
    """Map a LlamaForCausalLM, Qwen3ForCausalLM or Gemma3ForCausalLM config.json onto ModelConfig, or raise
    listing every problem."""
    return for_hf(hf, source).from_hf(hf, source, name)


def to_hf_config(
    cfg: ModelConfig,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> dict[str, Any]:
    """The config.json transformers needs to load our model."""
    return for_config(cfg).to_hf(cfg, bos_token_id, eos_token_id, pad_token_id)
