"""Where a step of the default run goes: the data loader and the trainer's own work vs the bare step.

Runs the real trainer (`enlace.train.trainer.train`) for a few steps on the default config under cProfile,
then splits its time into the model step (forward, backward, clip, AdamW), batch sampling, and the rest
(logging, progress bar, checksums, bookkeeping). Needs data/shards (`dvc repro shard`).
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import tempfile
from pathlib import Path

from bench.common import goal_row, write_result
from enlace.config import load_config
from enlace.runtime import resolve_run
from enlace.train.trainer import train

STEPS = int(os.environ.get("BENCH_OVERHEAD_STEPS", 20))


def cumulative(stats: pstats.Stats, *suffixes: str) -> float:
    total = 0.0
    for (filename, _line, name), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if any(f"{filename}:{name}".endswith(s) for s in suffixes):
            total += ct
    return total


def main() -> int:
    overrides = [
        f"train.max_steps={STEPS}",
        "train.schedule.warmup_steps=2",
        "train.schedule.decay_steps=2",
        "train.eval_every=0",
        f"train.checkpoint.every={STEPS}",
    ]
    cfg = resolve_run(load_config("params.yaml", overrides=overrides)).cfg  # as a run on this CPU resolves it
    with tempfile.TemporaryDirectory() as run_dir:
        prof = cProfile.Profile()
        prof.enable()
        train(cfg, Path(run_dir), progress=True)
        prof.disable()
    stats = pstats.Stats(prof)
    total = cumulative(stats, "trainer.py:train")
    loader = cumulative(stats, "loaders.py:get_batch")
    final_eval = cumulative(stats, "score.py:evaluate")
    # Forward calls inside the final evaluation are the eval's, not the training step's.
    forward = cumulative(stats, "module.py:_wrapped_call_impl") - final_eval
    model = forward + cumulative(stats, "_tensor.py:backward", "adamw.py:step")
    clip = cumulative(stats, "clip_grad.py:clip_grad_norm_")
    checkpoint = cumulative(stats, "checkpoint.py:save_checkpoint")
    # One-time start-up: runtime switches (deterministic mode imports part of torch's compiler stack),
    # model and optimizer construction, wrapping the model in torch.compile (importing the rest of that
    # stack; compiling itself happens in the first forward and backward, counted in the step), the run
    # identity and resume, loaders.
    setup = cumulative(
        stats,
        "runtime.py:setup_runtime",
        "trainer.py:init_model",
        "torch/__init__.py:compile",
        "trainer.py:run_identity",
        "trainer.py:resume",
        "optim.py:build_optimizer",
        "loaders.py:make_loader",
        "loaders.py:val_windows",
    )
    step_work = model + clip
    rest = total - step_work - loader - final_eval - checkpoint - setup
    result = {
        "steps": STEPS,
        "seconds": {
            "total": total, "model_step": step_work, "loader": loader, "final_eval": final_eval,
            "checkpoint": checkpoint, "setup": setup, "trainer_other": rest,
        },
        "loader_fraction": loader / step_work,
        "trainer_overhead_fraction": rest / step_work,
    }  # fmt: skip
    result["rows"] = [
        goal_row("data loader share of the step", "enlace loader", "model step", 100 * result["loader_fraction"], "<=", 1.0, "%"),
        goal_row("trainer's own share of the step", "enlace trainer", "model step",
                 100 * result["trainer_overhead_fraction"], "<=", 2.0, "%", f"precision {cfg.hardware.dtype}"),
    ]  # fmt: skip
    write_result("overhead", result)
    print(
        f"{STEPS} steps of the default run: model step {step_work:.2f} s, batch sampling {loader * 1000:.1f} ms, "
        f"trainer's own work {rest * 1000:.0f} ms, one checkpoint {checkpoint:.2f} s, final eval {final_eval:.2f} s"
    )
    print(
        f"overhead: loader {result['loader_fraction']:.2%} of the step (goal < 1%), "
        f"trainer {result['trainer_overhead_fraction']:.2%} (goal < 2%)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
