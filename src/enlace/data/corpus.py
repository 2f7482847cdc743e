"""Build the corpus as a stream: fetch every source, then extract+clean, dedup, cap, split and write.

The stages are datatrove pipelines (see `engine`): extract+clean and the MinHash signatures run as
`data.executor.tasks` tasks, split by input file; the exact-dedup decision, MinHash clustering and the final
write run as single ordered tasks, so the corpus is the same whatever the task count. `run_fetch` is `enlace fetch`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from .. import paths
from ..config.data import DataConfig, HfSource
from ..errors import DataError
from .clean import CleanStats
from .engine import Stage, run_stages
from .extract import list_files
from .pipeline_steps import (
    ExactDedup,
    ExtractClean,
    Finalize,
    MinhashFiles,
    SpanishWords,
    Survivors,
    WorkItem,
    docs_path,
    item_key,
    raise_recorded_errors,
)
from .sources import Lock, Source, fetch_source
from .util import log, progress


def _files_of(src: Source, root: Path) -> list[tuple[str, Path, str]]:
    include = list(src.include)
    if isinstance(src, HfSource) and not include:
        include = ["**"]  # the fetched folder holds only the selected files
    return list_files(root, include, list(src.exclude), src.extractor)


def work_items(data: DataConfig, roots: dict[str, Path]) -> list[WorkItem]:
    """Every input file, in config order then sorted path order: the order of the corpus."""
    items: list[WorkItem] = []
    for src in data.sources:
        files = _files_of(src, roots[src.name])
        if not files:
            raise DataError(
                f"source {src.name}: no files to extract under {roots[src.name]} (check include/exclude)"
            )
        for rel, p, kind in files:
            key = item_key(src, rel, p, kind, data.cleaning)
            items.append(WorkItem(src.name, rel, str(p), kind, src.text_column, key))
    return items


def minhash_config() -> Any:
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.utils.hashing import HashConfig

    # sha1: datatrove 0.10.1 hands str to xxhash, which current xxhash refuses.
    return MinhashConfig(
        n_grams=5, num_buckets=14, hashes_per_bucket=8, seed=1, hash_config=HashConfig(hash_fc="sha1")
    )


def corpus_stages(
    data: DataConfig, items: list[WorkItem], work: Path, out: Path, config_hash: str
) -> tuple[list[Stage], list[Stage]]:
    """(extraction stages, dedup/split stages) for the configured executor.

    Per file, in `tasks` parallel tasks: extract+clean (with each document's normalized key), MinHash
    signatures. Single ordered tasks: the exact-dedup decision (reads hashes only), datatrove's MinHash
    clustering, and the final stream that writes the corpus. datatrove's bucket stage runs one task per
    bucket.
    """
    from datatrove.pipeline.dedup.minhash import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )

    tasks = min(data.executor.tasks or os.cpu_count() or 1, len(items))
    cl = data.cleaning
    extract = [Stage("extract", [ExtractClean(items, cl, work)], tasks=tasks)]
    stages = [Stage("exact-dedup", [ExactDedup(items, work, cl.dedup)])]
    near = None
    if cl.dedup and cl.near_dedup:
        cfg = minhash_config()
        mh = work / "minhash"
        sig = MinhashDedupSignature(str(mh / "sigs"), config=cfg, language=SpanishWords())
        stages += [
            Stage("minhash-signatures", [MinhashFiles(items, work, sig)], tasks=tasks),
            # One task per bucket, as datatrove requires; each merges the sorted signature files.
            Stage(
                "minhash-buckets",
                [MinhashDedupBuckets(str(mh / "sigs"), str(mh / "buckets"), config=cfg)],
                tasks=cfg.num_buckets,
            ),
            Stage(
                "minhash-cluster", [MinhashDedupCluster(str(mh / "buckets"), str(mh / "remove"), config=cfg)]
            ),
        ]
        near = MinhashDedupFilter(str(mh / "remove"))
    stages.append(
        Stage("split", [Survivors(items, work, near), Finalize(data, work, out, config_hash, items)])
    )
    return extract, stages


def _check_sources(data: DataConfig, items: list[WorkItem], work: Path) -> None:
    """A source that lost every document in cleaning is an error naming it and why."""
    stats = {s.name: CleanStats() for s in data.sources}
    for item in items:
        st = json.loads(docs_path(work, item.key).with_suffix(".json").read_text())
        stats[item.source].add(CleanStats(**{k: v for k, v in st.items() if k != "extra"}))
    for src in data.sources:
        st = stats[src.name]
        if not st.docs_out:
            raise DataError(
                f"source {src.name}: no documents left after cleaning ({st.docs_in} extracted, {st.lines_in} lines; "
                f"dropped: {st.lines_short} short, {st.lines_symbols} symbol/code, {st.lines_english} English lines)"
            )


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
    tasks: int | None = None,
) -> dict[str, Any]:
    """Fetch, extract, clean, dedup and split every source of `data`; write train/val.jsonl and manifest.json.

    `workers`/`tasks` override data.executor's (tests use them). Intermediate files live under
    raw/.work: per input file a cleaned JSONL, reused when neither the file nor the cleaning changed.
    """
    # Long: the corpus stage in its order (fetch, clean per file, dedup, split, manifest); each part hands its state to the next.
    t0 = time.perf_counter()
    names = [s.name for s in data.sources]
    if len(set(names)) != len(names):
        raise DataError(f"data config {data.name}: source names must be unique, got {names}")
    executor = data.executor
    if workers is not None or tasks is not None:
        upd = {"workers": workers or executor.workers, "tasks": tasks or workers or executor.tasks}
        executor = executor.model_copy(update=upd)
        data = data.model_copy(update={"executor": executor})
    lock = Lock.load(lock_path)
    roots: dict[str, Path] = {}
    try:
        for src in progress(data.sources, desc="fetch", unit="source"):
            roots[src.name] = fetch_source(src, raw, lock)
    finally:
        lock.save()
    t_fetch = time.perf_counter() - t0
    items = work_items(data, roots)
    work = Path(raw) / ".work"
    errors = work / "errors"
    shutil.rmtree(errors, ignore_errors=True)
    shutil.rmtree(work / "minhash", ignore_errors=True)
    shutil.rmtree(work / "dedup", ignore_errors=True)
    extract, rest = corpus_stages(data, items, work, Path(out), config_hash)
    logs = (
        Path(raw).parent / "logs" / "fetch"
        if executor.kind == "local"
        else Path(executor.logging_dir) / "fetch"
    )
    if executor.kind == "slurm":  # submitted as chained jobs: nothing is done when sbatch returns
        run_stages(extract + rest, executor, logs)
        log(f"fetch: submitted {len(extract + rest)} stages to {executor.kind}; the corpus appears in {out}")
        return {}
    run_stages(extract, executor, logs / "extract")
    raise_recorded_errors(work)
    t_extract = time.perf_counter() - t0 - t_fetch
    _check_sources(data, items, work)
    run_stages(rest, executor, logs / "dedup")
    raise_recorded_errors(work)
    manifest = json.loads((Path(out) / "manifest.json").read_text(encoding="utf-8"))
    t = manifest["total"]
    if not manifest["splits"]["val"]["docs"]:
        log(f"corpus: warning: the val split is empty (val_fraction {data.val_fraction})")
    log(
        f"corpus: {t['docs']} docs, {t['chars'] / 1e6:.2f} M chars ({t['train_chars'] / 1e6:.2f} M train, "
        f"{t['val_chars'] / 1e6:.2f} M val) in {time.perf_counter() - t0:.1f} s (fetch {t_fetch:.1f} s, "
        f"extract {t_extract:.1f} s) -> {out}"
    )
    return manifest


def run_fetch(cfg: Any) -> dict[str, Any]:
    """`enlace fetch`: build data/corpus from cfg.data (cfg is an enlace.config.Config)."""
    return build_corpus(cfg.data, cfg.section_hash("data"), paths.RAW, paths.CORPUS, default_lock_path(cfg))
