"""`enlace eval` and `enlace generate`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import paths


def _eval(args: argparse.Namespace) -> int:
    from ..cli import load_cfg
    from .evaluate import run_eval

    cfg = load_cfg(args)
    result = run_eval(cfg, Path(args.run_dir), Path(args.out))
    m = result["metrics"]
    print(json.dumps(m, indent=2, sort_keys=True))
    print(f"\nval loss {m['val_loss']:.4f}  ppl {m['val_ppl']:.2f}  bits/byte {m['val_bpb']:.4f}", end="")
    if m.get("smoke_val_bpb") is not None:
        print(f"  (byte-level smoke model: {m['smoke_val_bpb']:.4f})", end="")
    print()
    for s in result["samples"]:
        print(f"> {s['prompt']}{s['continuation']}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from ..generate import generate

    if args.model:
        # A Hugging Face folder (e.g. the imported SmolLM2), optionally with a LoRA adapter.
        from ..finetune.generation import load_for_generation

        model, tok = load_for_generation(Path(args.model), Path(args.adapter) if args.adapter else None)
        ids = tok.encode_prompt(args.prompt, chat=not args.raw)
        eos, decode, device = tok.eos_ids, tok.decode, "cpu"
        prefix = "" if not args.raw else args.prompt
    else:
        from ..cli import load_cfg
        from ..hardware import setup_runtime
        from ..text import codec_for
        from .evaluate import load_trained_model

        cfg = load_cfg(args, layers=("hardware", "model", "train", "data"))
        device = setup_runtime(cfg.hardware)
        model, meta, _ = load_trained_model(Path(args.run_dir), device)
        codec = codec_for(meta["config"]["train"]["loader"], paths.TOKENIZER)
        ids, eos, decode, prefix = codec.encode(args.prompt), codec.eos_ids, codec.decode, args.prompt
    sys.stdout.write(prefix)
    sys.stdout.flush()
    new: list[int] = []
    printed = ""
    for token in generate(
        model,
        ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_ids=eos,
        device=device,
    ):
        new.append(token)
        text = decode(new)
        # Stream only whole characters: a multi-byte character may span several tokens.
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(printed) :])
            sys.stdout.flush()
            printed = text
    sys.stdout.write("\n")
    return 0


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("eval", parents=[common], help="stage 6: val loss, perplexity, bits/byte, samples")
    p.add_argument(
        "--run-dir", default=str(paths.RUNS / "pretrain"), help="run whose latest checkpoint to evaluate"
    )
    p.add_argument(
        "--out", default=str(paths.RUNS / "eval"), help="where metrics.json, samples.md, loss.png go"
    )
    p.set_defaults(handler=_eval)

    p = sub.add_parser(
        "generate", parents=[common], help="continue a prompt with a trained or imported model"
    )
    p.add_argument("prompt")
    p.add_argument("--run-dir", default=str(paths.RUNS / "pretrain"), help="our run to sample from (default)")
    p.add_argument("--model", default=None, help="a Hugging Face model folder instead of our run")
    p.add_argument("--adapter", default=None, help="a LoRA adapter folder (PEFT layout) for --model")
    p.add_argument("--raw", action="store_true", help="with --model: no chat template, plain continuation")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=_generate)
