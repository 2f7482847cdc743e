"""General commands: config show/check and hardware check."""

from __future__ import annotations

import argparse
import json


def _config_show(args: argparse.Namespace) -> int:
    from .cli import load_cfg
    from .config import show

    print(show(load_cfg(args, stage=args.stage)), end="")
    return 0


def _config_check(args: argparse.Namespace) -> int:
    from .cli import load_cfg
    from .data.budget import check_budget

    cfg = load_cfg(args, stage=args.stage)
    print(check_budget(cfg).line())  # raises when the plan would loop over the data too often
    print(f"ok: {', '.join(f'{k}={v}' for k, v in cfg.files.items())} (hash {cfg.hash})")
    return 0


def _hardware_check(args: argparse.Namespace) -> int:
    from .cli import load_cfg
    from .runtime import check_device, resolve_hardware

    cfg = load_cfg(args, layers=("hardware",))
    info = check_device(cfg.hardware, cfg.files["hardware"])
    hw = resolve_hardware(cfg.hardware)  # what a run resolves `auto` to on this machine
    print(
        json.dumps(
            {"profile": hw.name, "dtype": hw.dtype, "compile": hw.compile, "ok": True, **info.to_dict()},
            indent=2,
        )
    )
    return 0


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("config", help="show or validate the resolved config")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    for name, fn, text in (
        ("show", _config_show, "print the resolved config with the origin of each value"),
        ("check", _config_check, "validate the config and exit"),
    ):
        c = csub.add_parser(name, parents=[common], help=text)
        c.add_argument(
            "--stage", default=None, help="apply a stage's layer selection from params.yaml (e.g. smoke)"
        )
        c.set_defaults(handler=fn)
    p = sub.add_parser("hardware", help="check the hardware profile against this machine's device")
    hsub = p.add_subparsers(dest="hardware_command", metavar="ACTION", required=True)
    c = hsub.add_parser("check", parents=[common], help="compare the profile with the real device")
    c.set_defaults(handler=_hardware_check)
