"""llama.cpp for the tests and benchmarks: llama-cpp-python built once from its pinned PyPI source package.

    python scripts/llama_cpp_build.py           build if needed, then print the venv's python (the last line)
    python scripts/llama_cpp_build.py --check   print it if built, else exit 1 saying how to build it

The build goes to a cache outside the repository, shared by every clone on the machine:

    ${XDG_CACHE_HOME:-~/.cache}/enlace/llama-cpp/
      src/llama_cpp_python-<version>.tar.gz   the source package (sha256 checked before it is built)
      <version>-<sha12>/build.log             the last build's output
      <version>-<sha12>/wheels/<wheel>        the built wheel; wheels/build.json records the cmake flags
      <version>-<sha12>/venv/                 llama-cpp-python and its [server] extra, nothing else;
                                              venv/enlace-ready.json is written last, when it is complete

A second call finds the stamps and returns in well under a second. A changed pin (version, hash), changed
cmake flags or changed requirements-llama-cpp.txt rebuilds what they affect. The project's own venv is never
touched: callers run the printed python in a subprocess.

Portable flags: GGML_NATIVE=OFF with AVX2, FMA and F16C named explicitly, so the binaries run on every x86-64
CPU of the project's machines (AVX2 without AVX-512 included), not only the one that built them. The build is
checked for it: no AVX-512 (zmm) instruction may appear in ggml's CPU library.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VERSION = "0.3.36"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
CMAKE_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_OPENMP=ON"
ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "requirements-llama-cpp.txt"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
READY = "enlace-ready.json"


class BuildError(Exception):
    """llama.cpp could not be fetched, built or installed."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "enlace" / "llama-cpp"


def build_dir() -> Path:
    return cache_root() / f"{VERSION}-{SHA256[:12]}"


def venv_python() -> Path:
    return build_dir() / "venv" / "bin" / "python"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: Path, obj: dict) -> None:
    """Whole or not at all: a stamp is what says a step finished."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def wanted_venv() -> dict:
    """What a ready venv must have been built from; any difference rebuilds it."""
    return {
        "version": VERSION,
        "sdist_sha256": SHA256,
        "cmake_args": CMAKE_ARGS,
        "requirements_sha256": sha256_of(REQUIREMENTS),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def is_ready() -> bool:
    stamp = read_json(build_dir() / "venv" / READY)
    if stamp is None or not venv_python().exists():
        return False
    return {k: stamp.get(k) for k in wanted_venv()} == wanted_venv()


def log(msg: str) -> None:
    print(f"llama-cpp: {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], logfile: Path | None = None, env: dict | None = None) -> None:
    if logfile is None:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode:
            raise BuildError(f"{' '.join(cmd[:6])} ... failed:\n{proc.stdout[-3000:]}")
        return
    with open(logfile, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        tail = logfile.read_text(errors="replace")[-3000:]
        raise BuildError(f"{' '.join(cmd[:6])} ... failed (full log: {logfile}):\n{tail}")


def fetch_sdist() -> Path:
    """The pinned source package from PyPI (pip, so the user's index settings apply), hash-checked."""
    dest = cache_root() / "src" / SDIST
    if dest.exists() and sha256_of(dest) == SHA256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        req = Path(tmp) / "req.txt"
        req.write_text(f"llama-cpp-python=={VERSION} --hash=sha256:{SHA256}\n")
        log(f"downloading llama-cpp-python {VERSION} (source package) from PyPI")
        run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps",
             "--no-binary", "llama-cpp-python", "--require-hashes", "-r", str(req), "-d", tmp])  # fmt: skip
        got = Path(tmp) / SDIST
        if not got.exists() or sha256_of(got) != SHA256:
            raise BuildError(f"PyPI's {SDIST} does not have the pinned sha256 {SHA256}")
        os.replace(got, dest)
    return dest


def ensure_wheel(work: Path) -> Path:
    """The wheel built with CMAKE_ARGS: reused when wheels/build.json records the same flags."""
    wheels = work / "wheels"
    stamp = read_json(wheels / "build.json")
    if stamp and stamp.get("cmake_args") == CMAKE_ARGS and (wheels / stamp.get("wheel", "?")).exists():
        return wheels / stamp["wheel"]
    sdist = fetch_sdist()
    logfile = work / "build.log"
    logfile.write_text(f"CMAKE_ARGS={CMAKE_ARGS}\n")
    log(f"building llama-cpp-python {VERSION} from source (about 5-10 min on 2 idle cores; log: {logfile})")
    t0 = time.monotonic()
    env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS, "FORCE_CMAKE": "1"}
    out = Path(tempfile.mkdtemp(dir=work, prefix=".wheels-"))
    try:
        run(["nice", "-n", "10", sys.executable, "-m", "pip", "wheel", "-v", "--disable-pip-version-check",
             "--no-deps", str(sdist), "-w", str(out)], logfile, env)  # fmt: skip
        built = list(out.glob("llama_cpp_python-*.whl"))
        if len(built) != 1:
            raise BuildError(f"pip wheel left {[p.name for p in built]} in {out}, expected one wheel")
        if wheels.exists():
            shutil.rmtree(wheels)
        out.chmod(0o755)  # mkdtemp's 0700 would hide the shared cache from other users
        os.replace(out, wheels)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    wheel = wheels / built[0].name
    write_json(wheels / "build.json", {"cmake_args": CMAKE_ARGS, "wheel": wheel.name,
                                       "wheel_sha256": sha256_of(wheel), "seconds": round(time.monotonic() - t0)})  # fmt: skip
    log(f"built {wheel.name} in {time.monotonic() - t0:.0f} s")
    return wheel


def check_portable(venv: Path) -> None:
    """No AVX-512 in ggml's CPU kernels: they must run on the AVX2-only machines too."""
    if shutil.which("objdump") is None:
        log("objdump not found (binutils); the no-AVX-512 check of the build is skipped")
        return
    libs = sorted(venv.glob("lib/python*/site-packages/llama_cpp/lib/libggml-cpu.so"))
    if not libs:
        raise BuildError(f"{venv}: llama_cpp/lib/libggml-cpu.so not found in the installed package")
    asm = subprocess.run(["objdump", "-d", str(libs[0])], capture_output=True, text=True, check=True).stdout
    if "zmm" in asm:
        raise BuildError(
            f"{libs[0]} uses AVX-512 registers (zmm): not portable to AVX2-only CPUs; check CMAKE_ARGS"
        )


def ensure_venv(work: Path, wheel: Path) -> Path:
    venv = work / "venv"
    if venv.exists():
        shutil.rmtree(venv)  # incomplete or stale: its stamp did not match
    log(f"installing {wheel.name} and its pinned dependencies into {venv}")
    run([sys.executable, "-m", "venv", str(venv)])
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"]
    run([*pip, "-r", str(REQUIREMENTS), str(wheel)])
    run([py, "-m", "pip", "check", "--disable-pip-version-check"])  # the pins are the whole closure
    run([py, "-c", "import llama_cpp, llama_cpp.server.app; llama_cpp.llama_backend_init()"])
    check_portable(venv)
    write_json(venv / READY, {**wanted_venv(), "wheel": wheel.name})
    return venv


def ensure() -> Path:
    if is_ready():
        return venv_python()
    work = build_dir()
    work.mkdir(parents=True, exist_ok=True)
    with open(cache_root() / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per machine; the others wait, then reuse its build
        if not is_ready():
            ensure_venv(work, ensure_wheel(work))
    return venv_python()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="do not build: exit 1 unless it is built already")
    args = p.parse_args(argv)
    if args.check:
        if not is_ready():
            print(f"llama-cpp: not built in {build_dir()}; run `make llama-cpp`", file=sys.stderr)
            return 1
        print(venv_python())
        return 0
    try:
        print(ensure())
    except (BuildError, OSError, subprocess.CalledProcessError) as e:
        print(f"llama-cpp: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
