"""llama.cpp built for this CPU: `llama-server`, `llama-bench` and `llama-quantize` from the pinned source.

    python scripts/llama_cpp_native.py           build if needed, then print the folder of the binaries (last line)
    python scripts/llama_cpp_native.py --check   print it if built, else exit 1 saying how to build it

The source is the llama.cpp that the pinned llama-cpp-python source package vendors (vendor/llama.cpp), the
same package and hash as the portable build of scripts/llama_cpp_build.py, so both builds are one llama.cpp.
This one is compiled with GGML_NATIVE=ON (-march=native: AVX-512, VNNI, bf16 or AMX wherever the CPU has
them) by cmake directly, into a folder of its own beside the portable build, which it never touches:

    ${XDG_CACHE_HOME:-~/.cache}/enlace/llama-cpp/
      src/llama_cpp_python-<version>.tar.gz   shared with the portable build (sha256 checked)
      native-<version>-<sha12>-<key12>/       key12: hash of the cmake flags, the targets and the CPU's ISA flags
        build.log                             the last build's output
        bin/llama-server, bin/llama-bench, bin/llama-quantize
        enlace-ready.json                     written last, when the binaries run

A binary built for an AVX-512 CPU dies with SIGILL on an AVX2 one; keying the folder on the ISA flags means a
cache shared between machines (a mounted home, a Docker volume) gives each CPU kind its own build.

Offline: only PyPI is needed, for the source package. The web UI that llama-server can embed is not built and
not downloaded (LLAMA_BUILD_UI=OFF, LLAMA_USE_PREBUILT_UI=OFF); the API is all the benchmark uses. cmake and
ninja come from PATH (Debian's), or, where either is missing or cmake is older than llama.cpp needs, from
their PyPI wheels installed into tools/ in the cache (as scikit-build-core does for the portable build).
Every failure says which step failed in one line and exits 1; nothing falls back to the portable build.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_cpp_build import (  # noqa: E402  (the pin and the fetch are the portable build's, not a copy)
    SDIST,
    SHA256,
    VERSION,
    BuildError,
    cache_root,
    fetch_sdist,
    log,
    read_json,
    run,
    write_json,
)

TARGETS = ("llama-server", "llama-bench", "llama-quantize")
CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_OPENMP=ON -DBUILD_SHARED_LIBS=OFF "
    "-DGGML_BACKEND_DL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON "
    "-DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF "
    "-DLLAMA_USE_PREBUILT_UI=OFF"
)
CMAKE_MIN = (3, 18)  # scripts/ui-assets.cmake in the vendored tree asks for 3.18
# Build tools from PyPI where PATH has none (the versions of late 2026; any recent one builds llama.cpp).
TOOL_PINS = ("cmake==4.4.4", "ninja==1.13.2")
READY = "enlace-ready.json"
# The instruction-set flags that -march=native turns into code paths, as /proc/cpuinfo spells them.
ISA_PREFIXES = ("sse", "ssse", "avx", "amx", "fma", "f16c", "bmi", "vnni", "vaes", "vpclmul", "gfni", "sha")


def isa_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The first CPU's instruction-set flags (x86 `flags`, arm64 `Features`), sorted; empty where unknown."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return sorted(f for f in value.split() if f.startswith(ISA_PREFIXES))
        if key.strip() == "Features":
            return sorted(value.split())
    return []


def wanted() -> dict:
    """What a ready build must have been made from; any difference is another folder."""
    return {"version": VERSION, "sdist_sha256": SHA256, "cmake_args": CMAKE_ARGS, "targets": list(TARGETS),
            "isa_flags": isa_flags()}  # fmt: skip


def build_dir() -> Path:
    key = hashlib.sha256(json.dumps(wanted(), sort_keys=True).encode()).hexdigest()[:12]
    return cache_root() / f"native-{VERSION}-{SHA256[:12]}-{key}"


def bin_dir() -> Path:
    return build_dir() / "bin"


def is_ready() -> bool:
    stamp = read_json(build_dir() / READY)
    if stamp is None or not all((bin_dir() / t).exists() for t in TARGETS):
        return False
    return {k: stamp.get(k) for k in wanted()} == wanted()


def cmake_version(cmake: str) -> tuple[int, ...]:
    out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"version (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0,)


def build_tools(work: Path) -> tuple[str, str]:
    """cmake and ninja: PATH's when recent enough, else PyPI's wheels in the cache's tools/ venv."""
    cmake, ninja = shutil.which("cmake"), shutil.which("ninja")
    if cmake and ninja and cmake_version(cmake) >= CMAKE_MIN:
        return cmake, ninja
    tools = cache_root() / "tools"
    exe = tools / "bin"
    if not ((exe / "cmake").exists() and (exe / "ninja").exists()):
        log(f"cmake {'.'.join(map(str, CMAKE_MIN))}+ or ninja not on PATH: installing {' '.join(TOOL_PINS)} "
            f"from PyPI into {tools}")  # fmt: skip
        run([sys.executable, "-m", "venv", "--clear", str(tools)], work / "build.log")
        run([str(exe / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", *TOOL_PINS],
            work / "build.log")  # fmt: skip
    return str(exe / "cmake"), str(exe / "ninja")


def unpack_vendored(sdist: Path, dest: Path) -> Path:
    """vendor/llama.cpp out of the source package (nothing else of it is needed), and the llama.cpp commit it
    is (the submodule's HEAD, which the package also carries) into dest/COMMIT."""
    root = SDIST.removesuffix(".tar.gz")
    prefix, head = f"{root}/vendor/llama.cpp/", f"{root}/.git/modules/vendor/llama.cpp/HEAD"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        if not members:
            raise BuildError(
                f"{sdist} has no {prefix}: the pinned source package no longer vendors llama.cpp"
            )
        commit = tar.extractfile(head).read().decode().strip() if head in tar.getnames() else ""
        for m in members:
            m.name = m.name[len(prefix) :]
        tar.extractall(dest, members=[m for m in members if m.name], filter="data")
    (dest / "COMMIT").write_text(commit + "\n")
    return dest


def vendored_commit(src: Path) -> str:
    """The llama.cpp commit unpack_vendored found ("" where the package did not say)."""
    try:
        return (src / "COMMIT").read_text().strip()
    except OSError:
        return ""


def compile_targets(work: Path) -> None:
    logfile = work / "build.log"
    logfile.write_text(f"CMAKE_ARGS={CMAKE_ARGS}\nISA={' '.join(isa_flags())}\n")
    cmake, ninja = build_tools(work)
    src = work / "src"
    if not (src / "CMakeLists.txt").exists():
        shutil.rmtree(src, ignore_errors=True)
        unpack_vendored(fetch_sdist(), src)
    log(f"building {', '.join(TARGETS)} for this CPU (GGML_NATIVE=ON; tens of minutes on 2 busy cores; "
        f"log: {logfile})")  # fmt: skip
    t0 = time.monotonic()
    build = work / "build"  # kept when a step fails, so the next call resumes where ninja stopped
    # The source package has no git checkout to read the commit from; it only names the version string.
    commit = [f"-DLLAMA_BUILD_COMMIT={vendored_commit(src)[:12]}"] if vendored_commit(src) else []
    run([cmake, "-S", str(src), "-B", str(build), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
         *CMAKE_ARGS.split(), *commit], logfile)  # fmt: skip
    jobs = str(len(os.sched_getaffinity(0)))
    run(["nice", "-n", "10", cmake, "--build", str(build), "-j", jobs, "--target", *TARGETS], logfile)
    out = Path(tempfile.mkdtemp(dir=work, prefix=".bin-"))
    for t in TARGETS:
        found = build / "bin" / t
        if not found.exists():
            raise BuildError(f"the build finished but left no {found} (full log: {logfile})")
        shutil.copy2(found, out / t)
    out.chmod(0o755)
    shutil.rmtree(work / "bin", ignore_errors=True)
    os.replace(out, work / "bin")
    log(f"built {', '.join(TARGETS)} in {time.monotonic() - t0:.0f} s")


def check_runs(work: Path) -> str:
    """The server starts on this CPU (no SIGILL) and says which llama.cpp it is."""
    proc = subprocess.run([str(work / "bin" / "llama-server"), "--version"], capture_output=True, text=True)
    said = (proc.stdout + proc.stderr).strip()
    if proc.returncode:
        raise BuildError(
            f"{work / 'bin' / 'llama-server'} --version exited with {proc.returncode}: {said[-500:]}"
        )
    return said.splitlines()[0] if said else ""


def ensure() -> Path:
    if is_ready():
        return bin_dir()
    work = build_dir()
    work.mkdir(parents=True, exist_ok=True)
    with open(cache_root() / ".lock-native", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per machine; the others wait, then reuse its build
        if not is_ready():
            compile_targets(work)
            version = check_runs(work)
            commit = vendored_commit(work / "src")
            write_json(
                work / READY, {**wanted(), "llama_server_version": version, "llama_cpp_commit": commit}
            )
            # the binaries are static: the sources and objects (about 1 GB) are not needed any more
            shutil.rmtree(work / "build", ignore_errors=True)
            shutil.rmtree(work / "src", ignore_errors=True)
    return bin_dir()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="do not build: exit 1 unless it is built already")
    args = p.parse_args(argv)
    if args.check:
        if not is_ready():
            print(
                f"llama-cpp-native: not built in {build_dir()}; run `make llama-cpp-native`", file=sys.stderr
            )
            return 1
        print(bin_dir())
        return 0
    try:
        print(ensure())
    except (BuildError, OSError, subprocess.CalledProcessError) as e:
        first, _, rest = str(e).partition("\n")
        print(f"llama-cpp-native: {first}", file=sys.stderr)
        if rest:
            print(rest, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
