"""Instruction data -> token ids with assistant-only labels, and right-padded batches.

Formats: dolly JSONL (instruction, context, response[, category]) and chat JSONL ({"messages": [...]}).
Each conversation is rendered with the model's chat template; labels are the token ids inside assistant
turns and IGNORE_INDEX everywhere else. Or, with a preamble spec (finetune.preamble), as the served preamble
assistant renders it: the prompt `spec.encode` gives for the turns before the last answer, then that answer
and its end ("\n\nUsuario:"), the only labelled ids. Examples longer than max_len are dropped and counted,
never cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import DataError
from ..hf.tokenizer import HFTokenizer, Message
from ..io import iter_jsonl
from ..model import IGNORE_INDEX

if TYPE_CHECKING:
    from ..load.preamble import PreambleSpec

ROLES = ("system", "user", "assistant")


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]  # aligned with input_ids (Hugging Face convention): the loss shifts by one


@dataclass
class Dataset:
    examples: list[Example]
    total: int = 0
    dropped_too_long: int = 0
    dropped_no_answer: int = 0
    lengths: list[int] = field(default_factory=list)

    def report(self) -> dict:
        n_lab = sum(sum(1 for x in e.labels if x != IGNORE_INDEX) for e in self.examples)
        return {
            "examples": len(self.examples),
            "read": self.total,
            "dropped_too_long": self.dropped_too_long,
            "dropped_no_answer": self.dropped_no_answer,
            "tokens": sum(len(e.input_ids) for e in self.examples),
            "assistant_tokens": n_lab,
        }


def dolly_messages(row: dict, system: str | None = None) -> list[Message]:
    instruction, context = row["instruction"].strip(), (row.get("context") or "").strip()
    user = f"{instruction}\n\n{context}" if context else instruction
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [
        {"role": "user", "content": user},
        {"role": "assistant", "content": row["response"].strip()},
    ]


def read_conversations(
    path: Path, fmt: str, system: str | None = None, limit: int | None = None
) -> list[list[Message]]:
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: not found")
    out: list[list[Message]] = []
    for lineno, row in iter_jsonl(path):
        if not isinstance(row, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        if fmt == "dolly":
            missing = [k for k in ("instruction", "response") if not isinstance(row.get(k), str)]
            if missing:
                raise DataError(f"{path}:{lineno}: dolly record lacks {missing}")
            out.append(dolly_messages(row, system))
        elif fmt == "chat":
            msgs = row.get("messages")
            if not isinstance(msgs, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs
            ):
                raise DataError(f'{path}:{lineno}: expected {{"messages": [{{"role", "content"}}, ...]}}')
            unknown = [m["role"] for m in msgs if m["role"] not in ROLES]
            if unknown:
                # A typo'd role would be rendered by the template and silently trained on as prompt text.
                raise DataError(f"{path}:{lineno}: unknown chat role {unknown[0]!r}; use {', '.join(ROLES)}")
            if system and (not msgs or msgs[0]["role"] != "system"):
                msgs = [{"role": "system", "content": system}, *msgs]
            out.append(msgs)
        else:
            raise DataError(f"unknown data format {fmt!r} (dolly or chat)")
        if limit and len(out) >= limit:
            break
    if not out:
        raise DataError(f"{path}: no examples")
    return out


def assistant_spans(tok: HFTokenizer, messages: list[Message]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant turn (its text and end marker).

    A turn's span starts where the template's generation prompt for it ends, so the prompt of a turn must
    be a prefix of the rendered conversation; templates that rewrite earlier turns are refused.
    """
    full = tok.render_chat(messages)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = tok.render_chat(messages[:i], add_generation_prompt=True)
        upto = tok.render_chat(messages[: i + 1])
        if not (upto.startswith(prompt) and full.startswith(upto)):
            raise DataError(
                "the chat template does not render turns as prefixes; cannot locate assistant tokens"
            )
        spans.append((len(prompt), len(upto)))
    return full, spans


def encode_conversation(tok: HFTokenizer, messages: list[Message]) -> Example:
    text, spans = assistant_spans(tok, messages)
    ids, offsets = tok.encode_with_offsets(text)
    labels = [IGNORE_INDEX] * len(ids)
    for j, (start, _end) in enumerate(offsets):
        if any(a <= start < b for a, b in spans):
            labels[j] = ids[j]
    return Example(ids, labels)


def encode_preamble_conversation(tok: HFTokenizer, spec: PreambleSpec, messages: list[Message]) -> Example:
    """The conversation as the preamble assistant serves it (PreambleSpec.training_ids): the loss covers its
    last answer and that answer's end; earlier turns are prompt. No answer to learn: no labels."""
    if not messages or messages[-1]["role"] != "assistant":
        ids = spec.encode(tok, messages)
        return Example(ids, [IGNORE_INDEX] * len(ids))
    prompt, answer = spec.training_ids(tok, messages)
    return Example(prompt + answer, [IGNORE_INDEX] * len(prompt) + answer)


def build_dataset(
    tok: HFTokenizer, conversations: list[list[Message]], max_len: int, preamble: PreambleSpec | None = None
) -> Dataset:
    ds = Dataset(examples=[], total=len(conversations))
    for msgs in conversations:
        if preamble is None:
            ex = encode_conversation(tok, msgs)
        else:
            ex = encode_preamble_conversation(tok, preamble, msgs)
        if len(ex.input_ids) > max_len:
            ds.dropped_too_long += 1
            continue
        if all(x == IGNORE_INDEX for x in ex.labels[1:]):
            ds.dropped_no_answer += 1
            continue
        ds.examples.append(ex)
        ds.lengths.append(len(ex.input_ids))
    return ds


def load_dataset(
    tok: HFTokenizer,
    paths: Path | list[Path],
    fmt: str,
    max_len: int,
    limit: int | None = None,
    system: str | None = None,
    preamble: PreambleSpec | None = None,
) -> Dataset:
    """One instruction file or several, read in order; `limit` caps the examples of all of them together."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    conversations: list[list[Message]] = []
    for path in paths:
        left = None if limit is None else limit - len(conversations)
        if left is not None and left <= 0:
            break
        conversations += read_conversations(path, fmt, system, left)
    ds = build_dataset(tok, conversations, max_len, preamble)
    if not ds.examples:
        named = ", ".join(str(p) for p in paths)
        raise DataError(f"{named}: every example was dropped ({ds.report()}); raise max_len?")
    return ds


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right padding: real tokens never attend to pads under a causal mask, so no attention mask is needed."""
    T = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), T), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), T), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def epoch_order(
    n: int, batch: int, epoch: int, seed: int, lengths: list[int] | None = None, window: int = 0
) -> list[int]:
    """One epoch's order of the n examples, seeded by (seed, epoch).

    window 0: a plain shuffle. window W: the shuffle is cut into runs of W micro-batches, each run sorted by
    length and split into micro-batches, and those micro-batches shuffled again; a batch then pads to about
    its own examples' length instead of the longest of a random draw, and its position in the epoch stays
    random (Hugging Face's group_by_length does the same)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=gen).tolist()
    if not window or lengths is None:
        return perm
    run = window * batch
    groups: list[list[int]] = []
    for start in range(0, n, run):
        chunk = sorted(perm[start : start + run], key=lambda i: lengths[i])  # stable: ties keep the shuffle
        groups += [chunk[j : j + batch] for j in range(0, len(chunk), batch)]
    return [i for g in torch.randperm(len(groups), generator=gen).tolist() for i in groups[g]]


def batch_indices(
    n: int, batch: int, index: int, seed: int, lengths: list[int] | None = None, window: int = 0
) -> list[int]:
    """The index-th batch of an endless stream of seeded epochs (`epoch_order`): a pure function of its
    arguments, so resuming at step s needs no saved iterator state."""
    out: list[int] = []
    pos = index * batch
    while len(out) < batch:
        epoch, offset = divmod(pos, n)
        order = epoch_order(n, batch, epoch, seed, lengths, window)
        take = min(batch - len(out), n - offset)
        out += order[offset : offset + take]
        pos += take
    return out
