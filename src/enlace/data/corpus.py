"""Build the corpus: fetch and extract every source, clean, dedup, cap, split by hash, write. `run_fetch`."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import paths
from ..config.data import CleaningConfig, DataConfig, HfSource
from ..errors import DataError
from ..io import atomic_write_text, canonical_json
from .clean import CleanStats, clean_document, exact_key, normalized_key, split_long
from .extract import extract_file, list_files
from .sources import Lock, Source, fetch_source
from .util import log, progress


@dataclass(frozen=True)
class Doc:
    source: str
    text: str
    sha: str


def _work(task: tuple[str, str, str, dict[str, Any]]) -> tuple[list[str], CleanStats]:
    """Extract and clean one file (runs in a worker process)."""
    kind, path, column, cleaning = task
    cfg = CleaningConfig.model_validate(cleaning)
    stats = CleanStats()
    raw_docs, bad = extract_file(kind, Path(path), column)
    stats.replaced_bytes += bad
    out: list[str] = []
    for raw in raw_docs:
        doc = clean_document(raw, cfg, stats)
        if doc is None:
            continue
        out.extend(p for p in split_long(doc, cfg.max_doc_chars) if len(p) >= cfg.min_doc_chars)
    return out, stats


def val_fraction_of(sha: str) -> float:
    """A document's place in [0, 1) from its hash: the split depends on the text only, not on order."""
    return int(sha[:16], 16) / 2**64


def _files_of(src: Source, root: Path) -> list[tuple[str, Path, str]]:
    include = list(src.include)
    if isinstance(src, HfSource) and not include:
        include = list(src.files)
    return list_files(root, include, list(src.exclude), src.extractor)


def _pool(workers: int) -> Any:
    # fork: workers inherit the imported modules, so starting them costs milliseconds, not seconds.
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    return ctx.Pool(workers, initializer=_single_thread)


def _single_thread() -> None:
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"


def extract_sources(
    data: DataConfig, roots: dict[str, Path], workers: int
) -> tuple[dict[str, list[str]], dict[str, CleanStats]]:
    """Cleaned documents of every source, in a fixed order (config order, then sorted file paths)."""
    tasks: list[tuple[str, tuple[str, str, str, dict[str, Any]]]] = []
    cleaning = data.cleaning.model_dump(mode="json")
    for src in data.sources:
        files = _files_of(src, roots[src.name])
        if not files:
            raise DataError(
                f"source {src.name}: no files to extract under {roots[src.name]} (check include/exclude)"
            )
        tasks.extend((src.name, (kind, str(p), src.text_column, cleaning)) for _, p, kind in files)
    docs: dict[str, list[str]] = {s.name: [] for s in data.sources}
    stats: dict[str, CleanStats] = {s.name: CleanStats() for s in data.sources}
    bar = progress(total=len(tasks), desc="extract", unit="file")
    results: Iterator[tuple[list[str], CleanStats]]
    if workers > 1 and len(tasks) > 1:
        pool = _pool(workers)
        results = pool.imap(_work, [t for _, t in tasks], chunksize=2)
    else:
        pool = None
        results = (_work(t) for _, t in tasks)
    try:
        for (name, _), (got, st) in zip(tasks, results, strict=True):
            docs[name].extend(got)
            stats[name].add(st)
            bar.update(1)
            bar.set_postfix(docs=sum(len(v) for v in docs.values()), refresh=False)
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    for src in data.sources:
        if not docs[src.name]:
            st = stats[src.name]
            raise DataError(
                f"source {src.name}: no documents left after cleaning ({st.docs_in} extracted, {st.lines_in} lines; "
                f"dropped: {st.lines_short} short, {st.lines_symbols} symbol/code, {st.lines_english} English lines)"
            )
    return docs, stats


def dedup(data: DataConfig, docs: dict[str, list[str]]) -> tuple[dict[str, list[Doc]], dict[str, int]]:
    """Drop exact and normalized duplicates; the first occurrence (config order) wins."""
    seen_exact: set[str] = set()
    seen_norm: set[str] = set()
    out: dict[str, list[Doc]] = {}
    dropped: dict[str, int] = {}
    for src in data.sources:
        kept: list[Doc] = []
        n = 0
        for text in docs[src.name]:
            sha = exact_key(text)
            if data.cleaning.dedup:
                norm = normalized_key(text)
                if sha in seen_exact or norm in seen_norm:
                    n += 1
                    continue
                seen_exact.add(sha)
                seen_norm.add(norm)
            kept.append(Doc(src.name, text, sha))
        out[src.name], dropped[src.name] = kept, n
    return out, dropped


def apply_caps(data: DataConfig, docs: dict[str, list[Doc]]) -> dict[str, int]:
    """Trim sources with max_fraction to that share of the final characters; keeps docs in hash order."""
    capped = {s.name: s.max_fraction for s in data.sources if s.max_fraction is not None}
    dropped = {name: 0 for name in capped}
    if not capped:
        return dropped
    chars = {name: sum(len(d.text) for d in ds) for name, ds in docs.items()}
    # Fixed-point: a capped source's limit depends on the others' (possibly capped) sizes.
    limits = dict(chars)
    for _ in range(20):
        total = sum(limits.values())
        new = dict(limits)
        for name, frac in capped.items():
            others = total - limits[name]
            allowed = others * frac / (1 - frac) if frac < 1 else float("inf")
            new[name] = min(chars[name], int(allowed))
        if new == limits:
            break
        limits = new
    for name in capped:
        if chars[name] <= limits[name]:
            continue
        kept: list[Doc] = []
        used = 0
        for d in sorted(docs[name], key=lambda d: d.sha):
            if used + len(d.text) > limits[name]:
                dropped[name] += 1
                continue
            kept.append(d)
            used += len(d.text)
        docs[name] = kept
    return dropped


def split_docs(data: DataConfig, docs: dict[str, list[Doc]]) -> tuple[list[Doc], list[Doc]]:
    """Train/val by document hash; train repeats a source's documents by its weight. Sorted output."""
    weights = {s.name: s.weight for s in data.sources}
    train: list[Doc] = []
    val: list[Doc] = []
    for name, ds in docs.items():
        w = weights[name]
        whole, frac = int(w), w - int(w)
        for d in ds:
            if val_fraction_of(d.sha) < data.val_fraction:
                val.append(d)
                continue
            # The fractional part of a weight picks documents by a second hash, so reruns pick the same ones.
            extra = 1 if frac and val_fraction_of(hashlib.sha256(d.sha.encode()).hexdigest()) < frac else 0
            train.extend([d] * (whole + extra))
    order = {s.name: i for i, s in enumerate(data.sources)}
    key = lambda d: (order[d.source], d.sha)  # noqa: E731
    return sorted(train, key=key), sorted(val, key=key)


def _jsonl(docs: list[Doc]) -> str:
    return "".join(json.dumps({"source": d.source, "text": d.text}, ensure_ascii=False) + "\n" for d in docs)


def write_corpus(
    out: Path,
    data: DataConfig,
    config_hash: str,
    train: list[Doc],
    val: list[Doc],
    stats: dict[str, CleanStats],
    dups: dict[str, int],
    capped: dict[str, int],
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    manifest_path.unlink(missing_ok=True)  # a manifest means "complete": remove it before rewriting
    sources: dict[str, Any] = {}
    for src in data.sources:
        mine_train = [d for d in train if d.source == src.name]
        mine_val = [d for d in val if d.source == src.name]
        unique = sorted({d.sha for d in mine_train} | {d.sha for d in mine_val})
        sources[src.name] = {
            "kind": src.kind,
            "license": src.license,
            "weight": src.weight,
            "max_fraction": src.max_fraction,
            "docs": len(unique),
            "train_docs": len(mine_train),
            "val_docs": len(mine_val),
            "chars": sum(len(d.text) for d in {d.sha: d for d in mine_train + mine_val}.values()),
            "train_chars": sum(len(d.text) for d in mine_train),
            "sha256": hashlib.sha256("\n".join(unique).encode()).hexdigest(),
            "duplicates_dropped": dups.get(src.name, 0),
            "capped_docs_dropped": capped.get(src.name, 0),
            "cleaning": {k: v for k, v in asdict(stats[src.name]).items() if k != "extra"},
        }
    files: dict[str, Any] = {}
    for split, ds in (("train", train), ("val", val)):
        text = _jsonl(ds)
        atomic_write_text(out / f"{split}.jsonl", text)
        files[split] = {
            "file": f"{split}.jsonl",
            "docs": len(ds),
            "chars": sum(len(d.text) for d in ds),
            "bytes": sum(len(d.text.encode("utf-8")) for d in ds),
            "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        }
    manifest = {
        "name": data.name,
        "config_hash": config_hash,
        "val_fraction": data.val_fraction,
        "sources": sources,
        "splits": files,
        "total": {
            "docs": sum(s["docs"] for s in sources.values()),
            "chars": sum(s["chars"] for s in sources.values()),
            "train_chars": files["train"]["chars"],
            "val_chars": files["val"]["chars"],
        },
    }
    atomic_write_text(manifest_path, canonical_json(manifest))
    return manifest


def default_lock_path(cfg: Any) -> Path:
    """configs/data/<name>.lock.json beside the data config file."""
    rel = getattr(cfg, "files", {}).get("data")
    base = Path(rel) if rel else Path("configs/data") / f"{cfg.data.name}.yaml"
    return base.with_name(f"{base.stem}.lock.json")


def build_corpus(
    data: DataConfig,
    config_hash: str,
    raw: Path = paths.RAW,
    out: Path = paths.CORPUS,
    lock_path: Path | None = None,
    workers: int | None = None,
) -> dict[str, Any]:
    """Fetch, extract, clean and split every source of `data`; write train/val.jsonl and manifest.json."""
    t0 = time.perf_counter()
    lock = Lock.load(lock_path)
    roots: dict[str, Path] = {}
    names = [s.name for s in data.sources]
    if len(set(names)) != len(names):
        raise DataError(f"data config {data.name}: source names must be unique, got {names}")
    try:
        for src in progress(data.sources, desc="fetch", unit="source"):
            roots[src.name] = fetch_source(src, raw, lock)
    finally:
        lock.save()
    t_fetch = time.perf_counter() - t0
    workers = workers or data.shard.num_workers or os.cpu_count() or 1
    docs, stats = extract_sources(data, roots, workers)
    deduped, dups = dedup(data, docs)
    capped = apply_caps(data, deduped)
    train, val = split_docs(data, deduped)
    if not train:
        raise DataError(f"data config {data.name}: the corpus is empty after cleaning and splitting")
    if not val:
        log(
            f"corpus: warning: the val split is empty (val_fraction {data.val_fraction}, {len(train)} train docs)"
        )
    manifest = write_corpus(out, data, config_hash, train, val, stats, dups, capped)
    t = manifest["total"]
    log(
        f"corpus: {t['docs']} docs, {t['chars'] / 1e6:.2f} M chars ({t['train_chars'] / 1e6:.2f} M train, "
        f"{t['val_chars'] / 1e6:.2f} M val) in {time.perf_counter() - t0:.1f} s (fetch {t_fetch:.1f} s) -> {out}"
    )
    return manifest


def run_fetch(cfg: Any) -> dict[str, Any]:
    """`enlace fetch`: build data/corpus from cfg.data (cfg is an enlace.config.Config)."""
    return build_corpus(cfg.data, cfg.section_hash("data"), paths.RAW, paths.CORPUS, default_lock_path(cfg))
