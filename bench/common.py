"""Shared benchmark machinery: alternating rounds, robust statistics, the machine's matmul peak, JSON out.

Benchmarks compare ENLACE with the tool a user would otherwise pick, back to back in the same process and
in alternating order, so that a noisy neighbour or thermal drift hits both sides alike.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def alternate(
    contenders: dict[str, Callable[[], Any]], rounds: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Run each contender `warmup` times, then `rounds` times in alternating order; seconds per call."""
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(timed(contenders[name]))
    return times


def summary(seconds: list[float]) -> dict[str, float]:
    return {
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "max_s": max(seconds),
        "n": len(seconds),
    }


def matmul_peak_gflops(n: int = 2048, repeats: int = 6) -> float:
    """Practical fp32 matmul throughput on all threads: the reference for model FLOPs utilisation."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = min(timed(lambda: torch.mm(a, b)) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def machine() -> dict[str, Any]:
    return {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
    }


def line(name: str, ours: dict[str, float], peer: dict[str, float], peer_name: str, unit: str = "s") -> str:
    ratio = peer["median_s"] / ours["median_s"]
    return (
        f"{name}: enlace {ours['median_s']:.3f}{unit} [{ours['min_s']:.3f}-{ours['max_s']:.3f}]  "
        f"{peer_name} {peer['median_s']:.3f}{unit} [{peer['min_s']:.3f}-{peer['max_s']:.3f}]  "
        f"ratio {ratio:.2f}x"
    )


def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"benchmark": name, "machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return path
