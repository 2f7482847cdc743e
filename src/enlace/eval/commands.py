"""`enlace eval` and `enlace generate`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from .. import paths
from ..errors import EnlaceError


def _eval(args: argparse.Namespace) -> int:
    from ..cli import load_cfg
    from ..runtime import resolve_run
    from .evaluate import read_yardsticks, run_eval, score_model_dir

    cfg = resolve_run(load_cfg(args)).cfg  # as the run it scores was resolved on this CPU
    texts = {k: v for k, v in (("prose", args.prose), ("prose_new", args.prose_new)) if v is not None}
    if texts:
        # --prose-new '' turns the second text off, as prose_new: null in params.yaml does.
        texts = {k: v or None for k, v in texts.items()}
        cfg = dataclasses.replace(cfg, eval=cfg.eval.model_copy(update=texts))
    if args.model_dir:
        # One model folder, ours or Hugging Face's: print its figures, write nothing.
        from ..runtime import setup_runtime

        device = setup_runtime(cfg.hardware)
        m = score_model_dir(Path(args.model_dir), cfg, device, read_yardsticks(cfg))
        print(json.dumps(m, indent=2, sort_keys=True))
        return 0
    from ..io import require_folder

    result = run_eval(cfg, Path(args.run_dir), require_folder(Path(args.out), "--out"))
    m = result["metrics"]
    print(json.dumps(m, indent=2, sort_keys=True))
    print(f"\nval loss {m['val_loss']:.4f}  ppl {m['val_ppl']:.2f}  bits/byte {m['val_bpb']:.4f}")
    print(bpb_table(m))
    for s in result["samples"]:
        print(f"> {s['prompt']}{s['continuation']}")
    return 0


# The bits-per-byte columns of `bpb_table`: heading and the key after "{model}_" (the run has none).
BPB_COLUMNS = (
    ("val", "val_bpb"),
    ("prose", "prose_bpb"),
    ("new", "prose_new_bpb"),
    ("both", "prose_all_bpb"),
)


def bpb_table(m: dict) -> str:
    """Bits per byte of the run and the reference models, on val and on the prose yardsticks."""
    columns = [(head, key) for head, key in BPB_COLUMNS if key in m or head in ("val", "prose")]
    rows = [("this run", [m.get(key) for _, key in columns])]
    rows += [(name, [m.get(f"{name}_{key}") for _, key in columns]) for name in ("smoke", "smollm2")]
    lines = ["bits per byte   " + "".join(f"{head:>9}" for head, _ in columns)]
    fmt = lambda v: f"{v:.4f}" if v is not None else "   -  "  # noqa: E731
    for name, values in rows:
        if all(v is None for v in values):
            continue
        lines.append(f"  {name:<14}" + "".join(f" {fmt(v):>8}" for v in values))
    files = [f"prose: {m.get('prose_file', 'eval.prose')} ({m.get('prose_bytes')} bytes)"]
    if "prose_new_bpb" in m:
        files.append(f"new: {m.get('prose_new_file', 'eval.prose_new')} ({m.get('prose_new_bytes')} bytes)")
        files.append("both: the two texts' bits over their bytes")
    lines.append("  " + "; ".join(files))
    return "\n".join(lines)


def _generate(args: argparse.Namespace) -> int:
    from ..generate import check_sampling, generate
    from ..load import load_model

    check_sampling(  # before loading a model: a bad option costs nothing
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p
    )
    loaded = load_model(args.model, args.adapter, device=args.device, weights=args.weights, head=args.head)
    if args.raw or loaded.ref.kind == "run":
        ids, prefix = loaded.encode(args.prompt), args.prompt  # our runs continue text: no chat template
    else:
        chat = loaded.chat_template
        if chat is None:
            raise EnlaceError(f"--model {args.model}: no chat template; pass --raw for a plain continuation")
        ids, prefix = chat([{"role": "user", "content": args.prompt}]), ""
    if not ids:
        raise EnlaceError(
            "the prompt is empty and the model has no start token to continue from; give a prompt"
        )
    sys.stdout.write(prefix)
    sys.stdout.flush()
    stream = loaded.stream(ids)
    sample = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    # A preamble assistant's guard against copying its examples, as `enlace serve` and `enlace judge` apply it.
    sample["copy"] = loaded.copy
    for token in generate(
        loaded.model, ids, args.max_new_tokens, eos_ids=loaded.eos_ids, device=args.device, **sample
    ):
        sys.stdout.write(stream.push(token))  # whole characters only: one may span several tokens
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _report(args: argparse.Namespace) -> int:
    """The end of `make run`: the metrics DVC tracks, and what the model writes."""
    shown = False
    for name, path in (
        ("smoke", paths.RUNS / "smoke" / "metrics.json"),
        ("eval", paths.RUNS / "eval" / "metrics.json"),
        ("finetune-eval", paths.RUNS / "finetune" / "eval.json"),
    ):
        if path.exists():
            shown = True
            data = json.loads(path.read_text(encoding="utf-8"))
            flat = {k: v for k, v in data.items() if not isinstance(v, (dict, list))}
            print(f"== {name} ({path})")
            print(
                "   "
                + "  ".join(
                    f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(flat.items())
                )
            )
            if name == "eval" and "prose_bpb" in data:
                print(bpb_table(data))
    samples = paths.RUNS / "eval" / "samples.md"
    if samples.exists():
        print(f"== samples ({samples})")
        print(samples.read_text(encoding="utf-8").strip())
    if not shown:
        raise EnlaceError("no results yet: run `make run` (or `dvc repro`) first")
    from ..serve.loader import default_in_words

    print(f"== `make serve` answers with {default_in_words(paths.RUNS / 'finetune' / 'adapter')}")
    return 0


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    from ..choices import (
        HEAD_HELP,
        DecodeWeights,
        HeadWeights,
        values,
    )  # no torch: `enlace --help` stays fast
    from ..config.extra import GENERATE

    p = sub.add_parser("eval", parents=[common], help="stage 6: val loss, perplexity, bits/byte, samples")
    p.add_argument(
        "--run-dir", default=str(paths.RUNS / "pretrain"), help="run whose latest checkpoint to evaluate"
    )
    p.add_argument(
        "--out", default=str(paths.RUNS / "eval"), help="where metrics.json, samples.md, loss.png go"
    )
    p.add_argument(
        "--model-dir",
        default=None,
        help="score only this folder (a run such as runs/smoke, or a Hugging Face folder): val and prose "
        "bits per byte, printed, nothing written",
    )
    p.add_argument("--prose", default=None, help="the prose text to score (default: eval.prose)")
    p.add_argument(
        "--prose-new",
        default=None,
        help="the second prose text, scored apart and with --prose (default: eval.prose_new; '' for none)",
    )
    p.set_defaults(handler=_eval)

    p = sub.add_parser("generate", help="continue a prompt with a trained or imported model")
    p.add_argument("prompt")
    p.add_argument(
        "--model",
        default=str(paths.RUNS / "pretrain"),
        help="our run folder (default runs/pretrain: its latest checkpoint), a Hugging Face model folder, a "
        "LoRA run folder or a .gguf file",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--adapter", default=None, help="a LoRA adapter folder (PEFT layout) for --model")
    p.add_argument("--raw", action="store_true", help="with --model: no chat template, plain continuation")
    g = GENERATE  # the sampling defaults, defined once (config/extra.py)
    p.add_argument("--max-new-tokens", type=int, default=g.max_new_tokens)
    p.add_argument("--temperature", type=float, default=g.temperature)
    p.add_argument("--top-k", type=int, default=g.top_k)
    p.add_argument("--top-p", type=float, default=g.top_p)
    p.add_argument("--seed", type=int, default=g.seed)
    p.add_argument(
        "--weights",
        default="auto",
        choices=values(DecodeWeights),
        help="decode weights (auto: bf16 on a CPU with native bf16, else fp32; int8: weight-only, CPU)",
    )
    p.add_argument(
        "--head",
        default="same",
        choices=values(HeadWeights),
        help=HEAD_HELP,
    )
    p.set_defaults(handler=_generate)

    p = sub.add_parser("report", help="print the pipeline's metrics and samples")
    p.set_defaults(handler=_report)
    _register_benchmarks(sub)


def _bench_es(args: argparse.Namespace) -> int:
    from .bench_es import run_bench

    result = run_bench(Path(args.model_dir), Path(args.out) if args.out else None, limit=args.limit)
    for task, r in result["tasks"].items():
        print(f"{task:28s} acc {r['acc']:.4f} ± {r['acc_stderr']:.4f}  (n={r['n']})")
    if args.out:
        print(f"written to {args.out}")
    else:
        print(json.dumps(result["tasks"]))
    return 0


def _bench_bases(args: argparse.Namespace) -> int:
    from ..finetune.commands import load_finetune_cfg
    from .bench_bases import Entry, bench_bases, table
    from .evaluate import read_prose

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


def _register_benchmarks(sub: argparse._SubParsersAction) -> None:
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
