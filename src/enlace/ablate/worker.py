"""One ablation run in its own process: resolve the config as `enlace ablate` did, then `pretrain` it.

A fresh process per run, so no run inherits another's thread pools, allocator state or compiled code, and
its wall time is what `enlace pretrain` would take. Usage (the harness builds it):
`python -m enlace.ablate.worker --params P [--stage S] [--select LAYER=NAME ...] [--set K=V ...] RUN_DIR`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..config import load_config
from ..errors import EnlaceError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m enlace.ablate.worker")
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--stage", default=None)
    p.add_argument("--select", action="append", default=[], metavar="LAYER=NAME")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("run_dir", type=Path)
    a = p.parse_args(argv)
    from ..train.stages import pretrain

    try:
        select = dict(s.split("=", 1) for s in a.select)
        cfg = load_config(a.params, select=select, overrides=a.set, stage=a.stage)
        return pretrain(cfg, a.run_dir, progress=False, fresh=True)
    except EnlaceError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
