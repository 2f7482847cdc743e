"""Decoding that does not loop and the checks finetune-eval runs on its answers; sampling options and
chat input refused with one-line errors; unknown chat roles refused in training data."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from helpers import make_folder, write_jsonl

from enlace.cli import main
from enlace.config.model import ModelConfig
from enlace.errors import DataError, EnlaceError
from enlace.finetune.chat import chat_repl
from enlace.finetune.data import read_conversations
from enlace.finetune.text_checks import answer_checks, distinct_2, is_spanish, loops
from enlace.generate import RepeatGuard, generate
from enlace.load import load_model
from enlace.model import Llama

ROOT = Path(__file__).resolve().parents[1]


def tiny_llama(seq_len: int = 64) -> Llama:
    cfg = ModelConfig(name="t", vocab_size=13, n_layer=1, n_head=2, n_kv_head=1, d_model=16, seq_len=seq_len)
    torch.manual_seed(0)
    return Llama(cfg).eval()


def ngrams(ids: list[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]


def test_greedy_loops_and_no_repeat_ngram_stops_it():
    model = tiny_llama()
    plain = list(generate(model, [1, 2, 3], 40))
    # A 13-token vocabulary forces greedy decoding into a cycle: the failure the guard exists for.
    assert len(set(ngrams(plain, 3))) < len(ngrams(plain, 3))
    guarded = list(generate(model, [1, 2, 3], 40, no_repeat_ngram=3))
    assert len(set(ngrams(guarded, 3))) == len(ngrams(guarded, 3)) and len(guarded) == 40
    # Seeded sampling with the guard is reproducible.
    a = list(generate(model, [1, 2], 20, temperature=0.7, top_p=0.9, repetition_penalty=1.3, seed=4))
    assert a == list(generate(model, [1, 2], 20, temperature=0.7, top_p=0.9, repetition_penalty=1.3, seed=4))


def test_repetition_penalty_scales_seen_logits_but_never_the_end_of_turn():
    guard = RepeatGuard(penalty=2.0, keep={0})
    for t in (1, 2, 0):
        guard.push(t)
    logits = torch.tensor([[4.0, 4.0, -4.0, 4.0]])
    assert guard.apply(logits).tolist() == [[4.0, 2.0, -8.0, 4.0]]
    assert RepeatGuard().apply(logits) is logits  # off: untouched


def test_prompt_longer_than_the_context_is_cut_with_a_warning(capsys):
    model = tiny_llama(seq_len=16)
    out = list(generate(model, list(range(1, 13)) * 2, 4))
    assert len(out) == 4
    assert (
        "the prompt is 24 tokens and the model's context is 16; keeping its last 12"
        in capsys.readouterr().err
    )
    list(generate(model, [1, 2, 3], 4))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["chat", "--temperature", "-1"], "--temperature -1.0: must be >= 0"),
        (["chat", "--top-p", "2"], "--top-p 2.0: must be in (0, 1]"),
        (["chat", "--max-new-tokens", "-5"], "--max-new-tokens -5: must be at least 1"),
        (["chat", "--repetition-penalty", "0.5"], "--repetition-penalty 0.5: must be >= 1"),
        (["generate", "hola", "--top-p", "2"], "--top-p 2.0: must be in (0, 1]"),
        (["generate", "hola", "--max-new-tokens", "-5"], "--max-new-tokens -5"),
        (["generate", "hola", "--temperature", "-1"], "--temperature -1.0"),
    ],
)
def test_bad_sampling_options_are_refused_before_loading_a_model(argv, needle, capsys, tmp_path):
    # --model points nowhere: the refusal must come first.
    assert main([*argv, "--model", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("chat") / "base")


@pytest.fixture(scope="module")
def chat_model(chat_folder):
    return load_model(chat_folder)


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])
def test_invalid_utf8_on_chat_input_is_one_line_error(chat_model, errors):
    inp = io.TextIOWrapper(io.BytesIO(b"hola\n\xff\xfeadios\n"), encoding="utf-8", errors=errors)
    out = io.StringIO()
    with pytest.raises(EnlaceError, match=r"^input line \d: not valid UTF-8") as e:
        chat_repl(chat_model, inp, out, max_new_tokens=3)
    assert "\n" not in str(e.value)
    if errors == "surrogateescape":  # how `enlace chat` reads stdin: the line is named exactly
        assert str(e.value).startswith("input line 2:")
        assert out.getvalue().count("\n") == 1  # the first turn was answered before the bad line


def test_chat_command_refuses_invalid_utf8_stdin(chat_folder, monkeypatch, capsys):
    stdin = io.TextIOWrapper(io.BytesIO(b"hola\n\xffadios\n"), encoding="utf-8")
    monkeypatch.setattr("sys.stdin", stdin)
    assert main(["chat", "--model", str(chat_folder), "--max-new-tokens", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: input line 2: not valid UTF-8") and "\n" not in err


def test_unknown_chat_role_is_refused_with_file_and_line(tmp_path):
    good = {"messages": [{"role": "user", "content": "Hola"}, {"role": "assistant", "content": "¡Hola!"}]}
    bad = {"messages": [{"role": "user", "content": "Hola"}, {"role": "wizard", "content": "Abracadabra"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [good, bad])
    with pytest.raises(DataError, match=r"chat\.jsonl:2: unknown chat role 'wizard'; use system, user"):
        read_conversations(path, "chat")
    assert len(read_conversations(write_jsonl(tmp_path / "ok.jsonl", [good]), "chat")) == 1


def test_loop_check_catches_loops_and_spares_every_human_text_in_assets():
    assert loops("¿Qué abuela no sabía? ¿Por qué? ¿Por qué? ¿Por qué? ...")
    assert loops("Me llamo Ana y me gusta el pan. Me llamo Ana y me gusta el pan. Me llamo Ana y me gusta")
    assert not loops("Una cena de cerveza con la cerveza.")
    assert not loops("Así, 2 elevado a 5 significa 2 × 2 × 2 × 2 × 2, y no 2 × 5.")  # arithmetic
    assert loops("La respuesta es 1 1 1 1 1 1 1 1 1 1 1 1 1 1")  # a span without letters, six times
    human = (ROOT / "assets" / "eval" / "prosa-es.txt").read_text(encoding="utf-8").split("\n\n")
    for path in sorted((ROOT / "assets" / "instruct").glob("es_familia_*.jsonl")):
        human += [json.loads(line)["response"] for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(human) > 300
    assert [t[:60] for t in human if loops(t)] == []


def test_distinct_2_and_language_checks():
    assert distinct_2(["a b a b a b"]) == pytest.approx(2 / 5)
    assert distinct_2(["uno dos", "tres cuatro"]) == 1.0
    assert is_spanish("Puedes preparar una tortilla de patatas con la cebolla.")
    assert not is_spanish("You can make a potato omelette with the onion.")
    # Too short for the function-word vote: Spanish spelling decides, and no evidence is no Spanish.
    assert is_spanish("«¡Vamos a jugar! ¡Vamos a jugar!»") and is_spanish("Sí, está en África.")
    assert not is_spanish("Actor.") and not is_spanish("Yes, of course.") and not is_spanish("Ça va.")
    c = answer_checks(["¿Por qué? ¿Por qué? ¿Por qué?", "Para la cena, una tortilla de patatas."])
    assert c["looping"] == 0.5 and c["spanish"] == 1.0


def test_budget_shorter_than_heldout_answers_is_warned():
    """finetune-eval names a generation budget that would cut the held-out answers (answers cannot end)."""
    from enlace.finetune.data import Dataset, Example
    from enlace.finetune.evaluate import answer_budget_warning
    from enlace.model import IGNORE_INDEX

    def ex(prompt: int, answer: int) -> Example:
        return Example(list(range(prompt + answer)), [IGNORE_INDEX] * prompt + list(range(answer)))

    val = Dataset([ex(5, 10), ex(3, 30), ex(8, 20)])
    assert answer_budget_warning(val, 30) is None
    msg = answer_budget_warning(val, 12)
    assert msg is not None and "max_new_tokens=12" in msg and "2 of the 3" in msg and "longest is 30" in msg
