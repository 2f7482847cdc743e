"""Fit a run to a wall-time budget: how many steps fit, and the schedule that decays within them.

A calibration run of the variant measures its time per optimizer step (the median logged interval; the
first interval holds start-up and compilation) and its fixed overhead (the rest of the command's wall
time: start-up, compilation, the final evaluation and checkpoint). The real run then gets
max_steps = (fill * budget - overhead) / step time, and the WSD schedule keeps the variant's own shape at
that length: the decay stays the same fraction of max_steps, warmup keeps its length unless the run is
too short for it. The step count is in the config, so the run stays deterministic and resumable; only its
choice depends on the clock.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from ..config.train import TrainConfig
from ..errors import EnlaceError


@dataclass(frozen=True)
class Calibration:
    steps: int  # optimizer steps the calibration run made
    wall_s: float  # its whole command, start to exit
    step_s: float  # median seconds per step after the first logged interval

    @property
    def overhead_s(self) -> float:
        return max(0.0, self.wall_s - self.steps * self.step_s)


def step_seconds(records: list[dict[str, Any]], tokens_per_step: int) -> float:
    """Median seconds per step from a metrics.jsonl's training records (tokens_per_s per logged interval)."""
    speeds = [r["tokens_per_s"] for r in records if "loss" in r and r.get("tokens_per_s")][1:]
    if not speeds:
        raise EnlaceError("calibration logged too few steps to time one; raise calibration_steps")
    return tokens_per_step / statistics.median(speeds)


def fitted_steps(budget_s: float, cal: Calibration, fill: float) -> int:
    steps = int((fill * budget_s - cal.overhead_s) / cal.step_s)
    if steps < 10:
        raise EnlaceError(
            f"a budget of {budget_s:.0f} s fits {max(steps, 0)} steps ({cal.step_s:.3f} s each after "
            f"{cal.overhead_s:.0f} s of start-up): raise budget_s"
        )
    return steps


def schedule_overrides(t: TrainConfig, steps: int) -> dict[str, int]:
    """The FITTED keys (spec.py) for a run of `steps` steps with the variant's own schedule shape."""
    decay = round(steps * t.schedule.decay_steps / t.max_steps)
    warmup = min(t.schedule.warmup_steps, steps - decay)
    return {
        "train.max_steps": steps,
        "train.schedule.warmup_steps": warmup,
        "train.schedule.decay_steps": decay,
        "train.checkpoint.every": steps,  # the last step only (and on SIGTERM, which the trainer saves at)
        "train.eval_every": 0,  # validation only at the end, scored by the harness anyway
    }


def calibration_overrides(t: TrainConfig, steps: int) -> dict[str, int]:
    """A short run at the variant's plateau: same step cost (the lr does not change a step's time)."""
    return {
        "train.max_steps": steps,
        "train.schedule.warmup_steps": min(t.schedule.warmup_steps, steps),
        "train.schedule.decay_steps": 0,
        "train.checkpoint.every": steps,
        "train.eval_every": 0,
        "train.log_every": max(1, steps // 8),  # enough intervals for a median
    }
