"""LoRA (Hu et al. 2021): y = W x + (alpha / r) B A x with W frozen, A [r, in] and B [out, r] trained.

A starts kaiming-uniform and B at zero (as PEFT), so an untrained adapter reproduces the base exactly.
Adapters are saved and loaded in PEFT's layout, so either library can read the other's adapters.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from .errors import EnlaceError
from .hf.folder import content_fingerprint
from .io import atomic_dir, atomic_write_json, write_safetensors
from .manifest import verify_manifest, write_manifest

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
FINGERPRINT_KEY = "enlace.base_fingerprint"  # safetensors metadata: content fingerprint of the base folder


class AdapterError(EnlaceError):
    """An adapter does not fit the model it is loaded into."""


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        if rank <= 0:
            raise ValueError(f"LoRA rank must be positive, got {rank}")
        self.base = base
        base.weight.requires_grad_(False)
        # Adapters stay fp32 whatever the base dtype: their updates are small relative to W.
        kw = {"device": base.weight.device, "dtype": torch.float32}
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, **kw)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, **kw)
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False
        self.reset_lora()

    def reset_lora(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's default init
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.merged:
            return y
        if not torch.is_autocast_enabled(x.device.type):
            # A 16-bit base without autocast (decoding with bf16 weights) meets the fp32 adapters here.
            # Under autocast the linear casts x itself: an fp32 round trip would be two wasted copies per
            # adapter and pass (about 9% of a LoRA step on SmolLM2 at seq 128, bf16, measured).
            x = x.to(self.lora_A.weight.dtype)
        delta = self.lora_B(self.lora_A(self.dropout(x)))
        return y + (delta * self.scaling).to(y.dtype)

    def delta_weight(self) -> torch.Tensor:
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    @torch.no_grad()
    def merge(self) -> None:
        """Fold B A into W: faster inference, same outputs (up to rounding)."""
        if not self.merged:
            self.base.weight += self.delta_weight().to(self.base.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            self.base.weight -= self.delta_weight().to(self.base.weight.dtype)
            self.merged = False


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


def inject_lora(
    model: nn.Module, targets: Iterable[str], rank: int, alpha: float, dropout: float = 0.0
) -> dict[str, LoraLinear]:
    """Freeze every base parameter and wrap each nn.Linear whose name ends with a target."""
    targets = list(targets)
    unknown = [t for t in targets if t not in ALL_TARGETS]
    if unknown:
        raise AdapterError(f"unknown LoRA targets {unknown}; choose from {list(ALL_TARGETS)}")
    if lora_modules(model):
        raise AdapterError("the model already has LoRA adapters")
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped: dict[str, LoraLinear] = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, nn.Linear):
                lora = LoraLinear(child, rank, alpha, dropout)
                setattr(module, child_name, lora)
                wrapped[f"{name}.{child_name}" if name else child_name] = lora
    if not wrapped:
        raise AdapterError(f"no module matched the LoRA targets {targets}")
    return wrapped


@torch.no_grad()
def cast_frozen_base(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Store the frozen base's linear weights in `dtype` (bf16: half the bytes, native CPU kernels).

    For training under autocast of the same dtype, which would otherwise cast every fp32 weight at every
    forward. Adapters, their optimizer, the norms and the (tied) embedding stay fp32, so the residual
    stream and every trained value keep fp32. Returns the number of weights cast.
    """
    head = getattr(model, "lm_head", None)
    n = 0
    for m in model.modules():
        if type(m) is not nn.Linear or m.weight.requires_grad or m is head:
            continue  # adapters are trained and stay fp32; the head is tied to the fp32 embedding
        m.weight.data = m.weight.data.to(dtype)
        n += m.weight.numel()
    return n


def lora_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n]


def set_merged(model: nn.Module, merged: bool) -> None:
    for m in lora_modules(model).values():
        m.merge() if merged else m.unmerge()


def merge_and_unload(model: nn.Module) -> nn.Module:
    """Replace every LoraLinear by its base Linear with B A folded in (for export as a plain model)."""
    for name, m in lora_modules(model).items():
        m.merge()
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, m.base)
    return model


# ---- PEFT layout ---------------------------------------------------------------------------------------


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """lora_A/lora_B tensors under PEFT's key names."""
    out = {}
    for name, m in lora_modules(model).items():
        out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = m.lora_A.weight.detach().float().cpu()
        out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = m.lora_B.weight.detach().float().cpu()
    return out


def adapter_config(model: nn.Module, base_model: str) -> dict[str, Any]:
    mods = list(lora_modules(model).values())
    if not mods:
        raise AdapterError("the model has no LoRA adapters to save")
    targets = sorted({n.rsplit(".", 1)[-1] for n in lora_modules(model)})
    drop = mods[0].dropout.p if isinstance(mods[0].dropout, nn.Dropout) else 0.0
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": mods[0].rank,
        "lora_alpha": mods[0].alpha,
        "lora_dropout": drop,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def save_adapter(
    model: nn.Module, folder: Path, base_model: str, provenance: dict[str, Any] | None = None
) -> Path:
    """The adapter folder, written aside and swapped in whole, its manifest.json last (`provenance`: more
    to record there, e.g. the config hash)."""
    folder = Path(folder)
    if any(m.merged for m in lora_modules(model).values()):
        raise AdapterError("unmerge the adapters before saving them")
    # The base's content fingerprint rides in the safetensors metadata (PEFT ignores it): a byte-identical
    # copy of the base under another path or name is still recognised as the same model.
    meta = {"format": "pt"}
    fingerprint = content_fingerprint(Path(base_model))
    if fingerprint:
        meta[FINGERPRINT_KEY] = fingerprint
    with atomic_dir(folder) as tmp:
        write_safetensors(tmp / ADAPTER_WEIGHTS, adapter_state(model), metadata=meta)
        atomic_write_json(tmp / ADAPTER_CONFIG, adapter_config(model, base_model))
        info = {"base_model": str(base_model), "base_fingerprint": fingerprint, **(provenance or {})}
        write_manifest(tmp, "lora-adapter", info)
    return folder


def read_adapter_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / ADAPTER_CONFIG
    if not path.exists():
        raise AdapterError(f"{path}: not found; is {folder} a LoRA adapter folder?")
    cfg = json.loads(path.read_text(encoding="utf-8"))
    problems = []
    if cfg.get("peft_type") != "LORA":
        problems.append(f"peft_type {cfg.get('peft_type')!r} (only LORA)")
    for key, ok in (("bias", "none"), ("fan_in_fan_out", False), ("use_dora", False), ("use_rslora", False)):
        if cfg.get(key, ok) != ok:
            problems.append(f"{key}={cfg.get(key)!r} (only {ok!r})")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if cfg.get(key):
            problems.append(f"{key} is set (not supported)")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        problems.append(f"target_modules is a regex {targets!r} (only a list of names)")
    if problems:
        raise AdapterError(f"{path}: unsupported adapter: " + "; ".join(problems))
    return cfg


def check_finite(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse an adapter holding NaN or inf: merged in, it would turn every answer into garbage."""
    for key, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise AdapterError(f"{path}: tensor {key} has non-finite values (NaN or inf); adapter refused")


def _same_base(expected: str, recorded: str | None) -> bool:
    # Folders move between machines; their last path component (the model's name) must agree.
    return not recorded or Path(str(recorded).rstrip("/")).name == Path(str(expected).rstrip("/")).name


def load_adapter(
    model: nn.Module, folder: Path, base_model: str | None = None, scale: float = 1.0
) -> dict[str, LoraLinear]:
    """Inject adapters per adapter_config.json and load every tensor; anything missing or extra is an error.

    scale multiplies every delta (alpha / r times scale), as llama.cpp's --lora-scaled: 0 is the base, 1 the
    adapter as trained."""
    folder = Path(folder)
    if folder.is_dir():
        verify_manifest(folder)  # before anything is read: a changed or corrupt file is refused by name
    cfg = read_adapter_config(folder)
    path = folder / ADAPTER_WEIGHTS
    if not path.exists():
        raise AdapterError(f"{path}: not found")
    with safe_open(str(path), framework="pt") as f:
        recorded = (f.metadata() or {}).get(FINGERPRINT_KEY)
    if base_model is not None:
        if recorded and Path(base_model).is_dir():
            if content_fingerprint(Path(base_model)) != recorded:
                raise AdapterError(
                    f"{folder}: adapter was trained on {cfg.get('base_model_name_or_path')!r}, whose weights "
                    f"differ from {base_model!r} (content fingerprints differ)"
                )
        elif not _same_base(base_model, cfg.get("base_model_name_or_path")):
            raise AdapterError(
                f"{folder}: adapter was trained on {cfg.get('base_model_name_or_path')!r}, not on {base_model!r}"
            )
    tensors = load_file(str(path))
    check_finite(tensors, path)
    alpha = float(cfg["lora_alpha"]) * scale
    wrapped = inject_lora(model, cfg["target_modules"], int(cfg["r"]), alpha, 0.0)
    expected = {f"{PEFT_PREFIX}{n}.lora_{ab}.weight": (n, ab) for n in wrapped for ab in "AB"}
    # PEFT writes the adapter name into keys only when it is not "default"; accept ".default" too.
    found = {
        k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
        for k, v in tensors.items()
    }
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    shapes = []
    for key, (name, ab) in expected.items():
        if key in found:
            want = getattr(wrapped[name], f"lora_{ab}").weight.shape
            if found[key].shape != want:
                shapes.append(f"{key}: {tuple(found[key].shape)} != {tuple(want)}")
    if missing or unexpected or shapes:
        for name, m in wrapped.items():  # leave the model as it was
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, m.base)
        groups = (("missing", missing), ("unexpected", unexpected), ("wrong shape", shapes))
        # One line for the terminal (counts and the first of each kind); every tensor in a file beside it.
        parts = [f"{len(items)} {label} (e.g. {items[0]})" for label, items in groups if items]
        report = Path(tempfile.gettempdir()) / f"enlace-adapter-mismatch-{os.getpid()}.txt"
        report.write_text(
            "".join(f"{label}: {item}\n" for label, items in groups for item in items), encoding="utf-8"
        )
        raise AdapterError(
            f"{path}: adapter does not fit the model (r={cfg['r']}): "
            + "; ".join(parts)
            + f"; full list in {report}"
        )
    with torch.no_grad():
        for key, (name, ab) in expected.items():
            getattr(wrapped[name], f"lora_{ab}").weight.copy_(found[key])
    return wrapped
