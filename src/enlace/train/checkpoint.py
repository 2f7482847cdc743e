"""Atomic, complete, verifiable checkpoints.

Layout: <root>/step-00000300/ holding one `<name>.safetensors` per tensor group (model, optimizer, ...),
meta.json (everything else, with the sha256 of every file) and COMPLETE, written last.

Writing: all files go to <root>/.tmp-step-N-<pid>/, each fsynced, then the directory is fsynced and renamed
into place, and only then COMPLETE is written (and fsynced). A checkpoint without COMPLETE is ignored and
later deleted, so a SIGKILL at any instant leaves the previous checkpoint as the latest loadable one.
Loading verifies COMPLETE (it holds meta.json's sha256) and the sha256 of every file, naming the bad one.

These functions know nothing about models or optimizers: the fine-tuning stage reuses them with its own
tensor groups. The trainer-level helpers below them flatten a model and an AdamW into tensor groups.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..errors import CheckpointError
from ..io import fsync_dir, fsync_file, sha256_file

COMPLETE = "COMPLETE"
META = "meta.json"
STEP_RE = re.compile(r"^step-(\d+)$")
# Test seam: ENLACE_TEST_KILL_DURING_SAVE=<step> makes the process SIGKILL itself after the first tensor
# file of that step's checkpoint is written, to prove that a half-written checkpoint is never loaded.
KILL_DURING_SAVE_ENV = "ENLACE_TEST_KILL_DURING_SAVE"


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"  # zero-padded so names sort like numbers


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def save_checkpoint(
    root: Path,
    step: int,
    tensors: dict[str, dict[str, torch.Tensor]],
    meta: dict[str, Any],
    keep_last: int | None = None,
) -> Path:
    """Write step N's checkpoint atomically; return its directory. Deterministic: no timestamps, no paths."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dirname(step)
    tmp = root / f".tmp-{step_dirname(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    files: dict[str, str] = {}
    kill_at = os.environ.get(KILL_DURING_SAVE_ENV)
    for group in sorted(tensors):
        name = f"{group}.safetensors"
        data = {k: v.detach().to("cpu").contiguous() for k, v in tensors[group].items()}
        save_file(data, str(tmp / name))
        fsync_file(tmp / name)
        files[name] = sha256_file(tmp / name)
        if kill_at is not None and int(kill_at) == step:
            os.kill(os.getpid(), signal.SIGKILL)
    _write_text(tmp / META, _json({**meta, "step": step, "files": files}))
    fsync_dir(tmp)
    if final.exists():
        # Re-saving a step (e.g. a resumed run stopping at the same step): the old copy goes first.
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    _write_text(final / COMPLETE, sha256_file(final / META) + "\n")
    fsync_dir(final)
    if keep_last is not None:
        prune(root, keep_last)
    return final


def _step_of(path: Path) -> int:
    m = STEP_RE.match(path.name)
    return int(m.group(1)) if m else -1


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and STEP_RE.match(p.name) and (p / COMPLETE).exists()]
    return sorted(dirs, key=_step_of)


def prune(root: Path, keep_last: int) -> None:
    """Keep the newest keep_last complete checkpoints; delete older ones and stale partial writes."""
    root = Path(root)
    complete = list_checkpoints(root)
    for p in complete[:-keep_last]:
        shutil.rmtree(p, ignore_errors=True)
    clean_partial(root)


def clean_partial(root: Path) -> None:
    """Delete leftovers of interrupted writes: temporary dirs and step dirs without COMPLETE."""
    root = Path(root)
    if not root.is_dir():
        return
    for p in root.iterdir():
        if not p.is_dir():
            continue
        if p.name.startswith(".tmp-step-") and not p.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(p, ignore_errors=True)
        elif STEP_RE.match(p.name) and not (p / COMPLETE).exists():
            shutil.rmtree(p, ignore_errors=True)


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check COMPLETE and every checksum; return meta. Raises CheckpointError naming the bad file."""
    path = Path(path)
    marker, meta_path = path / COMPLETE, path / META
    if not marker.exists():
        raise CheckpointError(f"{path}: incomplete checkpoint (no {COMPLETE} marker)")
    if not meta_path.exists():
        raise CheckpointError(f"{meta_path}: missing")
    if sha256_file(meta_path) != marker.read_text().strip():
        raise CheckpointError(f"{meta_path}: checksum mismatch (file altered or truncated)")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_path}: not valid JSON ({e})") from None
    for name, digest in meta.get("files", {}).items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"{f}: missing")
        if sha256_file(f) != digest:
            raise CheckpointError(f"{f}: checksum mismatch (file altered or truncated)")
    return meta


def load_checkpoint(
    path: Path, device: str | torch.device = "cpu"
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """Verify, then read every tensor group and the metadata."""
    path = Path(path)
    meta = verify_checkpoint(path)
    tensors = {
        name.removesuffix(".safetensors"): load_file(str(path / name), device=str(device))
        for name in sorted(meta["files"])
    }
    return tensors, meta


def latest_checkpoint(
    root: Path, fallback_on_corrupt: bool = False, device: str | torch.device = "cpu"
) -> tuple[Path, dict[str, dict[str, torch.Tensor]], dict[str, Any]] | None:
    """The newest complete checkpoint that verifies, or None when there is none.

    A corrupted newest checkpoint is an error (naming the file and any older complete checkpoint) unless
    fallback_on_corrupt, in which case the next older one that verifies is used.
    """
    candidates = list_checkpoints(root)
    errors: list[str] = []
    for i, path in enumerate(reversed(candidates)):
        try:
            tensors, meta = load_checkpoint(path, device)
        except CheckpointError as e:
            older = candidates[: len(candidates) - 1 - i]
            if not fallback_on_corrupt:
                hint = (
                    f"; an older complete checkpoint exists: {older[-1]} (set train.checkpoint.fallback_on_corrupt"
                    " to resume from it, or delete the corrupted one)"
                    if older
                    else "; no older complete checkpoint exists"
                )
                raise CheckpointError(f"{e}{hint}") from None
            errors.append(str(e))
            print(f"warning: {e}; falling back to an older checkpoint", flush=True)
            continue
        return path, tensors, meta
    if errors:
        raise CheckpointError(f"every checkpoint under {root} is corrupted: {'; '.join(errors)}")
    return None


# ---- trainer-level helpers: model and AdamW <-> tensor groups -------------------------------------------


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with tied weights stored once: safetensors refuses tensors that share storage."""
    state = model.state_dict()
    if getattr(getattr(model, "cfg", None), "tie_embeddings", False):
        state.pop("lm_head.weight", None)  # the same tensor as model.embed_tokens.weight
    return dict(state)


def load_model_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = getattr(getattr(model, "cfg", None), "tie_embeddings", False)
    allowed_missing = {"lm_head.weight"} if tied else set()
    if set(missing) - allowed_missing or unexpected:
        raise CheckpointError(
            f"checkpoint does not fit the model: missing {sorted(set(missing) - allowed_missing)}, "
            f"unexpected {sorted(unexpected)}"
        )
    if tied:
        # load_state_dict copies in place, so the tie survives; re-tie anyway in case a caller rebuilt it.
        model.lm_head.weight = model.model.embed_tokens.weight


def optimizer_tensors(
    optimizer: torch.optim.Optimizer, names: list[str]
) -> tuple[dict[str, torch.Tensor], list]:
    """Flatten optimizer state to {"<param name>.<state key>": tensor} plus JSON-able param groups.

    `names[i]` is the name of the parameter with state_dict index i.
    """
    sd = optimizer.state_dict()
    flat: dict[str, torch.Tensor] = {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            t = value if torch.is_tensor(value) else torch.tensor(value)
            flat[f"{names[idx]}.{key}"] = t
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return flat, groups


def load_optimizer_tensors(
    optimizer: torch.optim.Optimizer, names: list[str], flat: dict[str, torch.Tensor], groups: list
) -> None:
    index = {n: i for i, n in enumerate(names)}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        pname, skey = key.rsplit(".", 1)
        if pname not in index:
            raise CheckpointError(f"optimizer state for unknown parameter {pname}")
        state.setdefault(index[pname], {})[skey] = t
    fixed = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in groups]
    optimizer.load_state_dict({"state": state, "param_groups": fixed})
