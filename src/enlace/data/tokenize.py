"""Train the sentencepiece tokenizer on the training split. `run_tokenize`."""

from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .. import paths
from ..config.data import TokenizerConfig
from ..errors import DataError
from ..hf.sp_convert import convert as convert_tokenizer
from ..io import atomic_dir, atomic_write_text, canonical_json, fsync_file, sha256_file
from ..manifest import write_manifest
from .util import log, progress

# Peak memory of training, per byte of the sentences trained on (the sample), an upper bound from runs on
# bench/bench_data.py text with vocab 8192 (6-16 MiB samples: unigram about 20x, bpe 4-6x plus ~50 MiB;
# README "Data at scale"). The sample is input_sentence_size sentences: memory is bounded by it, not by
# the corpus.
MEMORY_PER_SAMPLE_BYTE = {"unigram": 21, "bpe": 6}
# With input_sentence_size 0 every sentence is the sample: refused above this much training text.
ALL_SENTENCES_MAX_BYTES = 64 << 20

# Fixed special ids: the model, the loaders and the chat template all rely on them.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+")


def read_docs(path: Path) -> Iterator[str]:
    if not path.exists():
        raise DataError(f"{path}: not found; run `enlace fetch` first")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            try:
                yield json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise DataError(f"{path}:{lineno}: not a corpus line ({e})") from None


def split_sentence(line: str, max_bytes: int) -> list[str]:
    """Pieces of `line` of at most max_bytes UTF-8 bytes, cut at sentence ends, else spaces, else characters.

    sentencepiece silently skips longer input lines, which would drop e.g. every Bible chapter.
    """
    if len(line.encode("utf-8")) <= max_bytes:
        return [line]
    out: list[str] = []
    buf = ""
    for unit in SENTENCE_END.split(line):
        for part in _hard_split(unit, max_bytes):
            cand = f"{buf} {part}" if buf else part
            if len(cand.encode("utf-8")) <= max_bytes:
                buf = cand
            else:
                if buf:
                    out.append(buf)
                buf = part
    if buf:
        out.append(buf)
    return out


def _hard_split(text: str, max_bytes: int) -> list[str]:
    if len(text.encode("utf-8")) <= max_bytes:
        return [text]
    out: list[str] = []
    words = text.split(" ")
    buf = ""
    for w in words:
        while len(w.encode("utf-8")) > max_bytes:  # a single "word" longer than the limit
            cut = len(w.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore"))
            if buf:
                out.append(buf)
                buf = ""
            out.append(w[:cut])
            w = w[cut:]
        cand = f"{buf} {w}" if buf else w
        if len(cand.encode("utf-8")) <= max_bytes:
            buf = cand
        else:
            out.append(buf)
            buf = w
    if buf:
        out.append(buf)
    return out


def training_sentences(docs: Iterator[str], max_bytes: int, stats: dict[str, int]) -> Iterator[str]:
    """One sentence (a line, cut to max_bytes) at a time, in corpus order; `stats` counts as it goes."""
    for doc in progress(docs, desc="tokenizer: read", unit="doc"):
        stats["docs"] += 1
        for line in doc.split("\n"):
            line = line.strip()
            if not line:
                continue
            pieces = split_sentence(line, max_bytes)
            if len(pieces) > 1:
                stats["long_lines_split"] += 1
                stats["pieces_from_long_lines"] += len(pieces)
            for p in pieces:
                stats["lines"] += 1
                yield p


def sample_sentences(sentences: Iterator[str], n: int, seed: int) -> list[str]:
    """A seeded uniform sample of n sentences of the stream, kept in stream order (all when fewer).

    The n positions with the smallest keyed hash win: the same sample in every process and on every
    platform, holding n sentences. sentencepiece's own sampling (its input_sentence_size) is not: the same
    seed gave different models in two processes (sentencepiece 0.2.3).
    """
    heap: list[tuple[int, int, str]] = []  # (-key, position, sentence): the largest key on top
    salt = f"enlace-sample:{seed}:".encode()
    for i, sentence in enumerate(sentences):
        key = int.from_bytes(hashlib.blake2b(salt + str(i).encode(), digest_size=8).digest(), "big")
        if len(heap) < n:
            heapq.heappush(heap, (-key, i, sentence))
        elif key < -heap[0][0]:
            heapq.heapreplace(heap, (-key, i, sentence))
    heap.sort(key=lambda e: e[1])
    return [e[2] for e in heap]


def train_sentencepiece(sentences: Iterator[str], prefix: Path, cfg: TokenizerConfig) -> None:
    """Train and write prefix.model and prefix.vocab.

    The input goes in through an iterator and the model comes out through a writer: given file names,
    sentencepiece records them in the model, and the same training in another folder gives other bytes.
    sentencepiece trains on every sentence it is given: build_tokenizer passes the sample of
    input_sentence_size sentences (`sample_sentences`), so memory is bounded by the sample, not by the
    corpus: about MEMORY_PER_SAMPLE_BYTE times the sample's text.
    """
    import io

    import sentencepiece as spm

    spm.set_random_generator_seed(cfg.seed)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences,
        model_writer=model,
        model_type=cfg.type,
        vocab_size=cfg.vocab_size,
        character_coverage=cfg.character_coverage,
        byte_fallback=True,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        pad_piece="<pad>",
        unk_piece="<unk>",
        bos_piece="<s>",
        eos_piece="</s>",
        user_defined_symbols=list(cfg.user_defined_symbols),
        max_sentence_length=cfg.max_sentence_length,
        input_sentence_size=0,  # the caller samples (reproducibly); see sample_sentences
        shuffle_input_sentence=False,
        split_digits=cfg.split_digits,
        # Keep text as written: identity normalization (the corpus is NFC already) and no whitespace
        # squeezing, so decode(encode(text)) == text and bits-per-byte are measured on the real bytes.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        num_threads=cfg.num_threads,
        train_extremely_large_corpus=False,
        minloglevel=2,
    )
    prefix.with_suffix(".model").write_bytes(model.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.vocab_size()))
    prefix.with_suffix(".vocab").write_text(vocab, encoding="utf-8")


def evaluate(model_file: Path, docs: Iterable[str]) -> dict[str, Any]:
    """Chars per token and tokens per word on `docs` (streamed in batches), against the byte-level baseline."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    n = chars = nbytes = words = tokens = unk = 0
    batch: list[str] = []

    def flush() -> None:
        nonlocal tokens, unk
        for ids in sp.encode(batch) if batch else []:
            tokens += len(ids)
            unk += ids.count(UNK_ID)
        batch.clear()

    for d in docs:
        n += 1
        chars += len(d)
        nbytes += len(d.encode("utf-8"))
        words += len(d.split())
        batch.append(d)
        if len(batch) == 256:
            flush()
    flush()
    return {
        "docs": n,
        "chars": chars,
        "bytes": nbytes,
        "words": words,
        "tokens": tokens,
        "unk_tokens": unk,
        "chars_per_token": chars / tokens if tokens else None,
        "bytes_per_token": nbytes / tokens if tokens else None,
        "tokens_per_word": tokens / words if words else None,
        # The byte-level model sees one token per byte: its chars per token is chars / bytes.
        "byte_baseline": {
            "bytes_per_char": nbytes / chars if chars else None,
            "chars_per_token": chars / nbytes if nbytes else None,
            "tokens_per_word": nbytes / words if words else None,
        },
        "compression_vs_bytes": nbytes / tokens if tokens else None,
    }


# Val documents checked at once against tokenizer.json: bounds the memory of the check (both tokenizers'
# ids of every document of a chunk are held), whatever the size of the val split.
VAL_CHECK_DOCS = 2000


def check_tokenizer_json(model: Path, val_path: Path, out: Path) -> dict[str, Any]:
    """Write out (tokenizer.json) and check it gives sentencepiece's ids on the whole val split.

    The Hugging Face tokenizer.json `enlace export` ships must give these ids on the whole val split; a
    model that cannot be converted exactly is refused here, before anything is trained on it. The split is
    checked in chunks; the counts are those of one check over the edge cases and every val document.
    """
    edge = convert_tokenizer(model, [], out)  # the edge cases alone
    total = dict(edge)
    docs = read_docs(val_path) if val_path.exists() else iter(())
    while chunk := list(itertools.islice(docs, VAL_CHECK_DOCS)):
        r = convert_tokenizer(model, chunk, out)
        total["texts"] += r["texts"] - edge["texts"]
        total["tokens"] += r["tokens"] - edge["tokens"]
    return total


def build_tokenizer(cfg: TokenizerConfig, corpus: Path, out: Path, config_hash: str = "") -> dict[str, Any]:
    """Train on corpus/train.jsonl, write out/tokenizer.model, tokenizer.vocab, report.json.

    The previous tokenizer stays in place until the new one is complete: everything is written in a
    temporary folder beside `out`, manifest.json last, and the folder replaces `out` whole (io.atomic_dir).
    """
    # Long: train, write and swap in the tokenizer in order; the temporary folder moves in only at the end.
    t0 = time.perf_counter()
    train_file = corpus / "train.jsonl"
    if not train_file.exists():
        raise DataError(f"{train_file}: not found; run `enlace fetch` first")
    size = train_file.stat().st_size
    if not cfg.input_sentence_size and size > ALL_SENTENCES_MAX_BYTES:
        need = MEMORY_PER_SAMPLE_BYTE[cfg.type] * size
        raise DataError(
            f"tokenizer: input_sentence_size 0 trains {cfg.type} on every sentence of {train_file} "
            f"({size / 2**20:.0f} MiB), about {need / 2**30:.1f} GiB of memory; set "
            f"data.tokenizer.input_sentence_size (sentences sampled, e.g. 200000)"
        )
    stages = progress(total=3, desc="tokenizer", unit="stage")
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out) as tmp:
        prep = {"docs": 0, "lines": 0, "long_lines_split": 0, "pieces_from_long_lines": 0}
        text_bytes = [0]

        def counted(it: Iterator[str]) -> Iterator[str]:
            for sentence in it:
                text_bytes[0] += len(sentence.encode("utf-8")) + 1
                yield sentence

        sentences = counted(training_sentences(read_docs(train_file), cfg.max_sentence_length, prep))
        if cfg.input_sentence_size:
            sentences = iter(sample_sentences(sentences, cfg.input_sentence_size, cfg.seed))
        stages.update(1)
        stages.set_postfix_str(f"training {cfg.type} vocab {cfg.vocab_size}")
        t1 = time.perf_counter()
        try:
            train_sentencepiece(sentences, tmp / "tokenizer", cfg)
        except RuntimeError as e:
            if not prep["lines"]:
                raise DataError(f"tokenizer: {train_file} has no text") from None
            raise DataError(f"tokenizer training failed on {train_file}: {e}") from None
        t_train = time.perf_counter() - t1
        stages.update(1)
        val_path = corpus / "val.jsonl"
        ev = evaluate(tmp / "tokenizer.model", read_docs(val_path) if val_path.exists() else [])
        hf_check = check_tokenizer_json(tmp / "tokenizer.model", val_path, tmp / "tokenizer.json")
        stages.update(1)
        stages.close()
        report = {
            "config_hash": config_hash,
            "type": cfg.type,
            "vocab_size": cfg.vocab_size,
            "special_ids": {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID},
            "user_defined_symbols": list(cfg.user_defined_symbols),
            "model_sha256": sha256_file(tmp / "tokenizer.model"),
            # "lines" are sentences, what input_sentence_size counts: the sample holds at most that many.
            "training_input": {**prep, "input_sentence_size": cfg.input_sentence_size},
            "val": ev,
            "tokenizer_json": hf_check,
        }
        for name in ("tokenizer.model", "tokenizer.vocab", "tokenizer.json"):
            fsync_file(tmp / name)
        atomic_write_text(tmp / "report.json", canonical_json(report))
        info = {"config_hash": config_hash or None, "type": cfg.type, "vocab_size": cfg.vocab_size}
        write_manifest(tmp, "tokenizer", info)  # last; then the whole folder replaces the old one
    lines = prep["lines"] or 1
    sample = text_bytes[0] * min(1.0, (cfg.input_sentence_size or lines) / lines)
    log(
        f"tokenizer: {cfg.type} {cfg.vocab_size} trained in {t_train:.1f} s on {prep['lines']} sentences "
        f"({prep['long_lines_split']} long lines split; sample {cfg.input_sentence_size or 'all'}, about "
        f"{sample / 2**20:.0f} MiB of text, memory about {MEMORY_PER_SAMPLE_BYTE[cfg.type] * sample / 2**20:.0f} "
        "MiB); "
        f"val {ev['chars_per_token'] or 0:.2f} chars/token, "
        f"{ev['tokens_per_word'] or 0:.2f} tokens/word (bytes: {ev['byte_baseline']['tokens_per_word'] or 0:.2f}); "
        f"total {time.perf_counter() - t0:.1f} s -> {out}"
    )
    return report


def run_tokenize(cfg: Any) -> dict[str, Any]:
    """`enlace tokenize`: train data/tokenizer from data/corpus."""
    return build_tokenizer(cfg.data.tokenizer, paths.CORPUS, paths.TOKENIZER, cfg.section_hash("data"))
