"""The pretraining loop: one flat function, `train`, plus the small pieces it needs.

Per optimizer step: set lr from the WSD schedule; for each micro-batch forward (under the hardware profile's
autocast) and backward (DDP syncs gradients only on the last one); clip; step unless the loss or the gradient
is non-finite; log; evaluate; checkpoint. Everything a resume needs is in the checkpoint, so a resumed run
continues bit for bit (on CPU) where the uninterrupted one would be.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config.resolve import Config, _flatten, _hash
from ..errors import CheckpointError, EnlaceError
from ..eval.score import evaluate
from ..hardware import autocast, sdpa_backend, setup_runtime
from ..model import Llama
from . import dist as D
from .checkpoint import (
    clean_partial,
    latest_checkpoint,
    list_checkpoints,
    load_model_tensors,
    load_optimizer_tensors,
    model_tensors,
    optimizer_tensors,
    save_checkpoint,
)
from .metrics import MetricsLog
from .optim import build_optimizer, param_names
from .schedule import lr_at

# Test seam: ENLACE_TEST_NAN_STEPS="3,4" multiplies the loss of those (0-based) optimizer steps by NaN,
# to exercise the non-finite handling without a real divergence. Never set outside tests.
NAN_STEPS_ENV = "ENLACE_TEST_NAN_STEPS"
CHECKPOINT_FORMAT = 1
# Config keys that must not change across a resume (dotted prefixes of the resolved config). Batch size per
# micro-step and accumulation may change (the global batch is the same rows); hardware may change; max_steps
# and the schedule may change (see schedule.py).
RESUME_KEYS = {
    "model": ("model",),
    "data": ("data", "train.loader", "train.seed", "train.global_batch_size"),
    "optimizer": ("train.optimizer",),
}


class NonFiniteError(EnlaceError):
    """Too many non-finite losses or gradients in a row: the run diverged."""


@dataclass
class TrainResult:
    run_dir: Path
    step: int  # optimizer steps completed
    end_loss: float | None  # loss of the last step this process ran
    val_loss: float | None
    val_bpb: float | None
    tokens_per_s: float | None
    skipped: int  # non-finite steps skipped over the whole run
    interrupted: str | None = None  # "SIGTERM"/"SIGINT" when a signal stopped the run
    resumed_from: int | None = None

    @property
    def exit_code(self) -> int:
        # 128 + signal number, the shell convention: a preempted run is not a finished run, so a pipeline
        # (dvc repro) must not record its outputs; the saved checkpoint makes the rerun continue.
        return {"SIGTERM": 128 + signal.SIGTERM, "SIGINT": 128 + signal.SIGINT}.get(self.interrupted or "", 0)


# ---- seeds and RNG state ------------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG states as JSON (they go into meta.json, per rank)."""
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


# ---- resume checks ------------------------------------------------------------------------------------


def resume_view(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The resume-relevant keys of a resolved config, per section, flattened to dotted keys."""
    flat = _flatten(config)
    return {
        section: {k: v for k, v in flat.items() if any(k == p or k.startswith(p + ".") for p in prefixes)}
        for section, prefixes in RESUME_KEYS.items()
    }


def section_hashes(config: dict[str, Any]) -> dict[str, str]:
    return {section: _hash(view) for section, view in resume_view(config).items()}


def check_resume(cfg: Config, meta: dict[str, Any], fingerprint: str, world_size: int, path: Path) -> None:
    """Refuse a resume that would not continue the same run, naming what differs."""
    saved, now = resume_view(meta["config"]), resume_view(cfg.to_dict())
    changes = []
    for section in RESUME_KEYS:
        a, b = saved[section], now[section]
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                changes.append(f"{key}: {a.get(key)!r} -> {b.get(key)!r}")
    if changes:
        raise CheckpointError(
            f"{path}: cannot resume, the model/data/optimizer config changed since this checkpoint: "
            + "; ".join(changes)
            + ". Restore the config or start a fresh run (--fresh, or another --run-dir)"
        )
    if meta.get("data_fingerprint") != fingerprint:
        raise CheckpointError(
            f"{path}: cannot resume, the training data changed (fingerprint {meta.get('data_fingerprint')} "
            f"in the checkpoint, {fingerprint} now)"
        )
    if meta.get("world_size", 1) != world_size:
        raise CheckpointError(
            f"{path}: cannot resume, the checkpoint was written with world size {meta.get('world_size', 1)} "
            f"and this run has world size {world_size}; exact resume needs the same number of processes"
        )
    if meta["step"] > cfg.train.max_steps:
        raise CheckpointError(
            f"{path}: cannot resume, the checkpoint is at step {meta['step']}, past train.max_steps "
            f"{cfg.train.max_steps}; raise max_steps or start a fresh run"
        )


# ---- evaluation ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def precision(hw: Any):
    """The forward's context, for validation as for training: autocast and the attention backend."""
    with autocast(hw), sdpa_backend(hw):
        yield


# ---- signals ------------------------------------------------------------------------------------------


class StopFlag:
    """SIGTERM/SIGINT ask the loop to finish the current step, checkpoint and return."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the user does not want to wait for the checkpoint
        self.signal = signal.Signals(signum).name

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


# ---- the loop -----------------------------------------------------------------------------------------


def build_model(cfg: Config, device: torch.device) -> Llama:
    """Weights depend only on train.seed: the same seed gives the same initial model on any machine."""
    seed_everything(cfg.train.seed)
    return Llama(cfg.model).to(device)


def train(
    cfg: Config,
    run_dir: Path,
    *,
    loader: Any = None,
    val_loader: Any = None,
    stop_after: int | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train (or resume) the run in run_dir up to cfg.train.max_steps.

    loader/val_loader default to enlace.data.loaders.make_loader(cfg, "train"/"val"); tests pass their own.
    stop_after: checkpoint and return after that many steps (tests: a run interrupted at a known step).
    """
    t, hw = cfg.train, cfg.hardware
    info = D.init_distributed(hw.device, t.world_size)
    device = setup_runtime(hw)
    run_dir = Path(run_dir)
    ckpt_root = run_dir / "checkpoints"
    log = MetricsLog(run_dir / "metrics.jsonl", enabled=info.is_main)

    if loader is None or val_loader is None:
        from ..data.loaders import make_loader

        loader = loader or make_loader(cfg, "train", rank=info.rank, world_size=info.world_size)
        val_loader = val_loader or make_loader(cfg, "val", rank=info.rank, world_size=info.world_size)

    raw_model = build_model(cfg, device)
    seed_everything(t.seed + info.rank)  # per-rank streams after the shared init (dropout, if any)
    optimizer = build_optimizer(raw_model, t.optimizer, device.type)
    names = param_names(optimizer)
    scaler = torch.amp.GradScaler("cuda") if hw.loss_scaler else None
    step, tokens, skipped, nonfinite_in_row, resumed_from = 0, 0, 0, 0, None

    # Resume from the newest complete checkpoint, if any.
    if info.is_main:
        clean_partial(ckpt_root)
    D.barrier(info)
    found = latest_checkpoint(ckpt_root, t.checkpoint.fallback_on_corrupt, device="cpu")
    if found is not None:
        path, tensors, meta = found
        check_resume(cfg, meta, loader.fingerprint, info.world_size, path)
        load_model_tensors(raw_model, tensors["model"])
        load_optimizer_tensors(optimizer, names, tensors["optimizer"], meta["optimizer_groups"])
        if scaler is not None and meta.get("scaler"):
            scaler.load_state_dict(meta["scaler"])
        loader.load_state_dict(meta["loader"][info.rank])
        set_rng_state(meta["rng"][info.rank], device)
        c = meta["counters"]
        step, tokens, skipped, nonfinite_in_row = (
            meta["step"],
            c["tokens"],
            c["skipped"],
            c["nonfinite_in_row"],
        )
        resumed_from = step
        # The final evaluation comes after the last checkpoint: a run resumed at the target redoes it.
        log.truncate_after(step, keep_val_at_step=step != t.max_steps)
    else:
        log.reset()  # a log without any checkpoint belongs to a run that died before its first save

    model: torch.nn.Module = torch.compile(raw_model) if hw.compile else raw_model
    if info.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[info.local_rank] if device.type == "cuda" else None)
    model.train()

    nan_steps = {int(s) for s in os.environ.get(NAN_STEPS_ENV, "").split(",") if s.strip()}
    accum = t.grad_accum_steps
    tokens_per_step = t.global_batch_size * cfg.model.seq_len
    target = t.max_steps
    # Validation: fixed windows spread over the whole val split, scored by the eval stage's own function.
    val_windows = val_loader.val_windows(t.eval_batches * t.micro_batch_size) if info.is_main else None

    def validate() -> dict[str, float | int]:
        return evaluate(
            raw_model, val_windows, batch_size=t.micro_batch_size, precision=lambda: precision(hw)
        )

    end_loss = val_loss = val_bpb = tok_s = None
    interrupted = None

    def checkpoint() -> Path | None:
        rngs = D.gather_objects(info, rng_state(device))
        loader_states = D.gather_objects(info, loader.state_dict())
        path = None
        if info.is_main:
            flat, groups = optimizer_tensors(optimizer, names)
            meta = {
                "format": CHECKPOINT_FORMAT,
                "lr": lr_at(t, step - 1) if step > 0 else 0.0,
                "next_lr": lr_at(t, step),
                "max_steps": t.max_steps,
                "world_size": info.world_size,
                "optimizer_groups": groups,
                "scaler": scaler.state_dict() if scaler is not None else None,
                "rng": rngs,
                "loader": loader_states,
                "data_fingerprint": loader.fingerprint,
                "config": cfg.to_dict(),
                "config_hash": cfg.hash,
                "section_hashes": section_hashes(cfg.to_dict()),
                "counters": {"tokens": tokens, "skipped": skipped, "nonfinite_in_row": nonfinite_in_row},
            }
            tensors = {"model": model_tensors(raw_model), "optimizer": flat}
            path = save_checkpoint(ckpt_root, step, tensors, meta, keep_last=t.checkpoint.keep_last)
        D.barrier(info)
        return path

    from tqdm import tqdm

    bar = tqdm(total=target, initial=step, disable=not (progress and info.is_main), dynamic_ncols=True)
    last_time, last_tokens = time.perf_counter(), tokens
    with StopFlag() as stop:
        while step < target:
            lr = lr_at(t, step)
            for g in optimizer.param_groups:
                g["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            loss_sum = torch.zeros((), device=device)
            ce_sum = torch.zeros((), device=device)
            z_sum = torch.zeros((), device=device)
            for micro in range(accum):
                x, y = loader.get_batch(step, micro)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                # DDP all-reduces gradients on every backward unless told not to: only the last micro-step syncs.
                sync = contextlib.nullcontext() if not info.enabled or micro == accum - 1 else model.no_sync()
                with sync:
                    with autocast(hw), sdpa_backend(hw):
                        out = model(x, y)
                        loss = out.loss / accum
                        if step in nan_steps:
                            loss = loss * float("nan")
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                loss_sum += loss.detach()
                ce_sum += out.ce.detach() / accum
                z_sum += out.z_loss.detach() / accum

            if scaler is not None:
                scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            clip = t.optimizer.grad_clip if t.optimizer.grad_clip > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), clip, foreach=True).item()
            # One all-reduce for the logged numbers; every rank then takes the same skip decision.
            step_loss, step_ce, step_z = D.mean_across(info, torch.stack([loss_sum, ce_sum, z_sum])).tolist()
            if scaler is not None:
                # GradScaler skips the update itself on inf/NaN gradients and lowers the scale.
                scale_before = scaler.get_scale()
                scaler.step(optimizer)
                scaler.update()
                ok = scaler.get_scale() >= scale_before and math.isfinite(step_loss)
            else:
                ok = math.isfinite(step_loss) and math.isfinite(grad_norm)
                if ok:
                    optimizer.step()
            step += 1
            tokens += tokens_per_step
            if ok:
                nonfinite_in_row = 0
            else:
                skipped += 1
                nonfinite_in_row += 1
                if nonfinite_in_row >= t.max_nonfinite_in_row:
                    done = list_checkpoints(ckpt_root)
                    last = (
                        f"; the last good checkpoint is {done[-1]}"
                        if done
                        else "; no checkpoint was saved yet"
                    )
                    raise NonFiniteError(
                        f"{nonfinite_in_row} non-finite losses/gradients in a row (steps "
                        f"{step - nonfinite_in_row + 1}..{step}, train.max_nonfinite_in_row="
                        f"{t.max_nonfinite_in_row}): the run diverged{last}. Lower optimizer.lr or check the data"
                    )
            end_loss = step_loss

            if info.is_main and (step == 1 or step % t.log_every == 0 or step == target):
                now = time.perf_counter()
                tok_s = (tokens - last_tokens) / max(now - last_time, 1e-9)
                last_time, last_tokens = now, tokens
                log.append(
                    {
                        "step": step,
                        "loss": step_loss,
                        "ce": step_ce,
                        "z_loss": step_z,
                        "lr": lr,
                        "grad_norm": grad_norm,
                        "tokens": tokens,
                        "tokens_per_s": round(tok_s, 1),
                        "skipped": skipped,
                    }
                )
            bar.update(1)
            bar.set_postfix(loss=f"{step_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s or 0:.0f}", refresh=False)

            if info.is_main and t.eval_every and step % t.eval_every == 0 and step != target:
                v = validate()
                log.append({"step": step, "val_loss": v["loss"], "val_bpb": v["bpb"]})

            stop_now = D.any_across(info, stop.signal is not None, device)
            if step % t.checkpoint.every == 0 or step == target or stop_now or step == stop_after:
                checkpoint()
            if stop_now:
                interrupted = stop.signal or "SIGTERM"  # another rank got the signal
                break
            if step == stop_after:
                break
    bar.close()

    if step == target and info.is_main:
        v = validate()
        val_loss, val_bpb = v["loss"], v["bpb"]
        log.append(
            {
                "step": step,
                "val_loss": val_loss,
                "val_bpb": val_bpb,
                "val_tokens": v["tokens"],
                "val_bytes": v["bytes"],
            }
        )
    D.barrier(info)
    return TrainResult(
        run_dir=run_dir,
        step=step,
        end_loss=end_loss,
        val_loss=val_loss,
        val_bpb=val_bpb,
        tokens_per_s=tok_s,
        skipped=skipped,
        interrupted=interrupted,
        resumed_from=resumed_from,
    )
