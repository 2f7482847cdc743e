"""The ablation table: one row per variant (means over the seeds it ran), as markdown and JSON."""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

from ..io import atomic_write_text
from .spec import BASELINE


def rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    by: dict[str, list[dict[str, Any]]] = {}
    for r in result["runs"]:
        by.setdefault(r["variant"], []).append(r)

    def mean(runs: list[dict[str, Any]], key: str) -> float | None:
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.fmean(values) if values else None

    base = {k: mean(by[BASELINE], k) for k in ("prose_bpb", "val_bpb")}
    out = []
    for variant, runs in by.items():
        row = {
            "variant": variant,
            "seeds": [r["seed"] for r in runs],
            "steps": round(mean(runs, "steps")),
            "tokens": round(mean(runs, "tokens")),
            "prose_bpb": mean(runs, "prose_bpb"),
            "val_bpb": mean(runs, "val_bpb"),
            "pairs_acc": mean(runs, "pairs_acc"),
            "continuations_acc": mean(runs, "continuations_acc"),
            "mfu": mean(runs, "mfu"),
            "stopped_at_budget": any(r["stopped_at_budget"] for r in runs),
        }
        for k in ("prose_bpb", "val_bpb"):  # relative change against the baseline: negative is better
            row[f"{k}_change"] = None if variant == BASELINE else row[k] / base[k] - 1
        out.append(row)
    return out


def _pct(v: float | None) -> str:
    return "" if v is None else f"{v:+.2%}"


def _acc(v: float | None) -> str:
    return "" if v is None else f"{v:.3f}"


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"`{result['command']}`: each variant trained for {result['budget_s']:.0f} s of wall time on "
        f"{m['cpu']} ({m['isa']}, {m['dtype']}, threads: {m['threads']}, torch {m['torch']}; load average "
        f"{m['load_average_1min']} at the start, {m['load_average_1min_end']} at the end).",
        "",
        "| variant | seeds | steps | tokens | prose bits/byte | change | val bits/byte | change "
        "| minimal pairs | continuations | MFU |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows(result):
        mfu = "" if r["mfu"] is None else f"{r['mfu']:.1%}"
        note = " (stopped at the budget)" if r["stopped_at_budget"] else ""
        lines.append(
            f"| {r['variant']}{note} | {', '.join(map(str, r['seeds']))} | {r['steps']} | {r['tokens']:,} | "
            f"{r['prose_bpb']:.4f} | {_pct(r['prose_bpb_change'])} | {r['val_bpb']:.4f} | "
            f"{_pct(r['val_bpb_change'])} | {_acc(r['pairs_acc'])} | {_acc(r['continuations_acc'])} | {mfu} |"
        )
    return "\n".join(lines) + "\n"


def write_into(page: Path, name: str, text: str) -> None:
    """Replace (or append) the block between `<!-- ablation:NAME -->` and `<!-- /ablation:NAME -->`."""
    start, end = f"<!-- ablation:{name} -->", f"<!-- /ablation:{name} -->"
    block = f"{start}\n{text.rstrip()}\n{end}"
    old = page.read_text(encoding="utf-8") if page.exists() else ""
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    new = pattern.sub(lambda _: block, old) if pattern.search(old) else old.rstrip() + "\n\n" + block + "\n"
    atomic_write_text(page, new)
