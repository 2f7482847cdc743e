"""ENLACE's own CPU kernels for decoding: `torch.ops.enlace.linear_f32`, `linear_bf16` and `linear_i8`
(decode_linear.cpp), and `decode_layers` (decode_layers.cpp), a decode step through every layer of the
decoder in one call.

Decoding one token multiplies a few activation rows by every weight once, so its speed is the rate at which
those products stream the weights. decode_linear.cpp says why torch's own kernels fall short there and what
these do instead. They are compiled here, once per machine, with the C++ compiler torch.compile would use
(-march=native: the kernels use AVX2 and FMA where the CPU has them) against the installed torch's headers:

    ${XDG_CACHE_HOME:-~/.cache}/enlace/kernels/<key>/
      decode_linear.so   the library torch loads
      manifest.json      its sha256, written last: a library that does not match it is rebuilt, never loaded

key: a hash of the source, the compiler's version, the flags, torch's version and the CPU's ISA flags, so a
changed source, compiler or torch is never served by an old build, and a cache shared between machines
(a mounted home) gives each CPU kind its own.

`available()` builds on first use (a few seconds) and says whether the ops can be called; where there is no
compiler or the build fails, it says why once (`why_unavailable`) and decoding keeps torch's kernels.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ..io import replace_dir
from ..manifest import MANIFEST, ManifestError, verify_manifest, write_manifest
from ..runtime import cpp_compiler, cpu_flags

# The products, and the layer loop that calls them (one library, one namespace of ops).
SOURCES = tuple(Path(__file__).with_name(name) for name in ("decode_linear.cpp", "decode_layers.cpp"))
LIBRARY = "decode_linear.so"
MAX_ROWS = 8  # activation rows one call takes (kMaxRows in the source): more is a prefill, left to torch
# -fopenmp: at::parallel_for is inline in the headers and threads only where OpenMP is on (torch's own libgomp
# serves it: the library links the soname torch has already loaded).
FLAGS = ("-O3", "-march=native", "-std=c++20", "-fopenmp", "-fPIC", "-shared", "-w")
ENV_DISABLE = "ENLACE_KERNELS"  # "0": never build or load them (decoding keeps torch's kernels)

_state: dict[str, str | bool] = {}


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "enlace" / "kernels"


def _compiler_version(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.splitlines()[0] if out.stdout else cxx


def build_key(cxx: str) -> str:
    parts = [
        *(source.read_text(encoding="utf-8") for source in SOURCES),
        _compiler_version(cxx),
        " ".join(FLAGS),
        torch.__version__,
        " ".join(sorted(cpu_flags())),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _include_flags() -> list[str]:
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{torch_dir / 'include'}",
            f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}"]  # fmt: skip


def _link_command(cxx: str, objects: list[Path], out: Path) -> list[str]:
    torch_dir = Path(torch.__file__).parent
    return [cxx, *FLAGS, *map(str, objects), f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", "-o", str(out)]


def build(folder: Path, cxx: str) -> Path:
    """Compile into `folder` (replaced whole, manifest last); returns the library's path.

    Each source is compiled by its own process, at once (most of each one's 15 s is torch's headers), then
    linked: on 2 cores the first use waits half as long."""
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    objects = [tmp / source.with_suffix(".o").name for source in SOURCES]
    compiles = [
        subprocess.Popen(
            [cxx, *FLAGS, *_include_flags(), "-c", str(source), "-o", str(obj)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for source, obj in zip(SOURCES, objects, strict=True)
    ]
    results = [(c.returncode, err) for c in compiles for _, err in [c.communicate()]]
    if all(code == 0 for code, _ in results):
        link = subprocess.run(
            _link_command(cxx, objects, tmp / LIBRARY), capture_output=True, text=True, check=False
        )
        results.append((link.returncode, link.stderr))
    for code, err in results:
        if code != 0:
            last = (err.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"{cxx} failed on the kernels' sources: {last}")
    for obj in objects:
        obj.unlink()
    sources = [source.name for source in SOURCES]
    write_manifest(tmp, "kernels", {"sources": sources, "torch": torch.__version__, "compiler": cxx})
    replace_dir(tmp, folder)
    return folder / LIBRARY


def library() -> Path:
    """The verified library for this machine, built first where there is none (or a damaged one)."""
    cxx = cpp_compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX, or install g++)")
    folder = cache_root() / build_key(cxx)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # One build at a time per key: a second process (a test worker, a second server) waits, then loads it.
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / LIBRARY).is_file() and (folder / MANIFEST).is_file():
            try:
                verify_manifest(folder)
                return folder / LIBRARY
            except ManifestError as err:
                print(f"enlace kernels: {err}; rebuilding", file=sys.stderr)
        return build(folder, cxx)


def available() -> bool:
    """Whether torch.ops.enlace's products (linear_f32, linear_bf16, linear_i8) can be called (building and
    loading them once)."""
    if "ok" not in _state:
        if os.environ.get(ENV_DISABLE) == "0":
            _state.update(ok=False, why=f"{ENV_DISABLE}=0")
        elif not sys.platform.startswith("linux"):
            _state.update(ok=False, why=f"built on Linux only, not {sys.platform}")
        else:
            try:
                torch.ops.load_library(str(library()))
                _state.update(ok=True, why="")
            except (OSError, RuntimeError, ManifestError) as err:
                _state.update(ok=False, why=str(err))
                print(f"enlace kernels unavailable, decoding uses torch's: {err}", file=sys.stderr)
    return bool(_state["ok"])


def why_unavailable() -> str:
    """Why available() said no ("" when it said yes)."""
    available()
    return str(_state["why"])
