"""`enlace ablate FILE`: train the variants of an ablation file for the same wall time and table them."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from .. import paths


def command_line(args: argparse.Namespace) -> str:
    """The command that made a table, as it can be typed again."""
    words = ["enlace", "ablate", args.file]
    words += [] if args.params == "params.yaml" else ["--params", args.params]
    for layer in ("hardware", "model", "train", "data"):
        words += [f"--{layer}", getattr(args, layer)] if getattr(args, layer) else []
    for o in args.set:
        words += ["--set", o]
    words += [] if args.budget is None else ["--budget", f"{args.budget:g}"]
    words += [] if args.out is None else ["--out", args.out]
    words += [] if args.docs is None else ["--docs", args.docs]
    return shlex.join(words)


def _ablate(args: argparse.Namespace) -> int:
    from ..io import atomic_write_json, atomic_write_text
    from .runner import Selection, run_ablation
    from .spec import load_spec
    from .table import markdown, write_into

    spec = load_spec(Path(args.file))
    if args.budget is not None:
        spec = spec.model_copy(update={"budget_s": args.budget})
    select = {k: getattr(args, k) for k in ("hardware", "model", "train", "data") if getattr(args, k)}
    root = Path(args.out) if args.out else paths.RUNS / "ablate" / spec.name
    result = run_ablation(spec, Selection(args.params, select, args.set), root, command_line(args))
    table = markdown(result)
    atomic_write_json(root / "results.json", result)
    atomic_write_text(root / "table.md", table)
    if args.docs:
        write_into(Path(args.docs), spec.name, table)
    print(table, end="")
    print(f"results: {root / 'results.json'}, {root / 'table.md'}" + (f", {args.docs}" if args.docs else ""))
    return 0


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    text = "train the variants of an ablation file for the same wall time; table bits/byte, tokens, MFU"
    p = sub.add_parser("ablate", parents=[common], help=text, description=text + " (docs/ablations.md).")
    p.add_argument("file", help="ablation file (configs/ablations/NAME.yaml)")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS", help="override its budget_s")
    p.add_argument(
        "--out", default=None, help=f"folder for the runs and results (default {paths.RUNS}/ablate/NAME)"
    )
    p.add_argument(
        "--docs", default=None, metavar="PAGE", help="also write the table into PAGE (docs/ablations.md)"
    )
    p.set_defaults(handler=_ablate)
