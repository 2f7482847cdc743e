"""The training loop: every training run, pretraining or LoRA fine-tuning, goes through `open_run` and `run`.

A task (train/trainer.py `PretrainTask`, finetune/train.py `FinetuneTask`) says what is trained: it builds
the model, the optimizer and the batches, gives the loss, the run identity, what is logged and, through its
optional hooks, what is evaluated, recorded and written at the end. The loop alone owns how a run goes:

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
from contextlib import contextmanager
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
from .metrics import MetricsLog, read_jsonl
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
    """What every task has. Its optional hooks, called only where the task defines them:

    - `validate(final: bool) -> dict | None`: an evaluation, logged (every settings.eval_every steps, if
      the settings have it, and at the end; the final one is RunResult.val);
    - `checkpoint_meta(state: TrainState) -> dict`: extra metadata for each checkpoint's meta.json;
    - `write_config(run_dir: Path) -> None`: the resolved config beside the run;
    - `finish(model: nn.Module, run_dir: Path) -> None`: the task's outputs once the last step is done.
    """

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


def hook(task: Task, name: str) -> Callable[..., Any] | None:
    """The task's optional hook `name`, or None where the task has none."""
    return getattr(task, name, None)


@dataclass
class RunResult:
    """What a run did: pretraining and fine-tuning both return it."""

    run_dir: Path
    step: int  # optimizer steps completed
    end_loss: float | None = None  # loss of the last step this process ran
    # The last step record: from the run's log on the main process (a rerun of a finished run steps
    # nothing but reports its end), else the last one this process made.
    last: dict[str, Any] = field(default_factory=dict)
    val: dict[str, Any] | None = None  # the final evaluation, when this process ran it
    skipped: int = 0  # non-finite steps skipped over the whole run
    interrupted: str | None = None  # "SIGTERM"/"SIGINT" when a signal stopped the run
    resumed_from: int | None = None

    @property
    def exit_code(self) -> int:
        # 128 + signal number, the shell convention: a preempted run is not a finished run, so a pipeline
        # (dvc repro) must not record its outputs; the saved checkpoint makes the rerun continue.
        return {"SIGTERM": 128 + signal.SIGTERM, "SIGINT": 128 + signal.SIGINT}.get(self.interrupted or "", 0)


@dataclass(frozen=True)
class RunContext:
    """A run directory set up for training: locked, the process group joined, the runtime set up."""

    run_dir: Path
    hw: HardwareConfig
    info: D.DistInfo
    device: torch.device


@contextmanager
def open_run(
    run_dir: Path, hw: HardwareConfig, world_size: int, prepare: Callable[[], None] | None = None
) -> Iterator[RunContext]:
    """The one setup of a training run, held for the block: the run directory's lock (rank 0 takes it: the
    ranks share the directory), the caller's checks (`prepare`), the process group torchrun set up, the
    runtime (threads, determinism). The lock is re-entrant within a process."""
    run_dir = Path(run_dir)
    with run_dir_lock(run_dir, enabled=D.env_rank() == 0):
        if prepare is not None:
            prepare()
        info = D.init_distributed(hw.device, world_size)
        yield RunContext(run_dir, hw, info, setup_runtime(hw))


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
        if write_config := hook(task, "write_config"):
            write_config(run_dir)
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
        extra = hook(task, "checkpoint_meta")
        meta.update({"identity": ident.hash, "identity_keys": ident.keys, **(extra(state) if extra else {})})
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
    ctx: RunContext,
    *,
    fresh: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
) -> RunResult:
    """Train (or resume) the run in ctx.run_dir up to task.settings.max_steps.

    stop_after: checkpoint and return after that many steps, as an interrupted run would (gpu-check and
    the tests stop a run at a known step this way).
    """
    start_run_dir(task, ctx.run_dir, fresh, ctx.info)
    return _Loop(task, ctx).run(progress, stop_after)


class _Loop:
    """One run's loop, in three parts read top to bottom as nanoGPT's train.py: build and resume, the
    steps, the end."""

    built: Setup  # what the task built (build)
    state: TrainState
    last_time: float  # when the last step record was made, and at which step: its tokens/s interval
    last_step: int

    def __init__(self, task: Task, ctx: RunContext):
        self.task, self.ctx, self.cfg = task, ctx, task.settings
        self.run_dir, self.info, self.device = ctx.run_dir, ctx.info, ctx.device
        self.log = MetricsLog(ctx.run_dir / "metrics.jsonl", enabled=ctx.info.is_main)

    def run(self, progress: bool, stop_after: int | None) -> RunResult:
        model, result = self.build()
        self.steps(model, result, progress, stop_after)
        return self.end(result)

    def build(self) -> tuple[nn.Module, RunResult]:
        """The task's model and optimizer, resumed from what this run may continue from, wrapped for the
        steps (torch.compile, DDP)."""
        self.built = built = self.task.setup(self.device, self.info)
        self.state = TrainState(
            built.model,
            built.optimizer,
            make_scaler(self.device, self.ctx.hw),
            self.device,
            built.loader,
            built.trainable_only,
        )
        resumed_from = resume(self.task, self.state, self.run_dir, built.identity, self.info)
        if resumed_from is None:
            self.log.reset()  # a log without any checkpoint belongs to a run that died before its first save
        else:
            # The final evaluation comes after the last checkpoint: a run resumed at the target redoes it.
            self.log.truncate_after(resumed_from, keep_val_at_step=resumed_from != self.cfg.max_steps)

        model: nn.Module = torch.compile(built.model) if built.compile else built.model
        if self.info.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            cuda = self.device.type == "cuda"
            model = DDP(model, device_ids=[self.info.local_rank] if cuda else None)
        model.train()
        return model, RunResult(self.run_dir, self.state.step, resumed_from=resumed_from)

    def steps(self, model: nn.Module, result: RunResult, progress: bool, stop_after: int | None) -> None:
        """Step until max_steps, a signal or stop_after; log, evaluate and checkpoint on their cadence."""
        from tqdm import tqdm

        task, cfg, state, info = self.task, self.cfg, self.state, self.info
        opts = StepSettings(cfg.grad_accum_steps, cfg.optimizer.grad_clip, self.ctx.hw, info)
        batches = task.batches(state.step, self.device)
        batch = next(batches)
        show = progress and info.is_main
        bar = tqdm(
            total=cfg.max_steps, initial=state.step, disable=not show, dynamic_ncols=True, desc=task.section
        )
        self.last_time, self.last_step = time.perf_counter(), state.step
        try:
            with StopFlag() as stop:
                while state.step < cfg.max_steps:
                    lr = lr_at(cfg, state.step)
                    out, batch = train_step(
                        state, model, batch, lambda: next(batches), task.forward, lr, opts
                    )
                    state.tokens += task.step_tokens(out)
                    result.end_loss = out.loss
                    if state.nonfinite_in_row >= cfg.max_nonfinite_in_row:
                        raise diverged(task, state, self.run_dir)
                    self.log_step(out, result)
                    bar.update(1)
                    bar.set_postfix(loss=f"{out.loss:.4f}", lr=f"{out.lr:.2e}", refresh=False)
                    self.evaluate()
                    if self.checkpoint(stop.signal, result, stop_after):
                        break
        except SecondInterrupt:
            raise abandoned(state.step, list_checkpoints(self.run_dir / "checkpoints")) from None
        bar.close()

    def log_step(self, out: StepOutput, result: RunResult) -> None:
        """The step's log record, on the log's cadence (and the first and last step)."""
        cfg, step = self.cfg, self.state.step
        if step == 1 or step % cfg.log_every == 0 or step == cfg.max_steps:
            now = time.perf_counter()
            result.last = self.task.log_record(out, self.state, now - self.last_time, step - self.last_step)
            self.last_time, self.last_step = now, step
            self.log.append(result.last)

    def evaluate(self) -> None:
        """The periodic evaluation, every settings.eval_every steps where the settings have it (pretraining;
        0 or absent: only at the end) and the task can validate."""
        step, every, validate = (
            self.state.step,
            getattr(self.cfg, "eval_every", 0),
            hook(self.task, "validate"),
        )
        if validate and self.info.is_main and every and step % every == 0 and step != self.cfg.max_steps:
            v = validate(final=False)
            if v is not None:
                self.log.append({"step": step, **v})

    def checkpoint(self, signal_name: str | None, result: RunResult, stop_after: int | None) -> bool:
        """Save on the checkpoint cadence, at the end, at stop_after, before the decay and when a signal
        came (to any rank); True when the loop stops here."""
        cfg, step, info = self.cfg, self.state.step, self.info
        stop_now = D.any_across(info, signal_name is not None, self.device)
        due = step % cfg.checkpoint.every == 0 or step in (cfg.max_steps, stop_after, pinned_step(cfg))
        if due or stop_now:
            save(self.task, self.state, self.run_dir, self.built.identity, info)
        if stop_now:
            result.interrupted = signal_name or "SIGTERM"  # another rank got the signal
            if info.is_main:
                saved = list_checkpoints(self.run_dir / "checkpoints")[-1]
                print(
                    f"{self.task.section}: stopped by {result.interrupted} at step {step}; checkpoint saved "
                    f"to {saved}. Rerun the same command to continue",
                    flush=True,
                )
            return True
        return step == stop_after

    def end(self, result: RunResult) -> RunResult:
        """The final evaluation and the task's outputs, once the last step is done."""
        state, info = self.state, self.info
        result.step, result.skipped = state.step, state.skipped
        if state.step == self.cfg.max_steps and info.is_main:
            if validate := hook(self.task, "validate"):
                result.val = validate(final=True)
                if result.val is not None:
                    self.log.append({"step": state.step, **result.val})
            if finish := hook(self.task, "finish"):
                finish(self.built.model, self.run_dir)
        if info.is_main:
            result.last = ([r for r in read_jsonl(self.log.path) if "loss" in r] or [result.last])[-1]
        D.barrier(info)
        return result
