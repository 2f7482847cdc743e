"""The metrics log (one JSON object per line) and the loss/lr plot."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class MetricsLog:
    """Append-only jsonl; on resume it is cut back to the checkpoint step so no step appears twice."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, step: int, keep_val_at_step: bool = True) -> None:
        """Drop records past `step` (and the val record at `step` itself when it will be redone)."""
        if not self.enabled or not self.path.exists():
            return
        kept = [
            r
            for r in read_jsonl(self.path)
            if r.get("step", 0) < step
            or (r.get("step", 0) == step and (keep_val_at_step or "val_loss" not in r))
        ]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def reset(self) -> None:
        if self.enabled and self.path.exists():
            self.path.unlink()

    def append(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash mid-write
    return out


def plot_loss(records: list[dict[str, Any]], png: Path, title: str = "") -> None:
    """Training loss (and val loss where logged) against step, the learning rate on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", color="tab:blue")
    if val:
        ax.plot(
            [r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val loss", color="tab:red"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot([r["step"] for r in train], [r["lr"] for r in train], color="tab:gray", alpha=0.6, label="lr")
    ax2.set_ylabel("learning rate")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, metadata={"Software": None})
    plt.close(fig)
