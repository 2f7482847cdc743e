"""The `enlace` command line. Each area registers its own subcommands; this file only wires them.

User errors (bad config, missing data, wrong device) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from .errors import EnlaceError

# Modules with a `register(subparsers, common)` function, in the order `enlace --help` lists them.
COMMAND_MODULES = [
    "enlace.commands",
    "enlace.data.commands",
    "enlace.train.commands",
    "enlace.eval.commands",
    "enlace.hf.commands",
    "enlace.finetune.commands",
    "enlace.serve.commands",
    "enlace.ablate.commands",
]


def common_parser() -> argparse.ArgumentParser:
    """Options every config-reading command shares: which layer files, and overrides."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("config")
    g.add_argument("--params", default="params.yaml", help="params file selecting the config layers")
    for layer in ("hardware", "model", "train", "data"):
        g.add_argument(
            f"--{layer}",
            default=None,
            metavar="NAME",
            help=f"{layer} config (configs/{layer}/NAME.yaml or a path)",
        )
    g.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one value (repeatable)",
    )
    return p


def load_cfg(args: argparse.Namespace, layers=None, stage: str | None = None):
    """Resolve the config for a command; `stage` applies that stage's section of params.yaml (layers, set)."""
    from .config import load_config
    from .config.resolve import PRETRAIN_LAYERS

    select = {
        k: getattr(args, k, None) for k in ("hardware", "model", "train", "data") if getattr(args, k, None)
    }
    return load_config(
        args.params, layers=tuple(layers or PRETRAIN_LAYERS), select=select, overrides=args.set, stage=stage
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="enlace",
        description="ENLACE: pretrain a Spanish language model and fine-tune Llama-family models with LoRA.\n"
        "Pipeline stages: fetch -> tokenize -> shard -> smoke -> pretrain -> eval, export (dvc repro runs them all).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"enlace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    common = common_parser()
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int | None] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    try:
        return int(handler(args) or 0)
    except EnlaceError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
