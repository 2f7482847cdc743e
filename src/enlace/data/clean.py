"""Cleaning: NFC, markup removal, line filters (fragments, code, English), document length, dedup keys."""

from __future__ import annotations

import hashlib
import html
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any

from ..config.data import CleaningConfig

# Function words only: frequent, short, and (after removing the ones both languages share: a, no, me, he,
# son, once, sin, e, o) a good vote between Spanish and English on a single line.
ES_WORDS = frozenset(
    """de la que el en y los del se las por un para con una su al lo como más mas pero sus le ya este sí porque
    esta entre cuando muy sobre también hasta hay donde dónde quien desde todo nos durante todos uno les ni
    contra otros ese eso ante ellos esto mí antes algunos qué unos yo otro otras otra él tanto esa estos mucho
    quienes nada muchos cual cuál poco ella estar estas algunas algo nosotros es está están fue ser puede
    pueden si tiene tienen cada puede usted hace sólo solo era fué así aquí ahora según""".split()
)
EN_WORDS = frozenset(
    """the of and to in is that it for with as was on be by this are or from at which an but not have has you
    they we his her their will would can if your all there been were when what more one also into only its
    than other these some do does should could may must how about out up use used using shall who them""".split()
)
WORD = re.compile(r"[^\W\d_]+")
TAG = re.compile(r"</?[A-Za-z][^<>]{0,200}>")
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ufffd\u200b\ufeff]")
SPACES = re.compile(r"[ \t\u00a0\u2000-\u200a\u202f\u3000]+")


@dataclass
class CleanStats:
    docs_in: int = 0
    docs_out: int = 0
    lines_in: int = 0
    lines_short: int = 0  # too few words: fragments, headings, menu items
    lines_symbols: int = 0  # mostly non-letters: code, tables, numbers
    lines_english: int = 0
    docs_short: int = 0
    replaced_bytes: int = 0  # invalid UTF-8 replaced while reading
    extra: dict[str, int] = field(default_factory=dict)

    def add(self, other: CleanStats) -> None:
        for k, v in vars(other).items():
            if isinstance(v, int):
                setattr(self, k, getattr(self, k) + v)


def normalize_text(text: str) -> str:
    """NFC, entities decoded, leftover tags removed, control characters dropped, spaces collapsed."""
    text = unicodedata.normalize("NFC", text)
    if "&" in text:
        text = html.unescape(text)
    if "<" in text:
        text = TAG.sub(" ", text)
    text = CONTROL.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))
    return "\n".join(SPACES.sub(" ", line).strip() for line in text.split("\n"))


def line_verdict(line: str, cfg: CleaningConfig) -> str:
    """'keep', or why the line goes: 'short', 'symbols' or 'english'."""
    words = WORD.findall(line)
    if len(words) < cfg.min_words_per_line:
        return "short"
    letters = sum(len(w) for w in words)
    visible = sum(1 for c in line if not c.isspace())
    if visible and letters / visible < cfg.min_letter_fraction:
        return "symbols"
    if cfg.language_filter and cfg.language_id == "lingua":
        return "keep" if is_spanish_lingua(line) else "english"  # counted with the English lines
    if cfg.language_filter:
        lower = [w.lower() for w in words]
        es = sum(w in ES_WORDS for w in lower)
        en = sum(w in EN_WORDS for w in lower)
        if en >= es or (es == 0 and len(words) >= 2 * cfg.min_words_per_line):
            return "english" if en else "symbols"
    return "keep"


_DETECTOR: Any = None


def is_spanish_lingua(line: str) -> bool:
    """lingua-language-detector's verdict among the languages a Spanish corpus is mixed with."""
    global _DETECTOR
    from lingua import Language, LanguageDetectorBuilder

    if _DETECTOR is None:
        langs = ("SPANISH", "ENGLISH", "PORTUGUESE", "FRENCH", "ITALIAN", "CATALAN")
        _DETECTOR = LanguageDetectorBuilder.from_languages(*(getattr(Language, x) for x in langs)).build()
    return _DETECTOR.detect_language_of(line) == Language.SPANISH


def clean_document(text: str, cfg: CleaningConfig, stats: CleanStats) -> str | None:
    """The cleaned document (kept lines; blank lines between paragraphs) or None when too little is left."""
    stats.docs_in += 1
    paragraphs: list[str] = []
    current: list[str] = []
    for line in normalize_text(text).split("\n"):
        if not line:
            if current:
                paragraphs.append("\n".join(current))
                current = []
            continue
        stats.lines_in += 1
        verdict = line_verdict(line, cfg)
        if verdict == "keep":
            current.append(line)
        else:
            setattr(stats, f"lines_{verdict}", getattr(stats, f"lines_{verdict}") + 1)
    if current:
        paragraphs.append("\n".join(current))
    doc = "\n\n".join(paragraphs)
    if len(doc) < max(cfg.min_doc_chars, 1):
        stats.docs_short += 1
        return None
    stats.docs_out += 1
    return doc


def split_long(doc: str, max_chars: int) -> list[str]:
    """Cut a document into pieces of at most max_chars at paragraph, then line, then space boundaries."""
    if len(doc) <= max_chars:
        return [doc]
    pieces: list[str] = []
    buf = ""
    for sep, units in (("\n\n", doc.split("\n\n")),):
        for unit in units:
            for part in _fit(unit, max_chars):
                if buf and len(buf) + len(sep) + len(part) > max_chars:
                    pieces.append(buf)
                    buf = part
                else:
                    buf = f"{buf}{sep}{part}" if buf else part
    if buf:
        pieces.append(buf)
    return pieces


def _fit(unit: str, max_chars: int) -> list[str]:
    if len(unit) <= max_chars:
        return [unit]
    out: list[str] = []
    while len(unit) > max_chars:
        cut = unit.rfind("\n", 0, max_chars)
        if cut <= 0:
            cut = unit.rfind(" ", 0, max_chars)
        if cut <= 0:
            cut = max_chars
        out.append(unit[:cut].strip())
        unit = unit[cut:].strip()
    if unit:
        out.append(unit)
    return out


def exact_key(doc: str) -> str:
    return hashlib.sha256(doc.encode("utf-8")).hexdigest()


def normalized_key(doc: str) -> str:
    """Same key for documents that differ only in case, punctuation, accents' composition or spacing."""
    words = WORD.findall(unicodedata.normalize("NFKC", doc).casefold())
    return hashlib.sha256(" ".join(words).encode("utf-8")).hexdigest()
