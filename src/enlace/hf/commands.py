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
    from ..io import require_folder, sha256_file

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


def _bench_bases(args: argparse.Namespace) -> int:
    from ..eval.bench_bases import Entry, bench_bases, table
    from ..eval.evaluate import read_prose
    from ..finetune.commands import load_finetune_cfg

    cfg = load_finetune_cfg(args)  # the assistant: the selected finetune layer's base and adapter
    ft = cfg.finetune
    prose_file = args.prose or "assets/eval/prosa-es.txt"
    entries = [
        Entry("ENLACE (pretrained here)", Path(args.own), how="run `make run` (or `dvc repro export`) first"),
        Entry("SmolLM2-135M-Instruct", paths.SMOLLM2_DIR, how="run `dvc repro import-smollm2`"),
        Entry("Gemma 3 270M", paths.MODELS / "gemma3-270m", how="run `dvc repro import-gemma3`"),
        Entry(
            f"assistant ({Path(ft.base_model).name} + LoRA)",
            Path(ft.base_model),
            Path(ft.out) / "adapter",
            how=f"fine-tune it first (`make assistant`, or `enlace finetune --finetune {ft.name}`)",
        ),
    ]
    rows = bench_bases(
        entries, read_prose(Path(prose_file)), prose_file, Path(args.assets), Path(args.bench_out), args.limit,
        args.context,
    )  # fmt: skip
    print(table(rows, prose_file), end="")
    print(f"written to {Path(args.bench_out) / 'metrics.json'} and {Path(args.bench_out) / 'table.md'}")
    missing = [r["name"] for r in rows if "missing" in r]
    if missing:
        print(f"not measured (missing): {', '.join(missing)}")
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
    p.add_argument("--gguf-type", default="f16", help="f32, f16 (default), bf16 or q8_0")
    p.set_defaults(handler=_export)

    p = sub.add_parser("bench-es", help="the project's Spanish benchmark (lm-evaluation-harness, offline)")
    p.add_argument("model_dir", help="a Hugging Face model folder (e.g. runs/export/hf)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--limit", type=int, default=None, help="items per task (default: all)")
    p.set_defaults(handler=_bench_es)

    from ..finetune.commands import _common as finetune_options

    p = sub.add_parser(
        "bench-bases",
        parents=[finetune_options()],
        help="the bases side by side: bits per byte on the prose yardstick and Spanish minimal pairs, fp32",
        description="ENLACE's pretrained model, SmolLM2-135M, Gemma 3 270M and the fine-tuned assistant (the "
        "selected finetune layer's base + runs/finetune/adapter), scored by one code path at fp32: bits per "
        "byte on the prose yardstick and accuracy on assets/bench_es. A missing model is a row saying how "
        "to make it.",
    )
    p.add_argument("--own", default=str(paths.RUNS / "export" / "hf"), help="ENLACE's exported model folder")
    p.add_argument("--prose", default=None, help="prose text (default assets/eval/prosa-es.txt)")
    p.add_argument("--assets", default=str(paths.BENCH_ES), help="minimal pairs and continuations")
    p.add_argument(
        "--out",
        dest="bench_out",
        default=str(paths.RUNS / "bench_bases"),
        help="metrics.json and table.md go here",
    )  # not `out`: that flag is the finetune run folder, where the assistant's adapter is
    p.add_argument("--limit", type=int, default=None, help="items per set (default: all)")
    p.add_argument("--context", type=int, default=512, help="tokens per prose window (default 512)")
    p.set_defaults(handler=_bench_bases)
