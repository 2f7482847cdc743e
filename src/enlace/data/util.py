"""Small helpers shared by the data stages: hashing, atomic writes, canonical JSON, progress bars."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def canonical_json(obj: Any) -> str:
    """Sorted keys and a trailing newline: the same data always gives the same bytes."""
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def fsync_dir(path: Path) -> None:
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
    """Write to a temporary name, fsync, then rename: a crash never leaves a half file under the final name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def progress(iterable: Any = None, **kw: Any) -> tqdm:
    """A tqdm bar on stderr with counts and rates; quiet when stderr is not a terminal unless forced."""
    kw.setdefault("file", sys.stderr)
    kw.setdefault("dynamic_ncols", True)
    kw.setdefault("mininterval", 0.5)
    kw.setdefault("disable", os.environ.get("ENLACE_NO_PROGRESS") == "1")
    return tqdm(iterable, **kw)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
