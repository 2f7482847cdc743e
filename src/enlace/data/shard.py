"""Encode the corpus into token shards in parallel. `run_shard`.

Each worker process loads the tokenizer once and encodes batches of documents on one thread; the parent
writes tokens in corpus order, so the shards are the same whatever the worker count.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .. import paths
from ..errors import DataError
from ..io import atomic_write_text, canonical_json, fsync_dir, sha256_file
from .tokenize import EOS_ID
from .util import log, progress

DOCS_PER_TASK = 64
_SP: Any = None  # the worker's tokenizer


def _init_worker(model_file: str) -> None:
    # One thread per worker: OpenMP busy-waiting collapses throughput when processes share 2 cores.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"
    global _SP
    import sentencepiece as spm

    _SP = spm.SentencePieceProcessor(model_file=model_file)


def encode_batch(texts: list[str], dtype: str) -> bytes:
    """Token ids of the documents, each followed by EOS, as raw bytes of `dtype`."""
    ids = _SP.encode(texts, num_threads=1)
    flat: list[int] = []
    for doc in ids:
        flat.extend(doc)
        flat.append(EOS_ID)
    return np.asarray(flat, dtype=dtype).tobytes()


def _encode_task(task: tuple[list[str], str]) -> bytes:
    return encode_batch(*task)


def _batches(docs: Iterator[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for d in docs:
        batch.append(d)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def encode_stream(
    docs: Iterator[str], model_file: Path, dtype: str, workers: int, on_batch: Any = None
) -> Iterator[bytes]:
    """Encoded batches in input order; `workers` processes (1: in this process)."""
    tasks = ((b, dtype) for b in _batches(docs, DOCS_PER_TASK))
    if workers <= 1:
        _init_worker(str(model_file))
        for t in tasks:
            yield _encode_task(t)
        return
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    pool = ctx.Pool(workers, initializer=_init_worker, initargs=(str(model_file),))
    try:
        yield from pool.imap(_encode_task, tasks, chunksize=1)
    finally:
        pool.terminate()
        pool.join()


class _ShardWriter:
    """Writes NNNNN shards under temporary names; each is fsynced and renamed only when complete."""

    def __init__(self, out: Path, split: str, dtype: str, tokens_per_shard: int):
        self.out, self.split, self.dtype = out, split, np.dtype(dtype)
        self.cap = tokens_per_shard
        self.shards: list[dict[str, Any]] = []
        self.written: list[Path] = []  # final and temporary names this writer created, for cleanup
        self._f: Any = None
        self._n = 0

    def _open(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._tmp = self.out / f".{name}.tmp"
        self._final = self.out / name
        self.written.append(self._tmp)
        self._f = open(self._tmp, "wb")
        self._n = 0

    def _close(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
        os.replace(self._tmp, self._final)
        self.written.append(self._final)
        self.shards.append({"file": self._final.name, "tokens": self._n, "sha256": sha256_file(self._final)})

    def write(self, arr: np.ndarray) -> None:
        while arr.size:
            if self._f is None:
                self._open()
            room = self.cap - self._n
            part, arr = arr[:room], arr[room:]
            self._f.write(part.tobytes())
            self._n += part.size
            if self._n == self.cap:
                self._close()

    def finish(self) -> list[dict[str, Any]]:
        if self._f is not None:
            self._close()
        return self.shards

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
        for p in self.written:
            p.unlink(missing_ok=True)


def _split_docs(path: Path, counts: dict[str, int]) -> Iterator[str]:
    if not path.exists():
        raise DataError(f"{path}: not found; run `enlace fetch` first")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise DataError(f"{path}:{lineno}: not a corpus line ({e})") from None
            counts["docs"] += 1
            counts["bytes"] += len(text.encode("utf-8"))
            yield text


def build_shards(
    corpus: Path,
    tokenizer: Path,
    out: Path,
    dtype: str,
    vocab_size: int,
    tokens_per_shard: int,
    workers: int | None = None,
    config_hash: str = "",
) -> dict[str, Any]:
    """Encode corpus/{train,val}.jsonl into out/{split}-NNNNN.bin and write out/manifest.json last."""
    model_file = tokenizer / "tokenizer.model"
    if not model_file.exists():
        raise DataError(f"{model_file}: not found; run `enlace tokenize` first")
    import sentencepiece as spm

    actual_vocab = spm.SentencePieceProcessor(model_file=str(model_file)).vocab_size()
    if actual_vocab != vocab_size:
        raise DataError(
            f"{model_file}: vocab size {actual_vocab} differs from data.tokenizer.vocab_size {vocab_size}"
        )
    if actual_vocab > np.iinfo(np.dtype(dtype)).max + 1:
        raise DataError(f"{model_file}: vocab size {actual_vocab} does not fit {dtype} shards")
    workers = workers or os.cpu_count() or 1
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    manifest_path.unlink(missing_ok=True)  # shards without a manifest are never loaded
    for old in list(out.glob("*.bin")) + list(out.glob(".*.tmp")):
        old.unlink()
    t0 = time.perf_counter()
    splits: dict[str, Any] = {}
    writers: list[_ShardWriter] = []
    try:
        for split in ("train", "val"):
            counts = {"docs": 0, "bytes": 0}
            writer = _ShardWriter(out, split, dtype, tokens_per_shard)
            writers.append(writer)
            bar = progress(desc=f"shard {split}", unit="tok", unit_scale=True)
            total = 0
            for blob in encode_stream(
                _split_docs(corpus / f"{split}.jsonl", counts), model_file, dtype, workers
            ):
                arr = np.frombuffer(blob, dtype=dtype)
                writer.write(arr)
                total += arr.size
                bar.update(arr.size)
            bar.close()
            shards = writer.finish()
            splits[split] = {
                "docs": counts["docs"],
                "bytes": counts["bytes"],
                "tokens": total,
                "shards": shards,
            }
    except BaseException:
        for w in writers:
            w.abort()
        raise
    elapsed = time.perf_counter() - t0
    manifest = {
        "dtype": dtype,
        "vocab_size": vocab_size,
        "eos_id": EOS_ID,
        "tokenizer_sha256": sha256_file(model_file),
        "config_hash": config_hash,
        "splits": splits,
        # bits per byte = loss per token (nats) / ln 2 / bytes_per_token
        "bytes_per_token": {
            s: (v["bytes"] / v["tokens"] if v["tokens"] else None) for s, v in splits.items()
        },
    }
    atomic_write_text(manifest_path, canonical_json(manifest))
    fsync_dir(out)
    ntok = sum(v["tokens"] for v in splits.values())
    log(
        f"shard: {ntok} tokens ({splits['train']['tokens']} train, {splits['val']['tokens']} val) "
        f"in {elapsed:.1f} s ({ntok / max(elapsed, 1e-9) / 1e6:.2f} M tok/s, {workers} workers) -> {out}"
    )
    return manifest


def run_shard(cfg: Any) -> dict[str, Any]:
    """`enlace shard`: encode data/corpus with data/tokenizer into data/shards."""
    d = cfg.data
    return build_shards(
        paths.CORPUS,
        paths.TOKENIZER,
        paths.SHARDS,
        d.shard_dtype,
        d.tokenizer.vocab_size,
        d.shard.tokens_per_shard,
        d.shard.num_workers,
        cfg.section_hash("data"),
    )
