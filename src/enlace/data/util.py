"""Helpers of the data stages: progress bars and log lines (file helpers come from enlace.io)."""

from __future__ import annotations

import os
import sys
from typing import Any

from tqdm import tqdm


def progress(iterable: Any = None, **kw: Any) -> tqdm:
    """A tqdm bar on stderr with counts and rates; quiet when stderr is not a terminal unless forced."""
    kw.setdefault("file", sys.stderr)
    kw.setdefault("dynamic_ncols", True)
    kw.setdefault("mininterval", 0.5)
    kw.setdefault("disable", os.environ.get("ENLACE_NO_PROGRESS") == "1")
    return tqdm(iterable, **kw)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
