"""Warmup-stable-decay (WSD) learning-rate schedule as a pure function of the step.

Steps are 0-based optimizer steps: step s is the update that turns s completed steps into s + 1.
Warmup rises linearly to the peak over `warmup_steps` (the first update already gets peak/warmup, never 0);
the plateau holds the peak; the last `decay_steps` updates anneal towards final_lr_frac * peak, reaching it
exactly at step == max_steps (one past the last update), so no update is wasted at lr 0.

Only the decay depends on max_steps: every step before max_steps - decay_steps has the same lr whatever
max_steps is. So a run with a higher max_steps continues from the last checkpoint before the decay
(train/identity.py) and ends with the weights of a straight run of the longer config; annealed weights are
never re-used at peak lr.
"""

from __future__ import annotations

import math
from typing import Protocol

from ..choices import DecayShape, values
from ..config.train import AdamWConfig, ScheduleConfig

SHAPES = values(DecayShape)


def decay_factor(progress: float, shape: str) -> float:
    """1 at the start of the decay (progress 0), 0 at its end (progress 1)."""
    p = min(max(progress, 0.0), 1.0)
    if shape == "linear":
        return 1.0 - p
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    if shape == "1-sqrt":
        return 1.0 - math.sqrt(p)
    raise ValueError(f"unknown decay shape {shape!r}; expected one of {SHAPES}")


def wsd_lr(
    step: int,
    *,
    max_steps: int,
    peak_lr: float,
    warmup_steps: int,
    decay_steps: int,
    decay_shape: str = "1-sqrt",
    final_lr_frac: float = 0.0,
) -> float:
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    decay_start = max_steps - decay_steps
    if decay_steps == 0 or step < decay_start:
        return peak_lr
    f = decay_factor((step - decay_start) / decay_steps, decay_shape)
    return peak_lr * (final_lr_frac + (1.0 - final_lr_frac) * f)


class Scheduled(Protocol):
    """A run config with a step count, an optimizer and a schedule (pretraining's train, the finetune layer)."""

    @property
    def max_steps(self) -> int: ...
    @property
    def optimizer(self) -> AdamWConfig: ...
    @property
    def schedule(self) -> ScheduleConfig: ...


def decay_steps(max_steps: int, s: ScheduleConfig) -> int:
    """schedule.decay_steps, or every step after the warmup when it is null (no plateau)."""
    return s.decay_steps if s.decay_steps is not None else max(max_steps - s.warmup_steps, 0)


def decay_start(max_steps: int, s: ScheduleConfig) -> int:
    """The first step whose learning rate depends on max_steps."""
    return max_steps - decay_steps(max_steps, s)


def lr_at(run: Scheduled, step: int) -> float:
    """The learning rate of optimizer step `step` under a run config."""
    s = run.schedule
    return wsd_lr(
        step,
        max_steps=run.max_steps,
        peak_lr=run.optimizer.lr,
        warmup_steps=s.warmup_steps,
        decay_steps=decay_steps(run.max_steps, s),
        decay_shape=s.decay_shape,
        final_lr_frac=s.final_lr_frac,
    )
