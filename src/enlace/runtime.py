"""The runtime side of a hardware profile (enlace.config.hardware): the device check, threads and
determinism switches, the CPU allocator's settings, autocast and the attention backend."""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .config.hardware import CPU_KINDS, HardwareConfig
from .config.resolve import Config
from .errors import HardwareError

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class DeviceInfo:
    device: str
    name: str
    compute_capability: tuple[int, int] | None
    memory_gib: float | None
    torch: str
    cuda: str | None

    def to_dict(self) -> dict:
        return asdict(self)


# CPU instruction-set flags (as /proc/cpuinfo spells them) that give bf16 matmuls native kernels: AVX-512
# BF16 dot products (Cooper Lake, Zen 4 and newer) or AMX tiles (Sapphire Rapids and newer). Without them
# PyTorch still runs bf16, emulated by converting to fp32: slower than plain fp32 and no more exact.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
CPUINFO = Path("/proc/cpuinfo")


@functools.cache
def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The instruction-set flags of the first CPU in /proc/cpuinfo (empty where there is none: not Linux)."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86 / arm64 spelling
            return frozenset(value.split())
    return frozenset()


def cpu_bf16_native(flags: frozenset[str] | None = None, capability: str | None = None) -> str | None:
    """The flag that makes bf16 native on this CPU, or None where bf16 would be emulated.

    oneDNN (PyTorch's CPU matmul library) also needs PyTorch to dispatch its AVX-512 kernels: a build or an
    ATEN_CPU_CAPABILITY capped at AVX2 runs bf16 the slow way whatever the CPU has. flags and capability
    default to this machine's (/proc/cpuinfo, torch.backends.cpu.get_cpu_capability()).
    """
    flags = cpu_flags() if flags is None else flags
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    found = next((f for f in BF16_CPU_FLAGS if f in flags), None)
    if found is None or not capability.startswith("AVX512"):
        return None
    return found


# oneDNN's bf16 kernels (the reorder and prepacked linear behind enlace.generate.PackedLinear) run only on
# x86 CPUs with one of these instruction sets and raise a RuntimeError elsewhere, whatever PyTorch dispatches.
# AVX2-only CPUs (most laptops, many cloud EPYCs) have neither.
ONEDNN_BF16_ISAS = (("avx512bw", "avx512vl", "avx512dq"), ("avx_ne_convert",))


def onednn_bf16_missing(flags: frozenset[str] | None = None) -> str | None:
    """Why oneDNN's bf16 kernels cannot run here, as a clause for a one-line error; None where they can.

    Default: oneDNN's own answer for this machine, which also sees ONEDNN_MAX_CPU_ISA. Given flags (a CPU's
    /proc/cpuinfo flags), the answer for that CPU; only x86 CPUs (flags with sse2) are judged from flags.
    """
    need = " or ".join(", ".join(isa) for isa in ONEDNN_BF16_ISAS)
    if flags is None:
        if not torch.backends.mkldnn.is_available() or torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return None
        flags = cpu_flags()
        if any(all(f in flags for f in isa) for isa in ONEDNN_BF16_ISAS):
            cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "the build")
            return f"oneDNN's bf16 kernels need {need}, which ONEDNN_MAX_CPU_ISA={cap} turns off"
        return f"oneDNN's bf16 kernels need {need}, which this CPU lacks (/proc/cpuinfo)"
    if "sse2" not in flags or any(all(f in flags for f in isa) for isa in ONEDNN_BF16_ISAS):
        return None
    return f"oneDNN's bf16 kernels need {need}, which this CPU lacks (/proc/cpuinfo)"


_CXX = os.environ.get("CXX", "g++")  # what torch.compile's CPU backend (inductor) calls


def cpp_compiler() -> str | None:
    """The C++ compiler torch.compile would build CPU kernels with, or None where there is none."""
    return shutil.which(_CXX)


# What else decides the bits of a step on a CPU beyond its kind: the same config and code gave different first
# losses on 2 cores of an AMD Zen 4 (avx512_bf16) and of an Intel Xeon with AMX (amx_bf16), both the bf16 kind
# (oneDNN picks other kernels, which sum in another order), and a matmul differs with 1 and 2 threads.
NUMERICS_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16")


def cpu_vendor(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's vendor as /proc/cpuinfo gives it (GenuineIntel, AuthenticAMD), or the machine's architecture."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return value.strip()
    return platform.machine() or "unknown"


def numerics(device: torch.device | str, flags: frozenset[str] | None = None) -> str:
    """What, besides the config and ENLACE's code, decides a step's bits on this device: PyTorch's version
    and, on a CPU, its vendor, the instruction sets PyTorch's kernels choose from and the thread count (call
    it after setup_runtime); on a GPU, its name and compute capability. Part of every run's identity, so a
    run resumes bit for bit or not at all."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"torch {torch.__version__}; {torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    if device.type != "cpu":
        return f"torch {torch.__version__}; {device.type}"
    flags = cpu_flags() if flags is None else flags
    isa = " ".join(f for f in NUMERICS_CPU_FLAGS if f in flags) or "no listed flags"
    capability = torch.backends.cpu.get_cpu_capability()
    return (
        f"torch {torch.__version__}; {cpu_vendor()} ({isa}; PyTorch {capability}); "
        f"{torch.get_num_threads()} threads"
    )


def resolve_cpu_dtype(flags: frozenset[str] | None = None, capability: str | None = None) -> str:
    """The precision `dtype: auto` means on a CPU, which names its kind: bf16 where it is native, else the
    fp32 reference."""
    return "bf16" if cpu_bf16_native(flags, capability) else "fp32"


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name as /proc/cpuinfo gives it (the machine's architecture where it does not)."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return platform.machine() or "unknown CPU"


def resolve_hardware(
    hw: HardwareConfig, flags: frozenset[str] | None = None, capability: str | None = None
) -> HardwareConfig:
    """The profile as it runs on this CPU: `dtype: auto` and `compile: auto` decided (flags and capability
    default to this machine's); a profile without them is returned as it is."""
    if hw.dtype != "auto" and hw.compile != "auto":
        return hw
    kind = resolve_cpu_dtype(flags, capability) if hw.dtype == "auto" else hw.dtype
    compile_ = hw.compile
    if compile_ == "auto":  # kinds are declared (the profile's validation says so)
        compile_ = hw.kinds[kind].compile if hw.kinds and kind in hw.kinds else False
    return hw.model_copy(update={"dtype": kind, "compile": compile_})


@dataclass(frozen=True)
class ResolvedRun:
    """A config as it runs on this machine: what enlace.config.kinds.apply_kind made of it for the CPU's kind."""

    cfg: Config
    kind: (
        str | None
    )  # the CPU kind a `dtype: auto` profile resolved to; None for a profile that names its dtype
    recipe: dict[str, Any]  # the model/train values the kind's recipe set
    cpu: str = ""  # the CPU that decided: model, kind-deciding flags, what PyTorch dispatches

    def line(self) -> str:
        """What the run prints when it starts (and what its metrics.json records)."""
        hw = self.cfg.hardware
        how = f"{hw.dtype}, {'compiled' if hw.compile else 'eager'}"
        if self.kind is None:
            return f"hardware: {hw.name} ({hw.device}): {how}"
        layer = next((x for x in ("train", "finetune") if x in self.cfg.layers), None)
        named = f"{layer} {self.cfg.layers[layer].name}" if layer else ""
        if not self.recipe:
            recipe = f"; {named} as configured" if named else ""
        else:
            recipe = f"; the {self.kind} kind's recipe for {named}: " + ", ".join(
                f"{k}={v}" for k, v in self.recipe.items()
            )
        return f"hardware: {hw.name} on {self.cpu}: the {self.kind} CPU kind: {how}{recipe}"


def resolve_run(
    cfg: Config, flags: frozenset[str] | None = None, capability: str | None = None
) -> ResolvedRun:
    """Decide, once at the start of a run, what a `dtype: auto` profile means on this CPU: the dtype, whether
    to compile and the recipe of its kind (flags and capability default to this machine's). Resolving a
    resolved config changes nothing."""
    from .config.kinds import RECIPE_MARK, applied_recipe, apply_kind

    hw = cfg.layers.get("hardware")
    if hw is None:
        return ResolvedRun(cfg, None, {})
    if hw.dtype != "auto":
        if hw.compile == "auto":  # a dtype set by hand: its kind's compile only
            return ResolvedRun(apply_kind(cfg, hw.dtype) if hw.dtype in CPU_KINDS else cfg, None, {})
        if RECIPE_MARK not in cfg.provenance.get("hardware.dtype", ""):
            return ResolvedRun(cfg, None, applied_recipe(cfg))
    flags = cpu_flags() if flags is None else flags
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    isa = " ".join(f for f in ("avx2", "avx512f", *BF16_CPU_FLAGS) if f in flags) or "flags unknown"
    cpu = f"{cpu_model()} ({isa}; PyTorch {capability})"
    if hw.dtype != "auto":  # resolved before, by this function: its kind is its dtype
        return ResolvedRun(cfg, hw.dtype, applied_recipe(cfg), cpu)
    kind = resolve_cpu_dtype(flags, capability)
    out = apply_kind(cfg, kind)
    return ResolvedRun(out, kind, applied_recipe(out), cpu)


def _check_cpu(hw: HardwareConfig, source: str) -> None:
    if hw.compile and cpp_compiler() is None:
        raise HardwareError(
            f"{source}: hardware.compile: profile '{hw.name}' compiles the model, and torch.compile builds its "
            f"CPU kernels with a C++ compiler, but '{_CXX}' is not on PATH; install one (apt install g++) or "
            "use --set hardware.compile=false"
        )
    if hw.dtype == "bf16" and cpu_bf16_native() is None:
        cap = torch.backends.cpu.get_cpu_capability()
        has = [f for f in BF16_CPU_FLAGS if f in cpu_flags()]
        why = (
            f"the CPU has {has[0]} but PyTorch dispatches {cap} kernels"
            if has
            else f"this CPU has neither {' nor '.join(BF16_CPU_FLAGS)} in /proc/cpuinfo"
        )
        raise HardwareError(
            f"{source}: hardware.dtype: profile '{hw.name}' trains in bf16, which would be emulated here "
            f"({why}): slower than fp32; use --hardware cpu (fp32) or cpu-auto"
        )


def _sdpa_backend_available(backend: str, cc: tuple[int, int]) -> bool:
    # Flash and cuDNN attention kernels exist for sm_80 and newer only; memory-efficient from sm_50.
    if backend in ("flash", "cudnn"):
        return cc >= (8, 0)
    return True


def check_device(hw: HardwareConfig, source: str = "hardware profile") -> DeviceInfo:
    """Fail at once, with one line naming the profile, if the device cannot run it as configured."""
    hw = resolve_hardware(hw)
    if hw.device == "cpu":
        _check_cpu(hw, source)
        bf16 = cpu_bf16_native()
        name = f"cpu ({torch.backends.cpu.get_cpu_capability()}, bf16 {'native: ' + bf16 if bf16 else 'emulated'})"
        return DeviceInfo("cpu", name, None, None, torch.__version__, None)
    where = f"{source}: hardware.device"
    if not torch.cuda.is_available():
        built = torch.version.cuda or "CPU only"
        raise HardwareError(
            f"{where}: profile '{hw.name}' needs a CUDA GPU, but none is available "
            f"(torch {torch.__version__}, built for {built}); use --hardware cpu or run on the GPU machine"
        )
    props = torch.cuda.get_device_properties(0)
    cc = (props.major, props.minor)
    mem = props.total_memory / 2**30
    if hw.min_compute_capability and cc < tuple(hw.min_compute_capability):
        raise HardwareError(
            f"{source}: hardware.min_compute_capability: profile '{hw.name}' needs sm_{''.join(map(str, hw.min_compute_capability))}"
            f" or newer, found {props.name} (sm_{cc[0]}{cc[1]})"
        )
    # Decide bf16 by compute capability: torch.cuda.is_bf16_supported() is True on Turing (emulated).
    if hw.dtype == "bf16" and cc < (8, 0):
        raise HardwareError(
            f"{source}: hardware.dtype: bf16 needs sm_80 or newer, {props.name} is sm_{cc[0]}{cc[1]}; use fp16"
        )
    if hw.sdpa_backend != "auto" and not _sdpa_backend_available(hw.sdpa_backend, cc):
        raise HardwareError(
            f"{source}: hardware.sdpa_backend: '{hw.sdpa_backend}' attention has no kernel for sm_{cc[0]}{cc[1]}; use 'efficient'"
        )
    if mem < 0.9 * hw.memory_gib:
        raise HardwareError(
            f"{source}: hardware.memory_gib: profile plans for {hw.memory_gib} GiB, {props.name} has {mem:.1f} GiB"
        )
    return DeviceInfo("cuda", props.name, cc, round(mem, 2), torch.__version__, torch.version.cuda)


_OMP_PAUSE_SOFT = 1  # omp_pause_soft (omp.h, OpenMP 5.0)


def release_openmp_team() -> bool:
    """Hand back the OpenMP worker threads this thread's parallel regions started. True if it applied.

    libgomp keeps one team per thread that ever ran a parallel region. A server loads its model on the main
    thread, then decodes on a compute thread that starts a team of its own; once libgomp manages more
    threads than there are cores it makes every worker sleep soon after each region, and each of the ~150
    regions of a decode step then waits for a wake-up. On 2 AVX2 EPYC cores a SmolLM2 int8 step took
    8.6-10.6 ms on a second thread against 6.9-8.5 on the main one (alternating, in one process); after
    this call on the main thread, 7.4-7.5 against 7.2-8.2. The team is started again if this thread runs a
    parallel region later. A no-op where torch does not use libgomp."""
    import ctypes

    try:
        paths = {
            line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line
        }
    except OSError:
        return False
    paused = False
    for path in sorted(paths):  # torch's own copy, and the system's if something else loaded it too
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        paused = pause(_OMP_PAUSE_SOFT) == 0 or paused
    return paused


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of returning it to the kernel. True if it applied.

    A CPU training step frees and reallocates the same large tensors every step (activations, logits
    chunks, gradients). By default glibc serves each big block with a fresh mmap and unmaps it on free,
    so every step page-faults all of them in again and the kernel zeroes every page: on the 2-vCPU
    machines of this project that cost more than the arithmetic of the memory-bound ops (converting a
    64 MiB buffer took 71 ms instead of 7). With mmap off and trimming at 1 GiB, the heap keeps its
    peak size and the step reuses it. Numerics are untouched. A no-op where the C library is not glibc.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def release_freed_memory() -> bool:
    """Give the memory glibc holds free back to the kernel (malloc_trim). True if it applied.

    With keep_freed_memory on, what a model's load frees (the separate q, k and v weights once fused, fp32
    weights once quantised) would stay in the process's resident memory for its whole life. A no-op where
    the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    return bool(trim(0))


_MADV_DONTNEED = 4
_PAGE = 4096


def _file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process's memory mapped from files (/proc/self/maps; [heap], [stack] and
    anonymous memory excluded)."""
    ranges = []
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/") and parts[4] != "0":  # a path and an inode
            start, end = (int(a, 16) for a in parts[0].split("-"))
            ranges.append((start, end))
    return ranges


def drop_mapped_pages(tensors: list[torch.Tensor]) -> int:
    """Give back the resident pages of tensors read from a memory-mapped file and no longer needed; the
    bytes dropped.

    A safetensors weight is a view of the file's mapping, and its pages, once read (to quantise it, say),
    count in the process's memory for as long as any tensor of the file keeps the mapping. Only whole pages
    inside a tensor's own bytes and inside a file mapping are dropped (madvise DONTNEED: the kernel re-reads
    them from the file if they are ever touched again); anonymous memory is never touched.
    """
    import ctypes
    import ctypes.util

    try:
        madvise = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").madvise
    except (OSError, AttributeError):
        return 0
    mappings, dropped = _file_mappings(), 0
    for t in tensors:
        begin = t.data_ptr()
        end = begin + t.numel() * t.element_size()
        if not t.is_contiguous() or not any(lo <= begin and end <= hi for lo, hi in mappings):
            continue
        first, last = -(-begin // _PAGE) * _PAGE, end // _PAGE * _PAGE
        if (
            last > first
            and madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED) == 0
        ):
            dropped += last - first
    return dropped


def setup_runtime(hw: HardwareConfig) -> torch.device:
    """Threads, determinism switches and the CPU allocator; returns the torch device to use."""
    if hw.device == "cpu":
        keep_freed_memory()
    if hw.num_threads:
        torch.set_num_threads(hw.num_threads)
    if hw.deterministic:
        # Required by cuBLAS for deterministic matmuls; harmless on CPU.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # warn_only=False: an op without a deterministic kernel must stop a run that promises bit-exact
        # reruns. With warn_only=True, flash and memory-efficient attention keep their non-deterministic
        # backward and only warn once; with False they switch to their deterministic one.
        torch.use_deterministic_algorithms(True)
    if hw.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def autocast(hw: HardwareConfig):
    """Mixed precision lives here, not in the model: fp32 runs without autocast."""
    hw = resolve_hardware(hw)
    if hw.dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=hw.device, dtype=DTYPES[hw.dtype])


def sdpa_backend(hw: HardwareConfig):
    """Pin scaled_dot_product_attention to the profile's backend ("auto": PyTorch chooses)."""
    if hw.sdpa_backend == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {
        "math": SDPBackend.MATH,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }[hw.sdpa_backend]
    return sdpa_kernel([backend])
