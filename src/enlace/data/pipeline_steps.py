"""Our corpus steps as datatrove pipeline steps: extract+clean per file, exact dedup, MinHash per file,
the deduplicated stream, finalize.

Memory stays bounded: documents stream through, one file at a time; exact dedup keeps 8-byte hashes;
near-dedup is datatrove's disk-based MinHash; caps keep two numbers per document of a capped source.
Everything that reads text runs per file in parallel tasks, except the final write, which must follow
the corpus order; the ordered decisions (first copy wins) read only hashes and datatrove's removal lists.
"""

from __future__ import annotations

import hashlib
import json
import os
from array import array
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from datatrove.data import Document
from datatrove.pipeline.base import PipelineStep
from datatrove.utils.word_tokenizers import WordTokenizer

from ..config.data import CleaningConfig, DataConfig
from ..errors import DataError
from ..io import atomic_write_text, canonical_json
from .clean import WORD, CleanStats, clean_document, normalized_key, split_long
from .extract import iter_file
from .util import log

# Bump when extraction or cleaning changes what a file yields (or what is stored per file: 3 added the
# normalized keys): per-file results under an old version are not reused.
STEP_VERSION = 3


@dataclass(frozen=True)
class WorkItem:
    """One input file of one source; `key` names its cleaned output (and changes with any input to it)."""

    source: str
    rel: str
    path: str
    kind: str
    column: str
    key: str


def item_key(source: Any, rel: str, path: Path, kind: str, cleaning: CleaningConfig) -> str:
    st = path.stat()
    ident = {
        "v": STEP_VERSION,
        "source": source.name,
        "kind": kind,
        "column": source.text_column,
        "cleaning": cleaning.model_dump(mode="json"),
        "rel": rel,
        # Fetched files never change in place (they are verified and renamed); local ones may.
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]


def docs_path(work: Path, key: str) -> Path:
    return Path(work) / "docs" / key[:2] / f"{key}.jsonl"


def fraction(tag: str, key: str) -> float:
    """A number in [0, 1) from a document key and a purpose tag: split, caps and weights draw independently."""
    return int(hashlib.sha256(f"{tag}:{key}".encode()).hexdigest()[:16], 16) / 2**64


def record_error(work: Path, rank: int, err: Exception) -> None:
    atomic_write_text(Path(work) / "errors" / f"{rank:05d}.txt", str(err))


def raise_recorded_errors(work: Path) -> None:
    """Steps record a DataError instead of raising it (datatrove would log a traceback); raise it here."""
    folder = Path(work) / "errors"
    msgs = sorted(folder.glob("*.txt")) if folder.exists() else []
    if msgs:
        raise DataError(msgs[0].read_text(encoding="utf-8"))


class ExtractClean(PipelineStep):
    """Extract and clean each input file into docs/<key>.jsonl; files are split among tasks by index.

    A file whose output exists is skipped, so a killed fetch resumes at file granularity.
    """

    name = "enlace extract+clean"

    def __init__(self, items: list[WorkItem], cleaning: CleaningConfig, work: Path):
        super().__init__()
        self.items, self.cleaning, self.work = items, cleaning, Path(work)

    def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> Iterator[Document]:
        try:
            for i, item in enumerate(self.items):
                if i % world_size == rank:
                    self._one(item)
        except DataError as e:
            record_error(self.work, rank, e)
        yield from ()

    def _one(self, item: WorkItem) -> None:
        out = docs_path(self.work, item.key)
        stats_file = out.with_suffix(".json")
        if stats_file.exists():
            return
        out.parent.mkdir(parents=True, exist_ok=True)
        stats = CleanStats()
        counts: dict[str, Any] = {}
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        keys = keys_path(self.work, item.key)
        tmp_keys = keys.with_name(f".{keys.name}.tmp-{os.getpid()}")
        # The normalized key of each document is computed here, in parallel tasks, so that the ordered
        # exact-dedup decision reads 32 bytes per document instead of the text.
        with open(tmp, "w", encoding="utf-8") as f, open(tmp_keys, "wb") as fk:
            for raw in iter_file(item.kind, Path(item.path), item.column, counts):
                doc = clean_document(raw, self.cleaning, stats)
                if doc is not None:
                    f.write(json.dumps({"t": doc}, ensure_ascii=False) + "\n")
                    fk.write(bytes.fromhex(normalized_key(doc)))
            for h in (f, fk):
                h.flush()
                os.fsync(h.fileno())
        stats.replaced_bytes += counts.get("invalid_utf8", 0)
        if counts.get("invalid_utf8"):
            # Shown here, not only in the manifest: a file in another encoding or with stray bytes.
            log(
                f"extract: {item.source}: {item.rel}: {counts['invalid_utf8']} bytes were not UTF-8; "
                f"read as {counts.get('encoding', 'utf-8')}"
            )
        os.replace(tmp, out)
        os.replace(tmp_keys, keys)
        # The stats file marks the item complete: written last.
        atomic_write_text(stats_file, canonical_json(asdict(stats)))


KEY_BYTES = 32  # a normalized key (sha256 digest) per cleaned document, in docs/<key>.keys


def keys_path(work: Path, key: str) -> Path:
    return docs_path(work, key).with_suffix(".keys")


def read_docs_file(work: Path, item: WorkItem) -> Iterator[str]:
    with open(docs_path(work, item.key), encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["t"]


def read_keys(work: Path, item: WorkItem) -> np.ndarray:
    """The (docs, 32) uint8 normalized keys of one cleaned file."""
    return np.fromfile(keys_path(work, item.key), dtype=np.uint8).reshape(-1, KEY_BYTES)


def keep_path(work: Path) -> Path:
    return Path(work) / "dedup" / "keep.npy"


class ExactDedup(PipelineStep):
    """The ordered "first copy wins" decision of exact dedup, on 8 bytes per document (no text is read).

    ExtractClean stored each document's normalized key, so this single task reads only the key files, in
    corpus order, and writes one keep flag per document (dedup/keep.npy) and the per-source counts.
    Memory: the first 8 key bytes of every document and their sort (about 40 bytes per document, e.g.
    ~130 MB for 3.5 M documents).
    """

    name = "enlace exact dedup"

    def __init__(self, items: list[WorkItem], work: Path, dedup: bool):
        super().__init__()
        self.items, self.work, self.dedup = items, Path(work), dedup

    def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> Iterator[Document]:
        if rank == 0:
            self._run()
        yield from ()

    def _run(self) -> None:
        heads = [read_keys(self.work, it)[:, :8].copy().view(">u8").ravel() for it in self.items]
        counts = np.array([len(h) for h in heads], dtype=np.int64)
        allh = np.concatenate(heads) if heads else np.zeros(0, dtype=">u8")
        del heads
        if self.dedup:
            # np.unique's return_index is the first occurrence of each value: the first copy in corpus order.
            _, first = np.unique(allh, return_index=True)
            keep = np.zeros(len(allh), dtype=np.bool_)
            keep[first] = True
        else:
            keep = np.ones(len(allh), dtype=np.bool_)
        out: dict[str, dict[str, int]] = {}
        start = 0
        for item, n in zip(self.items, counts.tolist(), strict=True):
            c = out.setdefault(item.source, {"docs": 0, "duplicates": 0})
            kept = int(keep[start : start + n].sum())
            c["docs"] += kept
            c["duplicates"] += n - kept
            start += n
        path = keep_path(self.work)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, keep)
        os.replace(tmp, path)
        atomic_write_text(self.work / "merge.json", canonical_json(out))


def _offsets(work: Path, items: list[WorkItem]) -> list[int]:
    """Where each file's documents start in the corpus-wide keep flags."""
    offs = [0]
    for it in items:
        offs.append(offs[-1] + keys_path(work, it.key).stat().st_size // KEY_BYTES)
    return offs


def kept_docs(work: Path, item: WorkItem, keep: np.ndarray) -> Iterator[tuple[str, str]]:
    """(text, hex normalized key) of the documents of one file that survive exact dedup."""
    keys = read_keys(work, item)
    for text, flag, k in zip(read_docs_file(work, item), keep, keys, strict=True):
        if flag:
            yield text, k.tobytes().hex()


class MinhashFiles(PipelineStep):
    """datatrove's MinHash signature step, run once per input file (the file index is its "rank").

    Files are split among tasks by index, so the signatures (and the documents a cluster keeps, which
    datatrove orders by file then document) do not depend on the task count; a single ordered stream
    numbered 0..N gives the same pairs in the same order, only labelled differently.
    """

    name = "enlace minhash signatures"

    def __init__(self, items: list[WorkItem], work: Path, signature: PipelineStep):
        super().__init__()
        self.items, self.work, self.signature = items, Path(work), signature

    def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> Iterator[Document]:
        keep = np.load(keep_path(self.work), mmap_mode="r")
        offs = _offsets(self.work, self.items)
        for i, item in enumerate(self.items):
            if i % world_size != rank:
                continue
            docs = (
                Document(text=t, id=str(j))
                for j, (t, _) in enumerate(kept_docs(self.work, item, keep[offs[i] : offs[i + 1]]))
            )
            self.signature.run(docs, rank=i, world_size=len(self.items))
        yield from ()


class Survivors(PipelineStep):
    """The deduplicated stream, in corpus order: exact duplicates dropped by the keep flags, near
    duplicates by datatrove's MinHash filter (given each file's documents under the file's "rank")."""

    name = "enlace dedup stream"

    def __init__(self, items: list[WorkItem], work: Path, near_filter: PipelineStep | None):
        super().__init__()
        self.items, self.work, self.near_filter = items, Path(work), near_filter

    def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> Iterator[Document]:
        if rank != 0:
            return
        keep = np.load(keep_path(self.work), mmap_mode="r")
        offs = _offsets(self.work, self.items)
        n = 0
        for i, item in enumerate(self.items):
            docs: Iterator[Document] = (
                Document(text=t, id=str(j), metadata={"source": item.source, "key": k})
                for j, (t, k) in enumerate(kept_docs(self.work, item, keep[offs[i] : offs[i + 1]]))
            )
            # datatrove's filter warns about every file without a .remove file: skip those files instead.
            if self.near_filter is not None and self.near_filter.data_folder.isfile(f"{i:06d}.remove"):
                docs = self.near_filter.run(docs, rank=i, world_size=len(self.items))
            for doc in docs:
                doc.id = str(n)
                n += 1
                yield doc


class SpanishWords(WordTokenizer):
    """Words as the cleaning filter sees them, for MinHash shingles (datatrove's own need spaCy or NLTK)."""

    def word_tokenize(self, text: str) -> list[str]:
        return WORD.findall(text)

    def sent_tokenize(self, text: str) -> list[str]:
        return [s for s in text.split("\n") if s]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        return [m.span() for m in WORD.finditer(text)]


def _jsonl_line(source: str, key: str, text: str) -> str:
    return json.dumps({"source": source, "doc": key[:16], "text": text}, ensure_ascii=False) + "\n"


class _SplitWriter:
    """Writes one split's JSONL under a temporary name, hashing and counting as it goes."""

    def __init__(self, out: Path, split: str):
        self.final = out / f"{split}.jsonl"
        self.tmp = out / f".{split}.jsonl.tmp"
        self.f = open(self.tmp, "w", encoding="utf-8")
        self.h = hashlib.sha256()
        self.docs = self.chars = self.bytes = 0

    def write(self, source: str, key: str, text: str) -> None:
        line = _jsonl_line(source, key, text)
        self.f.write(line)
        self.h.update(line.encode("utf-8"))
        self.docs += 1
        self.chars += len(text)
        self.bytes += len(text.encode("utf-8"))

    def close(self) -> dict[str, Any]:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return {
            "file": self.final.name,
            "docs": self.docs,
            "chars": self.chars,
            "bytes": self.bytes,
            "sha256": self.h.hexdigest(),
        }


def cap_thresholds(
    data: DataConfig, chars: dict[str, int], caps: dict[str, tuple[array, array]]
) -> dict[str, float]:
    """For each capped source, keep documents whose cap draw is below the returned threshold.

    The limits are a fixed point (a capped source's allowance depends on the others' capped sizes). The
    draw is a hash of the document independent of the split's, so a cap keeps val and train alike.
    """
    capped = {s.name: s.max_fraction for s in data.sources if s.max_fraction is not None}
    limits = dict(chars)
    for _ in range(50):
        total = sum(limits.values())
        new = dict(limits)
        for name, frac in capped.items():
            others = total - limits[name]
            allowed = others * frac / (1 - frac) if frac < 1 else float("inf")
            new[name] = min(chars[name], int(allowed))
        if new == limits:
            break
        limits = new
    out: dict[str, float] = {}
    for name in capped:
        if chars[name] <= limits[name]:
            out[name] = 2.0  # above every draw: keep all
            continue
        draws, sizes = caps[name]
        used, threshold = 0, 0.0
        for u, n in sorted(zip(draws, sizes, strict=True)):
            if used + n > limits[name]:
                break
            used += n
            threshold = u
        out[name] = threshold + 1e-18 if used else 0.0
    return out


class Finalize(PipelineStep):
    """Caps, train/val split by parent document, long documents cut into pieces, corpus files + manifest.

    Two passes over a spill file of the deduplicated stream: the first counts each source's characters
    (the caps need the totals), the second writes. Every piece of a document goes to its parent's side.
    """

    name = "enlace caps+split+write"

    def __init__(self, data: DataConfig, work: Path, out: Path, config_hash: str, items: list[WorkItem]):
        super().__init__()
        self.data, self.work, self.out, self.config_hash = data, Path(work), Path(out), config_hash
        self.items = items

    def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> Iterator[Document]:
        if rank != 0:
            return
        try:
            self._run(data or iter(()))
        except DataError as e:
            record_error(self.work, rank, e)
        yield from ()

    def _run(self, docs: Any) -> None:
        d = self.data
        spill = self.work / "deduped.jsonl"
        chars, received, caps = self._spill(docs, spill)
        thresholds = cap_thresholds(d, chars, caps)
        self.out.mkdir(parents=True, exist_ok=True)
        writers = {"train": _SplitWriter(self.out, "train"), "val": _SplitWriter(self.out, "val")}
        counts = self._write_splits(spill, thresholds, writers)
        spill.unlink()
        files = {split: w.close() for split, w in writers.items()}
        if not files["train"]["docs"]:
            for w in writers.values():
                w.tmp.unlink(missing_ok=True)
            raise DataError(f"data config {d.name}: the corpus is empty after cleaning and splitting")
        manifest = self._manifest(counts, received, files)
        # The old corpus stays until the new one is complete; the manifest (the "complete" mark) goes last.
        (self.out / "manifest.json").unlink(missing_ok=True)
        for w in writers.values():
            os.replace(w.tmp, w.final)
        atomic_write_text(self.out / "manifest.json", canonical_json(manifest))

    def _spill(
        self, docs: Any, spill: Path
    ) -> tuple[dict[str, int], dict[str, int], dict[str, tuple[array, array]]]:
        """First pass: the stream to the spill file; each source's characters and documents received, and
        the cap draws and sizes of the capped sources' documents."""
        d = self.data
        capped = {s.name for s in d.sources if s.max_fraction is not None}
        chars = {s.name: 0 for s in d.sources}
        received = {s.name: 0 for s in d.sources}
        caps: dict[str, tuple[array, array]] = {n: (array("d"), array("q")) for n in capped}
        with open(spill, "w", encoding="utf-8") as f:
            for doc in docs:
                src, key = doc.metadata["source"], doc.metadata["key"]
                f.write(json.dumps({"s": src, "k": key, "t": doc.text}, ensure_ascii=False) + "\n")
                chars[src] += len(doc.text)
                received[src] += 1
                if src in capped:
                    caps[src][0].append(fraction("cap", key))
                    caps[src][1].append(len(doc.text))
        return chars, received, caps

    def _write_splits(
        self, spill: Path, thresholds: dict[str, float], writers: dict[str, _SplitWriter]
    ) -> dict[str, Any]:
        """Second pass: caps, the train/val split by parent document, long documents cut into pieces and
        the weights' repeats; returns per-source counts ("per"), capped drops and content digests."""
        d, cl = self.data, self.data.cleaning
        weights = {s.name: s.weight for s in d.sources}
        per = {
            s.name: {"docs": 0, "pieces": 0, "train_docs": 0, "val_docs": 0, "chars": 0, "train_chars": 0}
            for s in d.sources
        }
        dropped = {s.name: 0 for s in d.sources}
        digests = {s.name: hashlib.sha256() for s in d.sources}
        with open(spill, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                src, key, text = row["s"], row["k"], row["t"]
                if src in thresholds and fraction("cap", key) >= thresholds[src]:
                    dropped[src] += 1
                    continue
                pieces = [p for p in split_long(text, cl.max_doc_chars) if len(p) >= cl.min_doc_chars]
                if not pieces:
                    continue
                p = per[src]
                p["docs"] += 1
                p["pieces"] += len(pieces)
                p["chars"] += sum(len(x) for x in pieces)
                digests[src].update(key.encode() + b"\n")
                if fraction("split", key) < d.val_fraction:
                    p["val_docs"] += len(pieces)
                    for piece in pieces:
                        writers["val"].write(src, key, piece)
                    continue
                # A fractional weight repeats a document once more when a third, independent draw says so.
                w = weights[src]
                times = int(w) + (1 if fraction("weight", key) < w - int(w) else 0)
                for _ in range(times):
                    for piece in pieces:
                        writers["train"].write(src, key, piece)
                        p["train_docs"] += 1
                        p["train_chars"] += len(piece)
        return {"per": per, "dropped": dropped, "digests": digests}

    def _manifest(
        self, counts: dict[str, Any], received: dict[str, int], files: dict[str, Any]
    ) -> dict[str, Any]:
        """The corpus manifest: per source (licence, counts, what each dedup step and cap dropped,
        cleaning statistics), the split files and the totals."""
        d = self.data
        merge = json.loads((self.work / "merge.json").read_text())
        stats = self._clean_stats()
        sources: dict[str, Any] = {}
        for s in d.sources:
            m = merge.get(s.name, {"docs": 0, "duplicates": 0})
            sources[s.name] = {
                "kind": s.kind,
                "license": s.license,
                "weight": s.weight,
                "max_fraction": s.max_fraction,
                **counts["per"][s.name],
                "sha256": counts["digests"][s.name].hexdigest(),
                "duplicates_dropped": m["duplicates"],
                "near_duplicates_dropped": m["docs"] - received[s.name],
                "capped_docs_dropped": counts["dropped"][s.name],
                "cleaning": stats[s.name],
            }
        return {
            "name": d.name,
            "config_hash": self.config_hash,
            "val_fraction": d.val_fraction,
            "sources": sources,
            "splits": files,
            "total": {
                "docs": sum(s["docs"] for s in sources.values()),
                "chars": sum(s["chars"] for s in sources.values()),
                "train_chars": files["train"]["chars"],
                "val_chars": files["val"]["chars"],
            },
        }

    def _clean_stats(self) -> dict[str, dict[str, int]]:
        out: dict[str, CleanStats] = {s.name: CleanStats() for s in self.data.sources}
        for item in self.items:
            st = json.loads(docs_path(self.work, item.key).with_suffix(".json").read_text())
            out[item.source].add(CleanStats(**{k: v for k, v in st.items() if k != "extra"}))
        return {k: {a: b for a, b in asdict(v).items() if a != "extra"} for k, v in out.items()}
