"""Instruction data: assistant-only labels, dropped (never truncated) long examples, padding, and a loss
whose gradient ignores prompt labels and equals the full-logits reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import dolly_rows, make_folder, write_jsonl

from enlace.errors import DataError
from enlace.finetune.data import (
    batch_indices,
    build_dataset,
    collate,
    dolly_messages,
    encode_conversation,
    load_dataset,
)
from enlace.finetune.loss import assistant_loss_sum
from enlace.hf.folder import load_hf_folder
from enlace.hf.tokenizer import HFTokenizer
from enlace.io import sha256_file
from enlace.lora import inject_lora, lora_parameters
from enlace.model import IGNORE_INDEX


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("data") / "base")


def test_labels_cover_exactly_the_assistant_turns(folder):
    tok = HFTokenizer(folder)
    msgs = [
        {"role": "user", "content": "¿Qué cenamos?"},
        {"role": "assistant", "content": "Tortilla de patatas."},
        {"role": "user", "content": "¿Y mañana?"},
        {"role": "assistant", "content": "Ensalada."},
    ]
    ex = encode_conversation(tok, msgs)
    assert ex.input_ids == tok.apply_chat_template(msgs)
    labelled = [t for t, lab in zip(ex.input_ids, ex.labels, strict=True) if lab != IGNORE_INDEX]
    assert tok.decode(labelled) == "Tortilla de patatas.<|im_end|>\nEnsalada.<|im_end|>\n"
    assert all(lab in (IGNORE_INDEX, t) for t, lab in zip(ex.input_ids, ex.labels, strict=True))


def test_long_examples_are_dropped_and_counted(folder, tmp_path):
    tok = HFTokenizer(folder)
    rows = dolly_rows(6)
    rows[2]["response"] = "muy largo " * 200
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    ds = load_dataset(tok, path, "dolly", max_len=120)
    assert ds.dropped_too_long == 1 and len(ds.examples) == 5 and ds.report()["read"] == 6
    assert max(len(e.input_ids) for e in ds.examples) <= 120
    with pytest.raises(DataError, match="every example was dropped"):
        load_dataset(tok, path, "dolly", max_len=5)
    write_jsonl(tmp_path / "bad.jsonl", [{"instruction": "x"}])
    with pytest.raises(DataError, match=r"bad.jsonl:1: dolly record lacks \['response'\]"):
        load_dataset(tok, tmp_path / "bad.jsonl", "dolly", max_len=100)
    chat = write_jsonl(
        tmp_path / "c.jsonl",
        [{"messages": [{"role": "user", "content": "hola"}, {"role": "assistant", "content": "¡Hola!"}]}],
    )
    assert len(load_dataset(tok, chat, "chat", max_len=100).examples) == 1


def test_several_training_files_are_read_in_order_and_the_limit_spans_them(folder, tmp_path):
    from enlace.config.finetune import FinetuneConfig
    from enlace.finetune.train import data_fingerprint

    tok = HFTokenizer(folder)
    a, b = dolly_rows(3), dolly_rows(5)[3:]
    first, second = write_jsonl(tmp_path / "a.jsonl", a), write_jsonl(tmp_path / "b.jsonl", b)
    both = load_dataset(tok, [first, second], "dolly", max_len=200)
    one_by_one = [load_dataset(tok, p, "dolly", max_len=200).examples for p in (first, second)]
    assert both.examples == one_by_one[0] + one_by_one[1] and both.report()["read"] == 5
    assert len(load_dataset(tok, [first, second], "dolly", max_len=200, limit=4).examples) == 4
    with pytest.raises(DataError, match="missing.jsonl: not found"):
        load_dataset(tok, [first, tmp_path / "missing.jsonl"], "dolly", max_len=200)
    # The run's identity follows every file, in order; one file keeps its old fingerprint (its sha256).
    assert data_fingerprint([str(first), str(second)]) != data_fingerprint([str(second), str(first)])
    assert data_fingerprint([str(first)]) == sha256_file(first)[:16]
    cfg = FinetuneConfig(name="t", train_data=[str(first), str(second)])
    assert cfg.train_files == [str(first), str(second)]
    assert FinetuneConfig(name="t", train_data=str(first)).train_files == [str(first)]
    with pytest.raises(ValueError, match="no training file"):
        FinetuneConfig(name="t", train_data=[])


def test_collate_pads_right_with_pad_id(folder):
    tok = HFTokenizer(folder)
    ds = build_dataset(
        tok,
        [[{"role": "user", "content": "a" * n}, {"role": "assistant", "content": "b"}] for n in (1, 30)],
        200,
    )
    b = collate(ds.examples, tok.pad_id)
    n0 = len(ds.examples[0].input_ids)
    assert b["input_ids"].shape[1] == len(ds.examples[1].input_ids) > n0
    assert (b["input_ids"][0, n0:] == tok.pad_id).all() and (b["labels"][0, n0:] == IGNORE_INDEX).all()
    assert b["attention_mask"][0].sum() == n0


def test_batch_order_is_a_pure_function_of_step_and_seed():
    seen = [i for s in range(5) for i in batch_indices(10, 4, s, seed=3)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert batch_indices(10, 4, 3, seed=3) == seen[12:16] and batch_indices(10, 4, 3, seed=4) != seen[12:16]


def test_length_grouping_pads_less_and_still_sees_every_example_once_an_epoch():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 400, (96,), generator=gen).tolist()

    def padded(window: int) -> int:  # tokens of an epoch's 24 batches of 4, each padded to its longest
        return sum(
            4 * max(lengths[i] for i in batch_indices(96, 4, s, 7, lengths, window)) for s in range(24)
        )

    for window in (4, 16):
        for epoch in range(2):
            seen = [
                i
                for s in range(24 * epoch, 24 * epoch + 24)
                for i in batch_indices(96, 4, s, 7, lengths, window)
            ]
            assert sorted(seen) == list(range(96))
        assert padded(window) < 0.95 * padded(0)
    # The batches keep a random place in the epoch: the first ones are not the shortest.
    firsts = [max(lengths[i] for i in batch_indices(96, 4, s, 7, lengths, 16)) for s in range(6)]
    assert firsts != sorted(firsts)
    # Off (0), the order is the plain seeded shuffle whatever the lengths.
    assert [batch_indices(96, 4, s, 7, lengths, 0) for s in range(30)] == [
        batch_indices(96, 4, s, 7) for s in range(30)
    ]


def test_gradient_ignores_prompt_labels_and_matches_full_logits(folder):
    tok = HFTokenizer(folder)
    ds = build_dataset(tok, [dolly_messages(r) for r in dolly_rows(3)], 300)
    b = collate(ds.examples, tok.pad_id)
    model = load_hf_folder(folder)
    torch.manual_seed(0)
    inject_lora(model, ["q_proj", "v_proj"], 4, 8)
    with torch.no_grad():
        for n, p in lora_parameters(model):
            if "lora_B" in n:
                p.normal_(0, 0.05)
    params = [p for _, p in lora_parameters(model)]

    def grads(loss):
        return [g.clone() for g in torch.autograd.grad(loss, params, retain_graph=True)]

    s, n = assistant_loss_sum(model, b["input_ids"], b["labels"])
    ours = grads(s / n)
    # Reference: logits at every position; prompt and pad positions get arbitrary labels and weight 0.
    mask = b["labels"][:, 1:] != IGNORE_INDEX
    junk = torch.randint(0, tok.vocab_size, b["labels"].shape)
    targets = torch.where(b["labels"] != IGNORE_INDEX, b["labels"], junk)[:, 1:]
    logits = model(b["input_ids"]).logits[:, :-1]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    ref_loss = (ce * mask.reshape(-1)).sum() / mask.sum()
    ref = grads(ref_loss)
    assert abs(float(s.detach()) / n - float(ref_loss.detach())) < 1e-5
    assert all(torch.allclose(a, r, atol=1e-6, rtol=1e-4) for a, r in zip(ours, ref, strict=True))
    # Different prompt tokens' junk labels: same gradient (they are masked, whatever their value).
    targets2 = torch.where(b["labels"] != IGNORE_INDEX, b["labels"], (junk + 7) % tok.vocab_size)[:, 1:]
    ce2 = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets2.reshape(-1), reduction="none")
    ref2 = grads((ce2 * mask.reshape(-1)).sum() / mask.sum())
    assert all(torch.equal(a, r) for a, r in zip(ref, ref2, strict=True))
