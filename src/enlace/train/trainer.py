"""Pretraining as a task of the training loop (train/loop.py): a Llama from scratch on token shards.

The task builds the model (seeded by train.seed), AdamW with its decay/no-decay groups, and the loaders;
its loss is the model's cross-entropy plus z-loss; it evaluates bits per byte on fixed validation windows
(periodically and at the end) and names what decides the weights (the run identity). The loop does the
rest: steps, cadence, checkpoints, resume, signals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import model as model_module
from ..config import save_resolved
from ..config.kinds import applied_recipe
from ..config.resolve import Config
from ..data import loaders as loaders_module
from ..model import Llama
from ..runtime import ResolvedRun, numerics, resolve_run
from ..scoring.score import evaluate, precision
from . import dist as D
from . import loop as loop_module
from . import optim as optim_module
from . import schedule as schedule_module
from . import step as step_module
from .identity import RunIdentity, code_fingerprint, weight_keys
from .loop import NonFiniteError, RunContext, RunResult, Setup
from .optim import build_optimizer
from .schedule import lr_at
from .step import StepOutput, TrainState, seed_everything

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
STEP_CODE = (model_module, step_module, loop_module, optim_module, schedule_module, loaders_module)
# A run's outputs besides its checkpoints, archived with them when a changed run starts fresh.
RUN_FILES = ("metrics.jsonl", "metrics.json", "loss.png", "curves.csv")

__all__ = ["NonFiniteError", "PretrainRun", "PretrainTask", "RunResult", "open_pretrain", "train"]


# ---- the task -------------------------------------------------------------------------------------


def run_identity(cfg: Config, data_fingerprint: str, world_size: int, numerics: str) -> RunIdentity:
    """What decides the weights. cfg: as the run trains with it (resolved: the CPU kind's values included);
    numerics: runtime.numerics of the device it trains on."""
    d = cfg.to_dict()
    keys = weight_keys({s: d[s] for s in ("model", "data", "train")}, CADENCE_KEYS)
    keys.update(
        {
            "data.fingerprint": data_fingerprint,
            "world_size": world_size,
            "hardware.dtype": cfg.hardware.dtype,  # resolved: cpu-auto's bf16 or fp32
            "hardware.loss_scaler": cfg.hardware.loss_scaler,
            "hardware.numerics": numerics,
            "code": code_fingerprint(STEP_CODE),
        }
    )
    # The CPU kind chose these values (their effect is in the keys above; this says why). Cadence keys stay
    # out, as above: changing them by hand must not make another run.
    recipe = [k for k in applied_recipe(cfg) if k in keys]
    if recipe:
        keys["hardware.recipe"] = f"{cfg.hardware.name} {cfg.hardware.dtype}: " + ", ".join(recipe)
    return RunIdentity(keys, steps_key="train.max_steps")


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


class PretrainTask:
    """What pretraining trains; loaders default to enlace.data.loaders.make_loader (tests pass their own)."""

    section = "train"
    run_files = RUN_FILES

    def __init__(self, cfg: Config, loader: Any = None, val_loader: Any = None):
        self.cfg, self.loader, self.val_loader = cfg, loader, val_loader
        self.settings = cfg.train
        self.world_size = cfg.train.world_size
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
        self.val_windows: Any = None
        self.raw_model: Llama | None = None
        self.processes = 1  # data-parallel processes actually running (set by setup)

    def setup(self, device: torch.device, info: D.DistInfo) -> Setup:
        cfg, t = self.cfg, self.cfg.train
        self.processes = info.world_size
        if self.loader is None or self.val_loader is None:
            where = {"rank": info.rank, "world_size": info.world_size}
            self.loader = self.loader or loaders_module.make_loader(cfg, "train", **where)
            self.val_loader = self.val_loader or loaders_module.make_loader(cfg, "val", **where)
        ident = run_identity(cfg, self.loader.fingerprint, info.world_size, numerics(device))
        self.raw_model = init_model(cfg, device)
        seed_everything(t.seed + info.rank)  # per-rank streams after the shared init (dropout, if any)
        optimizer = build_optimizer(self.raw_model, t.optimizer, device.type)
        # Validation: fixed windows spread over the whole val split, scored by the eval stage's own function.
        if info.is_main:
            self.val_windows = self.val_loader.val_windows(t.eval_batches * t.micro_batch_size)
        return Setup(self.raw_model, optimizer, ident, self.loader, compile=cfg.hardware.compile)

    def batches(self, start_step: int, device: torch.device) -> Iterator[Any]:
        return micro_batches(self.loader, start_step, self.cfg.train.grad_accum_steps, device)

    def forward(self, model: torch.nn.Module, batch: Any):
        return lm_forward(model, batch, accum=self.cfg.train.grad_accum_steps)

    def step_tokens(self, out: StepOutput) -> int:
        return self.tokens_per_step

    def log_record(self, out: StepOutput, state: TrainState, seconds: float, steps: int) -> dict[str, Any]:
        tok_s = steps * self.tokens_per_step / max(seconds, 1e-9)
        return {
            "step": state.step,
            "loss": out.loss,
            **out.parts,
            "lr": out.lr,
            "grad_norm": out.grad_norm,
        } | {
            "tokens": state.tokens,
            "tokens_per_s": round(tok_s, 1),
            "skipped": state.skipped,
        }

    def validate(self, final: bool) -> dict[str, Any]:
        hw, t = self.cfg.hardware, self.cfg.train
        assert self.raw_model is not None
        v = evaluate(
            self.raw_model, self.val_windows, batch_size=t.micro_batch_size, precision=lambda: precision(hw)
        )
        extra = {"val_tokens": v["tokens"], "val_bytes": v["bytes"]} if final else {}
        return {"val_loss": v["loss"], "val_bpb": v["bpb"], **extra}

    def checkpoint_meta(self, state: TrainState) -> dict[str, Any]:
        t = self.cfg.train
        return {
            "lr": lr_at(t, state.step - 1) if state.step > 0 else 0.0,
            "next_lr": lr_at(t, state.step),
            "max_steps": t.max_steps,
            "world_size": self.processes,
            "data_fingerprint": self.loader.fingerprint,
            "config": self.cfg.to_dict(),
            "config_hash": self.cfg.hash,
        }

    def write_config(self, run_dir: Path) -> None:
        save_resolved(self.cfg, run_dir / "config.json")

    # No finish hook: the stage (train/stages.py) summarises the run from its log.


# ---- the one entry -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PretrainRun:
    """A pretraining run set up once (open_pretrain): its config as it runs on this machine, its directory
    locked, the process group joined."""

    resolved: ResolvedRun
    ctx: RunContext

    @property
    def cfg(self) -> Config:
        return self.resolved.cfg

    def train(
        self,
        *,
        loader: Any = None,
        val_loader: Any = None,
        stop_after: int | None = None,
        progress: bool = True,
        fresh: bool = False,
    ) -> RunResult:
        """Pretrain (or resume) up to cfg.train.max_steps; loaders default to data.loaders.make_loader."""
        task = PretrainTask(self.cfg, loader, val_loader)
        return loop_module.run(task, self.ctx, fresh=fresh, progress=progress, stop_after=stop_after)


@contextmanager
def open_pretrain(
    cfg: Config,
    run_dir: Path,
    *,
    announce: bool = False,
    prepare: Callable[[Config], None] | None = None,
) -> Iterator[PretrainRun]:
    """The one entry of a pretraining run: resolve the config for this CPU (runtime.resolve_run: dtype,
    compile, the CPU kind's recipe), then loop.open_run: lock the run directory, run `prepare` on the
    resolved config (the stage's preflight), join the process group. announce: print the hardware line
    first (status, on stdout as `enlace finetune` prints it)."""
    resolved = resolve_run(cfg)  # a no-op on a resolved config
    if announce:
        print(resolved.line(), flush=True)
    c = resolved.cfg
    checks = (lambda: prepare(c)) if prepare is not None else None
    with loop_module.open_run(run_dir, c.hardware, c.train.world_size, checks) as ctx:
        yield PretrainRun(resolved, ctx)


def train(
    cfg: Config,
    run_dir: Path,
    *,
    loader: Any = None,
    val_loader: Any = None,
    stop_after: int | None = None,
    progress: bool = True,
    fresh: bool = False,
) -> RunResult:
    """Pretrain (or resume) the run in run_dir up to cfg.train.max_steps: open_pretrain, then train."""
    with open_pretrain(cfg, run_dir) as run:
        return run.train(
            loader=loader, val_loader=val_loader, stop_after=stop_after, progress=progress, fresh=fresh
        )
