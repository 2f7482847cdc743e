"""Judging an answer to a question the instruction set never saw: in Spanish, on topic, free of loops, and,
for a fact question, correct.

Every held-out question (assets/eval/preguntas-juez.jsonl; the older assets/instruct/es_preguntas_nuevas.jsonl)
carries topic keywords an on-topic answer brings up. None of them may occur in the question itself, so
echoing the question earns nothing. A keyword counts in its close variants (plural, gender, verb forms sharing
its stem), compared without accents or case; ON_TOPIC_HITS distinct keywords make an answer on topic.

A fact question also has an answer key, accepted variants and competing keys (its `wrong` list, plus the keys
of the other questions of its `group`). Its answer is correct when the FIRST sentence states the key or a
variant, as whole words, ignoring accents and case, numbers as digits or words ("56", "cincuenta y seis"), and
no competing key: "No lo sé" is wrong, and so is "París o Roma". A fact answer that names the key or a
competing key anywhere is on topic (it answers what was asked, rightly or not).
"""

from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import DataError
from ..io import iter_jsonl

ON_TOPIC_HITS = 2  # one keyword can be chance ("agua" comes up everywhere); two rarely are
WORD = re.compile(r"\w+")


KINDS = ("fact", "advice", "writing")
SPLITS = ("dev", "test")  # dev: questions a prompt or recipe may be tuned on; test: the reported ones


@dataclass(frozen=True)
class Question:
    question: str
    keywords: tuple[str, ...]
    topic: str = ""
    kind: str = ""  # fact, advice or writing ("" in the older file: keywords only)
    split: str = "test"
    id: str = ""
    answer: str = ""  # a fact question's key ...
    accept: tuple[str, ...] = ()  # ... its accepted variants ...
    competitors: tuple[str, ...] = ()  # ... and the keys that compete with it (its `wrong` and its group's)

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.answer, *self.accept) if self.answer else ()


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


def _str_list(row: dict, key: str, where: str) -> tuple[str, ...]:
    v = row.get(key, [])
    if not isinstance(v, list) or not all(isinstance(x, str) and x.strip() for x in v):
        raise DataError(f"{where}: {key} must be a list of non-empty strings")
    return tuple(v)


def _read_row(row: object, where: str) -> tuple[Question, str | None]:
    """One question and its group (fact questions of a group compete with each other's keys)."""
    if not isinstance(row, dict) or not isinstance(row.get("question"), str):
        raise DataError(f'{where}: expected {{"question": str, "keywords": [str, ...]}}')
    kws = row.get("keywords")
    if not isinstance(kws, list) or len(kws) < ON_TOPIC_HITS or not all(isinstance(k, str) for k in kws):
        raise DataError(f"{where}: keywords must be a list of at least {ON_TOPIC_HITS} strings")
    echoed = keywords_found(row["question"], kws)
    if echoed:
        raise DataError(f"{where}: keywords {echoed} occur in the question itself")
    kind, split = str(row.get("kind", "")), str(row.get("split", "test"))
    if kind and kind not in KINDS:
        raise DataError(f"{where}: kind {kind!r} is not one of {', '.join(KINDS)}")
    if split not in SPLITS:
        raise DataError(f"{where}: split {split!r} is not one of {', '.join(SPLITS)}")
    answer = row.get("answer", "")
    if (kind == "fact") != (isinstance(answer, str) and bool(answer.strip())):
        raise DataError(f"{where}: a fact question needs an answer key, and only a fact question has one")
    q = Question(
        row["question"], tuple(kws), str(row.get("topic", "")), kind, split, str(row.get("id", "")),
        answer, _str_list(row, "accept", where), _str_list(row, "wrong", where),
    )  # fmt: skip
    return q, row.get("group")


def read_questions(path: Path, split: str | None = None) -> list[Question]:
    """The held-out questions (those of `split` when given); a keyword the question itself mentions is
    refused (it would reward echoes). A fact question's competitors are its `wrong` keys plus the keys of the
    other questions of its group, less any the question itself names ("siete por ocho" competes with no 7)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: not found")
    rows = [_read_row(row, f"{path}:{lineno}") for lineno, row in iter_jsonl(path)]
    groups: dict[str, list[str]] = {}
    for q, group in rows:
        if group:
            groups.setdefault(str(group), []).append(q.answer)
    out: list[Question] = []
    for q, group in rows:
        if q.kind == "fact":
            rivals = [*q.competitors, *(k for k in groups.get(str(group), []) if group and k != q.answer)]
            rivals = [r for r in dict.fromkeys(rivals) if not mentions(q.question, r)]
            q = replace(q, competitors=tuple(rivals))
        if split is None or q.split == split:
            out.append(q)
    if not out:
        raise DataError(f"{path}: no questions" + (f" in split {split!r}" if split else ""))
    return out


# Spanish number words, folded, for reading "cincuenta y seis" as 56.
_UNITS = "cero un dos tres cuatro cinco seis siete ocho nueve".split()
_TEENS = "diez once doce trece catorce quince dieciseis diecisiete dieciocho diecinueve veinte".split()
_TWENTIES = (
    "veintiun veintidos veintitres veinticuatro veinticinco veintiseis veintisiete veintiocho veintinueve"
)
_TENS = "treinta cuarenta cincuenta sesenta setenta ochenta noventa".split()
_HUNDREDS = (
    "ciento doscientos trescientos cuatrocientos quinientos seiscientos setecientos ochocientos novecientos"
)
NUMBER_WORDS: dict[str, int] = {
    **{w: i for i, w in enumerate(_UNITS)}, "uno": 1, "una": 1, "veintiuno": 21, "veintiuna": 21,
    **{w: 10 + i for i, w in enumerate(_TEENS)}, **{w: 21 + i for i, w in enumerate(_TWENTIES.split())},
    **{w: 30 + 10 * i for i, w in enumerate(_TENS)}, "cien": 100,
    **{w: 100 * (i + 1) for i, w in enumerate(_HUNDREDS.split())},
    **{w[:-2] + "as": 100 * (i + 2) for i, w in enumerate(_HUNDREDS.split()[1:])},  # doscientas ...
}  # fmt: skip


def _rank(word: str) -> int:
    """A number word's order: 4 mil, 3 hundreds, 2 tens (30-90), 1 up to 29. A number goes on only with a word
    of a lower order ("ciento veinte", "treinta y dos"; never "dos tres")."""
    if word == "mil":
        return 4
    n = NUMBER_WORDS[word]
    return 3 if n >= 100 else 2 if n >= 30 else 1


def numbers_as_digits(folded: str) -> str:
    """Runs of (folded) Spanish number words written as digits: "cien menos treinta y cinco" -> "100 menos 35".
    "y" joins a ten and a unit only; "mil" multiplies what precedes it ("dos mil" is 2000)."""
    parts = re.findall(r"\w+|\W+", folded)
    is_num = lambda i: i < len(parts) and (parts[i] in NUMBER_WORDS or parts[i] == "mil")  # noqa: E731
    out: list[str] = []
    i = 0
    while i < len(parts):
        if not is_num(i):
            out.append(parts[i])
            i += 1
            continue
        words = [parts[i]]
        while i + 2 < len(parts) and parts[i + 1].isspace():
            prev, nxt = words[-1], parts[i + 2]
            if nxt == "y" and _rank(prev) == 2 and i + 4 < len(parts) and parts[i + 3].isspace() \
                    and parts[i + 4] in NUMBER_WORDS and NUMBER_WORDS[parts[i + 4]] < 10:  # fmt: skip
                words.append(parts[i + 4])
                i += 4
            elif is_num(i + 2) and (nxt == "mil" or _rank(nxt) < _rank(prev) and _rank(prev) > 1):
                words.append(nxt)
                i += 2
            else:
                break
        total = current = 0
        for w in words:
            if w == "mil":
                total, current = total + (current or 1) * 1000, 0
            else:
                current += NUMBER_WORDS[w]
        out.append(str(total + current))
        i += 1
    return "".join(out)


def normalize(text: str) -> str:
    """What keys are compared on: folded, numbers as digits, runs of space as one."""
    return " ".join(numbers_as_digits(fold(text)).split())


def mentions(text: str, key: str) -> bool:
    """Whether the text states the key as whole words (normalized alike)."""
    return re.search(rf"(?<!\w){re.escape(normalize(key))}(?!\w)", normalize(text)) is not None


SENTENCE_END = re.compile(r"[.!?…](?=\s|$)|\n")


def first_sentence(text: str) -> str:
    """Up to the first full stop, question or exclamation mark before a space (not the one in "3.5"), or line
    break; leading empty pieces are skipped."""
    for piece in SENTENCE_END.split(text):
        if re.search(r"\w", piece):
            return piece.strip()
    return ""


def fact_verdict(answer: str, question: Question) -> dict:
    """Whether the answer's first sentence states the key (or a variant) and no competing key."""
    first = normalize(first_sentence(answer))
    stated = [k for k in question.keys if mentions(first, k)]
    rest = first
    for k in sorted(stated, key=len, reverse=True):  # "ballena azul" must not leave "azul" to compete
        rest = re.sub(rf"(?<!\w){re.escape(normalize(k))}(?!\w)", " ", rest)
    rivals = [c for c in question.competitors if mentions(rest, c)]
    return {"correct": bool(stated) and not rivals, "key_found": bool(stated), "competing_found": rivals}


BARE_NAME_WORDS = 3  # "Lisboa.", "Buenos Aires.", "56": an answer, in no language in particular


def is_bare_name(answer: str) -> bool:
    """A short answer with no function word of any language the vote knows ("Lisboa.", "Buenos Aires."): the
    language checks cannot tell its language. A fact answer that is only such a name, and names a key or a
    competing key, counts as Spanish when written in the Latin script: a Spanish speaker answers so."""
    from ..data.clean import EN_WORDS, ES_WORDS
    from .text_checks import foreign_script_share

    words = [w.lower() for w in WORD.findall(answer)]
    return (
        0 < len(words) <= BARE_NAME_WORDS
        and not any(w in ES_WORDS or w in EN_WORDS for w in words)
        and foreign_script_share(answer) == 0
    )


def judge(answer: str, question: Question) -> dict:
    """One answer's verdict: each check, the keywords it mentioned, for a fact question whether it is correct
    (None otherwise), and `ok` when it passes them all."""
    from .text_checks import is_spanish, loops

    found = keywords_found(answer, question.keywords)
    verdict = {
        "spanish": is_spanish(answer),
        "on_topic": len(found) >= ON_TOPIC_HITS,
        "loops": loops(answer),
        "keywords_found": found,
    }
    if question.kind == "fact":
        fact = fact_verdict(answer, question)
        named = any(mentions(answer, k) for k in (*question.keys, *question.competitors))
        verdict.update(fact, on_topic=verdict["on_topic"] or named)
        verdict["spanish"] = verdict["spanish"] or (named and is_bare_name(answer))
    verdict["ok"] = verdict["spanish"] and verdict["on_topic"] and not verdict["loops"]
    if question.kind == "fact":
        verdict["ok"] = verdict["ok"] and verdict["correct"]
    return verdict


def rates(verdicts: list[dict]) -> dict:
    """Share of answers that are Spanish, on topic, looping, and good on all counts; and of fact answers that
    are correct, when there are fact questions."""
    n = max(len(verdicts), 1)
    out = {
        "questions": len(verdicts),
        **{
            f"{k}_rate": round(sum(bool(v[k]) for v in verdicts) / n, 4)
            for k in ("spanish", "on_topic", "loops", "ok")
        },
    }
    facts = [v for v in verdicts if "correct" in v]
    if facts:
        out.update(facts=len(facts), correct_rate=round(sum(v["correct"] for v in facts) / len(facts), 4))
    return out


Z95 = 1.959964  # the normal quantile of a two-sided 95% interval


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for k successes in n trials (Wilson 1927): unlike the normal approximation it
    stays within [0, 1] and is not empty at 0/n or n/n, which matters at a few dozen questions."""
    if n <= 0:
        return (0.0, 1.0)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


CHECKS = ("on_topic", "correct", "spanish", "loops", "ended", "ok")


def summary(rows: list[dict]) -> dict:
    """Each check's count, rate and Wilson 95% interval over the rows (verdicts with `ended` added): `correct`
    over the fact questions only, every other check over all questions."""
    out = {}
    for check in CHECKS:
        values = [bool(r[check]) for r in rows if r.get(check) is not None]
        k, n = sum(values), len(values)
        lo, hi = wilson(k, n)
        out[check] = {"k": k, "n": n, "rate": round(k / n, 4) if n else None, "low": round(lo, 4),
                      "high": round(hi, 4)}  # fmt: skip
    return out


def interleave(questions: list[Question]) -> list[Question]:
    """The questions in turns of their kinds (fact, advice, writing, fact, ...), each kind in file order: any
    first part of a run then covers every kind in proportion."""
    by_kind: dict[str, list[Question]] = {}
    for q in questions:
        by_kind.setdefault(q.kind, []).append(q)
    queues = list(by_kind.values())
    n = len(questions)
    out: list[Question] = []
    taken = [0] * len(queues)
    while len(out) < n:  # the kind furthest behind its share goes next
        k = min((i for i in range(len(queues)) if taken[i] < len(queues[i])),
                key=lambda i: (taken[i] + 1) / len(queues[i]))  # fmt: skip
        out.append(queues[k][taken[k]])
        taken[k] += 1
    return out
