"""Automatic checks of an answer's text, shared by finetune-eval and the judge: loops, distinct-2, Spanish (and
no drift into another script); and a generated answer as both see it (Reply)."""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass

from ..data.clean import EN_WORDS, ES_WORDS, is_spanish_lingua

TOKEN = re.compile(r"\w+|[^\w\s]")  # words and single punctuation marks
WORD = re.compile(r"\w+")


def loops(text: str) -> bool:
    """Whether an answer degenerates into repetition.

    Two signs, each absent from every human-written text in assets/ (624 responses and paragraphs):
    a span of 2-20 tokens repeated three times in a row ("¿Por qué? ¿Por qué? ¿Por qué?"), or a
    sequence of four words occurring three times anywhere (a loop with a longer period). A span without
    letters must repeat six times: "2 × 2 × 2 × 2 × 2" is arithmetic, "1 1 1 1 1 1 1 1 1 1 1 1" a loop.
    """
    toks = [t.lower() for t in TOKEN.findall(text)]
    for span in range(2, min(20, len(toks) // 3) + 1):
        for i in range(len(toks) - 3 * span + 1):
            unit = toks[i : i + span]
            times = 3 if any(c.isalpha() for t in unit for c in t) else 6
            if all(toks[i + k * span : i + (k + 1) * span] == unit for k in range(1, times)):
                return True
    words = [w.lower() for w in WORD.findall(text)]
    fours = Counter(tuple(words[i : i + 4]) for i in range(len(words) - 3))
    return max(fours.values(), default=0) >= 3


def distinct_2(texts: list[str]) -> float:
    """Distinct word bigrams over all bigrams of all answers (Li et al. 2016); low means repetitive."""
    grams = [
        tuple(ws[i : i + 2])
        for t in texts
        for ws in [[w.lower() for w in WORD.findall(t)]]
        for i in range(len(ws) - 1)
    ]
    return len(set(grams)) / len(grams) if grams else 0.0


LINGUA_MIN_WORDS = 8  # below this lingua guesses ("¿Por qué? ¿Por qué? ¿Por qué?" came out French)


# Letters and marks Spanish spells with and English does not: in an answer too short for the function-word vote
# ("¡Vamos a jugar!" has none of either list), they are the evidence left.
SPANISH_MARKS = re.compile(r"[¡¿ñÑáéíóúÁÉÍÓÚ]")


def is_spanish(text: str) -> bool:
    """More Spanish than English function words (the corpus cleaner's vote, over a whole answer), and, from
    LINGUA_MIN_WORDS words on, Spanish for lingua among the languages it is confused with: the vote alone
    takes Portuguese or Italian for Spanish, since they share "de", "a", "que". A short answer the vote cannot
    decide (a tie, mostly none of either list) is Spanish when it spells as only Spanish does (SPANISH_MARKS);
    "Actor." or "Yes." is not taken for Spanish."""
    words = [w.lower() for w in WORD.findall(text)]
    es, en = sum(w in ES_WORDS for w in words), sum(w in EN_WORDS for w in words)
    if foreign_script_share(text) > MAX_FOREIGN_SCRIPT or es < en:
        return False
    if es == en:
        return len(words) < LINGUA_MIN_WORDS and SPANISH_MARKS.search(text) is not None
    return len(words) < LINGUA_MIN_WORDS or is_spanish_lingua(text)


MAX_FOREIGN_SCRIPT = 0.05  # a stray symbol passes; a sentence in Cyrillic or Japanese does not


def foreign_script_share(text: str) -> float:
    """Share of letters outside the Latin script: lingua, asked among Latin-script languages, calls an
    answer that drifts into Russian or Japanese halfway "Spanish" (Gemma's base did, in the chat format)."""
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return 0.0
    return sum("LATIN" not in unicodedata.name(c, "") for c in letters) / len(letters)


def answer_checks(answers: list[str]) -> dict:
    n = max(len(answers), 1)
    return {
        "looping": round(sum(map(loops, answers)) / n, 4),
        "distinct_2": round(distinct_2(answers), 4),
        "spanish": round(sum(map(is_spanish, answers)) / n, 4),
        "mean_words": round(sum(len(WORD.findall(a)) for a in answers) / n, 1),
    }


@dataclass(frozen=True)
class Reply:
    text: str
    tokens: int  # new tokens generated, the stop token included
    ended: bool  # stopped at an end id (<end_of_turn>, <eos>, ...) rather than at max_new_tokens
