"""A Hugging Face folder ready to generate from: our Llama, its tokenizer, an optional LoRA adapter merged in."""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import EnlaceError
from .hf.folder import load_hf_folder
from .hf.tokenizer import HFTokenizer


def check_model_folder(model_dir: Path, flag: str = "--model") -> Path:
    """Refuse a missing folder, or a file, by name before anything tries to read inside it."""
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise EnlaceError(f"{flag} {model_dir}: no such folder")
    if not model_dir.is_dir():
        raise EnlaceError(f"{flag} {model_dir}: not a folder (expected a Hugging Face model folder)")
    return model_dir


def load_for_generation(
    model_dir: str | Path, adapter_dir: str | Path | None = None, device: str | torch.device = "cpu"
) -> tuple[torch.nn.Module, HFTokenizer]:
    """Our Llama from a Hugging Face folder, with the adapter merged in (no extra matmuls per token)."""
    model_dir = check_model_folder(Path(model_dir))
    tok = HFTokenizer(model_dir)
    model = load_hf_folder(model_dir, device=device)
    if adapter_dir is not None:
        from .lora import load_adapter, set_merged

        load_adapter(model, Path(adapter_dir), str(model_dir))
        set_merged(model, True)
    return model.eval(), tok
