"""This machine's practical matmul throughput and MFU: the one peak measurement (bench, `enlace ablate`,
gpu-check) and the one MFU function.

MFU = a step's FLOPs (estimate.train_flops_per_token, the project's one formula) per second over this peak.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# Shapes (m, k, n) for the CPU matmul peak: squares and the skinny products a training step is made of.
PEAK_SHAPES = (
    (1024, 1024, 1024),
    (2048, 2048, 2048),
    (3072, 3072, 3072),
    (4096, 512, 1536),
    (2048, 1536, 512),
)
# On a GPU one large square: smaller products do not fill it. Timed over CUDA_ITERS back-to-back products,
# since one launch is too short to time against the host clock.
CUDA_PEAK_SHAPES = ((8192, 8192, 8192),)
CUDA_ITERS = 20
PEAK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU): what timing a GPU needs."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak_gflops(
    precision: str = "fp32", repeats: int = 5, device: torch.device | None = None
) -> dict[str, Any]:
    """Practical matmul throughput on all threads (or the GPU) for one precision: the reference for MFU.

    The best of several shapes and repeats, since one quick measurement on a shared machine comes out low
    and makes MFU exceed 100%. Call it again later in the same run and keep the maximum (`peak_update`).
    """
    device = device or torch.device("cpu")
    dtype = PEAK_DTYPES[precision]
    cuda = device.type == "cuda"
    shapes, iters = (CUDA_PEAK_SHAPES, CUDA_ITERS) if cuda else (PEAK_SHAPES, 1)
    best: dict[str, float] = {}
    for m, k, n in shapes:
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        for _ in range(3 if cuda else 1):  # warm-up: first calls pick kernels and allocate
            torch.mm(a, b)
        sync(device)

        def run(a: torch.Tensor = a, b: torch.Tensor = b) -> None:
            for _ in range(iters):
                torch.mm(a, b)
            sync(device)

        seconds = min(timed(run) for _ in range(repeats))
        best[f"{m}x{k}x{n}"] = 2 * m * k * n * iters / seconds / 1e9
    return {"precision": precision, "gflops": max(best.values()), "by_shape": best, "repeats": repeats}


def peak_update(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The higher of two peak measurements of the same precision, keeping every shape's best."""
    by_shape = {k: max(old["by_shape"].get(k, 0.0), v) for k, v in new["by_shape"].items()}
    return {
        **old,
        "gflops": max(by_shape.values()),
        "by_shape": by_shape,
        "measurements": old.get("measurements", 1) + 1,
    }


def mfu(tokens_per_s: float, flops_per_token: float, peak_gflops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s (tokens/s x estimate.train_flops_per_token) over the
    measured peak (matmul_peak_gflops's "gflops")."""
    return tokens_per_s * flops_per_token / (peak_gflops * 1e9)
