"""The training loop: every training run, pretraining or LoRA fine-tuning, is `run(task, run_dir, hw)`.

A task (train/pretrain_task.py, finetune/task.py) says what is trained: it builds the model, the optimizer
and the batches, gives the loss, the learning rate, the run identity, what is logged and evaluated, and
what is written at the end. The loop alone owns how a run goes:

- the run directory: its lock (one process per directory), `--fresh`, the resolved config beside it;
- run identity: a checkpoint of a changed run is archived, one of the same run resumed (bit for bit);
- the step (train/step.py: the only optimizer update in src), the lr per step, non-finite steps skipped
  and a run stopped after task.settings.max_nonfinite_in_row of them in a row;
- cadence: log, evaluate and checkpoint every so many steps, and the checkpoint before the decay kept;
- SIGTERM/SIGINT: finish the step, save, stop with 128 + the signal number; a second Ctrl-C abandons;
- the progress bar and the exit code.
"""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ..config.hardware import HardwareConfig
from ..config.train import AdamWConfig, CheckpointConfig, ScheduleConfig
from ..errors import EnlaceError
from ..runtime import setup_runtime
from . import dist as D
from .checkpoint import clean_partial, latest_checkpoint, list_checkpoints, save_checkpoint
from .identity import RunIdentity, reconcile
from .lock import run_dir_lock
from .metrics import MetricsLog
from .schedule import decay_start, lr_at
from .signals import SecondInterrupt, StopFlag, abandoned
from .step import Forward, StepOutput, StepSettings, TrainState, make_scaler, train_step


class NonFiniteError(EnlaceError):
    """Too many non-finite losses or gradients in a row: the run diverged."""


class LoopSettings(Protocol):
    """The loop's sections of a run config: TrainConfig and FinetuneConfig both have them."""

    @property
    def max_steps(self) -> int: ...
    @property
    def grad_accum_steps(self) -> int: ...
    @property
    def optimizer(self) -> AdamWConfig: ...
    @property
    def schedule(self) -> ScheduleConfig: ...
    @property
    def checkpoint(self) -> CheckpointConfig: ...
    @property
    def log_every(self) -> int: ...
    @property
    def max_nonfinite_in_row(self) -> int: ...


@dataclass
class Setup:
    """What a task builds before the first step."""

    model: nn.Module  # the raw model: its parameter names are the checkpoint's
    optimizer: torch.optim.Optimizer  # parameter groups carry "param_names"
    identity: RunIdentity
    loader: Any = None  # anything with state_dict/load_state_dict (its position is checkpointed)
    trainable_only: bool = False  # checkpoint only what the optimizer updates (LoRA adapters)
    compile: bool = False  # wrap the model in torch.compile for the steps


class Task(Protocol):
    section: str  # the config section holding the loop settings ("train", "finetune"), for messages
    settings: LoopSettings
    world_size: int  # data-parallel processes the run is planned for
    run_files: tuple[str, ...]  # the run's outputs besides checkpoints: archived or removed with them

    def setup(self, device: torch.device, info: D.DistInfo) -> Setup: ...
    def batches(self, start_step: int, device: torch.device) -> Iterator[Any]: ...

    forward: Forward

    def step_tokens(self, out: StepOutput) -> int: ...
    def log_record(
        self, out: StepOutput, state: TrainState, seconds: float, steps: int
    ) -> dict[str, Any]: ...
    def validate(self, final: bool) -> dict[str, Any] | None: ...
    def checkpoint_meta(self, state: TrainState) -> dict[str, Any]: ...
    def write_config(self, run_dir: Path) -> None: ...
    def finish(self, model: nn.Module, run_dir: Path) -> None: ...


@dataclass
class RunResult:
    run_dir: Path
    step: int  # optimizer steps completed
    end_loss: float | None = None  # loss of the last step this process ran
    last: dict[str, Any] = field(default_factory=dict)  # the last step record this process logged
    val: dict[str, Any] | None = None  # the final evaluation, when this process ran it
    skipped: int = 0  # non-finite steps skipped over the whole run
    interrupted: str | None = None  # "SIGTERM"/"SIGINT" when a signal stopped the run
    resumed_from: int | None = None

    @property
    def exit_code(self) -> int:
        # 128 + signal number, the shell convention: a preempted run is not a finished run, so a pipeline
        # (dvc repro) must not record its outputs; the saved checkpoint makes the rerun continue.
        return {"SIGTERM": 128 + signal.SIGTERM, "SIGINT": 128 + signal.SIGINT}.get(self.interrupted or "", 0)


def identity_decay_start(section: str) -> Callable[[dict[str, Any]], int]:
    """decay_start() of the config recorded in a run's identity keys: steps before it do not depend on
    max_steps, so a run that only changed max_steps resumes from the last checkpoint before both."""

    def of(keys: dict[str, Any]) -> int:
        s = ScheduleConfig.model_validate(
            {
                k.removeprefix(f"{section}.schedule."): v
                for k, v in keys.items()
                if k.startswith(f"{section}.schedule.")
            }
        )
        return decay_start(keys[f"{section}.max_steps"], s)

    return of


def pinned_step(settings: LoopSettings) -> int | None:
    """The last step before the decay: its checkpoint is kept, so a longer run can start from it."""
    s = decay_start(settings.max_steps, settings.schedule)
    return s if 0 < s < settings.max_steps else None


def start_run_dir(task: Task, run_dir: Path, fresh: bool, info: D.DistInfo) -> None:
    """--fresh removes the old run's checkpoints and outputs; the resolved config goes beside the run."""
    if info.is_main:
        if fresh:
            for name in ("checkpoints", *task.run_files):
                p = run_dir / name
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        task.write_config(run_dir)
    D.barrier(info)


def resume(task: Task, state: TrainState, run_dir: Path, ident: RunIdentity, info: D.DistInfo) -> int | None:
    """Load the newest checkpoint this run may continue from; None when it starts fresh."""
    ckpt_root, c = run_dir / "checkpoints", task.settings.checkpoint
    if info.is_main:
        clean_partial(ckpt_root)
        why = reconcile(
            run_dir,
            "checkpoints",
            ident,
            identity_decay_start(task.section),
            task.run_files,
            c.on_identity_change,
        )
        if why:
            print(why, flush=True)
    D.barrier(info)
    setting = f"{task.section}.checkpoint.fallback_on_corrupt"
    found = latest_checkpoint(ckpt_root, c.fallback_on_corrupt, "cpu", setting)
    if found is None:
        return None
    path, tensors, meta = found
    state.load_state_dict(tensors, meta, info.rank)
    if info.is_main:
        print(f"resumed from {path} at step {state.step}", flush=True)
    return state.step


def save(task: Task, state: TrainState, run_dir: Path, ident: RunIdentity, info: D.DistInfo) -> None:
    ranks = D.gather_objects(info, state.rank_state())
    if info.is_main:
        tensors, meta = state.state_dict(ranks)
        meta.update({"identity": ident.hash, "identity_keys": ident.keys, **task.checkpoint_meta(state)})
        c = task.settings.checkpoint
        pinned = [s for s in (pinned_step(task.settings),) if s is not None]
        save_checkpoint(run_dir / "checkpoints", state.step, tensors, meta, c.keep_last, pinned)
    D.barrier(info)


def diverged(task: Task, state: TrainState, run_dir: Path) -> NonFiniteError:
    n, done = state.nonfinite_in_row, list_checkpoints(run_dir / "checkpoints")
    last = f"; the last good checkpoint is {done[-1]}" if done else "; no checkpoint was saved yet"
    sec = task.section
    return NonFiniteError(
        f"{n} non-finite losses/gradients in a row (steps {state.step - n + 1}..{state.step}, "
        f"{sec}.max_nonfinite_in_row={task.settings.max_nonfinite_in_row}): the run diverged{last}. "
        f"Lower {sec}.optimizer.lr or check the data"
    )


def run(
    task: Task,
    run_dir: Path,
    hw: HardwareConfig,
    *,
    fresh: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
) -> RunResult:
    """Train (or resume) the run in run_dir up to task.settings.max_steps; one process per run directory.

    stop_after: checkpoint and return after that many steps, as an interrupted run would (gpu-check and
    the tests stop a run at a known step this way).
    """
    info = D.init_distributed(hw.device, task.world_size)
    device = setup_runtime(hw)
    run_dir = Path(run_dir)
    with run_dir_lock(run_dir, enabled=info.is_main):
        start_run_dir(task, run_dir, fresh, info)
        return _run(task, run_dir, hw, info, device, progress, stop_after)


def _run(
    task: Task,
    run_dir: Path,
    hw: HardwareConfig,
    info: D.DistInfo,
    device: torch.device,
    progress: bool,
    stop_after: int | None,
) -> RunResult:
    # Long on purpose: the whole loop, top to bottom, as nanoGPT's train.py reads; each part is named.
    from tqdm import tqdm

    cfg = task.settings
    log = MetricsLog(run_dir / "metrics.jsonl", enabled=info.is_main)

    # ---- build, then resume what this run may continue from
    built = task.setup(device, info)
    ident = built.identity
    state = TrainState(
        built.model, built.optimizer, make_scaler(device, hw), device, built.loader, built.trainable_only
    )
    resumed_from = resume(task, state, run_dir, ident, info)
    if resumed_from is None:
        log.reset()  # a log without any checkpoint belongs to a run that died before its first save
    else:
        # The final evaluation comes after the last checkpoint: a run resumed at the target redoes it.
        log.truncate_after(resumed_from, keep_val_at_step=resumed_from != cfg.max_steps)

    model: nn.Module = torch.compile(built.model) if built.compile else built.model
    if info.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[info.local_rank] if device.type == "cuda" else None)
    model.train()

    # ---- the steps
    settings = StepSettings(cfg.grad_accum_steps, cfg.optimizer.grad_clip, hw, info)
    batches = task.batches(state.step, device)
    batch = next(batches)
    result = RunResult(run_dir, state.step, resumed_from=resumed_from)
    bar = tqdm(
        total=cfg.max_steps,
        initial=state.step,
        disable=not (progress and info.is_main),
        dynamic_ncols=True,
        desc=task.section,
    )
    eval_every = getattr(cfg, "eval_every", 0)  # periodic evaluation (pretraining); 0 or absent: at the end
    last_time, last_step = time.perf_counter(), state.step
    try:
        with StopFlag() as stop:
            while state.step < cfg.max_steps:
                out, batch = train_step(
                    state, model, batch, lambda: next(batches), task.forward, lr_at(cfg, state.step), settings
                )
                state.tokens += task.step_tokens(out)
                step, result.end_loss = state.step, out.loss
                if state.nonfinite_in_row >= cfg.max_nonfinite_in_row:
                    raise diverged(task, state, run_dir)

                if step == 1 or step % cfg.log_every == 0 or step == cfg.max_steps:
                    now = time.perf_counter()
                    result.last = task.log_record(out, state, now - last_time, step - last_step)
                    last_time, last_step = now, step
                    log.append(result.last)
                bar.update(1)
                bar.set_postfix(loss=f"{out.loss:.4f}", lr=f"{out.lr:.2e}", refresh=False)

                if info.is_main and eval_every and step % eval_every == 0 and step != cfg.max_steps:
                    v = task.validate(final=False)
                    if v is not None:
                        log.append({"step": step, **v})

                stop_now = D.any_across(info, stop.signal is not None, device)
                due = step % cfg.checkpoint.every == 0 or step in (
                    cfg.max_steps,
                    stop_after,
                    pinned_step(cfg),
                )
                if due or stop_now:
                    save(task, state, run_dir, ident, info)
                if stop_now:
                    result.interrupted = stop.signal or "SIGTERM"  # another rank got the signal
                    if info.is_main:
                        print(
                            f"{task.section}: stopped by {result.interrupted} at step {step}; checkpoint saved "
                            f"to {list_checkpoints(run_dir / 'checkpoints')[-1]}. Rerun the same command to continue",
                            flush=True,
                        )
                    break
                if step == stop_after:
                    break
    except SecondInterrupt:
        raise abandoned(state.step, list_checkpoints(run_dir / "checkpoints")) from None
    bar.close()

    # ---- the end: final evaluation and the task's outputs
    result.step, result.skipped = state.step, state.skipped
    if state.step == cfg.max_steps and info.is_main:
        result.val = task.validate(final=True)
        if result.val is not None:
            log.append({"step": state.step, **result.val})
        task.finish(built.model, run_dir)
    D.barrier(info)
    return result
