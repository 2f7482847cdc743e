"""Turn raw files into plain UTF-8 text documents, one extractor per format. No cleaning here."""

from __future__ import annotations

import bz2
import fnmatch
import gettext
import gzip
import lzma
import os
import re
import shutil
import subprocess
import warnings
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from ..errors import DataError
from ..io import iter_jsonl

# Man page sections: foo.1, foo.8.gz, foo.3pm.
MAN_RE = re.compile(r"\.[1-9][a-z]*(\.(gz|bz2|xz))?$")
COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
OVERSTRIKE = re.compile(r".\x08")
SGR = re.compile(r"\x1b\[[0-9;]*m")
OSIS_NOTE = re.compile(r"<note\b[^>]*>.*?</note>", re.S)
TAG = re.compile(r"<[^>]*>")


def read_bytes(path: Path) -> bytes:
    opener = COMPRESSED.get(path.suffix)
    if opener is not None:
        with opener(path, "rb") as f:
            return f.read()
    return path.read_bytes()


# Up to this share of invalid UTF-8 bytes, a file is UTF-8 with a few stray bytes (replaced and counted);
# above it, the file is in another encoding, which charset-normalizer identifies, or it is not text.
MAX_INVALID_UTF8 = 0.001


def decode_as(data: bytes, where: object = "input") -> tuple[str, int, str]:
    """Text of `data`, how many bytes were not valid UTF-8, and the encoding it was read in.

    UTF-8 first. A file with more than MAX_INVALID_UTF8 invalid bytes is decoded in the encoding that
    charset-normalizer detects (Latin-1 "República" stays "República", not "Repblica"); NUL bytes or no
    plausible encoding mean binary data, which is refused instead of becoming corpus text.
    """
    try:
        return data.decode("utf-8"), 0, "utf-8"
    except UnicodeDecodeError:
        pass
    text = data.decode("utf-8", errors="replace")
    bad = text.count("\ufffd")
    if b"\x00" in data:
        raise DataError(
            f"{where}: binary data ({data.count(0)} NUL bytes, {bad} invalid UTF-8 bytes), not text"
        )
    if bad <= MAX_INVALID_UTF8 * len(data):
        return text, bad, "utf-8"
    from charset_normalizer import from_bytes

    best = from_bytes(data).best()
    if best is None or best.encoding is None or best.chaos > 0.2:
        raise DataError(
            f"{where}: not text in any known encoding ({bad} of {len(data)} bytes are invalid UTF-8)"
        )
    return data.decode(best.encoding, errors="replace"), bad, best.encoding


def detect(rel: str) -> str | None:
    """The extractor for a file by its name, for sources with extractor: auto. None skips the file."""
    name = rel.rsplit("/", 1)[-1].lower()
    base = re.sub(r"\.(gz|bz2|xz)$", "", name)
    if base.endswith((".html", ".htm", ".xhtml")):
        return "html"
    if base.endswith(".mo"):
        return "gettext"
    if base.endswith(".page"):
        return "mallard"
    if base.endswith(".parquet"):
        return "parquet"
    if base.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if base.endswith(".txt"):
        return "text"
    if "/man/" in f"/{rel}" and MAN_RE.search(name):
        return "man"
    if name.endswith(".conf") and "/mods.d/" in f"/{rel}":
        return "sword"
    return None


class _TextParser(HTMLParser):
    """Collects the text of HTML or XML, one line per block element, skipping tags that are not prose."""

    BLOCK = {
        "p",
        "div",
        "br",
        "li",
        "ul",
        "ol",
        "dl",
        "dt",
        "dd",
        "tr",
        "table",
        "section",
        "article",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
        "pre",
        "blockquote",
        "title",
        "td",
        "th",
        "hr",
        "figure",
        "caption",
        "item",
        "list",
        "steps",
        "note",
        "terms",
        "tree",
        "page",
        "links",
        "synopsis",
        "example",
        "body",
    }

    def __init__(self, skip: set[str]):
        super().__init__(convert_charrefs=True)
        self.skip = skip
        self.depth = 0  # inside how many skipped elements
        self.parts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.skip:
            self.depth += 1
        elif tag in self.BLOCK:
            self.parts.append("\n")

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self.skip:
            self.depth = max(0, self.depth - 1)
        elif tag in self.BLOCK:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self.depth:
            # Newlines inside a text node are the source file's wrapping, not the document's structure.
            self.parts.append(" ".join(data.split()) if data.strip() else " ")

    def text(self) -> str:
        raw = "".join(self.parts)
        lines = (" ".join(line.split()) for line in raw.split("\n"))
        return "\n".join(line for line in lines if line)


HTML_SKIP = {"script", "style", "nav", "head", "noscript", "svg", "pre", "footer", "header", "form", "button"}
# Mallard: <info> holds credits and licenses, <screen> blocks are terminal sessions, not prose.
MALLARD_SKIP = {"info", "screen", "media"}


def html_text(markup: str, skip: set[str] = HTML_SKIP) -> str:
    parser = _TextParser(skip)
    parser.feed(markup)
    parser.close()
    return parser.text()


def man_text(path: Path) -> str | None:
    """Render a man page with groff; -k reads UTF-8 input, LL/HY keep paragraphs on one unhyphenated line."""
    if shutil.which("groff") is None:
        return None
    src = read_bytes(path)
    env = dict(os.environ, GROFF_NO_SGR="1", LC_ALL="C.UTF-8")
    res = subprocess.run(
        ["groff", "-k", "-t", "-man", "-Tutf8", "-rLL=2000n", "-rHY=0", "-P", "-c"],
        input=src,
        capture_output=True,
        env=env,
        timeout=120,
    )
    if res.returncode != 0:
        return ""
    text = res.stdout.decode("utf-8", errors="replace")
    return SGR.sub("", OVERSTRIKE.sub("", text))


def gettext_texts(path: Path) -> list[str]:
    """The translated side (msgstr) of a compiled .mo catalog, in catalog order."""
    with open(path, "rb") as f:
        try:
            catalog = gettext.GNUTranslations(f)._catalog  # type: ignore[attr-defined]
        except (OSError, UnicodeDecodeError, gettext.error) as e:  # type: ignore[attr-defined]
            raise DataError(f"{path}: not a readable .mo catalog: {e}") from None
    out: list[str] = []
    for key, value in catalog.items():
        msgid = key[0] if isinstance(key, tuple) else key
        if not msgid or not value:  # the header entry
            continue
        if isinstance(key, tuple) and key[1] != 0:
            continue  # keep one plural form
        out.append(value)
    return out


def fortune_texts(text: str) -> list[str]:
    return [f.strip() for f in re.split(r"^%\s*$", text, flags=re.M) if f.strip()]


def sword_chapters(conf: Path) -> Iterator[str]:
    """One document per Bible chapter; OSIS tags stripped here (pysword's clean=True glues words)."""
    try:
        from pysword.modules import SwordModules
    except ImportError:  # pragma: no cover - pysword is pinned in requirements.txt
        raise DataError(f"{conf}: the sword extractor needs the pysword package") from None
    library = conf.parent.parent
    modules = SwordModules(str(library))
    found = modules.parse_modules()
    for key in sorted(found):
        bible = modules.get_bible_from_module(key)
        books = bible.get_structure().get_books()
        for testament in ("ot", "nt"):
            for book in books.get(testament, []):
                for chapter in range(1, book.num_chapters + 1):
                    verses = bible.get(books=[book.osis_name], chapters=[chapter], clean=False, join="\n")
                    text = TAG.sub("", OSIS_NOTE.sub("", verses))
                    text = " ".join(" ".join(v.split()) for v in text.split("\n") if v.strip())
                    if text:
                        yield text


def jsonl_texts(path: Path, column: str) -> Iterator[str]:
    for lineno, row in iter_jsonl(path, COMPRESSED.get(path.suffix, open)):
        if not isinstance(row, dict) or column not in row:
            have = sorted(row) if isinstance(row, dict) else []
            raise DataError(f"{path}:{lineno}: no text column {column!r}; columns are: {', '.join(have)}")
        value = row[column]
        if isinstance(value, str):
            yield value


def parquet_texts(path: Path, column: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq  # pinned in requirements.txt; guarded for slim installs
    except ImportError:
        raise DataError(
            f"{path}: reading parquet needs pyarrow, which is not installed (pip install pyarrow), "
            "or point the source at .jsonl/.jsonl.gz files"
        ) from None
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if column not in names:
        raise DataError(f"{path}: no text column {column!r}; columns are: {', '.join(names)}")
    for batch in pf.iter_batches(columns=[column], batch_size=1024):
        for value in batch.column(0).to_pylist():
            if isinstance(value, str):
                yield value


def iter_file(kind: str, path: Path, text_column: str, counts: dict[str, Any]) -> Iterator[str]:
    """Stream the documents of one file; counts["invalid_utf8"] (and "encoding") are filled as it goes.

    Row formats (parquet, jsonl, the Bible) are read piece by piece, so a large file never sits in memory.
    """
    counts.setdefault("invalid_utf8", 0)
    if kind in ("html", "mallard", "fortune", "text"):
        text, bad, enc = decode_as(read_bytes(path), path)
        counts["invalid_utf8"] += bad
        counts["encoding"] = enc
        if kind == "html":
            yield html_text(text)
        elif kind == "mallard":
            yield html_text(text, MALLARD_SKIP)
        elif kind == "fortune":
            yield "\n\n".join(fortune_texts(text))
        else:
            yield text
    elif kind == "man":
        text = man_text(path)
        if text is None:
            warnings.warn(f"groff is not installed: skipping man page {path}", stacklevel=2)
            return
        counts["invalid_utf8"] += text.count("\ufffd")
        yield text
    elif kind == "gettext":
        yield "\n".join(gettext_texts(path))
    elif kind == "sword":
        yield from sword_chapters(path)
    elif kind == "jsonl":
        for doc in jsonl_texts(path, text_column):
            counts["invalid_utf8"] += doc.count("\ufffd")
            yield doc
    elif kind == "parquet":
        yield from parquet_texts(path, text_column)
    else:
        raise DataError(f"{path}: unknown extractor {kind!r}")


IGNORED_NAMES = {".complete"}


def list_files(
    root: Path, include: list[str], exclude: list[str], extractor: str
) -> list[tuple[str, Path, str]]:
    """(relative path, path, extractor) of the files to read, sorted so that every run sees the same order."""
    if root.is_file():
        kind = extractor if extractor != "auto" else detect(root.name)
        return [(root.name, root, kind)] if kind else []
    out: list[tuple[str, Path, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))  # .cache of huggingface_hub
        for fn in sorted(filenames):
            p = Path(dirpath) / fn
            rel = p.relative_to(root).as_posix()
            if fn in IGNORED_NAMES or fn.endswith((".part", ".tmp", ".incomplete")) or p.is_symlink():
                continue
            if include and not any(fnmatch.fnmatchcase(rel, pat) for pat in include):
                continue
            if any(fnmatch.fnmatchcase(rel, pat) for pat in exclude):
                continue
            if extractor == "auto":
                kind = detect(rel)
            elif extractor == "sword":
                kind = "sword" if detect(rel) == "sword" else None
            else:
                kind = extractor
            if kind:
                out.append((rel, p, kind))
    out.sort()
    return out
