"""General commands: config show/check, hardware check, the memory estimate, export (a run, or base + LoRA
adapter merged, to a Hugging Face folder and GGUF) and verify (an artifact against its manifest)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from . import paths
from .errors import EnlaceError

if TYPE_CHECKING:
    from .config.hardware import HardwareConfig


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


def run_stages(
    hw: HardwareConfig, stages: list[str], kind: str | None = None
) -> tuple[list[str], list[str], str | None]:
    """`stages` less those a CPU kind (default: this machine's) leaves out of `make run` (CpuKind.run_skips):
    (kept, left out, the kind). A profile that names its dtype has no kind and keeps them all."""
    from .runtime import resolve_cpu_dtype

    if hw.dtype != "auto" or not hw.kinds:
        return list(stages), [], None
    kind = kind or resolve_cpu_dtype()
    skips = set(hw.kinds[kind].run_skips)
    return [s for s in stages if s not in skips], [s for s in stages if s in skips], kind


def _hardware_run_stages(args: argparse.Namespace) -> int:
    from .cli import load_cfg

    cfg = load_cfg(args, layers=("hardware",))
    kept, left, kind = run_stages(cfg.hardware, args.stages)
    if left:
        print(
            f"make run: the {kind} CPU kind leaves out {', '.join(left)} ({cfg.files['hardware']}, "
            f"kinds.{kind}.run_skips); `dvc repro {' '.join(left)}` runs it",
            file=sys.stderr,
            flush=True,
        )
    if not kept:
        raise EnlaceError(
            f"make run: the {kind} CPU kind leaves out every stage asked for ({' '.join(left)})"
        )
    print(" ".join(kept))
    return 0


def _estimate(args: argparse.Namespace) -> int:
    from .cli import load_cfg
    from .estimate import (
        estimate_training_memory,
        format_estimate,
        largest_fitting_micro_batch,
        suggest_geometry,
    )
    from .runtime import resolve_run

    # As the run would train on this CPU: cpu-auto's dtype and the CPU kind's recipe.
    cfg = resolve_run(load_cfg(args, layers=("hardware", "model", "train"), stage=args.stage)).cfg
    model, hw, train = cfg.layers["model"], cfg.layers["hardware"], cfg.layers["train"]
    mb = args.micro_batch or train.micro_batch_size
    est = estimate_training_memory(model, hw, mb, args.seq_len)
    if args.json:
        print(json.dumps(est.to_dict(), indent=2))
    else:
        print(format_estimate(est))
        if not est.fits:
            fitting = largest_fitting_micro_batch(model, hw, args.seq_len)
            geometry = suggest_geometry(fitting, train.global_batch_size, train.world_size)
            if geometry:
                print(
                    f"largest micro_batch_size that fits: {fitting}; keep global_batch_size "
                    f"{train.global_batch_size} with --set train.micro_batch_size={geometry[0]} "
                    f"--set train.grad_accum_steps={geometry[1]}"
                )
            else:
                print(f"largest micro_batch_size that fits: {fitting}")
    return 0 if est.fits else 1


def _register_estimate(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "estimate",
        parents=[common],
        help="predict the peak memory of a training step and whether it fits the hardware profile",
    )
    p.add_argument(
        "--micro-batch", type=int, default=None, help="micro-batch size (default: the train config's)"
    )
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: model.seq_len)")
    p.add_argument(
        "--stage", default=None, help="apply a stage's layer selection from params.yaml (e.g. smoke)"
    )
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.set_defaults(handler=_estimate)


def _adopt(path: Path) -> None:
    """Write the manifest of an artifact made before manifests existed, with what its files still say."""
    from .hf.folder import write_model_manifest
    from .manifest import guess_kind, write_file_manifest, write_manifest

    kind = guess_kind(path)
    note = {"adopted": "by `enlace verify --write`: the files as found, not checked against their origin"}
    if path.is_file():
        write_file_manifest(path, kind, note)
    elif kind in ("hf-model", "imported-model"):
        write_model_manifest(path, kind, note)
    elif kind == "lora-adapter":
        from safetensors import safe_open

        from .lora import ADAPTER_WEIGHTS, FINGERPRINT_KEY, read_adapter_config

        with safe_open(str(path / ADAPTER_WEIGHTS), framework="pt") as f:
            fingerprint = (f.metadata() or {}).get(FINGERPRINT_KEY)
        base = read_adapter_config(path).get("base_model_name_or_path")
        write_manifest(path, kind, {**note, "base_model": base, "base_fingerprint": fingerprint})
    else:
        report = path / "report.json"
        config_hash = (
            json.loads(report.read_text(encoding="utf-8")).get("config_hash") if report.is_file() else None
        )
        write_manifest(path, kind, {**note, "config_hash": config_hash or None})
    print(f"adopted {path}: wrote its manifest ({kind})")


def _verify(args: argparse.Namespace) -> int:
    from .manifest import ManifestError, check_export_gguf, has_manifest, verify_artifact

    path = Path(args.path)
    if not path.exists():
        raise EnlaceError(f"{path}: no such file or folder")
    if not has_manifest(path):
        if not args.write:
            raise ManifestError(
                f"{path}: no manifest (written before manifests existed); `enlace verify {path} --write` adopts it"
            )
        _adopt(path)
    doc = verify_artifact(path)
    assert doc is not None  # has_manifest held or _adopt wrote one
    files = sorted(doc["files"])
    print(f"ok: {path}: {doc['kind']}, written by enlace {doc.get('enlace_version', '?')}")
    for key, value in sorted(doc.get("provenance", {}).items()):
        print(f"  {key}: {', '.join(map(str, value)) if isinstance(value, list) else value}")
    print(f"  files checked (size and sha256): {len(files)}: {', '.join(files)}")
    gguf = check_export_gguf(path) if path.is_dir() else None
    if gguf:
        print(f"  {gguf}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from .export import export_merged, export_run
    from .hf.gguf_export import FILE_TYPES, export_folder_gguf

    if args.gguf_type not in FILE_TYPES:
        raise EnlaceError(f"--gguf-type {args.gguf_type!r}: choose one of {sorted(FILE_TYPES)}")
    if (args.model is None) != (args.adapter is None):
        raise EnlaceError("--model and --adapter go together (a base folder and the LoRA adapter to merge)")
    from .io import require_folder, sha256_file

    out = require_folder(Path(args.out), "--out")
    model = None
    if args.adapter:
        result = export_merged(Path(args.model), Path(args.adapter), out)
        model = result.pop("model")
    else:
        result = export_run(Path(args.run_dir), out)
    print(f"wrote {out}: {result['architecture']}, tied embeddings {result['tied_embeddings']}")
    print(f"tokenizer: {result['tokenizer']}")
    if args.gguf is not None:
        gguf = Path(args.gguf) if args.gguf else out.parent / f"{out.name}-{args.gguf_type}.gguf"
        export_folder_gguf(out, gguf, args.gguf_type, model)
        result["gguf"] = str(gguf)
        result["gguf_sha256"] = sha256_file(gguf)
        print(f"wrote {gguf} ({args.gguf_type}, sha256 {result['gguf_sha256']})")
    info = Path(out) / "export.json"
    from .io import atomic_write_json

    atomic_write_json(info, result)
    return 0


def _register_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a run's newest checkpoint (or --model + --adapter merged) as a Hugging Face folder [+ GGUF]",
    )
    p.add_argument(
        "--run-dir", default=str(paths.RUNS / "pretrain"), help="run to export (default runs/pretrain)"
    )
    p.add_argument("--out", default=str(paths.RUNS / "export" / "hf"), help="output folder")
    p.add_argument("--model", default=None, help="with --adapter: the base Hugging Face folder")
    p.add_argument("--adapter", default=None, help="with --model: a LoRA adapter folder to merge in")
    p.add_argument(
        "--gguf", nargs="?", const="", default=None, metavar="PATH",
        help="also write GGUF (default path: <out>-<type>.gguf beside the folder)",
    )  # fmt: skip
    p.add_argument("--gguf-type", default="f16", help="f32, f16 (default), bf16 or q8_0")
    p.set_defaults(handler=_export)


def _register_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="check an artifact (adapter, model folder, tokenizer, GGUF) against its manifest; say where it came from",
        description="Checks every file an artifact's manifest lists (size, then sha256) and prints what the "
        "artifact is and where it came from (kind, base model fingerprint, config hash). A folder's manifest "
        "is its manifest.json; a GGUF's is the sidecar <file>.manifest.json. A mismatch is one line naming "
        "the file, exit status 2.",
    )
    p.add_argument(
        "path", help="an artifact folder (runs/finetune/adapter, runs/export/hf, ...) or a GGUF file"
    )
    p.add_argument(
        "--write",
        action="store_true",
        help="adopt an artifact written before manifests existed: write its manifest from the files as they are",
    )
    p.set_defaults(handler=_verify)


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
    c = hsub.add_parser(
        "run-stages", parents=[common],
        help="the stages given, less those this machine's CPU kind leaves out of `make run` (kinds.KIND.run_skips)",
    )  # fmt: skip
    c.add_argument("stages", nargs="+", metavar="STAGE")
    c.set_defaults(handler=_hardware_run_stages)
    _register_estimate(sub, common)
    _register_export(sub)
    _register_verify(sub)
