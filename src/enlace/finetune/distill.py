"""Distillation from the base aligned in context (issue 40, item 3): new questions, several sampled answers
each, and only the answers that pass the judge's checks kept as instruction data.

For every question the in-context assistant (a preamble spec, enlace.load.preamble) answers k times with the
chat sampler (config.extra.CHAT_SAMPLING: temperature 0.7), seeds 0 to k-1. A sample passes when it is Spanish,
does not loop, ended by itself, is within its kind's length bounds and is no copy of one of the preamble's
example answers (the base's commonest failure: it rewrites the example message whatever the task). A fact
question has no answer key here, so its answers are kept only when the samples agree: a majority of all k
samples give the same normalized short answer (short_answer, majority). The kept answers are written in the
instruction set's format (assets/instruct/README.md) with a manifest recording where they came from and
under what licence: what Gemma produced stays under the Gemma Terms of Use.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DataError
from ..io import atomic_dir, atomic_write_json, atomic_write_text, iter_jsonl
from ..manifest import write_manifest
from .judge import KINDS, first_sentence, fold, numbers_as_digits
from .text_checks import WORD, Reply, is_spanish, loops

# Words an answer may have, by kind: a fact in a sentence, advice in a few steps, a short text. Below the
# floor an answer says nothing (or is a bare name the language check cannot tell); above the ceiling it has
# wandered off.
LENGTH = {"fact": (3, 60), "advice": (12, 160), "writing": (8, 160)}
COPY_SHARE = 0.6  # more of its words shared with an example answer than this (Jaccard): a copy
# Words that say nothing about which answer a fact sample gave (folded): the common verbs of an answer
# sentence, besides the function words the language vote uses; and "no", so that "No lo sé" answers nothing
# (a yes-or-no answer has no short answer either: distillation fact questions ask for a name or a number).
FILLER_WORDS = {"es", "son", "esta", "estan", "tiene", "tienen", "tienes", "hay", "se", "llama", "llaman",
                "llamado", "llamada", "unas", "suele", "suelen", "no"}  # fmt: skip
CLAUSE_END = re.compile(r"[,;:()]")
ARTICLE = re.compile(r"(?<!\w)(un|una)(?!\w)")  # an article, not the number one, in an answer sentence
HOW_MANY = re.compile(r"(?<!\w)cuant[oa]s?(?!\w)")  # a question that asks for a number


@dataclass(frozen=True)
class DistillQuestion:
    id: str
    kind: str  # fact, advice or writing (judge.KINDS)
    question: str


def read_distill_questions(path: Path) -> list[DistillQuestion]:
    """The distillation questions: {"id", "kind", "question"} per line, ids and questions unique."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: not found")
    out: list[DistillQuestion] = []
    seen: dict[str, str] = {}
    for lineno, row in iter_jsonl(path):
        where = f"{path}:{lineno}"
        if not isinstance(row, dict) or not all(
            isinstance(row.get(k), str) for k in ("id", "kind", "question")
        ):
            raise DataError(f'{where}: expected {{"id": str, "kind": str, "question": str}}')
        q = DistillQuestion(row["id"], row["kind"], row["question"].strip())
        if q.kind not in KINDS:
            raise DataError(f"{where}: kind {q.kind!r} is not one of {', '.join(KINDS)}")
        if not q.question:
            raise DataError(f"{where}: empty question")
        for key in (f"id {q.id!r}", f"question {q.question!r}"):
            if key in seen:
                raise DataError(f"{where}: {key} repeats line {seen[key]}")
            seen[key] = str(lineno)
        out.append(q)
    if not out:
        raise DataError(f"{path}: no questions")
    return out


def word_set(text: str) -> set[str]:
    """The text's words, folded (no case, no accents)."""
    return set(WORD.findall(fold(text)))


def near_copy(a: str, b: str, share: float = COPY_SHARE) -> bool:
    """Whether two texts share more than `share` of their words (Jaccard over folded word sets)."""
    wa, wb = word_set(a), word_set(b)
    return bool(wa | wb) and len(wa & wb) / len(wa | wb) > share


def sample_checks(text: str, ended: bool, kind: str, examples: Sequence[str] = ()) -> dict[str, Any]:
    """One sample's checks: the judge's (Spanish, loops, ended), its kind's length bounds in words, and no
    copy of a preamble example answer; `passes` when all hold."""
    lo, hi = LENGTH[kind]
    words = len(WORD.findall(text))
    v = {
        "spanish": is_spanish(text),
        "loops": loops(text),
        "ended": ended,
        "words": words,
        "length_ok": lo <= words <= hi,
        "copies_example": any(near_copy(text, e) for e in examples),
    }
    v["passes"] = v["spanish"] and not v["loops"] and ended and v["length_ok"] and not v["copies_example"]
    return v


def short_answer(answer: str, question: str) -> frozenset[str]:
    """What a fact sample answers, normalized: the words of its first sentence's first clause, folded,
    numbers as digits, less the question's own words and the words that say nothing (function words, "es",
    "tiene"...); for a "¿cuántos...?" question, only the numbers it does not ask about. "La capital de Italia es Roma, ..." asked
    "¿Cuál es la capital de Italia?" gives {"roma"}; "Un hexágono tiene 6 lados." gives {"6"}."""
    from ..data.clean import ES_WORDS

    clause = CLAUSE_END.split(first_sentence(answer))[0]
    words = WORD.findall(numbers_as_digits(ARTICLE.sub(" ", fold(clause))))
    asked = set(WORD.findall(numbers_as_digits(ARTICLE.sub(" ", fold(question)))))
    if HOW_MANY.search(fold(question)):
        return frozenset(w for w in words if w.isdigit() and w not in asked)
    filler = {fold(w) for w in ES_WORDS} | FILLER_WORDS
    return frozenset(w for w in words if w not in asked and w not in filler)


def majority(shorts: Sequence[frozenset[str]]) -> tuple[frozenset[str], int]:
    """The short answer most samples support, and how many do. A sample supports an answer when it names all
    of its words ("Roma" and "Roma, ciudad eterna" both support {"roma"}); among answers with equal support
    the one of fewer words wins, then the first in alphabetical order. No answer at all: (empty, 0)."""
    candidates = {s for s in shorts if s}
    if not candidates:
        return frozenset(), 0
    support = {c: sum(c <= s for s in shorts) for c in candidates}
    best = min(candidates, key=lambda c: (-support[c], len(c), sorted(c)))
    return best, support[best]


def filter_question(
    q: DistillQuestion, replies: Sequence[Reply], examples: Sequence[str] = ()
) -> dict[str, Any]:
    """Every sample of one question with its checks, and `kept`: the indices of the samples to keep. For a
    fact question also the majority short answer, its support, and whether the samples agree (more than half
    of all of them support it); then only passing samples that name the majority answer are kept."""
    checks = [sample_checks(r.text, r.ended, q.kind, examples) for r in replies]
    samples = [{"text": r.text, "tokens": r.tokens, **c} for r, c in zip(replies, checks, strict=True)]
    kept = [i for i, c in enumerate(checks) if c["passes"]]
    out: dict[str, Any] = {"id": q.id, "kind": q.kind, "question": q.question, "samples": samples}
    if q.kind == "fact":
        shorts = [short_answer(r.text, q.question) for r in replies]
        best, support = majority(shorts)
        agreed = 2 * support > len(replies)
        for sample, s in zip(samples, shorts, strict=True):
            sample["short_answer"] = sorted(s)
        kept = [i for i in kept if agreed and best <= shorts[i]]
        out.update(short_answer=sorted(best), support=support, agreed=agreed)
    out["kept"] = kept
    return out


def to_record(q: DistillQuestion, text: str, seed: int) -> dict[str, Any]:
    """A kept answer in the instruction set's format (dolly: instruction, context, response, category), with
    the question's id and the seed that drew it."""
    return {"instruction": q.question, "context": "", "response": text, "category": f"destilado-{q.kind}",
            "id": q.id, "seed": seed}  # fmt: skip


def distill(
    answer: Callable[[str, int], Reply],
    questions: Sequence[DistillQuestion],
    samples: int,
    examples: Sequence[str] = (),
    per_question: int = 1,
    log: Callable[[str], None] = lambda s: None,
    progress: Callable[[list[dict[str, Any]], list[dict[str, Any]]], None] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each question answered `samples` times (`answer(question, seed)`, seeds 0 to samples-1) and filtered:
    the records kept (at most `per_question` distinct answers a question, in seed order) and every question's
    verdicts. `progress` is given both after every question (a run stopped early keeps what it drew)."""
    if samples < 1 or per_question < 1:
        raise DataError(
            f"distill: samples ({samples}) and answers kept a question ({per_question}) must be >= 1"
        )
    records: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    for n, q in enumerate(questions, 1):
        row = filter_question(q, [answer(q.question, seed) for seed in range(samples)], examples)
        texts: list[str] = []
        for i in row["kept"]:
            text = row["samples"][i]["text"]
            if text not in texts and len(texts) < per_question:
                texts.append(text)
                records.append(to_record(q, text, i))
        rows.append(row)
        log(f"distill {n}/{len(questions)} {q.id}: kept {len(texts)} of {samples}")
        if progress is not None:
            progress(records, rows)
    return records, rows


def counts(rows: Sequence[dict[str, Any]], records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per kind: questions, questions with a kept answer, answers kept; and why samples failed."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        out[kind] = {
            "questions": len(mine),
            "with_answer": sum(bool(r["kept"]) for r in mine),
            "kept": sum(rec["category"] == f"destilado-{kind}" for rec in records),
        }
    every = [s for r in rows for s in r["samples"]]
    out["samples"] = len(every)
    out["failed"] = {
        "not_spanish": sum(not s["spanish"] for s in every),
        "loops": sum(s["loops"] for s in every),
        "not_ended": sum(not s["ended"] for s in every),
        "length": sum(not s["length_ok"] for s in every),
        "copies_example": sum(s["copies_example"] for s in every),
    }
    out["facts_disagreeing"] = sum(r["kind"] == "fact" and not r["agreed"] for r in rows)
    return out


DATA_FILE = "distilled.jsonl"
REPORT_FILE = "report.json"


def write_distilled(
    out: Path, records: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]], provenance: dict[str, Any]
) -> dict[str, Any]:
    """The folder `out`, written atomically: the kept records (JSONL), every question's verdicts
    (report.json) and the manifest with the provenance (its licence first). Returns the counts."""
    summary = counts(rows, records)
    with atomic_dir(Path(out)) as tmp:
        atomic_write_text(tmp / DATA_FILE, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        atomic_write_json(tmp / REPORT_FILE, {"counts": summary, "questions": list(rows)})
        write_manifest(tmp, "distilled-data", {**provenance, "counts": summary})
    return summary
