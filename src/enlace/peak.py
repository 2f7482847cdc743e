"""This machine's practical matmul throughput: the denominator of MFU (bench and `enlace ablate`).

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


# Shapes (m, k, n) for the matmul peak: squares and the skinny products a training step is made of.
PEAK_SHAPES = (
    (1024, 1024, 1024),
    (2048, 2048, 2048),
    (3072, 3072, 3072),
    (4096, 512, 1536),
    (2048, 1536, 512),
)
PEAK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def matmul_peak_gflops(precision: str = "fp32", repeats: int = 5) -> dict[str, Any]:
    """Practical matmul throughput on all threads for one precision: the reference for MFU.

    The best of several shapes and repeats, since one quick measurement on a shared machine comes out low
    and makes MFU exceed 100%. Call it again later in the same run and keep the maximum (`peak_update`).
    """
    dtype = PEAK_DTYPES[precision]
    best: dict[str, float] = {}
    for m, k, n in PEAK_SHAPES:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        torch.mm(a, b)  # warm-up: first calls pick kernels and allocate
        seconds = min(timed(lambda a=a, b=b: torch.mm(a, b)) for _ in range(repeats))
        best[f"{m}x{k}x{n}"] = 2 * m * k * n / seconds / 1e9
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
