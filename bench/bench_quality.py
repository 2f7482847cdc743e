"""Quality parity of native bf16: the default run trained in fp32 (`cpu`) and in bf16 (`cpu-bf16`).

The real trainer (`enlace.train.trainer.train`) runs the default config twice, same steps, same data, same
seed; only the hardware profile differs. Reports each run's own validation bits per byte (evaluated in its
own precision, as `make run` reports it) and the bf16 run's weights re-evaluated in fp32, so a gap can be
told apart into training and evaluation precision. Goal: bf16 within 1% of fp32. Needs data/shards
(`dvc repro shard`). BENCH_QUALITY_STEPS shortens both runs alike, the schedule scaled in proportion.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import cpu_tag, default_precision, format_row, goal_row, write_result
from enlace.config import load_config
from enlace.eval.evaluate import load_scorer, validation_metrics
from enlace.train.trainer import train

PROFILES = {"fp32": "cpu", "bf16": "cpu-bf16"}


def main() -> int:
    if default_precision() != "bf16" and os.environ.get("BENCH_PRECISIONS") is None:
        # bf16 would be emulated here (hours, and not what the default run trains in): nothing to compare.
        print(f"skipped: the bf16-vs-fp32 comparison needs native bf16, which {cpu_tag()} lacks; "
              "BENCH_PRECISIONS=bf16 forces it", flush=True)  # fmt: skip
        write_result("quality", {"skipped": "no native bf16", "rows": []})
        return 0
    steps = os.environ.get("BENCH_QUALITY_STEPS")
    overrides = []
    if steps:
        # A shorter run keeps the default schedule's proportions (warmup, WSD decay), for both precisions.
        base = load_config("params.yaml").train
        f = int(steps) / base.max_steps
        overrides = [
            f"train.max_steps={steps}",
            f"train.schedule.warmup_steps={max(1, round(base.schedule.warmup_steps * f))}",
            f"train.schedule.decay_steps={max(1, round(base.schedule.decay_steps * f))}",
            f"train.checkpoint.every={steps}",
            "train.eval_every=0",
        ]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="enlace-bench-quality-") as tmp:
        for precision, profile in PROFILES.items():
            cfg = load_config("params.yaml", select={"hardware": profile}, overrides=overrides)
            t0 = time.perf_counter()
            res = train(cfg, Path(tmp) / precision, progress=False)
            if res.interrupted:
                return res.exit_code
            results[precision] = {
                "profile": profile,
                "steps": res.step,
                "val_loss": res.val_loss,
                "val_bpb": res.val_bpb,
                "seconds": time.perf_counter() - t0,
                "tokens_per_s": res.tokens_per_s,
            }
            print(f"{precision} ({profile}): {res.step} steps, val bpb {res.val_bpb:.4f}", flush=True)
        # The bf16-trained weights evaluated in fp32: separates training precision from eval precision.
        ref = load_config("params.yaml", select={"hardware": "cpu"}, overrides=overrides)
        scorer = load_scorer(Path(tmp) / "bf16", ref.hardware, torch.device("cpu"))
        m = validation_metrics(scorer)
        results["bf16"]["val_bpb_fp32_eval"] = m["val_bpb"]
    gap = results["bf16"]["val_bpb"] / results["fp32"]["val_bpb"] - 1
    row = goal_row(
        "val bpb of the default run, bf16 vs fp32 (|gap|)",
        "enlace bf16 autocast",
        "enlace fp32",
        abs(gap) * 100,
        "<=",
        1.0,
        "%",
        f"{results['bf16']['val_bpb']:.4f} vs {results['fp32']['val_bpb']:.4f} bpb after {results['fp32']['steps']} steps",
    )
    path = write_result("quality", {"results": results, "relative_gap": gap, "rows": [row]})
    print(f"wrote {path}; bf16 weights evaluated in fp32: {results['bf16']['val_bpb_fp32_eval']:.4f} bpb")
    print(format_row(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
