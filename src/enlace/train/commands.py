"""`enlace smoke` and `enlace pretrain`."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import paths


def _run(args: argparse.Namespace, stage: str) -> int:

    from ..cli import load_cfg
    from . import stages

    # The stage resolves the hardware once (dtype, compile and the CPU kind's recipe: docs/cpu-kinds.md) and
    # prints it, on stdout as `enlace finetune` prints it: stderr carries errors alone, one line each.
    cfg = load_cfg(args, stage="smoke" if stage == "smoke" else None)
    run_dir = Path(args.run_dir) if args.run_dir else paths.RUNS / stage
    fn = stages.smoke if stage == "smoke" else stages.pretrain
    return fn(cfg, run_dir, progress=not args.no_progress, fresh=args.fresh)


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    for stage, text in (
        (
            "smoke",
            "stage 4: train the byte-level smoke model on CPU; check the loss falls and resume is exact",
        ),
        ("pretrain", "stage 5: pretrain the selected config (resumes from the last complete checkpoint)"),
    ):
        p = sub.add_parser(
            stage,
            parents=[common],
            help=text,
            description=text
            + ". Exit status: 0 done, 2 user error or divergence, 143/130 stopped by SIGTERM/SIGINT"
            " after saving a checkpoint (rerun to continue), 1 interrupted twice: stopped without saving the"
            " current step (the message names the last complete checkpoint). Under torchrun, set"
            " train.world_size.",
        )
        p.add_argument("--run-dir", default=None, help=f"run directory (default {paths.RUNS}/{stage})")
        p.add_argument(
            "--fresh",
            action="store_true",
            help="remove the run's checkpoints and outputs first instead of resuming",
        )
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        p.set_defaults(handler=lambda a, s=stage: _run(a, s))
