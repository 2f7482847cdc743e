"""Atomic, complete, verifiable checkpoints.

Layout: <root>/step-00000300/ holding one `<name>.safetensors` per tensor group (model, optimizer, ...),
meta.json (everything else, with the sha256 of every file) and COMPLETE, written last.

Writing: all files go to <root>/.tmp-step-N-<pid>/, each hashed while it is written (a second thread hashes
the bytes the first one writes, so the file is never read back) and fsynced, then the directory is fsynced and renamed
into place (an existing step-N is moved aside first and deleted only after the new one is in: see
enlace.io.replace_dir), and only then COMPLETE is written (and fsynced). A checkpoint without COMPLETE is
ignored and later deleted, so a SIGKILL at any instant leaves a complete checkpoint as the latest loadable one.
Loading verifies COMPLETE (it holds meta.json's sha256) and the sha256 of every file, naming the bad one.

The writing and loading know nothing about models or optimizers; the last section flattens a model and an
optimizer into the named tensor groups ("model", "optimizer") and back. enlace.train.step.TrainState makes
the tensor groups and metadata that both stages write.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import struct
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from ..errors import CheckpointError
from ..io import canonical_json, fsync_dir, fsync_file, replace_dir, restore_aside, sha256_file
from .optim import Optimizer

COMPLETE = "COMPLETE"
META = "meta.json"
STEP_RE = re.compile(r"^step-(\d+)$")


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"  # zero-padded so names sort like numbers


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


# safetensors' names for the dtypes a checkpoint holds.
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
WRITE_CHUNK = 32 << 20  # bytes per write call: big enough for full-speed I/O, small enough to overlap


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    """Write tensors as one safetensors file and return its sha256, computed while writing.

    The bytes go straight from the tensors' memory to the file (no serialised copy). One helper thread
    hashes each chunk while the main thread writes it, another asks the kernel to write the dirty pages
    out (fdatasync) as the file grows, so the caller's final fsync waits only for the tail. The layout is
    safetensors' own: 8-byte header length, JSON header padded to 8 bytes, then the tensors by
    descending element size (every tensor aligned to its dtype), then by name. Same tensors, same bytes.
    """
    data = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    order = sorted(data, key=lambda k: (-data[k].element_size(), k))
    header: dict[str, Any] = {}
    offset = 0
    for k in order:
        t = data[k]
        if t.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"{path}: tensor {k} has dtype {t.dtype}, which a checkpoint cannot hold")
        size = t.numel() * t.element_size()
        header[k] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    blobs = [memoryview(struct.pack("<Q", len(head)) + head)]
    blobs += [memoryview(data[k].reshape(-1).view(torch.uint8).numpy()) for k in order]
    digest = hashlib.sha256()
    with ThreadPoolExecutor(1) as hasher, ThreadPoolExecutor(1) as syncer, open(path, "wb", buffering=0) as f:
        # One worker each: chunks are hashed in order; at most one fdatasync is in flight.
        syncing: Future[None] | None = None
        unsynced = 0
        for blob in blobs:
            for start in range(0, len(blob), WRITE_CHUNK):
                chunk = blob[start : start + WRITE_CHUNK]
                hasher.submit(digest.update, chunk)  # hashlib releases the GIL on big buffers
                unsynced += len(chunk)
                while chunk:
                    chunk = chunk[f.write(chunk) :]
                if unsynced >= 2 * WRITE_CHUNK and (syncing is None or syncing.done()):
                    syncing = syncer.submit(os.fdatasync, f.fileno())
                    unsynced = 0
        if syncing is not None:
            syncing.result()  # raises an I/O error the kernel reported
    return digest.hexdigest()


def save_checkpoint(
    root: Path,
    step: int,
    tensors: dict[str, dict[str, torch.Tensor]],
    meta: dict[str, Any],
    keep_last: int | None = None,
    pinned: Collection[int] = (),
) -> Path:
    """Write step N's checkpoint atomically; return its directory. Deterministic: no timestamps, no paths.

    keep_last: prune to the newest keep_last checkpoints afterwards, keeping the steps in `pinned` too.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dirname(step)
    tmp = root / f".tmp-{step_dirname(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        files: dict[str, str] = {}
        for group in sorted(tensors):
            name = f"{group}.safetensors"
            files[name] = write_tensors(tmp / name, tensors[group])
            fsync_file(tmp / name)
        meta_text = canonical_json({**meta, "step": step, "files": files})
        _write_text(tmp / META, meta_text)
        fsync_dir(tmp)
    except OSError as e:
        # A full disk or a vanished folder: drop the partial copy, keep every complete checkpoint.
        shutil.rmtree(tmp, ignore_errors=True)
        done = list_checkpoints(root)
        kept = (
            f"the last complete checkpoint, {done[-1].name}, is intact"
            if done
            else "no checkpoint exists yet"
        )
        raise CheckpointError(
            f"{root}: could not write the checkpoint of step {step} ({_reason(e)}); {kept}. "
            "Free space or choose another run directory, then rerun to continue"
        ) from None
    # Re-saving a step (a resumed run stopping at the same step): the old copy is moved aside, not deleted,
    # until the new one is in place; COMPLETE marks the new one loadable.
    replace_dir(tmp, final)
    _write_text(final / COMPLETE, hashlib.sha256(meta_text.encode("utf-8")).hexdigest() + "\n")
    fsync_dir(final)
    if keep_last is not None:
        prune(root, keep_last, pinned)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and STEP_RE.match(p.name) and (p / COMPLETE).exists()]
    return sorted(dirs, key=step_of)


def _reason(e: OSError) -> str:
    return "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))


def step_of(path: Path) -> int:
    m = STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else -1


def prune(root: Path, keep_last: int, pinned: Collection[int] = ()) -> None:
    """Keep the newest keep_last complete checkpoints and the pinned steps; delete older ones and stale
    partial writes."""
    root = Path(root)
    complete = list_checkpoints(root)
    for p in complete[:-keep_last]:
        if step_of(p) not in pinned:
            shutil.rmtree(p, ignore_errors=True)
    clean_partial(root)


def clean_partial(root: Path) -> None:
    """Repair what an interrupted write left: put back a step moved aside for a re-save whose new copy never
    arrived, then delete temporary dirs and step dirs without COMPLETE."""
    root = Path(root)
    if not root.is_dir():
        return
    for p in list(root.iterdir()):
        if p.name.startswith(".old-step-"):
            final = root / p.name.removeprefix(".old-")
            if final.is_dir() and not (final / COMPLETE).exists():
                shutil.rmtree(final)  # the new copy, renamed in but never marked complete
            if not restore_aside(final):
                shutil.rmtree(p, ignore_errors=True)
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
    root: Path,
    fallback_on_corrupt: bool = False,
    device: str | torch.device = "cpu",
    fallback_setting: str | None = None,
) -> tuple[Path, dict[str, dict[str, torch.Tensor]], dict[str, Any]] | None:
    """The newest complete checkpoint that verifies, or None when there is none.

    A corrupted newest checkpoint is an error (naming the file and any older complete checkpoint) unless
    fallback_on_corrupt, in which case the next older one that verifies is used. fallback_setting: the
    config key that turns the fallback on, named in the error where the caller has one (training).
    """
    candidates = list_checkpoints(root)
    errors: list[str] = []
    for i, path in enumerate(reversed(candidates)):
        try:
            tensors, meta = load_checkpoint(path, device)
        except CheckpointError as e:
            older = candidates[: len(candidates) - 1 - i]
            if not fallback_on_corrupt:
                how = f"set {fallback_setting} to resume from it, or " if fallback_setting else ""
                hint = (
                    f"; an older complete checkpoint exists: {older[-1]} ({how}delete the corrupted one to use it)"
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


# Optimizer group settings that torch keeps as tuples and JSON turns into lists (AdamW's, Muon's).
TUPLE_KEYS = ("betas", "ns_coefficients")


# ---- model and optimizer <-> tensor groups --------------------------------------------------------------


def model_tensors(model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The weights to save. Tied weights are stored once (safetensors refuses tensors sharing storage);
    trainable_only keeps just what the optimizer updates (a LoRA adapter on a frozen base)."""
    if trainable_only:
        return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    state = model.state_dict()
    if getattr(getattr(model, "cfg", None), "tie_embeddings", False):
        state.pop("lm_head.weight", None)  # the same tensor as model.embed_tokens.weight
    return dict(state)


def load_model_tensors(
    model: nn.Module, tensors: dict[str, torch.Tensor], trainable_only: bool = False
) -> None:
    if trainable_only:
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if set(params) != set(tensors):
            raise CheckpointError(
                f"checkpoint does not fit the model: missing {sorted(set(params) - set(tensors))[:5]}, "
                f"unexpected {sorted(set(tensors) - set(params))[:5]}"
            )
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(tensors[n])
        return
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = getattr(getattr(model, "cfg", None), "tie_embeddings", False)
    allowed_missing = {"lm_head.weight"} if tied else set()
    if set(missing) - allowed_missing or unexpected:
        raise CheckpointError(
            f"checkpoint does not fit the model: missing {sorted(set(missing) - allowed_missing)}, "
            f"unexpected {sorted(unexpected)}"
        )


def param_names(optimizer: Optimizer) -> list[str]:
    """Names of the optimizer's parameters in state_dict index order (groups in order, params in order)."""
    return [n for g in optimizer.param_groups for n in g["param_names"]]


def optimizer_tensors(optimizer: Optimizer) -> tuple[dict[str, torch.Tensor], list]:
    """Flatten optimizer state to {"<param name>.<state key>": tensor} plus JSON-able param groups."""
    names = param_names(optimizer)
    sd = optimizer.state_dict()
    flat: dict[str, torch.Tensor] = {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            flat[f"{names[idx]}.{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return flat, groups


def load_optimizer_tensors(optimizer: Optimizer, flat: dict[str, torch.Tensor], groups: list) -> None:
    index = {n: i for i, n in enumerate(param_names(optimizer))}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        pname, skey = key.rsplit(".", 1)
        if pname not in index:
            raise CheckpointError(f"optimizer state for unknown parameter {pname}")
        state.setdefault(index[pname], {})[skey] = t
    fixed = [{k: (tuple(v) if k in TUPLE_KEYS else v) for k, v in g.items()} for g in groups]
    optimizer.load_state_dict({"state": state, "param_groups": fixed})
