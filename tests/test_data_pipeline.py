"""Corpus, tokenizer, shards and loaders on small generated Spanish text (no network)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from enlace.config import load_config
from enlace.config.data import DataConfig, TokenizerConfig
from enlace.data.corpus import build_corpus
from enlace.data.loaders import ByteLoader, ShardLoader
from enlace.data.shard import build_shards
from enlace.data.tokenize import build_tokenizer, split_sentence
from enlace.errors import ConfigError, DataError
from enlace.io import sha256_file

ROOT = Path(__file__).resolve().parents[1]
NOUNS = "casa perro ciudad río montaña libro mesa camino puerta ventana pueblo barco jardín árbol".split()
VERBS = "mira tiene busca encuentra lleva cuenta abre cierra recuerda construye pinta vende".split()
ADJ = "grande pequeña antigua nueva roja verde tranquila oscura alegre lejana".split()


def spanish(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        out.append(
            f"El {rng.choice(NOUNS)} de la {rng.choice(NOUNS)} {rng.choice(VERBS)} una {rng.choice(NOUNS)} "
            f"{rng.choice(ADJ)} que está en el {rng.choice(NOUNS)} con los {rng.choice(NOUNS)}s."
        )
    return " ".join(out)


def make_text_source(folder: Path, ndocs: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(ndocs):
        paras = [spanish(rng, rng.randint(2, 6)) for _ in range(rng.randint(2, 5))]
        (folder / f"doc{i:04d}.txt").write_text("\n\n".join(paras), encoding="utf-8")
    return folder


def data_config(sources: list[dict], **kw) -> DataConfig:
    base = {"name": "t", "val_fraction": 0.1, "cleaning": {"min_doc_chars": 100}, "sources": sources}
    base.update(kw)
    return DataConfig.model_validate(base)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One small corpus, tokenizer and shard set shared by the tests that only read them."""
    tmp = tmp_path_factory.mktemp("built")
    src = make_text_source(tmp / "src", 120)
    data = data_config([{"name": "gen", "kind": "local", "path": str(src)}])
    build_corpus(data, "h", tmp / "raw", tmp / "corpus", None, workers=1)
    tok = TokenizerConfig(type="bpe", vocab_size=400, num_threads=1)
    build_tokenizer(tok, tmp / "corpus", tmp / "tok")
    build_shards(tmp / "corpus", tmp / "tok", tmp / "shards", "uint16", 400, 5000, workers=2)
    return tmp


def test_corpus_rerun_is_byte_identical(tmp_path):
    src = make_text_source(tmp_path / "src", 40)
    data = data_config([{"name": "gen", "kind": "local", "path": str(src)}])
    build_corpus(data, "h", tmp_path / "raw", tmp_path / "c1", None, workers=2)
    build_corpus(data, "h", tmp_path / "raw", tmp_path / "c2", None, workers=1)
    for name in ("train.jsonl", "val.jsonl", "manifest.json"):
        assert (tmp_path / "c1" / name).read_bytes() == (tmp_path / "c2" / name).read_bytes()


def test_non_utf8_bytes_are_replaced_and_counted(tmp_path):
    src = make_text_source(tmp_path / "src", 5)
    good = (src / "doc0000.txt").read_bytes()
    (src / "doc0000.txt").write_bytes(good[:50] + b"\xff\xfe" + good[50:])
    data = data_config([{"name": "gen", "kind": "local", "path": str(src)}])
    m = build_corpus(data, "h", tmp_path / "raw", tmp_path / "c", None, workers=1)
    assert m["sources"]["gen"]["cleaning"]["replaced_bytes"] == 2
    assert m["sources"]["gen"]["docs"] >= 5
    assert "\ufffd" not in (tmp_path / "c" / "train.jsonl").read_text(encoding="utf-8")


def test_empty_source_after_cleaning_names_the_source(tmp_path):
    src = make_text_source(tmp_path / "src", 5)
    eng = tmp_path / "english"
    eng.mkdir()
    (eng / "a.txt").write_text("The quick brown fox jumps over the lazy dog and it is fine.\n" * 20)
    data = data_config(
        [
            {"name": "gen", "kind": "local", "path": str(src)},
            {"name": "inglés", "kind": "local", "path": str(eng)},
        ]
    )
    with pytest.raises(DataError, match="source inglés: no documents left"):
        build_corpus(data, "h", tmp_path / "raw", tmp_path / "c", None, workers=1)
    empty = tmp_path / "empty"
    empty.mkdir()
    data = data_config([{"name": "vacía", "kind": "local", "path": str(empty)}])
    with pytest.raises(DataError, match="source vacía: no files"):
        build_corpus(data, "h", tmp_path / "raw", tmp_path / "c", None, workers=1)


def test_max_fraction_caps_a_source(tmp_path):
    a = make_text_source(tmp_path / "a", 60, seed=1)
    b = make_text_source(tmp_path / "b", 20, seed=2)
    data = data_config(
        [
            {"name": "big", "kind": "local", "path": str(a), "max_fraction": 0.3},
            {"name": "small", "kind": "local", "path": str(b)},
        ]
    )
    m = build_corpus(data, "h", tmp_path / "raw", tmp_path / "c", None, workers=1)
    share = m["sources"]["big"]["chars"] / m["total"]["chars"]
    assert 0.2 < share <= 0.3 and m["sources"]["big"]["capped_docs_dropped"] > 0


def test_long_sentences_are_split_not_skipped(tmp_path):
    line = spanish(random.Random(3), 200)  # one line of ~15 kB
    pieces = split_sentence(line, 1000)
    assert len(pieces) > 10 and all(len(p.encode()) <= 1000 for p in pieces)
    assert " ".join(pieces).split() == line.split()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(4)
    docs = [spanish(rng, 3) for _ in range(200)] + [line]
    (corpus / "train.jsonl").write_text("".join(json.dumps({"source": "s", "text": d}) + "\n" for d in docs))
    rep = build_tokenizer(
        TokenizerConfig(type="bpe", vocab_size=300, max_sentence_length=1000, num_threads=1),
        corpus,
        tmp_path / "tok",
    )
    assert rep["training_input"]["long_lines_split"] == 1
    assert rep["training_input"]["pieces_from_long_lines"] == len(pieces)


def test_tokenizer_is_deterministic(built, tmp_path):
    tok = TokenizerConfig(type="bpe", vocab_size=400, num_threads=1)
    build_tokenizer(tok, built / "corpus", tmp_path / "tok2")
    assert sha256_file(tmp_path / "tok2" / "tokenizer.model") == sha256_file(
        built / "tok" / "tokenizer.model"
    )
    rep = json.loads((built / "tok" / "report.json").read_text())
    assert rep["special_ids"] == {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(built / "tok" / "tokenizer.model"))
    marker = sp.piece_to_id("<|im_start|>")
    assert marker > 3 and marker in sp.encode("hola<|im_start|>adiós")  # one piece, never split
    assert rep["val"]["chars_per_token"] > 1.0


def test_val_check_in_chunks_reports_as_one_check(built, tmp_path, monkeypatch):
    """The tokenizer.json check reads the val split in chunks (bounded memory); the report is unchanged."""
    import enlace.data.tokenize as tokenize

    val_docs = len((built / "corpus" / "val.jsonl").read_text(encoding="utf-8").splitlines())
    assert val_docs > 3
    monkeypatch.setattr(tokenize, "VAL_CHECK_DOCS", 3)
    build_tokenizer(
        TokenizerConfig(type="bpe", vocab_size=400, num_threads=1), built / "corpus", tmp_path / "t"
    )
    assert (tmp_path / "t" / "report.json").read_bytes() == (built / "tok" / "report.json").read_bytes()
    assert (tmp_path / "t" / "tokenizer.json").read_bytes() == (built / "tok" / "tokenizer.json").read_bytes()


def test_training_on_every_sentence_of_a_large_split_is_refused(built, tmp_path, monkeypatch):
    import enlace.data.tokenize as tokenize

    monkeypatch.setattr(tokenize, "ALL_SENTENCES_MAX_BYTES", 1000)
    with pytest.raises(DataError, match="input_sentence_size 0 .* set data.tokenizer.input_sentence_size"):
        build_tokenizer(TokenizerConfig(type="bpe", vocab_size=400), built / "corpus", tmp_path / "t")
    sampled = TokenizerConfig(type="bpe", vocab_size=400, num_threads=1, input_sentence_size=500)
    assert (
        build_tokenizer(sampled, built / "corpus", tmp_path / "t")["training_input"]["input_sentence_size"]
        == 500
    )


def test_sentence_sample_is_seeded_bounded_and_in_order():
    from enlace.data.tokenize import sample_sentences

    lines = [f"frase {i}" for i in range(1000)]
    a = sample_sentences(iter(lines), 100, seed=0)
    assert a == sample_sentences(iter(lines), 100, seed=0) and len(a) == 100
    assert a == sorted(a, key=lines.index)  # corpus order
    assert a != sample_sentences(iter(lines), 100, seed=1)
    assert sample_sentences(iter(lines[:50]), 100, seed=0) == lines[:50]


def test_sampled_tokenizer_is_identical_in_another_process(built, tmp_path):
    """input_sentence_size below the sentence count: the same model in a fresh process (sentencepiece's
    own sampling was not reproducible across processes)."""
    import subprocess
    import sys

    code = (
        "import sys; from pathlib import Path; from enlace.config.data import TokenizerConfig; "
        "from enlace.data.tokenize import build_tokenizer; "
        "build_tokenizer(TokenizerConfig(type='bpe', vocab_size=400, num_threads=1, input_sentence_size=150), "
        "Path(sys.argv[1]), Path(sys.argv[2]))"
    )
    tok = TokenizerConfig(type="bpe", vocab_size=400, num_threads=1, input_sentence_size=150)
    rep = build_tokenizer(tok, built / "corpus", tmp_path / "here")
    assert rep["training_input"]["lines"] > 150
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "ENLACE_NO_PROGRESS": "1"}
    subprocess.run(
        [sys.executable, "-c", code, str(built / "corpus"), str(tmp_path / "there")], env=env, check=True
    )
    for name in ("tokenizer.model", "report.json"):
        assert (tmp_path / "here" / name).read_bytes() == (tmp_path / "there" / name).read_bytes()


def test_shards_match_direct_encoding(built):
    import sentencepiece as spm

    m = json.loads((built / "shards" / "manifest.json").read_text())
    assert m["dtype"] == "uint16" and len(m["splits"]["train"]["shards"]) > 1
    sp = spm.SentencePieceProcessor(model_file=str(built / "tok" / "tokenizer.model"))
    docs = [json.loads(x)["text"] for x in (built / "corpus" / "train.jsonl").read_text().splitlines()]
    expect = [t for d in docs for t in sp.encode(d) + [3]]
    got = np.concatenate(
        [np.fromfile(built / "shards" / s["file"], dtype=np.uint16) for s in m["splits"]["train"]["shards"]]
    )
    assert got.tolist() == expect


def test_shard_truncation_and_alteration_are_detected(built, tmp_path):
    import shutil

    d = tmp_path / "shards"
    shutil.copytree(built / "shards", d)
    first = d / "train-00000.bin"
    blob = first.read_bytes()
    first.write_bytes(blob[:-2])
    with pytest.raises(DataError, match="train-00000.bin: shard size"):
        ShardLoader(d, "train", 16, 2, 4, 0).get_batch(0, 0)
    first.write_bytes(blob[:10] + bytes([blob[10] ^ 1]) + blob[11:])
    with pytest.raises(DataError, match="train-00000.bin: shard checksum mismatch: expected sha256"):
        ShardLoader(d, "train", 16, 2, 4, 0).get_batch(0, 0)
    first.unlink()
    with pytest.raises(DataError, match="missing"):
        ShardLoader(d, "train", 16, 2, 4, 0).get_batch(0, 0)


def test_vocab_that_does_not_fit_the_dtype_is_a_config_error():
    with pytest.raises(ConfigError, match="uint16"):
        load_config(
            ROOT / "params.yaml",
            overrides=[
                "data.shard.dtype=uint16",
                "data.tokenizer.vocab_size=70000",
                "model.vocab_size=70000",
            ],
        )


@pytest.mark.parametrize("cls", ["bytes", "shards"])
def test_loader_is_pure_and_rank_accum_equivalent(built, cls):
    def make(mbs: int, gbs: int, rank: int = 0, ws: int = 1, seed: int = 7):
        if cls == "bytes":
            return ByteLoader(built / "corpus", "train", 32, mbs, gbs, seed, rank, ws)
        return ShardLoader(built / "shards", "train", 32, mbs, gbs, seed, rank, ws)

    one = make(2, 4)  # 1 process, accum 2
    x0, y0 = one.get_batch(5, 0)
    assert x0.shape == (2, 32) and x0.dtype == torch.long
    assert torch.equal(x0[:, 1:], y0[:, :-1])
    assert torch.equal(one.get_batch(5, 0)[0], make(2, 4).get_batch(5, 0)[0])  # pure
    assert not torch.equal(one.get_batch(6, 0)[0], x0)
    r0, r1 = make(2, 4, 0, 2), make(2, 4, 1, 2)  # 2 ranks, accum 1
    assert torch.equal(r0.get_batch(5, 0)[0], x0)
    assert torch.equal(r1.get_batch(5, 0)[0], one.get_batch(5, 1)[0])
    assert not torch.equal(make(2, 4, seed=8).get_batch(5, 0)[0], x0)
    if cls == "shards":
        import shutil

        shutil.copytree(
            built / "tok", built / "tokenizer", dirs_exist_ok=True
        )  # beside the shards, as in data/
    vw = one.val_windows(4)
    assert len(vw) == 4 and torch.equal(vw.x, one.val_windows(4).x)
    assert vw.tokens == 4 * 32 and (
        vw.bytes == vw.tokens if cls == "bytes" else vw.tokens < vw.bytes < 10 * vw.tokens
    )
    # state: same geometry loads, another fingerprint or geometry is refused
    sd = one.state_dict()
    make(2, 4).load_state_dict(sd)
    with pytest.raises(DataError, match="global_batch_size"):
        make(2, 8).load_state_dict(sd)
    with pytest.raises(DataError, match="fingerprint"):
        make(2, 4).load_state_dict({**sd, "fingerprint": "x"})
