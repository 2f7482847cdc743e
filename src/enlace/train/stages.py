"""The `smoke` and `pretrain` stages: train, then summarise (metrics.json, loss.png, config.json).

smoke proves the stack on CPU in minutes: the byte-level loss must fall clearly, and resuming from a
mid-run checkpoint must reproduce the final weights bit for bit.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..config import Config
from ..data.budget import check_budget
from ..errors import EnlaceError
from ..estimate import preflight
from ..io import atomic_write_json, atomic_write_text
from ..runtime import ResolvedRun, check_device
from . import dist as D
from .checkpoint import list_checkpoints
from .loop import RunResult
from .metrics import plot_loss, read_jsonl
from .trainer import PretrainRun, open_pretrain, train

# The smoke stage fails unless the final loss is below this fraction of the first step's loss.
SMOKE_MAX_LOSS_RATIO = 0.8


class SmokeError(EnlaceError):
    """The smoke run did not learn, or did not resume exactly."""


def _prepare(cfg: Config) -> None:
    """The stage's checks, on the resolved config, before the process group is joined or anything trains."""
    # The device check comes before anything touches data or starts the run.
    check_device(cfg.hardware, cfg.files.get("hardware", "hardware profile"))
    # Memory preflight: a step that cannot fit fails now, with the micro-batch that does, not at step 1.
    preflight(cfg)
    # Data budget: refuse a plan that would loop over the data more than data.max_epochs times.
    print(check_budget(cfg, require_data=True).line(), file=sys.stderr)


def summarise(resolved: ResolvedRun, run_dir: Path, result: RunResult) -> dict[str, Any]:
    """metrics.json and loss.png from the run's log (complete even when this process only resumed)."""
    cfg, val = resolved.cfg, result.val or {}
    records = read_jsonl(run_dir / "metrics.jsonl")
    train_recs = [r for r in records if "loss" in r]
    speeds = [r["tokens_per_s"] for r in train_recs[1:]]  # the first interval includes start-up
    final_val = next((r for r in reversed(records) if "val_bytes" in r), {})
    summary = {
        "steps": result.step,
        "start_loss": train_recs[0]["loss"] if train_recs else None,
        "final_train_loss": train_recs[-1]["loss"] if train_recs else None,
        "val_loss": val.get("val_loss"),
        "val_bpb": val.get("val_bpb"),
        "val_tokens": final_val.get("val_tokens"),  # what the val figures scored
        "val_bytes": final_val.get("val_bytes"),
        "tokens_per_s": round(statistics.median(speeds), 1) if speeds else None,
        "tokens": train_recs[-1]["tokens"] if train_recs else 0,
        "skipped_steps": result.skipped,
        "config_hash": cfg.hash,
        "precision": cfg.hardware.dtype,  # resolved (cpu-auto: bf16 or fp32 by the CPU)
        "compiled": cfg.hardware.compile,  # resolved too (cpu-auto: by the CPU kind)
        "hardware": resolved.line(),  # the CPU, its kind and the kind's recipe, as the run printed it
    }
    plot_loss(records, run_dir / "loss.png", title=f"{cfg.model.name} / {cfg.train.name}")
    write_curves(records, run_dir / "curves.csv")
    return summary


def write_curves(records: list[dict[str, Any]], path: Path) -> None:
    """step, loss, lr as CSV: what `dvc plots show` draws (it reads CSV/JSON, not jsonl)."""
    rows = ["step,loss,lr"] + [f"{r['step']},{r['loss']:.6f},{r['lr']:.6g}" for r in records if "loss" in r]
    atomic_write_text(path, "\n".join(rows) + "\n")


def final_weights_equal(a: Path, b: Path) -> bool:
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def verify_resume(cfg: Config, run_dir: Path) -> tuple[bool, int]:
    """Copy the main run's second-to-last checkpoint to a scratch dir, resume it to the end, compare.

    Cheap (only the last checkpoint interval is retrained) and it exercises the full load path: model,
    optimizer, RNG and loader state, and the metrics cut-back.
    """
    ckpts = list_checkpoints(run_dir / "checkpoints")
    if len(ckpts) < 2:
        raise SmokeError(
            f"{run_dir}: need two checkpoints to verify resume, found {len(ckpts)}; "
            "lower train.checkpoint.every or raise keep_last"
        )
    mid, final = ckpts[-2], ckpts[-1]
    with tempfile.TemporaryDirectory(prefix=".resume-check-", dir=run_dir) as scratch:
        shutil.copytree(mid, Path(scratch) / "checkpoints" / mid.name)
        again = train(cfg, Path(scratch), progress=False)
        resumed = list_checkpoints(Path(scratch) / "checkpoints")[-1]
        exact = again.step == int(final.name.split("-")[1]) and final_weights_equal(final, resumed)
    return exact, int(mid.name.split("-")[1])


def smoke(cfg: Config, run_dir: Path, progress: bool = True, fresh: bool = False) -> int:
    # The run directory stays locked until the stage's summary is written.
    with open_pretrain(cfg, run_dir, announce=True, prepare=_prepare) as run:
        return _smoke(run, progress, fresh)


def pretrain(cfg: Config, run_dir: Path, progress: bool = True, fresh: bool = False) -> int:
    with open_pretrain(cfg, run_dir, announce=True, prepare=_prepare) as run:
        return _pretrain(run, progress, fresh)


def _smoke(run: PretrainRun, progress: bool, fresh: bool) -> int:
    cfg, run_dir, info = run.cfg, run.ctx.run_dir, run.ctx.info
    result = run.train(progress=progress, fresh=fresh)
    if result.interrupted:
        return result.exit_code
    summary = summarise(run.resolved, run_dir, result)
    start, end = summary["start_loss"], summary["final_train_loss"]
    if start is None or end is None or not end < SMOKE_MAX_LOSS_RATIO * start:
        raise SmokeError(
            f"smoke: the loss did not fall clearly: {start} -> {end} in {result.step} steps "
            f"(needs below {SMOKE_MAX_LOSS_RATIO} x start); check the learning rate and the data"
        )
    exact, from_step = verify_resume(cfg, run_dir)
    summary["resume_exact"] = exact
    summary["resume_checked_from_step"] = from_step
    if info.is_main:
        atomic_write_json(run_dir / "metrics.json", summary)
    if not exact:
        raise SmokeError(
            f"smoke: resuming from step {from_step} did not reproduce the final weights bit for bit"
        )
    print(f"smoke: loss {start:.2f} -> {end:.2f} in {result.step} steps, resume exact")
    D.cleanup(info)
    return 0


def _pretrain(run: PretrainRun, progress: bool, fresh: bool) -> int:
    run_dir, info = run.ctx.run_dir, run.ctx.info
    result = run.train(progress=progress, fresh=fresh)
    if result.interrupted:
        D.cleanup(info)
        return result.exit_code
    if info.is_main:
        summary = summarise(run.resolved, run_dir, result)
        atomic_write_json(run_dir / "metrics.json", summary)
        print(
            f"pretrain: {result.step} steps, train loss {summary['final_train_loss']:.3f}, "
            f"val loss {summary['val_loss']:.3f} ({summary['val_bpb']:.3f} bits/byte), "
            f"{summary['tokens_per_s']} tokens/s"
        )
    D.cleanup(info)
    return 0
