"""`make bench`: every benchmark, each in its own process, then one table of every goal.

Each benchmark runs ENLACE and the peer a user would pick instead, alternating, on the same data and shapes,
and writes bench/results/<name>.json with its rows: the figure, its goal, and who in which precision is on
each side. The table at the end gathers the rows of this run; bench/results/summary.json keeps them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from bench.common import RESULTS, cpu_description, format_table, machine

# benchmark module -> its bench/results/<name>.json
BENCHMARKS = {
    "bench_shard": "shard",
    "bench_checkpoint": "checkpoint",
    "bench_overhead": "overhead",
    "bench_generate": "generate",
    "bench_serve": "serve",
    "bench_llamacpp_serve": "llamacpp_serve",
    "bench_llamacpp_quality": "llamacpp_quality",
    "bench_lora": "lora",
    "bench_attention": "attention",
    "bench_pretrain": "pretrain",
    "bench_quality": "quality",
    "bench_lora_quality": "lora_quality",
}


def table_of_results() -> str:
    """The goal table from whatever bench/results/*.json hold (`python -m bench --table`)."""
    rows = []
    for name in BENCHMARKS.values():
        path = RESULTS / f"{name}.json"
        if path.exists():
            rows += json.loads(path.read_text()).get("rows", [])
    return format_table(rows)


def main() -> int:
    if sys.argv[1:] == ["--table"]:
        print(table_of_results())
        return 0
    only = sys.argv[1:] or list(BENCHMARKS)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ENLACE_NO_PROGRESS": "1"}
    # Every figure below is this CPU's, in the precision named beside it; by default the benchmarks run in
    # the precision the default run trains in here (bf16 where the CPU has it natively, else fp32).
    print(f"cpu: {cpu_description()}", flush=True)
    finals: list[str] = []
    failed = []
    rows: list[dict] = []
    for name in only:
        print(f"\n=== {name}", flush=True)
        t0, t0_wall = time.perf_counter(), time.time() - 1
        proc = subprocess.run(
            [sys.executable, "-m", f"bench.{name}"], env=env, stdout=subprocess.PIPE, text=True
        )
        out = proc.stdout.rstrip()
        print(out, flush=True)
        lines = out.splitlines()
        finals.append(f"{name} ({time.perf_counter() - t0:.0f} s): {lines[-1] if lines else 'no output'}")
        if proc.returncode:
            failed.append(name)
            continue
        result = RESULTS / f"{BENCHMARKS.get(name, name)}.json"
        if result.exists() and result.stat().st_mtime >= t0_wall:
            rows += json.loads(result.read_text()).get("rows", [])
    print("\n=== summary")
    print("\n".join(finals))
    print("\n=== goals (ratios are peer time / ours; shared machine, so interleaved medians of a noisy run)")
    print(f"cpu: {cpu_description()}")
    print(format_table(rows))
    (RESULTS / "summary.json").write_text(
        json.dumps({"machine": machine(), "rows": rows, "failed": failed}, indent=2) + "\n"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
