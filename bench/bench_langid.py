"""Language ID: the cleaning's stopword rule against lingua-language-detector on a labelled sample.

The sample comes from the gettext catalogs installed on this machine (/usr/share/locale/<lang>/LC_MESSAGES):
each catalog pairs an English msgid with its translation, so every line has a known language. Spanish
translations are the positives; English msgids and Portuguese, French, Italian and Catalan translations the
negatives (the languages most easily confused with Spanish). Only lines the other filters would keep are
used (at least min_words_per_line words, mostly letters), and each text is taken once.

    python -m bench.bench_langid [--per-language 600]

Prints accuracy, precision and recall for "is Spanish" for both methods and how often they agree, and
writes bench/results/langid.json.
"""

from __future__ import annotations

import argparse
import gettext
import hashlib
import json
import time
from pathlib import Path

from enlace.config.data import CleaningConfig
from enlace.data.clean import line_verdict

LOCALES = Path("/usr/share/locale")
NEGATIVE = ("pt", "fr", "it", "ca")


def catalog(path: Path) -> dict[str, str]:
    with open(path, "rb") as f:
        try:
            cat = gettext.GNUTranslations(f)._catalog  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - a broken catalog is skipped, not fatal to a benchmark
            return {}
    out = {}
    for key, value in cat.items():
        msgid = key[0] if isinstance(key, tuple) else key
        if isinstance(key, tuple) and key[1] != 0:
            continue
        if msgid and value and value != msgid:
            out[msgid] = value
    return out


def passes_other_filters(line: str, cfg: CleaningConfig) -> bool:
    off = cfg.model_copy(update={"language_filter": False})
    return line_verdict(line, off) == "keep"


def build_sample(per_language: int, cfg: CleaningConfig) -> list[tuple[str, str]]:
    """(text, language) pairs, a fixed number per language, chosen by hash (deterministic)."""
    pools: dict[str, set[str]] = {lang: set() for lang in ("es", "en", *NEGATIVE)}
    for es_file in sorted((LOCALES / "es" / "LC_MESSAGES").glob("*.mo")):
        for msgid, msgstr in catalog(es_file).items():
            for lang, text in (("en", msgid), ("es", msgstr)):
                line = " ".join(text.split())
                if passes_other_filters(line, cfg):
                    pools[lang].add(line)
        for lang in NEGATIVE:
            other = LOCALES / lang / "LC_MESSAGES" / es_file.name
            if other.exists():
                for msgstr in catalog(other).values():
                    line = " ".join(msgstr.split())
                    if passes_other_filters(line, cfg):
                        pools[lang].add(line)
    seen: set[str] = set()
    sample = []
    for lang, pool in pools.items():
        n = per_language if lang in ("es", "en") else per_language // 2
        ranked = sorted(pool - seen, key=lambda t: hashlib.sha256(t.encode()).hexdigest())[:n]
        seen.update(ranked)
        sample.extend((t, lang) for t in ranked)
    return sample


def scores(pred: list[bool], truth: list[bool]) -> dict[str, float]:
    tp = sum(p and t for p, t in zip(pred, truth, strict=True))
    fp = sum(p and not t for p, t in zip(pred, truth, strict=True))
    fn = sum(t and not p for p, t in zip(pred, truth, strict=True))
    correct = sum(p == t for p, t in zip(pred, truth, strict=True))
    return {
        "accuracy": correct / len(truth),
        "precision": tp / (tp + fp) if tp + fp else 0.0,
        "recall": tp / (tp + fn) if tp + fn else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-language", type=int, default=600)
    args = ap.parse_args()
    from lingua import Language, LanguageDetectorBuilder

    cfg = CleaningConfig()
    sample = build_sample(args.per_language, cfg)
    truth = [lang == "es" for _, lang in sample]
    t0 = time.perf_counter()
    rule = [line_verdict(text, cfg) == "keep" for text, _ in sample]
    t_rule = time.perf_counter() - t0
    langs = [Language.SPANISH, Language.ENGLISH, Language.PORTUGUESE, Language.FRENCH, Language.ITALIAN]
    langs.append(Language.CATALAN)
    detector = LanguageDetectorBuilder.from_languages(*langs).build()
    t0 = time.perf_counter()
    lingua = [detector.detect_language_of(text) == Language.SPANISH for text, _ in sample]
    t_lingua = time.perf_counter() - t0
    counts = {lang: sum(1 for _, x in sample if x == lang) for lang in ("es", "en", *NEGATIVE)}
    per_lang = {
        lang: {
            "rule_says_spanish": sum(r for r, (_, x) in zip(rule, sample, strict=True) if x == lang)
            / counts[lang],
            "lingua_says_spanish": sum(g for g, (_, x) in zip(lingua, sample, strict=True) if x == lang)
            / counts[lang],
        }
        for lang in counts
        if counts[lang]
    }
    result = {
        "sample": {"lines": len(sample), "per_language": counts, "source": str(LOCALES)},
        "stopword_rule": {**scores(rule, truth), "seconds": round(t_rule, 3)},
        "lingua": {**scores(lingua, truth), "seconds": round(t_lingua, 3), "version": "2.1.1"},
        "agreement": sum(a == b for a, b in zip(rule, lingua, strict=True)) / len(sample),
        "by_language": per_lang,
    }
    out = Path("bench/results/langid.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
