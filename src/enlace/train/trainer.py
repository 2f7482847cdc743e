"""The pretraining loop: `train`, read top to bottom, plus the small pieces it needs.

Per optimizer step: take the lr from the WSD schedule, run `train_step` (accumulated forward/backward under
the hardware profile's autocast, GradScaler, clip, skip on non-finite, AdamW), log, evaluate, checkpoint.
Everything a resume needs is in the checkpoint (`TrainState`), so a resumed run continues bit for bit (on
CPU) where the uninterrupted one would be. A checkpoint is only resumed by a run of the same identity
(train/identity.py): changed params, data or code start a fresh run.
"""

from __future__ import annotations

import functools
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import model as model_module
from ..config.kinds import applied_recipe
from ..config.resolve import Config
from ..data import loaders as loaders_module
from ..errors import EnlaceError
from ..eval.score import evaluate, precision
from ..model import Llama
from ..runtime import resolve_run, setup_runtime
from . import dist as D
from . import optim as optim_module
from . import schedule as schedule_module
from . import step as step_module
from .checkpoint import clean_partial, latest_checkpoint, list_checkpoints, save_checkpoint
from .identity import RunIdentity, code_fingerprint, reconcile, weight_keys
from .metrics import MetricsLog
from .optim import build_optimizer
from .schedule import lr_at
from .signals import SecondInterrupt, StopFlag, abandoned
from .step import StepSettings, TrainState, make_scaler, seed_everything, train_step

# Keys that provably do not change the weights: names, how often to log, evaluate and save, how many
# checkpoints to keep, when to give up on a diverged run, what to do with an old run.
CADENCE_KEYS = (
    "model.name",
    "train.name",
    "data.name",
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.checkpoint",
    "train.max_nonfinite_in_row",
)
# The source of these modules computes a step: editing any of them makes a new run identity.
STEP_CODE = (model_module, step_module, optim_module, schedule_module, loaders_module)
# A run's outputs besides its checkpoints, archived with them when a changed run starts fresh.
RUN_FILES = ("metrics.jsonl", "metrics.json", "loss.png", "curves.csv")


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


# ---- run identity -------------------------------------------------------------------------------------


def run_identity(cfg: Config, data_fingerprint: str, world_size: int) -> RunIdentity:
    cfg = resolve_run(cfg).cfg  # the values the run trains with, the CPU kind's included
    d = cfg.to_dict()
    keys = weight_keys({s: d[s] for s in ("model", "data", "train")}, CADENCE_KEYS)
    keys.update(
        {
            "data.fingerprint": data_fingerprint,
            "world_size": world_size,
            "hardware.dtype": cfg.hardware.dtype,  # resolved: cpu-auto's bf16 or fp32
            "hardware.loss_scaler": cfg.hardware.loss_scaler,
            "code": code_fingerprint(STEP_CODE),
        }
    )
    # The CPU kind chose these values (their effect is in the keys above; this says why). Cadence keys stay
    # out, as above: changing them by hand must not make another run.
    recipe = [k for k in applied_recipe(cfg) if k in keys]
    if recipe:
        keys["hardware.recipe"] = f"{cfg.hardware.name} {cfg.hardware.dtype}: " + ", ".join(recipe)
    return RunIdentity(keys, steps_key="train.max_steps")


def decay_start(keys: dict[str, Any]) -> int:
    """The first step whose learning rate depends on max_steps (WSD: the start of the decay)."""
    return keys["train.max_steps"] - keys["train.schedule.decay_steps"]


def pinned_step(cfg: Config) -> int | None:
    """The last step before the decay: its checkpoint is kept, so a longer run can start from it."""
    s = cfg.train.max_steps - cfg.train.schedule.decay_steps  # decay_start() of this config
    return s if 0 < s < cfg.train.max_steps else None


# ---- the loop -----------------------------------------------------------------------------------------


def init_model(cfg: Config, device: torch.device) -> Llama:
    """A freshly initialised model (hf.build_model adopts loaded weights instead). The weights depend only
    on train.seed: the same seed gives the same initial model on any machine."""
    seed_everything(cfg.train.seed)
    return Llama(cfg.model, cfg.hardware.sdpa_backend).to(device)


def lm_forward(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], accum: int):
    """A micro-batch's share of the step loss, and of its cross-entropy and z-loss parts."""
    x, y = batch
    out = model(x, y)
    return out.loss / accum, {"ce": out.ce / accum, "z_loss": out.z_loss / accum}


def micro_batches(loader: Any, start_step: int, accum: int, device: torch.device) -> Iterator[Any]:
    """The loader's micro-batches from start_step on, moved to the device (pinned, so the copy overlaps)."""
    step = start_step
    while True:
        for micro in range(accum):
            x, y = loader.get_batch(step, micro)
            if device.type == "cuda":
                x, y = x.pin_memory(), y.pin_memory()
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        step += 1


def resume(state: TrainState, cfg: Config, run_dir: Path, ident: RunIdentity, info: D.DistInfo) -> int | None:
    """Load the newest checkpoint this run may continue from; None when it starts fresh."""
    ckpt_root = run_dir / "checkpoints"
    if info.is_main:
        clean_partial(ckpt_root)
        why = reconcile(
            run_dir, "checkpoints", ident, decay_start, RUN_FILES, cfg.train.checkpoint.on_identity_change
        )
        if why:
            print(why, flush=True)
    D.barrier(info)
    fallback = cfg.train.checkpoint.fallback_on_corrupt
    found = latest_checkpoint(ckpt_root, fallback, "cpu", "train.checkpoint.fallback_on_corrupt")
    if found is None:
        return None
    _, tensors, meta = found
    state.load_state_dict(tensors, meta, info.rank)
    return state.step


def save(state: TrainState, cfg: Config, run_dir: Path, ident: RunIdentity, info: D.DistInfo) -> None:
    ranks = D.gather_objects(info, state.rank_state())
    if info.is_main:
        tensors, meta = state.state_dict(ranks)
        t = cfg.train
        meta.update(
            {
                "identity": ident.hash,
                "identity_keys": ident.keys,
                "lr": lr_at(t, state.step - 1) if state.step > 0 else 0.0,
                "next_lr": lr_at(t, state.step),
                "max_steps": t.max_steps,
                "world_size": info.world_size,
                "data_fingerprint": ident.keys["data.fingerprint"],
                "config": cfg.to_dict(),
                "config_hash": cfg.hash,
            }
        )
        pinned = [s for s in (pinned_step(cfg),) if s is not None]
        save_checkpoint(run_dir / "checkpoints", state.step, tensors, meta, t.checkpoint.keep_last, pinned)
    D.barrier(info)


def diverged(state: TrainState, cfg: Config, run_dir: Path) -> NonFiniteError:
    n, done = state.nonfinite_in_row, list_checkpoints(run_dir / "checkpoints")
    last = f"; the last good checkpoint is {done[-1]}" if done else "; no checkpoint was saved yet"
    return NonFiniteError(
        f"{n} non-finite losses/gradients in a row (steps {state.step - n + 1}..{state.step}, "
        f"train.max_nonfinite_in_row={cfg.train.max_nonfinite_in_row}): the run diverged{last}. "
        "Lower optimizer.lr or check the data"
    )


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
    from tqdm import tqdm

    cfg = resolve_run(cfg).cfg  # a no-op where the caller resolved it (enlace pretrain, smoke)
    t, hw = cfg.train, cfg.hardware
    info = D.init_distributed(hw.device, t.world_size)
    device = setup_runtime(hw)
    run_dir = Path(run_dir)
    log = MetricsLog(run_dir / "metrics.jsonl", enabled=info.is_main)
    if loader is None or val_loader is None:
        loader = loader or loaders_module.make_loader(
            cfg, "train", rank=info.rank, world_size=info.world_size
        )
        val_loader = val_loader or loaders_module.make_loader(
            cfg, "val", rank=info.rank, world_size=info.world_size
        )
    ident = run_identity(cfg, loader.fingerprint, info.world_size)

    raw_model = init_model(cfg, device)
    seed_everything(t.seed + info.rank)  # per-rank streams after the shared init (dropout, if any)
    optimizer = build_optimizer(raw_model, t.optimizer, device.type)
    state = TrainState(raw_model, optimizer, make_scaler(device, hw), device, loader)
    resumed_from = resume(state, cfg, run_dir, ident, info)
    if resumed_from is None:
        log.reset()  # a log without any checkpoint belongs to a run that died before its first save
    else:
        # The final evaluation comes after the last checkpoint: a run resumed at the target redoes it.
        log.truncate_after(resumed_from, keep_val_at_step=resumed_from != t.max_steps)

    model: torch.nn.Module = torch.compile(raw_model) if hw.compile else raw_model
    if info.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[info.local_rank] if device.type == "cuda" else None)
    model.train()

    settings = StepSettings(t.grad_accum_steps, t.optimizer.grad_clip, hw, info)
    forward = functools.partial(lm_forward, accum=t.grad_accum_steps)
    next_batch = functools.partial(next, micro_batches(loader, state.step, t.grad_accum_steps, device))
    batch = next_batch()
    tokens_per_step = t.global_batch_size * cfg.model.seq_len
    # Validation: fixed windows spread over the whole val split, scored by the eval stage's own function.
    val_windows = val_loader.val_windows(t.eval_batches * t.micro_batch_size) if info.is_main else None

    def validate() -> dict[str, float | int]:
        return evaluate(
            raw_model, val_windows, batch_size=t.micro_batch_size, precision=lambda: precision(hw)
        )

    end_loss = val_loss = val_bpb = tok_s = None
    interrupted = None

    bar = tqdm(
        total=t.max_steps, initial=state.step, disable=not (progress and info.is_main), dynamic_ncols=True
    )
    last_time, last_tokens = time.perf_counter(), state.tokens
    try:
        with StopFlag() as stop:
            while state.step < t.max_steps:
                lr = lr_at(t, state.step)
                out, batch = train_step(state, model, batch, next_batch, forward, lr, settings)
                state.tokens += tokens_per_step
                step, end_loss = state.step, out.loss
                if state.nonfinite_in_row >= t.max_nonfinite_in_row:
                    raise diverged(state, cfg, run_dir)

                if info.is_main and (step == 1 or step % t.log_every == 0 or step == t.max_steps):
                    now = time.perf_counter()
                    tok_s = (state.tokens - last_tokens) / max(now - last_time, 1e-9)
                    last_time, last_tokens = now, state.tokens
                    log.append(
                        {
                            "step": step,
                            "loss": out.loss,
                            **out.parts,
                            "lr": out.lr,
                            "grad_norm": out.grad_norm,
                            "tokens": state.tokens,
                            "tokens_per_s": round(tok_s, 1),
                            "skipped": state.skipped,
                        }
                    )
                bar.update(1)
                bar.set_postfix(
                    loss=f"{out.loss:.4f}", lr=f"{out.lr:.2e}", tok_s=f"{tok_s or 0:.0f}", refresh=False
                )

                if info.is_main and t.eval_every and step % t.eval_every == 0 and step != t.max_steps:
                    v = validate()
                    log.append({"step": step, "val_loss": v["loss"], "val_bpb": v["bpb"]})

                stop_now = D.any_across(info, stop.signal is not None, device)
                due = step % t.checkpoint.every == 0 or step in (t.max_steps, stop_after, pinned_step(cfg))
                if due or stop_now:
                    save(state, cfg, run_dir, ident, info)
                if stop_now:
                    interrupted = stop.signal or "SIGTERM"  # another rank got the signal
                    if info.is_main:
                        print(
                            f"stopped by {interrupted} at step {step}; checkpoint saved to "
                            f"{list_checkpoints(run_dir / 'checkpoints')[-1]}. Rerun the same command to continue",
                            flush=True,
                        )
                    break
                if step == stop_after:
                    break
    except SecondInterrupt:
        raise abandoned(state.step, list_checkpoints(run_dir / "checkpoints")) from None
    bar.close()

    if state.step == t.max_steps and info.is_main:
        v = validate()
        val_loss, val_bpb = v["loss"], v["bpb"]
        log.append(
            {"step": state.step, "val_loss": val_loss, "val_bpb": val_bpb}
            | {"val_tokens": v["tokens"], "val_bytes": v["bytes"]}
        )
    D.barrier(info)
    return TrainResult(
        run_dir=run_dir,
        step=state.step,
        end_loss=end_loss,
        val_loss=val_loss,
        val_bpb=val_bpb,
        tokens_per_s=tok_s,
        skipped=state.skipped,
        interrupted=interrupted,
        resumed_from=resumed_from,
    )
