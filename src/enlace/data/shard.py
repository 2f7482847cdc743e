"""Encode the corpus into token shards. `run_shard`.

1. The corpus files are checked against the sha256 that `enlace fetch` recorded in its manifest.
2. Each split is cut into units of at most `unit_docs` documents and about UNIT_BYTES bytes (the byte cap
   keeps the tasks busy to the end: with units of a fixed document count, a small corpus made two or
   three units and one task did nearly all the work). An `EncodeUnits` pipeline step (datatrove; units
   split among tasks by index) encodes each unit into its own token file, so a killed run resumes
   without redoing finished units.
3. The unit files are concatenated in order into shards of `tokens_per_shard` tokens and a manifest.
   Units, not tasks, fix the order: the shards are the same whatever the task count.

Everything is built in a staging folder beside the output and swapped in at the end: a failed or killed
run leaves the previous shards as they were.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from datatrove.pipeline.base import PipelineStep

from .. import paths
from ..config.data import ExecutorConfig
from ..errors import DataError
from ..io import atomic_write_text, canonical_json, fsync_dir, sha256_file
from ..manifest import verify_manifest
from .engine import Stage, run_stages
from .pipeline_steps import raise_recorded_errors, record_error
from .tokenize import EOS_ID
from .util import log, progress

UNIT_DOCS = 4096  # at most this many documents per encoded unit: the granularity of resuming
UNIT_BYTES = 1 << 19  # a unit ends at the first line past this many bytes: about 0.1 s of encoding
BATCH_DOCS = 64
_SP: dict[str, Any] = {}  # the process's tokenizer, by model path


def load_tokenizer(model_file: Path) -> Any:
    """The sentencepiece model, or a one-line error when the file is missing or not a model."""
    key = str(model_file)
    if key not in _SP:
        if not model_file.exists():
            raise DataError(f"{model_file}: not found; run `enlace tokenize` first")
        verify_manifest(model_file.parent, [model_file.name])
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ[var] = "1"  # one thread per task: busy-waiting collapses when tasks share cores
        import sentencepiece as spm

        try:
            _SP[key] = spm.SentencePieceProcessor(model_file=key)
        except (RuntimeError, OSError) as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(
                f"{model_file}: not a valid sentencepiece model ({msg}); run `enlace tokenize`"
            ) from None
    return _SP[key]


def encode_batch(sp: Any, texts: list[str], dtype: str) -> np.ndarray:
    """Token ids of the documents, each followed by EOS."""
    flat: list[int] = []
    for doc in sp.encode(texts, num_threads=1):
        flat.extend(doc)
        flat.append(EOS_ID)
    return np.asarray(flat, dtype=dtype)


def verify_corpus(corpus: Path) -> dict[str, Any]:
    """The corpus manifest, after checking every split file against the sha256 that fetch recorded."""
    mpath = corpus / "manifest.json"
    if not mpath.exists():
        raise DataError(f"{mpath}: not found; the corpus is missing or incomplete (run `enlace fetch`)")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
        splits = {s: manifest["splits"][s] for s in ("train", "val")}
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise DataError(f"{mpath}: not a corpus manifest ({e})") from None
    for split, meta in splits.items():
        p = corpus / f"{split}.jsonl"
        if not p.exists():
            raise DataError(f"{p}: not found; run `enlace fetch`")
        actual = sha256_file(p)
        if actual != meta["sha256"]:
            raise DataError(
                f"{p}: does not match the corpus manifest (sha256 {actual}, fetch recorded {meta['sha256']}); "
                "the corpus was modified: run `enlace fetch` again"
            )
    return manifest


def unit_offsets(path: Path, unit_docs: int, unit_bytes: int = UNIT_BYTES) -> list[tuple[int, int, int]]:
    """(start byte, end byte, first line number) of each unit: `unit_docs` lines, or fewer lines once the
    unit holds `unit_bytes` bytes. Depends on the file only, never on the task count."""
    units: list[tuple[int, int, int]] = []
    start, n, lineno, pos = 0, 0, 1, 0
    with open(path, "rb") as f:
        for line in f:
            pos += len(line)
            n += 1
            if n == unit_docs or pos - start >= unit_bytes:
                units.append((start, pos, lineno))
                start, n, lineno = pos, 0, lineno + n
    if n:
        units.append((start, pos, lineno))
    return units


def unit_name(split: str, i: int) -> str:
    return f"{split}-{i:06d}"


class EncodeUnits(PipelineStep):
    """Encode units i with i % world_size == rank into staging/units/<split>-NNNNNN.bin (+ .json counts)."""

    name = "enlace sentencepiece encode"

    def __init__(
        self, units: list[tuple[str, int, str, int, int, int]], model_file: Path, dtype: str, staging: Path
    ):
        super().__init__()
        self.units, self.model_file, self.dtype, self.staging = units, Path(model_file), dtype, Path(staging)

    def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> Iterator[Any]:
        try:
            sp = load_tokenizer(self.model_file)
            for i, unit in enumerate(self.units):
                if i % world_size == rank:
                    self._one(sp, *unit)
        except DataError as e:
            record_error(self.staging, rank, e)
        yield from ()

    def _one(self, sp: Any, split: str, idx: int, path: str, start: int, end: int, lineno: int) -> None:
        folder = self.staging / "units"
        counts_file = folder / f"{unit_name(split, idx)}.json"
        if counts_file.exists():  # finished by an earlier, interrupted run (build_shards checked it)
            return
        folder.mkdir(parents=True, exist_ok=True)
        out = folder / f"{unit_name(split, idx)}.bin"
        tmp = folder / f".{out.name}.tmp-{os.getpid()}"
        docs = nbytes = tokens = 0
        digest = hashlib.sha256()
        with open(path, "rb") as src, open(tmp, "wb") as f:
            src.seek(start)
            batch: list[str] = []
            lines = src.read(end - start).splitlines()
            for n, raw in enumerate(lines):
                try:
                    text = json.loads(raw)["text"]
                    if not isinstance(text, str):
                        raise TypeError("text is not a string")
                except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                    raise DataError(f"{path}:{lineno + n}: not a corpus line ({e})") from None
                docs += 1
                nbytes += len(text.encode("utf-8"))
                batch.append(text)
                if len(batch) == BATCH_DOCS or n == len(lines) - 1:
                    blob = encode_batch(sp, batch, self.dtype).tobytes()
                    f.write(blob)
                    digest.update(blob)
                    tokens += len(blob) // np.dtype(self.dtype).itemsize
                    batch = []
        # Not fsynced (a unit is an intermediate file; a sync each cost more than encoding a small unit):
        # the renames make each file whole or absent after a kill, and the token file's sha256 in the
        # counts file catches one that a power loss left bad (see _drop_bad_units).
        os.replace(tmp, out)
        counts = {"docs": docs, "bytes": nbytes, "tokens": tokens, "sha256": digest.hexdigest()}
        tmp_counts = folder / f".{counts_file.name}.tmp-{os.getpid()}"
        tmp_counts.write_text(canonical_json(counts), encoding="utf-8")
        os.replace(tmp_counts, counts_file)


def _unit_tokens(units_dir: Path, name: str, dtype: str) -> tuple[dict[str, Any], np.ndarray] | None:
    """A finished unit's counts and tokens, or None when its files are missing or disagree."""
    try:
        counts = json.loads((units_dir / f"{name}.json").read_text(encoding="utf-8"))
        blob = (units_dir / f"{name}.bin").read_bytes()
    except (OSError, ValueError):
        return None
    if not isinstance(counts, dict) or hashlib.sha256(blob).hexdigest() != counts.get("sha256"):
        return None
    return counts, np.frombuffer(blob, dtype=dtype)


def _drop_bad_units(units_dir: Path, names: list[str], dtype: str) -> int:
    """Delete the files of units that do not check out (so they are encoded again); return how many are
    finished and good."""
    good = 0
    for name in names:
        if not (units_dir / f"{name}.json").exists():
            continue
        if _unit_tokens(units_dir, name, dtype) is None:
            for suffix in (".json", ".bin"):
                (units_dir / f"{name}{suffix}").unlink(missing_ok=True)
        else:
            good += 1
    return good


class _ShardWriter:
    """Cuts a token stream into NNNNN shards of `cap` tokens, hashing each as it is written."""

    def __init__(self, out: Path, split: str, dtype: str, cap: int):
        self.out, self.split, self.dtype, self.cap = out, split, np.dtype(dtype), cap
        self.shards: list[dict[str, Any]] = []
        self._f: Any = None
        self._n = 0

    def _open(self) -> None:
        self._name = f"{self.split}-{len(self.shards):05d}.bin"
        self._f = open(self.out / self._name, "wb")
        self._h = hashlib.sha256()
        self._n = 0

    def _close(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
        self.shards.append({"file": self._name, "tokens": self._n, "sha256": self._h.hexdigest()})

    def write(self, arr: np.ndarray) -> None:
        while arr.size:
            if self._f is None:
                self._open()
            room = self.cap - self._n
            part, arr = arr[:room], arr[room:]
            blob = part.tobytes()
            self._f.write(blob)
            self._h.update(blob)
            self._n += part.size
            if self._n == self.cap:
                self._close()

    def finish(self) -> list[dict[str, Any]]:
        if self._f is not None:
            self._close()
        return self.shards


def _state_key(corpus_manifest: dict[str, Any], model_sha: str, dtype: str, unit_docs: int) -> str:
    ident = {
        "corpus": {s: corpus_manifest["splits"][s]["sha256"] for s in ("train", "val")},
        "tokenizer": model_sha,
        "dtype": dtype,
        "unit_docs": unit_docs,
        "unit_bytes": UNIT_BYTES,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _restore_interrupted_swap(out: Path) -> None:
    """A run killed between the two renames of the swap left out.old: put it back."""
    old = out.with_name(f".{out.name}.old")
    if old.exists() and not out.exists():
        os.replace(old, out)
    shutil.rmtree(old, ignore_errors=True)


def _check_tokenizer(model_file: Path, vocab_size: int, dtype: str) -> None:
    """The tokenizer loads, has the configured vocabulary and its ids fit the shards' dtype."""
    actual_vocab = load_tokenizer(model_file).vocab_size()
    if actual_vocab != vocab_size:
        raise DataError(
            f"{model_file}: vocab size {actual_vocab} differs from data.tokenizer.vocab_size {vocab_size}"
        )
    if actual_vocab > np.iinfo(np.dtype(dtype)).max + 1:
        raise DataError(f"{model_file}: vocab size {actual_vocab} does not fit {dtype} shards")


def _open_staging(out: Path, key: str) -> Path:
    """The staging folder beside out, kept (with its finished units) only if it was built from these inputs."""
    staging = out.with_name(f".{out.name}.partial")
    key_file = staging / "state.json"
    if not key_file.exists() or json.loads(key_file.read_text()).get("key") != key:
        shutil.rmtree(staging, ignore_errors=True)  # units of other inputs: start over
        staging.mkdir(parents=True)
        atomic_write_text(key_file, canonical_json({"key": key}))
    shutil.rmtree(staging / "errors", ignore_errors=True)
    return staging


def _assemble(
    staging: Path, units: list[tuple[str, int, str, int, int, int]], dtype: str, tokens_per_shard: int
) -> tuple[Path, dict[str, Any]]:
    """Unit files in order -> fixed-size shards in staging/shards; returns that folder and each split's
    counts."""
    new = staging / "shards"
    shutil.rmtree(new, ignore_errors=True)
    new.mkdir()
    splits: dict[str, Any] = {}
    for split in ("train", "val"):
        writer = _ShardWriter(new, split, dtype, tokens_per_shard)
        counts = {"docs": 0, "bytes": 0, "tokens": 0}
        mine = [i for s, i, *_ in units if s == split]
        for i in progress(mine, desc=f"shard {split}", unit="unit"):
            unit = _unit_tokens(staging / "units", unit_name(split, i), dtype)
            if unit is None:  # a unit changed after encoding: never build shards from it
                raise DataError(
                    f"{staging / 'units' / unit_name(split, i)}: unit files missing or altered; rerun"
                )
            c, tokens = unit
            for k in counts:
                counts[k] += c[k]
            writer.write(tokens)
        splits[split] = {**counts, "shards": writer.finish()}
    return new, splits


def _swap_in(new: Path, out: Path, staging: Path) -> None:
    """The new shards replace out (the old ones moved aside first, deleted last); staging goes."""
    fsync_dir(new)
    old = out.with_name(f".{out.name}.old")
    if out.exists():
        os.replace(out, old)
    os.replace(new, out)
    fsync_dir(out.parent)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)


def build_shards(
    corpus: Path,
    tokenizer: Path,
    out: Path,
    dtype: str,
    vocab_size: int,
    tokens_per_shard: int,
    workers: int | None = None,
    config_hash: str = "",
    tasks: int | None = None,
    executor: ExecutorConfig | None = None,
    unit_docs: int = UNIT_DOCS,
) -> dict[str, Any]:
    """Encode corpus/{train,val}.jsonl into out/{split}-NNNNN.bin and out/manifest.json."""
    out = Path(out)
    _restore_interrupted_swap(out)
    model_file = tokenizer / "tokenizer.model"
    _check_tokenizer(model_file, vocab_size, dtype)
    corpus_manifest = verify_corpus(corpus)
    model_sha = sha256_file(model_file)
    executor = executor or ExecutorConfig()
    if workers is not None or tasks is not None:
        executor = executor.model_copy(update={"workers": workers, "tasks": tasks or workers})
    ntasks = executor.tasks or os.cpu_count() or 1
    t0 = time.perf_counter()
    staging = _open_staging(out, _state_key(corpus_manifest, model_sha, dtype, unit_docs))
    # Encode: each unit into its own token files (those already encoded and intact are kept).
    units: list[tuple[str, int, str, int, int, int]] = []
    for split in ("train", "val"):
        path = corpus / f"{split}.jsonl"
        for i, (start, end, lineno) in enumerate(unit_offsets(path, unit_docs)):
            units.append((split, i, str(path), start, end, lineno))
    done = _drop_bad_units(staging / "units", [unit_name(s, i) for s, i, *_ in units], dtype)
    if done:
        log(f"shard: resuming: {done} of {len(units)} units already encoded")
    stage = Stage(
        "encode", [EncodeUnits(units, model_file, dtype, staging)], tasks=max(1, min(ntasks, len(units)))
    )
    logs = out.parent / "logs" / "shard" if executor.kind == "local" else Path(executor.logging_dir) / "shard"
    if done < len(units) and not run_stages([stage], executor, logs):
        log(f"shard: submitted the encoding to {executor.kind}; run `enlace shard` again when it is done")
        return {}
    raise_recorded_errors(staging)
    # Assemble, write the manifest beside the shards, then swap them in.
    new, splits = _assemble(staging, units, dtype, tokens_per_shard)
    manifest = {
        "dtype": dtype,
        "vocab_size": vocab_size,
        "eos_id": EOS_ID,
        "tokenizer_sha256": model_sha,
        "corpus_sha256": {s: corpus_manifest["splits"][s]["sha256"] for s in ("train", "val")},
        "config_hash": config_hash,
        "splits": splits,
        # bits per byte = loss per token (nats) / ln 2 / bytes_per_token
        "bytes_per_token": {
            s: (v["bytes"] / v["tokens"] if v["tokens"] else None) for s, v in splits.items()
        },
    }
    atomic_write_text(new / "manifest.json", canonical_json(manifest))
    _swap_in(new, out, staging)
    elapsed = time.perf_counter() - t0
    ntok = sum(v["tokens"] for v in splits.values())
    log(
        f"shard: {ntok} tokens ({splits['train']['tokens']} train, {splits['val']['tokens']} val) "
        f"in {elapsed:.1f} s ({ntok / max(elapsed, 1e-9) / 1e6:.2f} M tok/s, {stage.tasks} tasks) -> {out}"
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
        executor=d.executor,
    )
