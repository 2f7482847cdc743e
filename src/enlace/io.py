"""File helpers every stage shares: checksums, canonical JSON, atomic writes, JSONL reading.

Atomic means: write to a temporary sibling, fsync, rename over the final name, fsync the folder. A reader
(or a resumed run) then sees either the old file or the new one, never half of one.

Folders cannot be renamed over a non-empty folder, so replacing one moves the old copy aside first, renames
the new one in, and only then deletes the old copy: at every instant one complete copy exists under a known
name, and `restore_aside` puts the old copy back after a crash between the two renames.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import DataError

if TYPE_CHECKING:
    import torch

CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def canonical_json(obj: Any) -> str:
    """Sorted keys and a trailing newline: the same data always gives the same bytes."""
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable. Some filesystems refuse to open or sync folders: then skip."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def require_folder(path: Path, what: str) -> Path:
    """Refuse an output path that exists and is not a folder, before any work starts."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise DataError(f"{what} {path}: not a directory (it names an existing file)")
    return path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, canonical_json(obj))


def write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    sort_safetensors_metadata(tmp)
    os.chmod(tmp, 0o644)  # safetensors creates 0600 files; the folder is meant to be shared
    fsync_file(tmp)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def sort_safetensors_metadata(path: Path) -> None:
    """Rewrite a safetensors file's header in place with its `__metadata__` keys sorted. safetensors writes
    them from a Rust HashMap, whose order changes from process to process: the same tensors and metadata
    gave files whose bytes, and so checksums, differed (two `make run`s' adapters, 2026-12-07). Same keys,
    same length: the tensors' offsets do not move."""
    with open(path, "r+b") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        raw = f.read(size).decode("utf-8")
        meta = json.loads(raw).get("__metadata__") or {}
        if len(meta) < 2:
            return

        def compact(d: dict) -> str:
            return json.dumps({"__metadata__": d}, separators=(",", ":"), ensure_ascii=False)[1:-1]

        written = compact(meta)
        if written not in raw:  # serde_json's compact form, as json.dumps spells it: should never happen
            raise DataError(f"{path}: unexpected safetensors header layout, cannot order its metadata")
        f.seek(8)
        f.write(raw.replace(written, compact(dict(sorted(meta.items()))), 1).encode("utf-8"))


def aside_name(final: Path) -> Path:
    """Where replace_dir keeps the old copy of `final` while the new one is renamed in."""
    return final.with_name(f".old-{final.name}")


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename the complete folder `tmp` to `final`; an existing `final` is moved aside first, then deleted."""
    tmp, final = Path(tmp), Path(final)
    old = aside_name(final)
    if old.exists():
        shutil.rmtree(old)  # a leftover whose `final` is in place (restore_aside handles the other case)
    if final.exists():
        os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
        fsync_dir(final.parent)


def restore_aside(final: Path) -> bool:
    """After a crash inside replace_dir: put the old copy back when `final` is missing. True if it did."""
    final = Path(final)
    old = aside_name(final)
    if old.is_dir() and not final.exists():
        os.replace(old, final)
        fsync_dir(final.parent)
        return True
    return False


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder to fill; on success it replaces `final` (see replace_dir)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    restore_aside(final)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(tmp)
    replace_dir(tmp, final)


def iter_jsonl(path: Path, opener: Any = open) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) for each non-blank line; a malformed line is a DataError naming it."""
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
