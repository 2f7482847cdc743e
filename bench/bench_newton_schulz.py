"""Muon's Newton-Schulz iterations for one cpu-small optimizer step, in bf16 (torch.optim.Muon's dtype) and in
fp32 (optimizer.muon.ns_dtype: fp32): on a CPU without bf16 units the first is emulated (docs/cpu-kinds.md).

    python -m bench.bench_newton_schulz [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from enlace.config import load_config
from enlace.train.optim import is_hidden_matrix, orthogonalize
from enlace.train.trainer import init_model


def block_matrices(model_layer: str) -> list[torch.Tensor]:
    """The matrices Muon orthogonalises, in the model layer's shapes (random: the cost depends on shape only)."""
    cfg = load_config(select={"model": model_layer})
    model = init_model(cfg, torch.device("cpu"))
    types = {n: type(m) for n, m in model.named_modules()}
    return [torch.randn_like(p) for n, p in model.named_parameters() if is_hidden_matrix(n, p, types)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mats = block_matrices("cpu-small")
    group = {"ns_coefficients": (3.4445, -4.7750, 2.0315), "eps": 1e-7, "ns_steps": 5}
    times: dict[torch.dtype, list[float]] = {torch.bfloat16: [], torch.float32: []}
    for _ in range(args.rounds):
        for dtype, seen in times.items():
            start = time.perf_counter()
            for m in mats:
                orthogonalize(m, group, dtype)
            seen.append(time.perf_counter() - start)
    shapes = sorted({tuple(m.shape) for m in mats})
    print(f"{len(mats)} matrices {shapes}, 5 iterations, {args.threads} threads, median of {args.rounds}:")
    for dtype, seen in times.items():
        print(f"  {str(dtype).removeprefix('torch.'):>8}: {statistics.median(seen):.4f} s per optimizer step")


if __name__ == "__main__":
    main()
