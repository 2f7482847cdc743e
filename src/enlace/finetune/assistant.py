"""An assistant as the judge sees it, and the judge run over the held-out questions.

An assistant is a model, its tokenizer, how messages become prompt ids, and what ends an answer: a base folder's
own chat template (SmolLM2-Instruct; a base plus a LoRA adapter), or a preamble spec that aligns a base in
context (enlace.load.preamble). `judge_assistant` answers every question with each decoding and reports,
per decoding, the judge's checks with their Wilson 95% intervals (enlace.finetune.judge.summary).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EnlaceError
from ..hf.tokenizer import HFTokenizer, Message
from ..load.preamble import cut_at_stop
from .judge import Question, judge, rates, summary
from .text_checks import Reply

DECODING = re.compile(r"greedy|sample-(\d+)")


@dataclass
class Assistant:
    name: str
    model: Any
    tok: HFTokenizer
    encode: Callable[[list[Message]], list[int]]
    stops: tuple[str, ...] = ()  # strings that end an answer (a preamble's next turn)
    stop_ids: tuple[int, ...] = ()  # ids that end it (<eos>, <end_of_turn>, <|im_end|>, ...)
    what: str = ""  # what answers: base, preamble or adapter
    copy: Any = None  # a preamble's example answers, never copied beyond copy.n tokens (generate.CopyTable)


def from_loaded(
    name: str, model: Any, tok: HFTokenizer, what: str = "", system: str | None = None
) -> Assistant:
    """A loaded model that answers in its folder's chat template (after `system`, when given)."""
    head: list[Message] = [{"role": "system", "content": system}] if system else []
    encode = lambda msgs: tok.apply_chat_template(head + msgs, add_generation_prompt=True)  # noqa: E731
    return Assistant(name, model, tok, encode, (), tuple(tok.eos_ids), what)


def load_assistant(spec: str | Path | None = None, model_dir: str | Path | None = None,
                   adapter: str | Path | None = None, weights: str | None = None,
                   adapter_scale: float = 1.0) -> Assistant:  # fmt: skip
    """A preamble spec's assistant (plus an adapter trained in its format), or a model folder (plus an adapter)
    answering in its chat template; both opened by enlace.load. weights: decode weights as `enlace serve
    --weights` (None: the fp32 weights as loaded, through torch's own kernels)."""
    from ..load import load_model

    if spec is not None:
        loaded = load_model(spec, adapter, flag="--assistant", weights=weights, adapter_scale=adapter_scale)
        tok = loaded.hf_tokenizer("enlace judge")
        scaled = f" scaled by {adapter_scale:g}" if adapter_scale != 1.0 else ""
        with_adapter = f"+ adapter {adapter}{scaled}" if adapter else "(no adapter)"
        return Assistant(
            loaded.name, loaded.model, tok, loaded.chat_template, loaded.stops, loaded.eos_ids,
            f"{Path(loaded.preamble.base).name}, preamble {spec} {with_adapter}{_decoded(loaded, weights)}",
            loaded.copy,
        )  # fmt: skip
    if model_dir is None:
        raise EnlaceError("an assistant needs a spec or a model folder")
    loaded = load_model(model_dir, adapter, flag="--model", weights=weights, adapter_scale=adapter_scale)
    tok = loaded.hf_tokenizer("enlace judge")
    name = Path(model_dir).name + (" + LoRA" if adapter else "")
    what = f"{Path(model_dir).name}, its chat template, " + (
        f"adapter {adapter}" if adapter else "no adapter"
    )
    return from_loaded(name, loaded.model, tok, what + _decoded(loaded, weights))


def _decoded(loaded: Any, weights: str | None) -> str:
    """How the answers were decoded, for the result's `what` (nothing when the weights were left as loaded)."""
    return (
        "" if weights is None else f"; {loaded.weights} decode weights, as `enlace serve --weights {weights}`"
    )


def decoding(name: str, sampler: dict[str, Any]) -> dict[str, Any]:
    """The sampling settings of a decoding: `greedy` (temperature 0, the sampler's repetition controls, as
    `enlace serve` answers a request at temperature 0) or `sample-N` (the sampler, seed N)."""
    m = DECODING.fullmatch(name)
    if m is None:
        raise EnlaceError(f"decoding {name!r}: expected greedy or sample-N (N a seed)")
    if m.group(1) is None:
        return {**sampler, "temperature": 0.0, "seed": 0}
    return {**sampler, "seed": int(m.group(1))}


def ended_reply(a: Assistant, ids: list[int]) -> Reply | None:
    """The reply when `ids` end it (a stop id last, or a stop string: cut before it); None while it goes on."""
    if ids and ids[-1] in a.stop_ids:
        return Reply(a.tok.decode(ids, skip_special_tokens=True).strip(), len(ids), True)
    if a.stops:
        text, hit = cut_at_stop(a.tok.decode(ids, skip_special_tokens=True), list(a.stops))
        if hit:
            return Reply(text.strip(), len(ids), True)
    return None


def replies(
    a: Assistant, prompt: str, sampling: dict[str, Any], seeds: list[int], max_new_tokens: int, prefix=None
) -> list[Reply]:
    """One answer per seed to one user message, decoded together (generate.sample_many; `prefix`, a
    generate.Prefilled, spares the prefill of the ids the prompt shares with it). Each ends as `reply`'s."""
    from ..generate import sample_many

    msgs: list[Message] = [{"role": "user", "content": prompt}]
    settings = {k: v for k, v in sampling.items() if k != "seed"}
    out = sample_many(a.model, a.encode(msgs), max_new_tokens, seeds, eos_ids=a.stop_ids,
                      done=lambda ids: ended_reply(a, ids) is not None, prefix=prefix, copy=a.copy,
                      **settings)  # fmt: skip
    return [
        ended_reply(a, ids) or Reply(a.tok.decode(ids, skip_special_tokens=True).strip(), len(ids), False)
        for ids in out
    ]


def reply(a: Assistant, prompt: str, sampling: dict[str, Any], max_new_tokens: int) -> Reply:
    """One answer to one user message; it ends at a stop id or a stop string (cut before it), else at the
    budget."""
    from ..generate import generate

    ids: list[int] = []
    msgs: list[Message] = [{"role": "user", "content": prompt}]
    for t in generate(a.model, a.encode(msgs), max_new_tokens, eos_ids=a.stop_ids, copy=a.copy, **sampling):
        ids.append(t)
        if t in a.stop_ids:
            break
        if a.stops:
            text, hit = cut_at_stop(a.tok.decode(ids, skip_special_tokens=True), list(a.stops))
            if hit:
                return Reply(text.strip(), len(ids), True)
    ended = bool(ids) and ids[-1] in a.stop_ids
    return Reply(a.tok.decode(ids, skip_special_tokens=True).strip(), len(ids), ended)


def judge_assistant(
    a: Assistant,
    questions: list[Question],
    decodings: list[str],
    sampler: dict[str, Any],
    max_new_tokens: int,
    log: Callable[[str], None] = lambda s: None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every question answered with each decoding and judged: per decoding, the summary (each check's count,
    rate and Wilson interval), the flat rates, and each answer with its verdict. `progress` is given the
    result so far after every answer (a slow CPU's run can be stopped and still reported, with its n)."""
    out: dict[str, Any] = {
        "assistant": a.name,
        "what": a.what,
        "max_new_tokens": max_new_tokens,
        "decodings": {},
    }
    for d in decodings:
        sampling = decoding(d, sampler)
        rows: list[dict[str, Any]] = []
        for i, q in enumerate(questions, 1):
            r = reply(a, q.question, sampling, max_new_tokens)
            v = judge(r.text, q)
            rows.append({"id": q.id, "kind": q.kind, "question": q.question, "answer": r.text,
                         "tokens": r.tokens, "ended": r.ended, **v})  # fmt: skip
            log(f"{a.name} {d} {i}/{len(questions)}: {'ok' if v['ok'] else 'fails'}")
            out["decodings"][d] = {"sampling": sampling, "answered": f"{i}/{len(questions)}",
                                   "summary": summary(rows), "rates": rates(rows), "answers": rows}  # fmt: skip
            if progress is not None:
                progress(out)
    return out


def rejudge(result: dict[str, Any], questions: list[Question]) -> dict[str, Any]:
    """A stored result judged again by the current judge (the answers stay as they were generated)."""
    by_text = {q.question: q for q in questions}
    for d in result["decodings"].values():
        rows = []
        for row in d["answers"]:
            q = by_text.get(row["question"])
            if q is None:
                raise EnlaceError(f"rejudge: question {row['question']!r} is not in the question file")
            keep = {k: row[k] for k in ("id", "kind", "question", "answer", "tokens", "ended")}
            rows.append(keep | judge(row["answer"], q))
        d.update(answers=rows, summary=summary(rows), rates=rates(rows))
    return result


def summary_table(results: list[dict[str, Any]]) -> str:
    """One row per assistant and decoding: each check as rate (k/n) [low, high]."""
    checks = ("on_topic", "correct", "spanish", "loops", "ended")
    lines = [
        "| assistant | decoding | " + " | ".join(c.replace("_", " ") for c in checks) + " |",
        "|---|---|" + "---:|" * len(checks),
    ]
    for res in results:
        for d, r in res["decodings"].items():
            cells = []
            for c in checks:
                s = r["summary"][c]
                cells.append(
                    "-"
                    if not s["n"]
                    else f"{s['rate']:.0%} ({s['k']}/{s['n']}) [{s['low']:.0%}, {s['high']:.0%}]"
                )
            lines.append(f"| {res['assistant']} | {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
