"""Hugging Face folders <-> our Llama: config.json plus model.safetensors (or a sharded index).

Names and the tied head are the architecture's business (hf/arch/); this file reads and writes the files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path, PurePosixPath

import torch
from safetensors import safe_open

from ..errors import EnlaceError, WeightsError
from ..io import atomic_write_json, write_safetensors
from ..manifest import hash_folder, verify_manifest, write_manifest
from ..model import Llama
from .arch import from_hf_config, to_hf_config
from .arch.common import from_hf_state, to_hf_state

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.exists():
        raise EnlaceError(f"{path}: not found; is {folder} a Hugging Face model folder?")
    return json.loads(path.read_text(encoding="utf-8"))


def weight_files(folder: Path) -> list[Path]:
    folder = Path(folder)
    if (folder / WEIGHTS).exists():
        return [folder / WEIGHTS]
    if (folder / INDEX).exists():
        index = json.loads((folder / INDEX).read_text(encoding="utf-8"))
        names = sorted(set(index["weight_map"].values()))
        for n in names:
            p = PurePosixPath(str(n))
            if p.is_absolute() or ".." in p.parts or "\\" in str(n) or not str(n).strip():
                raise WeightsError(f"{folder / INDEX}: shard name {n!r} leaves the folder; refused")
        missing = [n for n in names if not (folder / n).exists()]
        if missing:
            raise WeightsError(f"{folder / INDEX}: shards missing: {missing}")
        return [folder / n for n in names]
    raise WeightsError(f"{folder}: neither {WEIGHTS} nor {INDEX} found (only safetensors are read)")


def read_state(folder: Path, dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
    """All tensors of the folder, converted to dtype (None keeps the stored one), verified against the
    folder's manifest first."""
    state: dict[str, torch.Tensor] = {}
    files = weight_files(folder)
    verify_manifest(folder, [INDEX, *(f.name for f in files)])
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                if k in state:
                    raise WeightsError(f"{f}: tensor {k} appears in more than one shard")
                t = sf.get_tensor(k)
                state[k] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return state


def build_model(
    cfg, state: dict[str, torch.Tensor], source: str, device: str | torch.device = "cpu"
) -> Llama:
    """Instantiate on the meta device (no random init of 100M+ weights) and adopt the loaded tensors."""
    with torch.device("meta"):
        model = Llama(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    state = from_hf_state(cfg, expected, state, source)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    left = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if left:
        raise WeightsError(f"{source}: tensors not loaded: {left}")
    return model.to(device)


def load_hf_folder(
    folder: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Llama:
    """Our Llama with the folder's weights (bf16/fp16 checkpoints become `dtype`, fp32 by default)."""
    folder = Path(folder)
    verify_manifest(folder, ["config.json"])  # the weights are verified as read_state reads them
    cfg = from_hf_config(read_config(folder), str(folder / "config.json"), name=folder.name)
    model = build_model(cfg, read_state(folder, dtype), str(folder), device)
    return model.eval()


def save_hf_folder(
    model: Llama,
    folder: Path,
    tokenizer_dir: Path | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    manifest: bool = True,
) -> Path:
    """Write a folder transformers (and load_hf_folder) can load; tokenizer files are copied if given.

    Several eos ids (text end and chat-turn end) all go to generation_config.json; config.json holds the first.
    `manifest`: write manifest.json last (off for a caller that adds files and writes it itself).
    """
    folder = Path(folder)
    state = to_hf_state(model.cfg, model.state_dict())  # safetensors refuses the shared tied head
    first_eos = eos_token_id[0] if isinstance(eos_token_id, list) else eos_token_id
    if isinstance(eos_token_id, list) and len(eos_token_id) == 1:
        eos_token_id = first_eos
    write_safetensors(folder / WEIGHTS, state, metadata={"format": "pt"})
    atomic_write_json(folder / "config.json", to_hf_config(model.cfg, bos_token_id, first_eos, pad_token_id))
    gen = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    atomic_write_json(folder / "generation_config.json", {k: v for k, v in gen.items() if v is not None})
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.exists() and src.resolve() != (folder / name).resolve():
                shutil.copyfile(src, folder / name)
    if manifest:
        write_model_manifest(folder, "hf-model")
    return folder


def write_model_manifest(folder: Path, kind: str, provenance: dict | None = None) -> dict:
    """manifest.json of a model folder, with the content fingerprint adapters record of their base."""
    files = hash_folder(folder)
    sums = {name: entry["sha256"] for name, entry in files.items()}
    fingerprint = content_fingerprint(folder, sums)  # from the sums just taken: no second read
    return write_manifest(folder, kind, {**(provenance or {}), "fingerprint": fingerprint}, files)


def content_fingerprint(folder: Path, sums: dict[str, str] | None = None) -> str | None:
    """sha256 over config.json and every weight file: the same model wherever (and under whatever name) it
    is copied. None when the folder is not a model folder. `sums`: sha256 already known, by file name."""
    import hashlib

    from ..io import sha256_file

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        return None
    try:
        files = [folder / "config.json", *weight_files(folder)]
    except WeightsError:
        return None
    h = hashlib.sha256()
    for f in files:
        digest = (sums or {}).get(f.relative_to(folder).as_posix()) or sha256_file(f)
        h.update(f"{f.name}:{digest}\n".encode())
    return h.hexdigest()
