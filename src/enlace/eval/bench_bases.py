"""`enlace bench-bases` (`make bench-es`): the bases side by side on the same Spanish texts, at one precision.

Every model is loaded the same way (transformers, fp32 weights, a LoRA adapter merged by PEFT) and scored by
the same code: bits per byte on the prose yardstick (eval.prose) and accuracy on the project's Spanish
minimal pairs and continuations (assets/bench_es, compared by summed log-likelihood as lm-eval does).

Every text is scored after the token the model was trained to see at the start of a document: the one its
tokenizer puts there itself (Gemma's <bos>, our exports' document separator), else <|endoftext|> (SmolLM2's
document separator), else bos, else eos. A text fed without it is what makes a multilingual model look
near chance: Gemma 3 without <bos> (measured on this yardstick in docs/assistant.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import EnlaceError
from ..io import atomic_write_json, atomic_write_text

PAIR_FILES = (
    "pares_genero", "pares_numero", "pares_ser_estar", "pares_subjuntivo",
    "pares_cliticos", "pares_preposiciones", "pares_tildes",
)  # fmt: skip
CONTEXT = 512  # tokens per prose window (fewer where a model's context is shorter), moved by half


@dataclass(frozen=True)
class Entry:
    name: str
    folder: Path
    adapter: Path | None = None
    how: str = ""  # how to make the folder when it is missing


def start_ids(tok: Any) -> list[int]:
    """The ids a document starts with, for this tokenizer's model (see the module docstring)."""
    own = tok("a")["input_ids"]
    bare = tok("a", add_special_tokens=False)["input_ids"]
    if len(own) > len(bare) and own[-len(bare) :] == bare:
        return own[: len(own) - len(bare)]
    vocab = tok.get_vocab()
    for i in (vocab.get("<|endoftext|>"), tok.bos_token_id, tok.eos_token_id):
        if i is not None:
            return [i]
    raise EnlaceError(f"{tok.name_or_path}: the tokenizer has no start, bos or eos token to begin a text")


def load(entry: Entry) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..manifest import verify_manifest

    # transformers and PEFT read the files themselves: check them against their manifests first.
    for folder in (entry.folder, entry.adapter):
        if folder is not None:
            verify_manifest(Path(folder))
    tok = AutoTokenizer.from_pretrained(entry.folder)
    model = AutoModelForCausalLM.from_pretrained(entry.folder, dtype=torch.float32)
    if entry.adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(entry.adapter)).merge_and_unload()
    return model.eval(), tok


@torch.no_grad()
def token_logprobs(model: Any, ids: list[list[int]]) -> list[torch.Tensor]:
    """log p(ids[j] | ids[:j]) for j >= 1 of each sequence (right padding, one batch)."""
    T = max(len(s) for s in ids)
    x = torch.zeros((len(ids), T), dtype=torch.long)
    mask = torch.zeros((len(ids), T), dtype=torch.long)
    for i, s in enumerate(ids):
        x[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    logits = model(input_ids=x, attention_mask=mask).logits.float()
    out = []
    for i, s in enumerate(ids):
        lp = torch.log_softmax(logits[i, : len(s) - 1], dim=-1)
        out.append(lp.gather(1, torch.tensor(s[1:]).unsqueeze(1)).squeeze(1))
    return out


def prose_bpb(model: Any, tok: Any, text: str, context: int = CONTEXT) -> dict[str, Any]:
    """Bits per byte of the whole text: windows of `context` tokens, each starting with the start ids, moved
    by half a window; every text token is scored once, so the bits cover exactly the text's UTF-8 bytes."""
    start = start_ids(tok)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    limit = getattr(model.config, "max_position_embeddings", None) or context
    length = min(context, limit) - len(start)  # text tokens per window
    stride = max(1, length // 2)
    nats, done, pos = 0.0, 0, 0  # done: text tokens scored so far; pos: where the window starts
    while done < len(ids):
        pos = max(0, min(done - (length - stride) if done else 0, len(ids) - length))
        window = ids[pos : pos + length]
        lp = token_logprobs(model, [start + window])[0]
        first = done - pos  # window-relative index of the first unscored text token
        nats += float(lp[len(start) - 1 + first :].double().sum())
        done = pos + len(window)
    n_bytes = len(text.encode("utf-8"))
    return {
        "bpb": round(-nats / math.log(2) / n_bytes, 4),
        "tokens": len(ids),
        "bytes": n_bytes,
        "context": length + len(start),
    }


def choice_scores(
    model: Any, tok: Any, items: list[tuple[str, list[str]]], batch: int = 16, start: list[int] | None = None
) -> list[list[float]]:
    """Summed log-likelihood of each choice after its context (joined by a space), as lm-eval's
    multiple_choice: the context's tokens end where the context alone ends. `start`: the ids before each
    context (default start_ids; [] to see what a model does without them)."""
    start = start_ids(tok) if start is None else start
    seqs, spans = [], []
    for context, choices in items:
        ctx = tok(context, add_special_tokens=False)["input_ids"]
        for c in choices:
            full = tok(f"{context} {c}", add_special_tokens=False)["input_ids"]
            if full[: len(ctx)] != ctx:  # the join changed the context's last token: encode apart
                full = ctx + tok(f" {c}", add_special_tokens=False)["input_ids"]
            seqs.append(start + full)
            spans.append(len(start) + len(ctx))
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # similar lengths per batch: less padding
    scores = [0.0] * len(seqs)
    for b in range(0, len(order), batch):
        idx = order[b : b + batch]
        for i, lp in zip(idx, token_logprobs(model, [seqs[i] for i in idx]), strict=True):
            scores[i] = float(lp[spans[i] - 1 :].double().sum())
    out, k = [], 0
    for _, choices in items:
        out.append(scores[k : k + len(choices)])
        k += len(choices)
    return out


def read_items(assets: Path, limit: int | None) -> dict[str, list[tuple[str, list[str], int]]]:
    sets: dict[str, list[tuple[str, list[str], int]]] = {}
    for name in PAIR_FILES:
        rows = [json.loads(x) for x in (assets / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()]
        sets[name] = [(r["prefix"], [r["good_rest"], r["bad_rest"]], 0) for r in rows[:limit]]
    rows = [json.loads(x) for x in (assets / "continuaciones.jsonl").read_text(encoding="utf-8").splitlines()]
    sets["continuaciones"] = [(r["context"], r["choices"], r["label"]) for r in rows[:limit]]
    return sets


def accuracy(
    model: Any, tok: Any, items: list[tuple[str, list[str], int]], start: list[int] | None = None
) -> float:
    scores = choice_scores(model, tok, [(c, ch) for c, ch, _ in items], start=start)
    right = [
        max(range(len(s)), key=s.__getitem__) == label for s, (_, _, label) in zip(scores, items, strict=True)
    ]
    return sum(right) / len(items)


def choice_metrics(model: Any, tok: Any, assets: Path, limit: int | None = None) -> dict[str, Any]:
    """Accuracy on the minimal pairs (overall and per phenomenon) and on the continuations."""
    sets = read_items(assets, limit)
    pairs = {name.removeprefix("pares_"): accuracy(model, tok, sets[name]) for name in PAIR_FILES}
    n_pairs = {name.removeprefix("pares_"): len(sets[name]) for name in PAIR_FILES}
    total = sum(n_pairs.values())
    return {
        "pairs_acc": round(sum(pairs[k] * n_pairs[k] for k in pairs) / total, 4),
        "pairs_n": total,
        "pairs_by_phenomenon": {k: round(v, 4) for k, v in pairs.items()},
        "continuations_acc": round(accuracy(model, tok, sets["continuaciones"]), 4),
        "continuations_n": len(sets["continuaciones"]),
    }


def bench_one(entry: Entry, prose: str, assets: Path, limit: int | None, context: int) -> dict[str, Any]:
    model, tok = load(entry)
    row = {
        "name": entry.name,
        "folder": str(entry.folder),
        "adapter": str(entry.adapter) if entry.adapter else None,
        "parameters": sum(p.numel() for p in model.parameters()),
        "start_tokens": tok.convert_ids_to_tokens(start_ids(tok)),
        "prose": prose_bpb(model, tok, prose, context),
        **choice_metrics(model, tok, assets, limit),
    }
    del model
    return row


def table(rows: list[dict[str, Any]], prose_file: str) -> str:
    lines = [
        f"| model | parameters | bits per byte ({prose_file}) | minimal pairs (chance 0.50) "
        "| continuations (chance 0.25) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "missing" in r:
            lines.append(f"| {r['name']} | - | missing: {r['missing']} | - | - |")
            continue
        lines.append(
            f"| {r['name']} | {r['parameters'] / 1e6:.0f} M | {r['prose']['bpb']:.3f} | "
            f"{r['pairs_acc']:.3f} (n={r['pairs_n']}) | {r['continuations_acc']:.3f} (n={r['continuations_n']}) |"
        )
    return "\n".join(lines) + "\n"


def bench_bases(
    entries: list[Entry],
    prose: str,
    prose_file: str,
    assets: Path,
    out: Path | None,
    limit: int | None = None,
    context: int = CONTEXT,
    log=print,
) -> list[dict[str, Any]]:
    """Score each entry whose folder exists; a missing one is a row saying what is missing and how to make it."""
    from .bench_es import go_offline

    go_offline()
    rows = []
    for e in entries:
        missing = [p for p in (e.folder, e.adapter) if p is not None and not (Path(p) / "config.json").exists()
                   and not (Path(p) / "adapter_config.json").exists()]  # fmt: skip
        if missing:
            row = {"name": e.name, "missing": f"{missing[0]} not found; {e.how}"}
            log(f"{e.name}: {row['missing']}")
        else:
            log(f"{e.name}: scoring {e.folder}{f' + {e.adapter}' if e.adapter else ''} ...")
            row = bench_one(e, prose, assets, limit, context)
        rows.append(row)
    md = table(rows, prose_file)
    if out is not None:
        atomic_write_json(Path(out) / "metrics.json", {"precision": "fp32", "limit": limit, "models": rows})
        atomic_write_text(Path(out) / "table.md", md)
    return rows
