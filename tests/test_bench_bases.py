"""The side-by-side benchmark's scoring on a tiny model: every text starts with the model's document-start
token, the prose's bits cover exactly its bytes whatever the window, choices are scored as lm-eval does,
and a missing model is a row saying how to make it."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import make_folder

from enlace.eval import bench_bases as bb

TEXT = (
    "Había una vez un niño que vivía cerca del mar con su abuela. ¿Qué cenamos hoy? Tortilla de patatas.\n"
    * 3
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_folder(tmp_path_factory.mktemp("bb") / "m")
    model, tok = bb.load(bb.Entry("tiny", folder))
    return folder, model, tok


def test_start_token_is_the_document_separator_when_the_tokenizer_adds_none(tiny):
    _, _, tok = tiny
    assert tok("a")["input_ids"] == tok("a", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(bb.start_ids(tok)) == ["<|endoftext|>"]


def test_start_token_is_what_the_tokenizer_puts_first(tiny):
    from tokenizers import processors

    _, _, tok = tiny
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    tok2 = type(tok)(
        tokenizer_object=tok.backend_tokenizer.__class__.from_str(tok.backend_tokenizer.to_str())
    )
    tok2.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)]
    )
    assert bb.start_ids(tok2) == [bos]


def full_bits(model, tok, text: str) -> float:
    ids = bb.start_ids(tok) + tok(text, add_special_tokens=False)["input_ids"]
    return -float(bb.token_logprobs(model, [ids])[0].double().sum()) / math.log(2)


def test_prose_bits_cover_every_byte_once(tiny):
    _, model, tok = tiny
    n_tokens = len(tok(TEXT, add_special_tokens=False)["input_ids"])
    whole = bb.prose_bpb(model, tok, TEXT, context=n_tokens + 8)  # one window: exactly the full sequence
    assert whole["bytes"] == len(TEXT.encode()) and whole["tokens"] == n_tokens
    assert whole["bpb"] == pytest.approx(full_bits(model, tok, TEXT) / len(TEXT.encode()), abs=1e-4)
    small = bb.prose_bpb(model, tok, TEXT, context=24)  # many windows, each restarting with the start token
    assert small["context"] == 24 and math.isfinite(small["bpb"]) and small["bpb"] > 0
    assert small["bpb"] != whole["bpb"]  # shorter contexts: other (not identical) conditional probabilities


def test_choices_scored_after_their_context(tiny):
    _, model, tok = tiny
    items = [("Había una vez", ["un niño.", "una tortilla."]), ("¿Qué cenamos", ["hoy?"])]
    got = bb.choice_scores(model, tok, items, batch=2)
    start = bb.start_ids(tok)
    for (context, choices), scores in zip(items, got, strict=True):
        ctx = tok(context, add_special_tokens=False)["input_ids"]
        for c, s in zip(choices, scores, strict=True):
            full = tok(f"{context} {c}", add_special_tokens=False)["input_ids"]
            lp = bb.token_logprobs(model, [start + full])[0]
            assert s == pytest.approx(float(lp[len(start) + len(ctx) - 1 :].sum()), abs=1e-4)
    assert bb.accuracy(model, tok, [("Había una vez", ["un niño.", "una tortilla."], 0)]) in (0.0, 1.0)
    # No start ids (the diagnosis of a model fed raw text): other conditionals, scored the same way.
    bare = bb.choice_scores(model, tok, items[:1], start=[])[0]
    full = tok("Había una vez un niño.", add_special_tokens=False)["input_ids"]
    ctx = len(tok("Había una vez", add_special_tokens=False)["input_ids"])
    assert bare[0] == pytest.approx(float(bb.token_logprobs(model, [full])[0][ctx - 1 :].sum()), abs=1e-4)
    assert bare != got[0]


def test_bench_writes_a_table_and_names_what_is_missing(tiny, tmp_path):
    folder, _, _ = tiny
    from enlace import paths

    entries = [
        bb.Entry("tiny", folder),
        bb.Entry("absent", tmp_path / "nowhere", how="run `make something`"),
    ]
    rows = bb.bench_bases(
        entries, TEXT, "prose.txt", paths.BENCH_ES, tmp_path / "out", limit=2, log=lambda m: None
    )
    assert (
        rows[0]["pairs_n"] == 14
        and rows[0]["continuations_n"] == 2
        and rows[0]["start_tokens"] == ["<|endoftext|>"]
    )
    assert rows[1] == {"name": "absent", "missing": f"{tmp_path / 'nowhere'} not found; run `make something`"}
    saved = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert saved["precision"] == "fp32" and saved["models"] == json.loads(json.dumps(rows))
    md = (tmp_path / "out" / "table.md").read_text()
    assert "| tiny |" in md and "missing: " in md and "bits per byte (prose.txt)" in md
    assert torch.get_default_dtype() == torch.float32
