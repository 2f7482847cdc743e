"""Shared benchmark machinery: alternating rounds, robust statistics, the machine's matmul peak, JSON out.

Benchmarks compare ENLACE with the tool a user would otherwise pick, back to back in the same process and
in alternating order, so that a noisy neighbour or thermal drift hits both sides alike.
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# The matmul peak (MFU's denominator) lives in the package: `enlace ablate` measures MFU too.
from enlace.peak import PEAK_DTYPES, PEAK_SHAPES, matmul_peak_gflops, peak_update, timed  # noqa: F401

RESULTS = Path(__file__).parent / "results"


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


def wait_until_serving(
    proc: subprocess.Popen, port: int, path: str, timeout_s: float, died: Callable[[], str]
) -> None:
    """Poll GET path on 127.0.0.1:port until it answers 200; died() says why when the server process exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise SystemExit(died())
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def summary(seconds: list[float]) -> dict[str, float]:
    return {
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "max_s": max(seconds),
        "n": len(seconds),
    }


def check_mfu(mfu: float, what: str, peak: dict[str, Any]) -> float:
    """MFU above 100% means the peak was measured too low: fail loudly instead of printing a wrong figure."""
    if not 0 < mfu <= 1:
        raise AssertionError(
            f"{what}: MFU {mfu:.1%} against a {peak['precision']} peak of {peak['gflops']:.0f} GFLOP/s is "
            "impossible; the peak measurement is wrong (a noisy neighbour during it?). Rerun the benchmark."
        )
    return mfu


# The instruction sets that decide a CPU's kind here (docs/cpu-kinds.md), as /proc/cpuinfo spells them.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_tag() -> str:
    """The CPU beside every figure: model, the ISA flags that decide its kind, what PyTorch dispatches."""
    from enlace.runtime import cpu_flags, cpu_model

    flags = cpu_flags()
    isa = " ".join(f if f in flags else f"no-{f}" for f in ISA_FLAGS)
    return f"{cpu_model()} [{isa}; torch {torch.backends.cpu.get_cpu_capability()}]"


def cpu_description() -> str:
    """cpu_tag and the precision the default run trains in here (cpu-auto), for a benchmark's first line."""
    return f"{cpu_tag()}, default run in {default_precision()}"


def default_precision() -> str:
    """BENCH_PRECISIONS' default: the precision the default run (cpu-auto) trains in on this CPU."""
    from enlace.runtime import resolve_cpu_dtype

    return resolve_cpu_dtype()


def default_compile() -> bool:
    """Whether the default run (cpu-auto) compiles on this CPU."""
    from enlace.config import load_config
    from enlace.runtime import resolve_hardware

    hw = load_config(Path(__file__).parents[1] / "params.yaml", layers=("hardware",)).hardware
    return bool(resolve_hardware(hw).compile)


def machine() -> dict[str, Any]:
    from enlace.runtime import cpu_flags, cpu_model, resolve_cpu_dtype

    return {
        "cpu": cpu_model(),
        "isa": {f: f in cpu_flags() for f in ISA_FLAGS},
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "default_dtype": resolve_cpu_dtype(),
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
    }


def line(name: str, ours: dict[str, float], peer: dict[str, float], peer_name: str, unit: str = "s") -> str:
    """One measured comparison; `name` carries the precision, the CPU is printed once per benchmark
    (bench/__main__.py) and recorded with every row and result."""
    ratio = peer["median_s"] / ours["median_s"]
    return (
        f"{name}: enlace {ours['median_s']:.3f}{unit} [{ours['min_s']:.3f}-{ours['max_s']:.3f}]  "
        f"{peer_name} {peer['median_s']:.3f}{unit} [{peer['min_s']:.3f}-{peer['max_s']:.3f}]  "
        f"ratio {ratio:.2f}x"
    )


def goal_row(
    what: str,
    ours: str,
    peer: str,
    value: float,
    op: str,
    goal: float,
    unit: str = "x",
    note: str = "",
) -> dict[str, Any]:
    """One line of `make bench`'s table: a figure, its goal, and who (in which precision) is on each side.

    ours/peer name the contender and its precision, e.g. "enlace bf16" vs "transformers eager bf16".
    value is a ratio peer time / our time (unit "x") or a percentage (unit "%"); op is ">=" or "<=".
    """
    ok = value >= goal if op == ">=" else value <= goal
    return {"what": what, "ours": ours, "peer": peer, "value": value, "op": op, "goal": goal, "unit": unit,
            "ok": ok, "note": note, "cpu": cpu_tag()}  # fmt: skip


def fmt_value(value: float, unit: str) -> str:
    return f"{value:.2f}x" if unit == "x" else f"{value:.2f}%" if unit == "%" else f"{value:.3g}{unit}"


def format_row(r: dict[str, Any]) -> str:
    goal = f"{r['op']} {fmt_value(r['goal'], r['unit'])}"
    mark = "ok" if r["ok"] else "MISSED"
    cpu = f" on {r['cpu']}" if r.get("cpu") else ""  # rows written before the CPU was recorded have none
    return f"{r['what']}: {r['ours']} vs {r['peer']}: {fmt_value(r['value'], r['unit'])} (goal {goal}) {mark}{cpu}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as an aligned text table."""
    head = ("figure", "ours", "peer", "value", "goal", "")
    body = [
        (r["what"], r["ours"], r["peer"], fmt_value(r["value"], r["unit"]),
         f"{r['op']} {fmt_value(r['goal'], r['unit'])}", "ok" if r["ok"] else "MISSED")
        for r in rows
    ]  # fmt: skip
    widths = [max(len(str(row[i])) for row in [head, *body]) for i in range(len(head))]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [head, *body]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = [f"  {r['what']}: {r['note']}" for r in rows if r.get("note")]
    return "\n".join(lines + (["notes:", *notes] if notes else []))


def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"benchmark": name, "machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return path
