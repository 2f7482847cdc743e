"""Judging an answer to a question the instruction set never saw: in Spanish, on topic, free of loops.

The held-out questions (assets/instruct/es_preguntas_nuevas.jsonl) each carry topic keywords an on-topic
answer brings up. None of them may occur in the question itself, so echoing the question earns nothing.
A keyword counts in its close variants (plural, gender, verb forms sharing its stem), compared without
accents or case; ON_TOPIC_HITS distinct keywords make an answer on topic.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from ..errors import DataError
from ..io import iter_jsonl

ON_TOPIC_HITS = 2  # one keyword can be chance ("agua" comes up everywhere); two rarely are
WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class Question:
    question: str
    keywords: tuple[str, ...]
    topic: str = ""


def fold(text: str) -> str:
    """Lower case without accents or diaeresis (ñ becomes n): "Dióxido" and "dioxido" are one word."""
    nfd = unicodedata.normalize("NFD", text.lower())
    return "".join(c for c in nfd if unicodedata.category(c) != "Mn")


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def variant_of(word: str, keyword: str) -> bool:
    """Whether a (folded) word is the (folded) keyword or a close variant of it.

    Short keywords (3 letters or fewer: "sol", "luz", "sal") match only themselves and their plurals, so that
    "sol" never matches "solo". Four letters: one letter may differ at the end ("frío"/"fría", "agua"/"aguas").
    Longer ones: a shared stem of all but the last three letters, at least five ("condensa"/"condensación",
    "enfría"/"enfriar", "hidratado"/"hidratarse").
    """
    if word == keyword:
        return True
    if len(keyword) <= 3:
        plurals = {keyword + "s", keyword + "es"}
        if keyword.endswith("z"):
            plurals.add(keyword[:-1] + "ces")  # luz -> luces
        return word in plurals
    if len(keyword) == 4:
        return _common_prefix(word, keyword) >= 3 and abs(len(word) - len(keyword)) <= 2
    return _common_prefix(word, keyword) >= max(5, len(keyword) - 3)


def keywords_found(text: str, keywords: tuple[str, ...] | list[str]) -> list[str]:
    """The keywords (as written in the question file) that the text mentions, in their order."""
    words = {fold(w) for w in WORD.findall(text)}
    found = []
    for kw in keywords:
        parts = [fold(p) for p in WORD.findall(kw)]
        if parts and all(any(variant_of(w, p) for w in words) for p in parts):
            found.append(kw)
    return found


def read_questions(path: Path) -> list[Question]:
    """The held-out questions; a keyword the question itself mentions is refused (it would reward echoes)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: not found")
    out: list[Question] = []
    for lineno, row in iter_jsonl(path):
        if not isinstance(row, dict) or not isinstance(row.get("question"), str):
            raise DataError(f'{path}:{lineno}: expected {{"question": str, "keywords": [str, ...]}}')
        kws = row.get("keywords")
        if not isinstance(kws, list) or len(kws) < ON_TOPIC_HITS or not all(isinstance(k, str) for k in kws):
            raise DataError(f"{path}:{lineno}: keywords must be a list of at least {ON_TOPIC_HITS} strings")
        echoed = keywords_found(row["question"], kws)
        if echoed:
            raise DataError(f"{path}:{lineno}: keywords {echoed} occur in the question itself")
        out.append(Question(row["question"], tuple(kws), str(row.get("topic", ""))))
    if not out:
        raise DataError(f"{path}: no questions")
    return out


def judge(answer: str, question: Question) -> dict:
    """One answer's verdict: each check, the keywords it mentioned, and `ok` when it passes all three."""
    from .evaluate import is_spanish, loops

    found = keywords_found(answer, question.keywords)
    verdict = {
        "spanish": is_spanish(answer),
        "on_topic": len(found) >= ON_TOPIC_HITS,
        "loops": loops(answer),
        "keywords_found": found,
    }
    verdict["ok"] = verdict["spanish"] and verdict["on_topic"] and not verdict["loops"]
    return verdict


def rates(verdicts: list[dict]) -> dict:
    """Share of answers that are Spanish, on topic, looping, and good on all counts."""
    n = max(len(verdicts), 1)
    return {
        "questions": len(verdicts),
        **{
            f"{k}_rate": round(sum(bool(v[k]) for v in verdicts) / n, 4)
            for k in ("spanish", "on_topic", "loops", "ok")
        },
    }
