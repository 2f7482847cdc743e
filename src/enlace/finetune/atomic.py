"""Atomic file writes: a reader never sees a half-written file, whatever kills the writer."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..io import fsync_file


def write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.chmod(tmp, 0o644)  # safetensors creates 0600 files; the folder is meant to be shared
    fsync_file(tmp)
    os.replace(tmp, path)


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces `final` (the old one is removed first).

    A folder cannot be renamed over a non-empty one, so there is a short window in which `final` is
    missing; it is never partially written, which is what loaders care about.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
