"""Causal attention on CPU, forward and backward: the model's matmul_attention vs PyTorch's SDPA.

SDPA (`F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)`) is what a user of PyTorch
would call, and on CPU it picks the flash kernel. The process keeps freed memory as the trainer does. Both sides take the same q, k, v (B, H, T, D and
B, KV, T, D) and the same output gradient, eager and (where the default run compiles) under torch.compile, in
alternating rounds, in the default run's precision on this CPU (bf16 or fp32; BENCH_PRECISIONS,
BENCH_COMPILE choose). The shapes
are the layers of the default run (cpu-small), tiny-50m at seq 512, SmolLM2-135M's at the fine-tune's seq 128,
and tiny-50m's full window of 2048, where the model keeps SDPA: the row there shows why the model switches
at enlace.model.CPU_MATMUL_ATTENTION_MAX_LEN (goal: at least 1.0x up to that length, none beyond it).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

from bench.common import alternate, default_compile, default_precision, goal_row, line, summary, write_result
from enlace.model import CPU_MATMUL_ATTENTION_MAX_LEN, matmul_attention
from enlace.runtime import keep_freed_memory

# The default run's precision and compile on this CPU (BENCH_PRECISIONS / BENCH_COMPILE choose).
PRECISION = os.environ.get("BENCH_PRECISIONS", default_precision()).split(",")[0]
DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}[PRECISION]
COMPILE = os.environ.get("BENCH_COMPILE", "1" if default_compile() else "0") != "0"

SHAPES = [
    # (what, batch, heads, KV heads, seq, head_dim)
    ("cpu-small layer", 16, 4, 2, 256, 64),
    ("tiny-50m layer", 4, 8, 2, 512, 64),
    ("SmolLM2-135M layer", 4, 9, 3, 128, 64),
    ("tiny-50m layer, full window", 1, 8, 2, 2048, 64),
]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return matmul_attention(q, k, v, 0.0)


def forward_backward(fn, q, k, v, grad):
    def step():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(grad)

    return step


def bench_shape(what: str, b: int, h: int, kv: int, t: int, d: int, rounds: int) -> dict:
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, n, t, d, dtype=DTYPE, requires_grad=True) for n in (h, kv, kv))
    grad = torch.randn(b, h, t, d, dtype=DTYPE)
    contenders = {
        "enlace": forward_backward(ours, q, k, v, grad),
        "sdpa": forward_backward(sdpa, q, k, v, grad),
    }
    if COMPILE:
        contenders["enlace-compiled"] = forward_backward(torch.compile(ours), q, k, v, grad)
        contenders["sdpa-compiled"] = forward_backward(torch.compile(sdpa), q, k, v, grad)
    stats = {name: summary(s) for name, s in alternate(contenders, rounds=rounds, warmup=2).items()}
    label = f"attention fwd+bwd {what} (B{b} H{h} KV{kv} T{t} D{d}) {PRECISION}"
    print(line(f"{label} [eager]", stats["enlace"], stats["sdpa"], "sdpa"), flush=True)
    if COMPILE:
        print(
            line(f"{label} [compiled]", stats["enlace-compiled"], stats["sdpa-compiled"], "sdpa-compiled"),
            flush=True,
        )
    return {"what": what, "shape": {"B": b, "H": h, "KV": kv, "T": t, "D": d}, "stats": stats}


def main() -> int:
    rounds = int(os.environ.get("BENCH_ROUNDS", 10))
    # As setup_runtime does for a CPU run: the T x T scores would otherwise be freshly mapped (and
    # page-faulted) on every call. It applies to the whole process, so SDPA gets it too.
    keep_freed_memory()
    results = [bench_shape(*shape, rounds=rounds) for shape in SHAPES]
    rows = []
    for r in results:
        st, t = r["stats"], r["shape"]["T"]
        used = t <= CPU_MATMUL_ATTENTION_MAX_LEN  # what the model runs at this length
        for mode, peer in (("eager", "sdpa"), ("compiled", "sdpa-compiled"))[: 2 if COMPILE else 1]:
            ours_key = "enlace" if mode == "eager" else "enlace-compiled"
            ratio = st[peer]["median_s"] / st[ours_key]["median_s"]
            what = f"attention fwd+bwd, {r['what']}, T {t}"
            if used:
                rows.append(goal_row(what, f"enlace matmul {mode} {PRECISION}", f"torch sdpa (flash) {mode} {PRECISION}", ratio,
                                     ">=", 1.0))  # fmt: skip
            else:
                print(f"  {what} [{mode}]: {ratio:.2f}x (the model keeps SDPA beyond "
                      f"{CPU_MATMUL_ATTENTION_MAX_LEN} tokens)", flush=True)  # fmt: skip
    write_result("attention", {"rounds": rounds, "results": results, "rows": rows,
                               "matmul_max_len": CPU_MATMUL_ATTENTION_MAX_LEN})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
