"""`make bench`: every benchmark, each in its own process, then the ratio lines together.

Each benchmark runs ENLACE and the peer a user would pick instead, alternating, on the same data and shapes,
and ends with its ratio line; results also go to bench/results/<name>.json.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

BENCHMARKS = [
    "bench_shard",
    "bench_checkpoint",
    "bench_overhead",
    "bench_generate",
    "bench_lora",
    "bench_pretrain",
]


def main() -> int:
    only = sys.argv[1:] or BENCHMARKS
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ENLACE_NO_PROGRESS": "1"}
    finals: list[str] = []
    failed = []
    for name in only:
        print(f"\n=== {name}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", f"bench.{name}"], env=env, stdout=subprocess.PIPE, text=True
        )
        out = proc.stdout.rstrip()
        print(out, flush=True)
        lines = out.splitlines()
        finals.append(f"{name} ({time.perf_counter() - t0:.0f} s): {lines[-1] if lines else 'no output'}")
        if proc.returncode:
            failed.append(name)
    print("\n=== summary")
    print("\n".join(finals))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
