"""Sharding throughput: `enlace shard` (build_shards, one task per core) vs one sentencepiece process.

Both sides do the whole job on the same corpus and tokenizer: read train.jsonl and val.jsonl, encode every
document (EOS after each), write uint16 token files. ENLACE runs its real path: the corpus checksums, the
units encoded by datatrove tasks, the shards assembled, hashed, fsynced and swapped in. The peer is the loop
a user would write: one process, sentencepiece's batch encode on one thread, one token file per split.

Runs on data/corpus and data/tokenizer if present, else on generated Spanish-like text with a small
tokenizer trained on the spot. Interleaved repeats; prints median and min-max of each, and the ratio as
its last line; writes bench/results/shard.json.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import goal_row
from enlace.config.data import TokenizerConfig
from enlace.data.shard import build_shards
from enlace.data.tokenize import EOS_ID, build_tokenizer
from enlace.io import sha256_file

REPEATS = int(os.environ.get("BENCH_ROUNDS", 3))
BATCH = 64


def _generated(tmp: Path) -> tuple[Path, Path]:
    """A corpus folder (train, val, manifest with checksums) and a tokenizer folder."""
    rng = random.Random(0)
    words = (
        "el la de que en los las un una por con para casa ciudad río camino libro tiempo mundo agua".split()
    )
    corpus = tmp / "corpus"
    corpus.mkdir()
    splits = {}
    for split, n in (("train", 4000), ("val", 100)):
        docs = [" ".join(rng.choice(words) for _ in range(rng.randint(200, 800))) for _ in range(n)]
        path = corpus / f"{split}.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        splits[split] = {"sha256": sha256_file(path)}
    (corpus / "manifest.json").write_text(json.dumps({"splits": splits}))
    build_tokenizer(TokenizerConfig(type="unigram", vocab_size=1000, num_threads=1), corpus, tmp / "tok")
    return corpus, tmp / "tok"


def _peer(corpus: Path, model: Path, out: Path) -> int:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model))
    tokens = 0

    def flush(batch: list[str], f) -> int:
        flat: list[int] = []
        for ids in sp.encode(batch, num_threads=1):
            flat.extend(ids)
            flat.append(EOS_ID)
        f.write(np.asarray(flat, dtype=np.uint16).tobytes())
        return len(flat)

    for split in ("train", "val"):
        with open(corpus / f"{split}.jsonl", encoding="utf-8") as src, open(out / f"{split}.bin", "wb") as f:
            batch: list[str] = []
            for line in src:
                batch.append(json.loads(line)["text"])
                if len(batch) == BATCH:
                    tokens += flush(batch, f)
                    batch = []
            if batch:
                tokens += flush(batch, f)
    return tokens


def main() -> dict:
    os.environ.setdefault("ENLACE_NO_PROGRESS", "1")
    workers = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        corpus, tok = Path("data/corpus"), Path("data/tokenizer")
        if (corpus / "manifest.json").exists() and (tok / "tokenizer.model").exists():
            source = str(corpus)
        else:
            corpus, tok = _generated(tmp)
            source = "generated"
        import sentencepiece as spm

        vocab = spm.SentencePieceProcessor(model_file=str(tok / "tokenizer.model")).vocab_size()
        mb = sum((corpus / f"{s}.jsonl").stat().st_size for s in ("train", "val")) / 1e6
        (tmp / "peer").mkdir()
        contenders = {
            "single": lambda: _peer(corpus, tok / "tokenizer.model", tmp / "peer"),
            "parallel": lambda: build_shards(corpus, tok, tmp / "shards", "uint16", vocab, 1 << 24, workers=workers),
        }  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for r in range(REPEATS):  # interleaved, so a noisy neighbour hits both alike
            for name in list(contenders)[:: 1 if r % 2 == 0 else -1]:
                t0 = time.perf_counter()
                contenders[name]()
                times[name].append(time.perf_counter() - t0)
        shards = json.loads((tmp / "shards" / "manifest.json").read_text())
        ours = sum(s["tokens"] for s in shards["splits"].values())
        peer = sum((tmp / "peer" / f"{s}.bin").stat().st_size // 2 for s in ("train", "val"))
        if ours != peer:
            raise AssertionError(f"enlace wrote {ours} tokens, the peer {peer}: not the same job")
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "source": source,
        "mb": mb,
        "tokens": ours,
        "workers": workers,
        "repeats": REPEATS,
        "seconds": times,
        "median_s": med,
        "mb_per_s": {k: mb / v for k, v in med.items()},
        "ratio": med["single"] / med["parallel"],
    }
    result["rows"] = [
        goal_row("shard throughput", f"enlace shard ({workers} tasks)", "sentencepiece, one process, one thread",
                 result["ratio"], ">=", 1.7, note=f"{mb:.1f} MB of {source} JSONL, whole job")
    ]  # fmt: skip
    out = Path("bench/results/shard.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for k in ("single", "parallel"):
        print(
            f"{k}: median {med[k]:.3f} s ({mb / med[k]:.2f} MB/s), min-max {min(times[k]):.3f}-{max(times[k]):.3f} s"
        )
    print(
        f"shard throughput: enlace shard ({workers} tasks) / single = {result['ratio']:.2f}x on {mb:.1f} MB"
    )
    return result


if __name__ == "__main__":
    main()
