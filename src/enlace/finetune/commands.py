"""Commands: finetune, finetune-eval, judge, distill, chat."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import EnlaceError

DEFAULT_LAYER = "smollm2-es"
# `enlace finetune` flags -> finetune.<key>; each is a shorthand for --set finetune.<key>=VALUE.
FLAGS = {
    "steps": "max_steps",
    "lr": "optimizer.lr",
    "rank": "rank",
    "alpha": "alpha",
    "targets": "targets",
    "max_len": "max_len",
    "examples": "max_examples",
    "batch": "micro_batch_size",
    "out": "out",
    "model": "base_model",
    "data": "train_data",
    "val_data": "val_data",
}


def _common() -> argparse.ArgumentParser:
    # Not cli.common_parser(): its --model/--data select pretraining layers, here they name a folder/file.
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("config")
    g.add_argument("--params", default="params.yaml", help="params file selecting the config layers")
    g.add_argument(
        "--hardware", default=None, metavar="NAME", help="hardware config (configs/hardware/NAME.yaml)"
    )
    g.add_argument(
        "--finetune", dest="finetune_layer", default=None, metavar="NAME",
        help=f"finetune config (configs/finetune/NAME.yaml; default {DEFAULT_LAYER})",
    )  # fmt: skip
    g.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override one value"
    )
    return p


def load_finetune_cfg(args: argparse.Namespace):
    from ..config import load_config, read_params

    # Each flag is an override whose errors name the flag (--max-len), not the key it sets.
    flags = {
        f"finetune.{key}": ("--" + attr.replace("_", "-"), getattr(args, attr))
        for attr, key in FLAGS.items()
        if getattr(args, attr, None) is not None
    }
    select = {}
    selected = read_params(args.params).get("config") or {}
    if args.finetune_layer:
        select["finetune"] = args.finetune_layer
    elif "finetune" not in selected:
        select["finetune"] = DEFAULT_LAYER
    if args.hardware:
        select["hardware"] = args.hardware
    return load_config(
        args.params, layers=("hardware", "finetune"), select=select, overrides=args.set, flags=flags
    )


def _finetune(args: argparse.Namespace) -> int:
    from ..load import check_model_folder
    from ..runtime import resolve_run
    from .train import finetune

    # Resolved once, at the start: dtype, compile and the CPU kind's recipe (docs/cpu-kinds.md).
    resolved = resolve_run(load_finetune_cfg(args))
    print(resolved.line(), flush=True)
    cfg = resolved.cfg
    check_model_folder(Path(cfg.finetune.base_model))
    result = finetune(cfg.finetune, cfg.hardware, fresh=args.fresh, progress=not args.quiet, resolved=cfg)
    print(json.dumps(result.last))
    return result.exit_code


def _finetune_eval(args: argparse.Namespace) -> int:
    from ..load import check_model_folder
    from ..runtime import resolve_run
    from .evaluate import finetune_eval

    cfg = resolve_run(load_finetune_cfg(args)).cfg  # as `enlace finetune` resolved it on this CPU
    check_model_folder(Path(cfg.finetune.base_model))
    r = finetune_eval(cfg.finetune, cfg.hardware, Path(args.adapter) if args.adapter else None)
    for a in r["answers"]:
        print(f"\n> {a['prompt']}\n[base] {a['base']}\n[finetuned] {a['finetuned']}")
    for q in r.get("questions", []):
        v = q["verdict"]
        marks = ", ".join(
            f"{name} {'yes' if v[key] else 'no'}"
            for name, key in (("Spanish", "spanish"), ("on topic", "on_topic"))
        )
        print(f"\n? {q['question']}\n[finetuned] {q['finetuned']}")
        print(
            f"  -> {'OK' if v['ok'] else 'FAIL'}: {marks}, loops {'yes' if v['loops'] else 'no'}; "
            f"keywords {v['keywords_found']}"
        )
    for who, j in r.get("judge", {}).items():
        correct = f", correct {j['correct_rate']:.0%} of {j['facts']} facts" if "correct_rate" in j else ""
        print(
            f"unseen questions ({who}): {j['ok_rate']:.0%} good; Spanish {j['spanish_rate']:.0%}, "
            f"on topic {j['on_topic_rate']:.0%}, looping {j['loops_rate']:.0%} of {j['questions']}{correct}"
        )
    if r.get("judge_decodings"):
        from .assistant import summary_table

        print(summary_table([{"assistant": who, "decodings": {d: {"summary": s} for d, s in ds.items()}}
                             for who, ds in r["judge_decodings"].items()]), end="")  # fmt: skip
    if "judge_with" in r:  # a layer in a preamble's format: its answers are the judge's, through the spec
        print(f"its answers, judged: {r['judge_with']}")
    print(
        f"\nheld-out loss: {r['loss_before']:.4f} (base) -> {r['loss_after']:.4f} (adapter); written to {Path(cfg.finetune.out) / 'eval.json'}"
    )
    return 0


def _judge(args: argparse.Namespace) -> int:
    from ..config.extra import CHAT_SAMPLING
    from ..io import atomic_write_json
    from .assistant import decoding, judge_assistant, load_assistant, summary_table
    from .judge import interleave, read_questions

    if args.table:
        return _judge_table(args.table, args.out)
    if args.rejudge:
        from .assistant import rejudge

        path = Path(args.rejudge)
        if not path.is_file():
            raise EnlaceError(f"--rejudge {path}: no such result file")
        stored = json.loads(path.read_text(encoding="utf-8"))
        result = rejudge(stored, read_questions(Path(stored.get("questions_file", args.questions))))
        atomic_write_json(path, result)
        print(summary_table([result]), end="")
        print(f"judged again, written to {path}")
        return 0
    if (args.assistant is None) == (args.model is None):
        raise EnlaceError("enlace judge: give one of --assistant SPEC or --model FOLDER")
    decodings = [d.strip() for d in args.decodings.split(",") if d.strip()]
    for d in decodings:
        decoding(d, CHAT_SAMPLING)  # a bad name fails before the model loads
    questions = read_questions(Path(args.questions), None if args.split == "all" else args.split)
    questions = interleave(questions)  # kinds in turn: a run stopped early is still a fair sample
    questions = questions[: args.limit] if args.limit else questions
    a = load_assistant(
        args.assistant, args.model, args.adapter, weights=args.weights, adapter_scale=args.adapter_scale
    )
    log = (lambda s: print(s, flush=True)) if args.verbose else (lambda s: None)  # noqa: E731
    out = Path(args.out or f"runs/judge/{a.name.replace(' ', '').replace('+', '-')}/judge.json")
    meta = {"questions_file": args.questions, "split": args.split}
    save = lambda r: atomic_write_json(out, r | meta)  # noqa: E731  (after every answer)
    result = judge_assistant(a, questions, decodings, CHAT_SAMPLING, args.max_new_tokens, log, save) | meta
    save(result)
    print(summary_table([result]), end="")
    print(f"{a.what}; {len(questions)} questions ({args.split}); written to {out}")
    return 0


def _distill(args: argparse.Namespace) -> int:
    from ..config.extra import CHAT_SAMPLING
    from ..generate import prefill
    from ..io import sha256_file
    from ..load.preamble import load_spec
    from .assistant import load_assistant, replies
    from .distill import COPY_SHARE, DATA_FILE, LENGTH, distill, read_distill_questions, write_distilled
    from .judge import interleave

    for flag, value in (
        ("--samples", args.samples),
        ("--keep", args.keep),
        ("--max-new-tokens", args.max_new_tokens),
    ):
        if value < 1:
            raise EnlaceError(f"enlace distill: {flag} {value}: must be at least 1")
    spec_path, questions_path = Path(args.assistant), Path(args.questions)
    spec = load_spec(spec_path)  # a bad spec or question file fails before the model loads
    # Kinds in turn (as the judge takes its questions): a run stopped early, or --limit, covers every kind.
    questions = interleave(read_distill_questions(questions_path))
    questions = questions[: args.limit] if args.limit else questions
    a = load_assistant(spec_path)
    log = (lambda s: print(s, flush=True)) if args.verbose else (lambda s: None)  # noqa: E731

    # The chat sampler (CHAT_SAMPLING), seeds 0 to SAMPLES-1: a question's samples are decoded together (the
    # weights read once a step for all of them), after the preamble's keys and values, computed once.
    prefix = prefill(a.model, a.encode([{"role": "user", "content": ""}]))
    drawn: dict[str, list] = {}

    def answer(question: str, seed: int):
        if question not in drawn:
            drawn.clear()
            seeds = list(range(args.samples))
            drawn[question] = replies(a, question, CHAT_SAMPLING, seeds, args.max_new_tokens, prefix)
        return drawn[question][seed]

    examples = [e.assistant for e in spec.examples]
    provenance = {
        "licence": spec.licence or "Gemma Terms of Use",
        "generated_by": a.what,
        "assistant": str(spec_path), "assistant_sha256": sha256_file(spec_path),
        "questions": str(questions_path), "questions_sha256": sha256_file(questions_path),
        "questions_used": len(questions), "samples": args.samples, "seeds": list(range(args.samples)),
        "sampler": CHAT_SAMPLING, "max_new_tokens": args.max_new_tokens, "kept_per_question": args.keep,
        "decoding": "a question's samples decoded together, after the preamble's keys and values "
                    "(generate.sample_many)",
        "filter": {"length_words": LENGTH, "copy_share": COPY_SHARE,
                   "facts": "kept when more than half of the samples give the same short answer"},
    }  # fmt: skip

    def save(records: list, rows: list) -> None:  # after every question: a stopped run keeps its answers
        write_distilled(Path(args.out), records, rows, provenance | {"questions_answered": len(rows)})

    records, rows = distill(answer, questions, args.samples, examples, args.keep, log, save)
    c = write_distilled(Path(args.out), records, rows, provenance | {"questions_answered": len(rows)})
    for kind in ("fact", "advice", "writing"):
        k = c[kind]
        print(f"{kind}: {k['with_answer']} of {k['questions']} questions kept an answer ({k['kept']} kept)")
    print(f"{len(records)} answers written to {Path(args.out) / DATA_FILE} ({provenance['licence']})")
    return 0


def _chat(args: argparse.Namespace) -> int:
    import sys

    from ..config.extra import CHAT_SAMPLING, SAMPLING_KEYS
    from ..generate import check_sampling
    from ..load import load_model
    from .chat import chat_repl

    # Only the flags given: the rest are the model's own defaults (an assistant spec may set its sampler).
    sampling = {k: getattr(args, k) for k in SAMPLING_KEYS if getattr(args, k) is not None}
    check_sampling(max_new_tokens=args.max_new_tokens, **{**CHAT_SAMPLING, **sampling})  # before loading
    if hasattr(sys.stdin, "reconfigure"):
        # Bad bytes become lone surrogates line by line (a strict decoder fails a whole buffered chunk
        # at once, naming the wrong line); chat_repl then refuses the line that holds them.
        sys.stdin.reconfigure(encoding="utf-8", errors="surrogateescape")
    loaded = load_model(args.model, args.adapter, weights=args.weights, head=args.head)  # checked first
    if loaded.chat_template is None:
        raise EnlaceError(
            f"--model {args.model}: no chat template; use `enlace generate --raw` to continue text"
        )
    chat_repl(loaded, system=args.system, max_new_tokens=args.max_new_tokens, seed=args.seed, **sampling)
    return 0


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    # The flat argparse declarations of finetune, finetune-eval and chat, in the order `enlace --help` lists them.
    ft = _common()
    p = sub.add_parser(
        "finetune",
        parents=[ft],
        help="train a LoRA adapter on instruction data",
        description="Train a LoRA adapter on instruction data (resumes the run in --out when its settings, data, "
        "base model and code are unchanged). Exit status: 0 done, 2 user error or divergence, 143/130 "
        "stopped by SIGTERM/SIGINT after saving a checkpoint (rerun to continue), 1 interrupted twice "
        "without saving the current step.",
    )
    p.add_argument("--steps", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--rank", type=int)
    p.add_argument("--alpha", type=float)
    p.add_argument("--targets", help="comma-separated, e.g. q_proj,v_proj (or q,v)")
    p.add_argument("--max-len", dest="max_len", type=int)
    p.add_argument("--examples", type=int, help="use the first N training examples (0: all)")
    p.add_argument("--batch", type=int, help="micro-batch size")
    p.add_argument("--out", help="run folder (adapter/, checkpoints/, metrics.jsonl)")
    p.add_argument("--model", help="base model folder (Hugging Face layout)")
    p.add_argument("--data", help="training JSONL")
    p.add_argument("--val-data", dest="val_data", help="held-out JSONL")
    p.add_argument("--fresh", action="store_true", help="ignore existing checkpoints")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=_finetune)

    p = sub.add_parser(
        "finetune-eval", parents=[ft], help="held-out loss before/after the adapter, sample answers"
    )
    p.add_argument("--adapter", default=None, help="adapter folder (default: <out>/adapter)")
    p.add_argument("--model", help="base model folder")
    p.add_argument("--out", help="run folder (eval.json goes here)")
    p.add_argument("--val-data", dest="val_data", help="held-out JSONL")
    p.set_defaults(handler=_finetune_eval)

    _register_judge(sub)
    _register_distill(sub)
    _register_chat(sub)


def _judge_table(paths: list[str], out: str | None) -> int:
    """Stored results side by side, in the order given: one row per file and decoding, named by both."""
    from ..io import atomic_write_text
    from .assistant import summary_table

    results = []
    for name in paths:
        path = Path(name)
        if not path.is_file():
            raise EnlaceError(f"--table {path}: no such result file")
        try:
            result = json.loads(path.read_text(encoding="utf-8"))
            result["decodings"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise EnlaceError(f"--table {path}: not an `enlace judge` result ({e.__class__.__name__})") from e
        # Two adapters on one base share a name ("gemma3-270m + LoRA"): the file names the row.
        results.append(result | {"assistant": f"{path.stem}: {result.get('assistant', '?')}"})
    table = summary_table(results)
    print(table, end="")
    if out:
        atomic_write_text(Path(out), table)
        print(f"written to {out}")
    return 0


def _register_judge(sub: argparse._SubParsersAction) -> None:
    from ..choices import DecodeWeights, values

    p = sub.add_parser(
        "judge",
        help="answer the held-out questions with an assistant and judge them (on topic, correct, Spanish, ...)",
        description="Answer every held-out question with an assistant (a preamble spec, or a model folder with "
        "its chat template and an optional LoRA adapter), with each decoding, and report each check's rate "
        "with its Wilson 95% interval: on topic, correct (fact questions), Spanish, loops, ended by itself.",
    )
    p.add_argument("--assistant", default=None, help="a preamble spec (configs/assistant/NAME.yaml)")
    p.add_argument("--model", default=None, help="or a model folder answering in its chat template")
    p.add_argument(
        "--adapter", default=None,
        help="a LoRA adapter folder: with --model, answering in the chat template; with --assistant, on the "
        "spec's base in its format (an adapter trained with finetune.preamble)",
    )  # fmt: skip
    p.add_argument(
        "--adapter-scale", type=float, default=1.0, metavar="S",
        help="the adapter's delta times S (default 1: as trained; 0: the base), as `enlace serve --adapter-scale`",
    )  # fmt: skip
    p.add_argument(
        "--weights", default="auto", choices=values(DecodeWeights),
        help="decode weights, as `enlace serve --weights` (default auto, as the server answers on this CPU)",
    )  # fmt: skip
    p.add_argument("--questions", default="assets/eval/preguntas-juez.jsonl", help="question file")
    p.add_argument(
        "--split", default="test", choices=("test", "dev", "all"), help="which questions (default test)"
    )
    p.add_argument(
        "--decodings", default="greedy,sample-0,sample-1",
        help="comma-separated: greedy (temperature 0 with the serving repetition controls) and sample-N (the "
        "chat sampler, temperature 0.7, seed N: what a request gets from a model with no sampler of its own); "
        "default greedy,sample-0,sample-1",
    )  # fmt: skip
    p.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=0, help="the first N questions only (0: all)")
    p.add_argument("--out", default=None, help="result JSON (default runs/judge/<assistant>/judge.json)")
    p.add_argument("--verbose", action="store_true", help="a line per answer")
    p.add_argument("--rejudge", default=None, metavar="JSON", help="judge a stored result's answers again")
    p.add_argument(
        "--table", nargs="+", default=None, metavar="JSON",
        help="print stored results side by side (a row per file and decoding, named by both; --out: also a file)",
    )  # fmt: skip
    p.set_defaults(handler=_judge)


def _register_distill(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "distill",
        help="answer new questions with the in-context assistant, several samples each; keep what passes",
        description="Answer every distillation question with a preamble assistant, SAMPLES times (the serving "
        "default sampler, seeds 0 to SAMPLES-1), and keep an answer only when it is Spanish, does not loop, "
        "ended by itself, is within its kind's length bounds and copies no example answer; a fact question's "
        "answers only when most samples give the same short answer. Writes OUT/distilled.jsonl (the "
        "instruction set's format), OUT/report.json (every sample with its checks) and OUT/manifest.json "
        "(provenance and licence).",
    )
    p.add_argument(
        "--assistant",
        default="configs/assistant/gemma3-preamble.yaml",
        help="a preamble spec (the default's)",
    )
    p.add_argument("--questions", default="assets/distill/preguntas-destilar.jsonl", help="question file")
    p.add_argument("--samples", type=int, default=3, help="answers drawn per question (default 3)")
    p.add_argument(
        "--keep", type=int, default=1, help="distinct answers kept per question at most (default 1)"
    )
    p.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=0, help="the first N questions only, kinds in turn (0: all)")
    p.add_argument("--out", default="runs/distill", help="output folder (default runs/distill)")
    p.add_argument("--verbose", action="store_true", help="a line per question")
    p.set_defaults(handler=_distill)


def _register_chat(sub: argparse._SubParsersAction) -> None:
    # No torch: `enlace --help` stays fast.
    from ..choices import HEAD_HELP, DecodeWeights, HeadWeights, values
    from ..config.extra import CHAT
    from ..paths import SMOLLM2_DIR

    p = sub.add_parser("chat", help="chat with a Hugging Face model folder (optionally with a LoRA adapter)")
    p.add_argument(
        "--model", default=str(SMOLLM2_DIR),
        help="a model with a chat template (a Hugging Face folder, a LoRA run folder or a .gguf file), or an "
        "assistant spec (configs/assistant/NAME.yaml: its base answers after the spec's preamble)",
    )  # fmt: skip
    p.add_argument("--adapter", default=None, help="LoRA adapter folder (PEFT layout)")
    p.add_argument("--system", default=None, help="system message")
    g = CHAT  # the sampling defaults, defined once (config/extra.py); an assistant spec's `sampling:` wins
    own = "or the assistant spec's"
    p.add_argument("--temperature", type=float, help=f"0: greedy (default {g.temperature}, {own})")
    p.add_argument("--top-k", dest="top_k", type=int, help=f"0: off (default {g.top_k}, {own})")
    p.add_argument("--top-p", dest="top_p", type=float, help=f"1: off (default {g.top_p}, {own})")
    p.add_argument(
        "--repetition-penalty", dest="repetition_penalty", type=float,
        help=f"divides the logits of tokens this reply already used; 1: off (default {g.repetition_penalty}, {own})",
    )  # fmt: skip
    p.add_argument(
        "--no-repeat-ngram", dest="no_repeat_ngram", type=int,
        help=f"never repeat an n-gram of tokens within a reply; 0: off (default {g.no_repeat_ngram}, {own})",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=g.seed)
    p.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=g.max_new_tokens)
    p.add_argument(
        "--weights",
        default="auto",
        choices=values(DecodeWeights),
        help="decode weights (auto: bf16 on a CPU with native bf16, else fp32; int8: weight-only)",
    )
    p.add_argument(
        "--head",
        default="same",
        choices=values(HeadWeights),
        help=HEAD_HELP,
    )
    p.set_defaults(handler=_chat)
