"""Evaluation: val windows spread over the whole split, exact UTF-8 bytes per token, bits per byte, and
one scoring path shared by the trainer's in-run validation and the eval stage."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import synthetic_text, tiny_config

from enlace.cli import main
from enlace.config.data import DataConfig, TokenizerConfig
from enlace.config.model import ModelConfig
from enlace.data.corpus import build_corpus
from enlace.data.loaders import ByteLoader, ShardLoader
from enlace.data.shard import build_shards
from enlace.data.tokenize import build_tokenizer
from enlace.errors import EnlaceError
from enlace.eval.evaluate import (
    Yardsticks,
    load_scorer,
    prose_metrics,
    read_yardsticks,
    run_eval,
    score_model_dir,
)
from enlace.model import IGNORE_INDEX, Llama
from enlace.scoring.score import evaluate, sliding_windows, spread_starts
from enlace.scoring.token_bytes import TokenBytes
from enlace.train.trainer import train

PROSE = "Él vio 🙂 a su abuela.\nLa niña comió pan con aceite, ¿verdad? Sí, y después durmió la siesta."
PROSE_NEW = "—¿Vienes al concierto del viernes?\n—Sí, pero llegaré tarde: salgo a las siete y media.\n" * 3


def uniform_model(vocab: int, seq_len: int = 64) -> Llama:
    """Every parameter zero: logits are all 0, so each token costs exactly ln(vocab) nats."""
    cfg = ModelConfig(
        name="u", vocab_size=vocab, n_layer=1, n_head=2, n_kv_head=1, d_model=16, seq_len=seq_len
    )
    model = Llama(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model.eval()


def write_corpus(folder: Path, docs: dict[str, list[str]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, texts in docs.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return folder


def test_spread_starts_cover_the_split_evenly_without_overlap():
    starts = spread_starts(10_000, 32, 10)
    assert starts[0] == 0 and starts[-1] + 32 + 1 == 10_000  # first at the start, last at the end
    gaps = np.diff(starts)
    assert gaps.min() >= 32 and gaps.max() - gaps.min() <= 1  # targets never overlap; even spacing
    tiled = spread_starts(1000, 32, 10_000)  # more than fit: the whole split, every target once
    assert len(tiled) == 999 // 32 and (np.diff(tiled) == 32).all()
    with pytest.raises(ValueError):
        spread_starts(20, 32, 1)


def test_val_windows_reach_every_part_of_the_split(tmp_path):
    # 100 documents in order; the windows must come from the start, the middle and the end of the split.
    docs = [f"doc{i:03d} un texto corto" for i in range(100)]  # 24 bytes: every window sees a marker
    root = write_corpus(tmp_path / "corpus", {"train": docs, "val": docs})
    loader = ByteLoader(root, "val", 64, 4, 4, seed=0)
    w = loader.val_windows(12)
    assert len(w) == 12 and w.tokens == w.bytes == 12 * 64
    seen = set()
    for row in w.x:
        text = bytes(row.tolist()).decode("utf-8", errors="ignore")
        seen |= {
            int(text[i + 3 : i + 6])
            for i in range(len(text))
            if text.startswith("doc", i) and text[i + 3 : i + 6].isdigit()
        }
    assert min(seen) <= 5 and max(seen) >= 90 and any(40 <= d <= 60 for d in seen)
    assert torch.equal(loader.val_windows(12).x, w.x)  # deterministic


def test_bits_per_byte_exact_on_a_hand_computed_case():
    # Byte model, uniform: 8 bits per byte. "Él vio 🙂" is 2+1+1+3+1+4 = 12 bytes; after a one-byte
    # separator every byte is scored once, whatever the window and stride.
    text = "Él vio 🙂"
    ids = [10, *text.encode("utf-8")]
    w = sliding_windows(ids, context=5, stride=2, counter=TokenBytes.raw_bytes())
    assert w.bytes == 12 and w.tokens == 12
    r = evaluate(uniform_model(256), w, batch_size=2)
    assert r["loss"] == pytest.approx(math.log(256), rel=1e-6)
    assert r["bpb"] == pytest.approx(8.0, rel=1e-6)
    # Each target scored once: the scored targets, in order, are the text's bytes.
    scored = torch.cat([y[y != IGNORE_INDEX] for y in w.y]).tolist()
    assert scored == ids[1:]


@pytest.fixture(scope="module")
def sp_data(tmp_path_factory):
    """A corpus, a sentencepiece tokenizer (byte fallback) and its shards, as the pipeline lays them out."""
    tmp = tmp_path_factory.mktemp("sp")
    words = "la casa del abuelo tiene un jardín con árboles y flores que cuidamos cada día".split()
    rng = np.random.default_rng(0)
    src = tmp / "src"
    src.mkdir()
    for i in range(200):
        (src / f"doc{i:03d}.txt").write_text(" ".join(rng.choice(words, 60)) + ".", encoding="utf-8")
    data = DataConfig.model_validate(
        {"name": "t", "val_fraction": 0.2, "sources": [{"name": "gen", "kind": "local", "path": str(src)}]}
    )
    corpus = tmp / "data" / "corpus"
    build_corpus(data, "h", tmp / "raw", corpus, None, workers=1)
    tok = tmp / "data" / "tokenizer"
    build_tokenizer(TokenizerConfig(type="bpe", vocab_size=300, num_threads=1), corpus, tok)
    manifest = build_shards(corpus, tok, tmp / "data" / "shards", "uint16", 300, 10_000, workers=1)
    return tmp, manifest


def test_sentencepiece_bytes_are_exact(sp_data):
    tmp, manifest = sp_data
    counter = TokenBytes.sentencepiece(tmp / "data" / "tokenizer" / "tokenizer.model")
    loader = ShardLoader(tmp / "data" / "shards", "val", 32, 4, 4, seed=0)
    tokens = np.concatenate([[3], np.asarray(loader.tokens("val").window(0, loader.tokens("val").size))])
    # Every val token after an EOS: the shards' byte count, with the dummy prefix of each document removed.
    assert counter.count(tokens[:-1], tokens[1:]) == manifest["splits"]["val"]["bytes"]
    # A text with accents, a character only byte fallback can spell, and a leading space.
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tmp / "data" / "tokenizer" / "tokenizer.model"))
    ids = [sp.eos_id(), *sp.encode(PROSE)]
    assert any(sp.is_byte(i) for i in ids)
    w = sliding_windows(ids, context=16, stride=8, counter=counter)
    assert w.bytes == len(PROSE.encode("utf-8"))
    r = evaluate(uniform_model(300), w, batch_size=4)
    assert r["bpb"] == pytest.approx((len(ids) - 1) * math.log2(300) / len(PROSE.encode("utf-8")), rel=1e-6)


def test_hugging_face_byte_level_bytes_are_exact(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([PROSE] * 3, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    counter = TokenBytes.hugging_face(tmp_path / "tokenizer.json")
    ids = [0, *tok.encode(PROSE).ids]
    assert counter.count(ids[:-1], ids[1:]) == len(PROSE.encode("utf-8"))
    assert counter.lengths[0] == 0  # special tokens are no text


def test_in_run_val_equals_eval_stage_and_references_are_scored(tmp_path, monkeypatch, capsys):
    text = synthetic_text(40_000).decode("utf-8", errors="ignore")
    docs = [text[i : i + 800] for i in range(0, len(text), 800)]
    write_corpus(tmp_path / "data" / "corpus", {"train": docs[:-8], "val": docs[-8:]})
    prose, prose_new = tmp_path / "prose.txt", tmp_path / "prose-new.txt"
    prose.write_text(PROSE * 4, encoding="utf-8")
    prose_new.write_text(PROSE_NEW, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    cfg = tiny_config({"train.max_steps": 4, "train.eval_batches": 3, "train.checkpoint.every": 4})
    texts = {"prose": str(prose), "prose_new": str(prose_new), "prompts": ["La"]}
    cfg = dataclasses.replace(cfg, eval=cfg.eval.model_copy(update=texts))
    result = train(cfg, tmp_path / "runs" / "smoke", progress=False)  # also the eval stage's reference
    m = run_eval(cfg, tmp_path / "runs" / "smoke", tmp_path / "runs" / "eval")["metrics"]
    # Same weights, same windows, same function: the value the trainer logged at its end.
    assert m["val_loss"] == round(result.val["val_loss"], 6) and m["val_bpb"] == round(
        result.val["val_bpb"], 6
    )
    assert m["val_tokens"] == m["val_bytes"] == 3 * 4 * 32  # eval_batches x micro_batch_size windows
    assert m["prose_bytes"] == len((PROSE * 4).encode("utf-8")) and m["prose_context"] == 32
    assert m["smoke_val_bpb"] == m["val_bpb"] and m["smoke_prose_bpb"] == m["prose_bpb"]
    # The second text: scored as its own document, as if it were the only one, and kept for the references.
    assert m["prose_new_bytes"] == len(PROSE_NEW.encode("utf-8")) and m["prose_new_file"] == str(prose_new)
    alone = score_model_dir(tmp_path / "runs" / "smoke", cfg, torch.device("cpu"), PROSE_NEW)
    assert m["prose_new_bpb"] == alone["prose_bpb"] and m["prose_new_tokens"] == alone["prose_tokens"]
    assert m["smoke_prose_new_bpb"] == m["prose_new_bpb"] and m["smoke_prose_all_bpb"] == m["prose_all_bpb"]
    # Both texts together: total bits over total bytes, not the mean of the two figures.
    scorer = load_scorer(tmp_path / "runs" / "smoke", cfg.hardware, torch.device("cpu"))
    one = prose_metrics(scorer, PROSE * 4, cfg.hardware, cfg.eval.prose_context)
    two = prose_metrics(scorer, PROSE_NEW, cfg.hardware, cfg.eval.prose_context, prefix="prose_new")
    assert one["prose_bits"] == pytest.approx(one["prose_loss"] * one["prose_tokens"] / math.log(2), rel=1e-6)
    n_bytes = one["prose_bytes"] + two["prose_new_bytes"]
    assert m["prose_all_bytes"] == n_bytes
    assert m["prose_all_bpb"] == round((one["prose_bits"] + two["prose_new_bits"]) / n_bytes, 6)
    assert abs(m["prose_bpb"] - m["prose_new_bpb"]) > 0.01  # so a plain mean would land elsewhere
    assert abs(m["prose_all_bpb"] - (m["prose_bpb"] + m["prose_new_bpb"]) / 2) > 1e-4
    again = score_model_dir(tmp_path / "runs" / "smoke", cfg, torch.device("cpu"), PROSE * 4)
    assert again["prose_bpb"] == m["prose_bpb"] and again["val_bpb"] == m["val_bpb"]
    assert not {k for k in again if k.startswith(("prose_new", "prose_all"))}  # one text: no second figure
    written = json.loads((tmp_path / "runs" / "eval" / "metrics.json").read_text())
    assert written["prose_bpb"] == m["prose_bpb"] and written["prose_all_bpb"] == m["prose_all_bpb"]
    assert not [k for k in written if k.endswith("_bits")]  # the unrounded sums stay internal
    capsys.readouterr()
    assert main(["report"]) == 0  # the table `make run` ends with
    report = capsys.readouterr().out
    assert f"{m['val_bpb']:.4f}" in report and f"{m['prose_bpb']:.4f}" in report and "smoke" in report
    assert f"{m['prose_new_bpb']:.4f}" in report and f"{m['prose_all_bpb']:.4f}" in report
    assert f"new: {prose_new} ({m['prose_new_bytes']} bytes)" in report
    # It ends by naming what `make serve` would answer with: here no assistant exists yet, and it says how.
    assert (
        report.rstrip()
        .splitlines()[-1]
        .startswith("== `make serve` answers with nothing yet: import Gemma 3")
    )


def test_missing_second_prose_text_is_named(tmp_path):
    cfg = tiny_config({})
    prose = tmp_path / "prose.txt"
    prose.write_text(PROSE, encoding="utf-8")
    missing = tmp_path / "nope.txt"
    cfg = dataclasses.replace(
        cfg, eval=cfg.eval.model_copy(update={"prose": str(prose), "prose_new": str(missing)})
    )
    with pytest.raises(
        EnlaceError, match=r"nope.txt: prose text not found \(eval.prose_new in params.yaml\)"
    ):
        read_yardsticks(cfg)
    off = read_yardsticks(dataclasses.replace(cfg, eval=cfg.eval.model_copy(update={"prose_new": None})))
    assert off == Yardsticks(PROSE, None)
