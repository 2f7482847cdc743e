"""One training step and the state a resume needs: shared by pretraining, fine-tuning, gpu-check and bench.

`train_step` runs the accumulated forward/backward passes of one optimizer step under the hardware
profile's autocast, scales the loss with a GradScaler (a no-op when disabled), unscales and clips, decides
whether the step is finite and only then updates. It fetches the next micro-batch right after each forward,
so loading overlaps the backward pass (nanoGPT's prefetch).

`TrainState` holds everything that decides the next steps: model, optimizer, scaler, counters, the loader's
state and every RNG (Python, NumPy, torch CPU and CUDA). Its `state_dict` is the one checkpoint layout both
stages write: tensor groups "model" and "optimizer" (flattened by train/checkpoint.py) plus JSON metadata.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..config.hardware import HardwareConfig
from ..errors import CheckpointError
from ..runtime import autocast, sdpa_backend
from . import dist as D
from .checkpoint import load_model_tensors, load_optimizer_tensors, model_tensors, optimizer_tensors
from .optim import Optimizer

CHECKPOINT_FORMAT = 2

# forward(model, micro_batch) -> (this micro-batch's share of the step loss, {name: share of a logged part}).
# The shares are already divided so that summing them over the step's micro-batches gives the step value.
Forward = Callable[[nn.Module, Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]


# ---- RNG ----------------------------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG states as JSON: they go into meta.json, one entry per rank."""
    py = random.getstate()
    npst = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
        "torch": torch.get_rng_state().numpy().tobytes().hex(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device).numpy().tobytes().hex()
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.frombuffer(bytearray.fromhex(state["torch"]), dtype=torch.uint8))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(
            torch.frombuffer(bytearray.fromhex(state["cuda"]), dtype=torch.uint8), device
        )


# ---- the state --------------------------------------------------------------------------------------------


@dataclass
class TrainState:
    """Everything that decides the following steps. `step` counts completed optimizer steps."""

    model: nn.Module  # the raw model (not a compiled or DDP wrapper): its names are the checkpoint's
    # AdamW, or Muon + AdamW as one OptimizerChain (train/optim.py); parameter groups carry "param_names"
    optimizer: Optimizer
    scaler: torch.amp.GradScaler
    device: torch.device
    loader: Any = None  # anything with state_dict/load_state_dict; None for loaders without state
    trainable_only: bool = False  # save only the parameters the optimizer updates (LoRA)
    step: int = 0
    tokens: int = 0
    skipped: int = 0
    nonfinite_in_row: int = 0

    def rank_state(self) -> dict[str, Any]:
        """The per-process part (each DDP rank has its own RNG streams and loader position)."""
        return {
            "rng": rng_state(self.device),
            "loader": self.loader.state_dict() if self.loader is not None else None,
        }

    def state_dict(
        self, ranks: list[dict[str, Any]] | None = None
    ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        """(tensor groups, JSON metadata). `ranks`: every rank's rank_state, gathered; default this one's."""
        ranks = ranks if ranks is not None else [self.rank_state()]
        flat, groups = optimizer_tensors(self.optimizer)
        meta = {
            "format": CHECKPOINT_FORMAT,
            "step": self.step,
            "counters": {
                "tokens": self.tokens,
                "skipped": self.skipped,
                "nonfinite_in_row": self.nonfinite_in_row,
            },
            "optimizer_groups": groups,
            "scaler": self.scaler.state_dict(),
            "rng": [r["rng"] for r in ranks],
            "loader": [r["loader"] for r in ranks],
        }
        return {"model": model_tensors(self.model, self.trainable_only), "optimizer": flat}, meta

    def load_state_dict(
        self, tensors: dict[str, dict[str, torch.Tensor]], meta: dict[str, Any], rank: int = 0
    ) -> None:
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(
                f"checkpoint format {meta.get('format')} is not this version's ({CHECKPOINT_FORMAT})"
            )
        load_model_tensors(self.model, tensors["model"], self.trainable_only)
        load_optimizer_tensors(self.optimizer, tensors["optimizer"], meta["optimizer_groups"])
        if meta["scaler"]:  # a disabled scaler saves {}; the run identity pins whether it is enabled
            self.scaler.load_state_dict(meta["scaler"])
        if self.loader is not None and meta["loader"][rank] is not None:
            self.loader.load_state_dict(meta["loader"][rank])
        set_rng_state(meta["rng"][rank], self.device)
        c = meta["counters"]
        self.step, self.tokens = int(meta["step"]), c["tokens"]
        self.skipped, self.nonfinite_in_row = c["skipped"], c["nonfinite_in_row"]


# ---- the step ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepSettings:
    accum: int  # micro-batches per optimizer step
    grad_clip: float  # 0 disables clipping
    hardware: HardwareConfig  # autocast dtype and attention backend
    dist: D.DistInfo | None = None  # data-parallel processes (None: one process)


@dataclass
class StepOutput:
    loss: float  # the step's loss, averaged over processes
    parts: dict[str, float]  # the forward's logged parts, summed over micro-batches, averaged over processes
    grad_norm: float  # before clipping; inf or nan on a non-finite step
    lr: float
    ok: bool  # False: non-finite loss or gradient, the update was skipped


def make_scaler(device: torch.device, hw: HardwareConfig) -> torch.amp.GradScaler:
    """Always a GradScaler: disabled, its scale/unscale_/step/update are plain pass-throughs."""
    return torch.amp.GradScaler(device.type, enabled=hw.loss_scaler)


def train_step(
    state: TrainState,
    model: nn.Module,
    batch: Any,
    next_batch: Callable[[], Any],
    forward: Forward,
    lr: float,
    settings: StepSettings,
) -> tuple[StepOutput, Any]:
    """One optimizer step from `batch` (its first micro-batch, already fetched); returns the step's output
    and the next step's first micro-batch.

    `model` is what to call (the raw model or its compiled/DDP wrapper); state.model is what gets clipped
    and saved. Every process takes the same skip decision from the all-reduced loss and gradient norm.
    """
    opt, scaler, accum = state.optimizer, state.scaler, settings.accum
    ddp = settings.dist is not None and settings.dist.enabled
    for g in opt.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)  # a group's own peak (Muon's matrices), same schedule
    opt.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=state.device)
    part_sums: dict[str, torch.Tensor] = {}
    for micro in range(accum):
        # DDP all-reduces gradients on every backward unless told not to: only the last micro-step syncs.
        sync = model.no_sync() if ddp and micro < accum - 1 else contextlib.nullcontext()
        with sync:
            with autocast(settings.hardware), sdpa_backend(settings.hardware):
                loss, parts = forward(model, batch)
            batch = next_batch()  # fetch while the backward runs
            scaler.scale(loss).backward()
        loss_sum += loss.detach()
        for k, v in parts.items():
            part_sums[k] = part_sums.get(k, torch.zeros((), device=state.device)) + v.detach()

    scaler.unscale_(opt)  # clip the true gradients, not the scaled ones
    params = [p for g in opt.param_groups for p in g["params"]]
    clip = settings.grad_clip if settings.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, clip, foreach=True).item()
    keys = sorted(part_sums)
    logged = torch.stack([loss_sum, *(part_sums[k] for k in keys)])
    if settings.dist is not None:
        logged = D.mean_across(settings.dist, logged)  # one all-reduce for every logged number
    values = logged.tolist()
    ok = math.isfinite(values[0]) and math.isfinite(grad_norm)
    if ok:
        scaler.step(opt)
    # An enabled scaler lowers its scale after the inf/NaN gradients unscale_ found (and raises it after a
    # run of good steps); a disabled one does nothing.
    scaler.update()
    state.step += 1
    if ok:
        state.nonfinite_in_row = 0
    else:
        state.skipped += 1
        state.nonfinite_in_row += 1
    out = StepOutput(
        loss=values[0], parts=dict(zip(keys, values[1:], strict=True)), grad_norm=grad_norm, lr=lr, ok=ok
    )
    return out, batch
