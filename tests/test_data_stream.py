"""The streaming corpus: dedup (exact, normalized, MinHash), split by parent document, caps independent of
the split, and outputs that do not depend on the number of datatrove tasks."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from test_data_pipeline import data_config, make_text_source, spanish

from enlace.config.data import TokenizerConfig
from enlace.data.corpus import build_corpus
from enlace.data.loaders import ShardLoader
from enlace.data.shard import build_shards
from enlace.data.tokenize import build_tokenizer


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


def _parents(corpus: Path, split: str, source: str | None = None) -> set[str]:
    return {r["doc"] for r in _rows(corpus / f"{split}.jsonl") if source is None or r["source"] == source}


@pytest.mark.slow  # over 15 s on 2 busy cores (pytest --durations)
def test_one_task_and_four_tasks_give_the_same_corpus_shards_and_batches(tmp_path):
    src = make_text_source(tmp_path / "src", 48, seed=5)
    data = data_config([{"name": "gen", "kind": "local", "path": str(src)}])
    build_corpus(data, "h", tmp_path / "raw1", tmp_path / "c1", None, workers=1, tasks=1)
    build_corpus(data, "h", tmp_path / "raw4", tmp_path / "c4", None, workers=2, tasks=4)
    for name in ("train.jsonl", "val.jsonl", "manifest.json"):
        assert (tmp_path / "c1" / name).read_bytes() == (tmp_path / "c4" / name).read_bytes()
    build_tokenizer(
        TokenizerConfig(type="bpe", vocab_size=400, num_threads=1), tmp_path / "c1", tmp_path / "tok"
    )
    for n in (1, 4):
        build_shards(
            tmp_path / "c1", tmp_path / "tok", tmp_path / f"s{n}", "uint16", 400, 2000, tasks=n, unit_docs=5
        )
    assert (tmp_path / "s1" / "manifest.json").read_bytes() == (
        tmp_path / "s4" / "manifest.json"
    ).read_bytes()
    a = ShardLoader(tmp_path / "s1", "train", 32, 2, 4, 0).get_batch(3, 1)[0]
    b = ShardLoader(tmp_path / "s4", "train", 32, 2, 4, 0).get_batch(3, 1)[0]
    assert torch.equal(a, b)


def test_exact_normalized_and_near_duplicates_are_dropped(tmp_path):
    rng = random.Random(11)
    src = tmp_path / "src"
    src.mkdir()
    base = [spanish(rng, 30) for _ in range(6)]
    for i, text in enumerate(base):
        (src / f"a{i}.txt").write_text(text, encoding="utf-8")
    (src / "b0.txt").write_text(base[0], encoding="utf-8")  # exact copy
    (src / "b1.txt").write_text(base[1].upper().replace(".", " ."), encoding="utf-8")  # case and spacing
    words = base[2].split()
    words[len(words) // 2] = "zanahoria"  # one word of ~500 changed: a near duplicate
    (src / "b2.txt").write_text(" ".join(words), encoding="utf-8")
    data = data_config([{"name": "gen", "kind": "local", "path": str(src)}], val_fraction=0.01)
    m = build_corpus(data, "h", tmp_path / "raw", tmp_path / "c", None, workers=1)
    s = m["sources"]["gen"]
    assert s["duplicates_dropped"] == 2 and s["near_duplicates_dropped"] == 1 and s["docs"] == 6
    text = (tmp_path / "c" / "train.jsonl").read_text(encoding="utf-8")
    assert "zanahoria" not in text  # the first occurrence wins
    # Signatures are computed per file in parallel tasks; the decisions must not depend on the task count.
    build_corpus(data, "h", tmp_path / "raw", tmp_path / "c3", None, workers=2, tasks=3)
    for name in ("train.jsonl", "val.jsonl", "manifest.json"):
        assert (tmp_path / "c" / name).read_bytes() == (tmp_path / "c3" / name).read_bytes()
    # Without near-dedup, the near duplicate stays.
    loose = data_config(
        [{"name": "gen", "kind": "local", "path": str(src)}],
        val_fraction=0.01,
        cleaning={"min_doc_chars": 100, "near_dedup": False},
    )
    m = build_corpus(loose, "h", tmp_path / "raw", tmp_path / "c2", None, workers=1)
    assert m["sources"]["gen"]["docs"] == 7 and m["sources"]["gen"]["near_duplicates_dropped"] == 0


def test_pieces_of_a_long_document_stay_on_one_side(tmp_path):
    src = make_text_source(tmp_path / "src", 80, seed=7)
    data = data_config(
        [{"name": "gen", "kind": "local", "path": str(src)}],
        val_fraction=0.3,
        cleaning={"min_doc_chars": 50, "max_doc_chars": 300},  # every document is cut into pieces
    )
    m = build_corpus(data, "h", tmp_path / "raw", tmp_path / "c", None, workers=1)
    train, val = _parents(tmp_path / "c", "train"), _parents(tmp_path / "c", "val")
    assert train and val and not train & val
    assert m["sources"]["gen"]["pieces"] > 2 * m["sources"]["gen"]["docs"]


def test_caps_do_not_depend_on_the_split(tmp_path):
    a = make_text_source(tmp_path / "a", 90, seed=1)
    b = make_text_source(tmp_path / "b", 30, seed=2)

    def run(val_fraction: float, name: str) -> tuple[set[str], set[str], dict]:
        data = data_config(
            [
                {"name": "big", "kind": "local", "path": str(a), "max_fraction": 0.3},
                {"name": "small", "kind": "local", "path": str(b)},
            ],
            val_fraction=val_fraction,
        )
        m = build_corpus(data, "h", tmp_path / "raw", tmp_path / name, None, workers=1)
        return _parents(tmp_path / name, "train", "big"), _parents(tmp_path / name, "val", "big"), m

    t1, v1, m1 = run(0.1, "c1")
    t2, v2, m2 = run(0.4, "c2")
    assert t1 | v1 == t2 | v2  # the cap keeps the same documents whatever the split
    assert m1["sources"]["big"]["capped_docs_dropped"] > 0
    share = m1["sources"]["big"]["chars"] / m1["total"]["chars"]
    assert 0.2 < share <= 0.3
    # The capped source keeps train documents too, not only its val ones (the old bug kept val first).
    assert len(t1) > len(v1) and v2


def test_language_id_lingua_rejects_other_romance_languages_the_stopword_rule_keeps():
    from enlace.config.data import CleaningConfig
    from enlace.data.clean import line_verdict

    es = "El perro de la casa come mucho pan todos los días con su familia."
    pt = "O cachorro da casa come muito pão todos os dias com a sua família."
    en = "The dog of the house eats a lot of bread every day with its family."
    rule, lingua = CleaningConfig(), CleaningConfig(language_id="lingua")
    assert [line_verdict(x, rule) for x in (es, pt, en)] == ["keep", "keep", "english"]
    assert [line_verdict(x, lingua) for x in (es, pt, en)] == ["keep", "english", "english"]
