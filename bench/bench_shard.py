"""Sharding throughput: the parallel encoder (all cores) vs plain single-process sentencepiece encoding.

Runs on data/corpus/train.jsonl and data/tokenizer if present, else on generated Spanish-like text with a
small tokenizer trained on the spot. Prints median and min-max of each, and the ratio as its last line;
writes bench/results/shard.json.
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
from enlace.data.shard import encode_stream
from enlace.data.tokenize import EOS_ID, build_tokenizer

REPEATS = 3
MAX_DOCS = 3000


def _generated(tmp: Path) -> tuple[list[str], Path]:
    rng = random.Random(0)
    words = (
        "el la de que en los las un una por con para casa ciudad río camino libro tiempo mundo agua".split()
    )
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(200, 800))) for _ in range(2000)]
    corpus = tmp / "corpus"
    corpus.mkdir()
    (corpus / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    build_tokenizer(TokenizerConfig(type="unigram", vocab_size=1000, num_threads=1), corpus, tmp / "tok")
    return docs, tmp / "tok" / "tokenizer.model"


def _single(docs: list[str], model: Path) -> int:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model))
    n = 0
    for d in docs:
        ids = sp.encode(d)
        ids.append(EOS_ID)
        n += np.asarray(ids, dtype=np.uint16).size
    return n


def _parallel(docs: list[str], model: Path, workers: int) -> int:
    return sum(len(b) // 2 for b in encode_stream(iter(docs), model, "uint16", workers))


def main() -> dict:
    os.environ.setdefault("ENLACE_NO_PROGRESS", "1")
    workers = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        corpus, model = Path("data/corpus/train.jsonl"), Path("data/tokenizer/tokenizer.model")
        if corpus.exists() and model.exists():
            with open(corpus, encoding="utf-8") as f:
                docs = [json.loads(line)["text"] for _, line in zip(range(MAX_DOCS), f, strict=False)]
            source = str(corpus)
        else:
            docs, model = _generated(Path(tmp))
            source = "generated"
        mb = sum(len(d.encode()) for d in docs) / 1e6
        times: dict[str, list[float]] = {"single": [], "parallel": []}
        for _ in range(REPEATS):  # interleaved, so a noisy neighbour hits both alike
            for name, fn in (
                ("single", lambda: _single(docs, model)),
                ("parallel", lambda: _parallel(docs, model, workers)),
            ):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "source": source,
        "docs": len(docs),
        "mb": mb,
        "workers": workers,
        "repeats": REPEATS,
        "seconds": times,
        "median_s": med,
        "mb_per_s": {k: mb / v for k, v in med.items()},
        "ratio": med["single"] / med["parallel"],
    }
    result["rows"] = [
        goal_row("shard throughput", f"enlace parallel ({workers} workers)", "sentencepiece, one process",
                 result["ratio"], ">=", 1.7, note=f"{mb:.1f} MB of {source} text")
    ]  # fmt: skip
    out = Path("bench/results/shard.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for k in ("single", "parallel"):
        print(
            f"{k}: median {med[k]:.3f} s ({mb / med[k]:.2f} MB/s), min-max {min(times[k]):.3f}-{max(times[k]):.3f} s"
        )
    print(f"shard throughput: parallel ({workers} workers) / single = {result['ratio']:.2f}x on {mb:.1f} MB")
    return result


if __name__ == "__main__":
    main()
