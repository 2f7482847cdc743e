"""Commands: export (a run, or base + LoRA adapter merged, to a Hugging Face folder and GGUF) and bench-es."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .. import paths
from ..errors import EnlaceError


def _export(args: argparse.Namespace) -> int:
    from ..export import export_merged, export_run
    from .gguf_export import FILE_TYPES, export_folder_gguf

    if args.gguf_type not in FILE_TYPES:
        raise EnlaceError(f"--gguf-type {args.gguf_type!r}: choose one of {sorted(FILE_TYPES)}")
    if (args.model is None) != (args.adapter is None):
        raise EnlaceError("--model and --adapter go together (a base folder and the LoRA adapter to merge)")
    from ..io import require_folder

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
        print(f"wrote {gguf} ({args.gguf_type})")
    info = Path(out) / "export.json"
    from ..io import atomic_write_json

    atomic_write_json(info, result)
    return 0


def _bench_es(args: argparse.Namespace) -> int:
    from ..eval.bench_es import run_bench

    result = run_bench(Path(args.model_dir), Path(args.out) if args.out else None, limit=args.limit)
    for task, r in result["tasks"].items():
        print(f"{task:28s} acc {r['acc']:.4f} ± {r['acc_stderr']:.4f}  (n={r['n']})")
    if args.out:
        print(f"written to {args.out}")
    else:
        print(json.dumps(result["tasks"]))
    return 0


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
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
    p.add_argument("--gguf-type", default="f16", help="f32, f16 (default) or bf16")
    p.set_defaults(handler=_export)

    p = sub.add_parser("bench-es", help="the project's Spanish benchmark (lm-evaluation-harness, offline)")
    p.add_argument("model_dir", help="a Hugging Face model folder (e.g. runs/export/hf)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--limit", type=int, default=None, help="items per task (default: all)")
    p.set_defaults(handler=_bench_es)
