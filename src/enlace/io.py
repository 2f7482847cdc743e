"""File helpers every stage shares: checksums, canonical JSON, atomic writes, JSONL reading.

Atomic means: write to a temporary sibling, fsync, rename over the final name, fsync the folder. A reader
(or a resumed run) then sees either the old file or the new one, never half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import DataError

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
