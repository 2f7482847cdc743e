"""The judge on fact questions (first sentence, key or variant, no competing key, numbers as words), its Wilson
intervals, the judge's question file (structure, counts, nothing from the training files) and the preamble
assistant (its prompt and its stop), with a Gemma-layout tokenizer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from gemma_helpers import tiny_gemma_folder
from helpers import write_jsonl

from enlace.errors import ConfigError, DataError
from enlace.finetune.judge import (
    first_sentence,
    fold,
    judge,
    mentions,
    numbers_as_digits,
    read_questions,
    summary,
    wilson,
)
from enlace.load.preamble import cut_at_stop, load_spec

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT / "assets" / "eval" / "preguntas-juez.jsonl"
SPEC = ROOT / "configs" / "assistant" / "gemma3-preamble.yaml"


@pytest.fixture(scope="module")
def qs() -> dict[str, object]:
    return {q.question: q for q in read_questions(QUESTIONS, None)}


FRANCE = "¿Cuál es la capital de Francia?"
SEVEN_EIGHT = "¿Cuánto es siete por ocho?"


@pytest.mark.parametrize(
    "question, answer, correct",
    [
        (FRANCE, "La capital de Francia es París.", True),
        (FRANCE, "PARIS, a orillas del Sena.", True),  # case and accents do not matter
        (FRANCE, "París. Roma es la capital de Italia.", True),  # a rival after the first sentence is fine
        (FRANCE, "La capital de Francia es Roma.", False),  # wrong
        (FRANCE, "Es París o Roma, no estoy seguro.", False),  # the key with a competing key (same group)
        (FRANCE, "No lo sé.", False),  # evasive
        (FRANCE, "Es una ciudad muy bonita. Se llama París.", False),  # the key only after the first sentence
        (FRANCE, "La capital es Parisina.", False),  # whole words only
        (SEVEN_EIGHT, "Siete por ocho son cincuenta y seis.", True),  # numbers as words ...
        (SEVEN_EIGHT, "7 x 8 = 56", True),  # ... or digits; the question's own 7 and 8 compete with nothing
        (SEVEN_EIGHT, "Siete por ocho son cincuenta y cuatro.", False),  # an explicit wrong key
        (SEVEN_EIGHT, "Son 56 o 54.", False),
        (SEVEN_EIGHT, "Son quinientos sesenta.", False),  # 560 is not 56
        ("¿Cuál es el animal más grande del mundo?", "El animal más grande es la ballena azul.", True),
        ("¿A cuántos grados Celsius hierve el agua al nivel del mar?", "A cien grados.", True),
        ("¿A cuántos grados Celsius hierve el agua al nivel del mar?", "A 100 grados, y se congela a 0.", False),
    ],
)  # fmt: skip
def test_fact_answers(qs, question, answer, correct):
    v = judge(answer, qs[question])
    assert v["correct"] is correct, v
    assert v["ok"] is (correct and v["spanish"] and not v["loops"])


def test_a_wrong_fact_answer_is_on_topic_and_an_evasive_one_is_not(qs):
    wrong = judge("La capital de Francia es Roma.", qs[FRANCE])
    assert wrong["on_topic"] and wrong["competing_found"] == ["Roma"] and not wrong["key_found"]
    evasive = judge("No lo sé, lo siento.", qs[FRANCE])
    assert not evasive["on_topic"] and not evasive["correct"] and not evasive["ok"]


def test_advice_answers_have_no_fact_verdict(qs):
    q = qs["¿Cómo se hace un huevo cocido?"]
    v = judge("Pon el huevo en un cazo con agua fría y, cuando hierva, cuenta diez minutos.", q)
    assert "correct" not in v and v["on_topic"] and v["ok"]


def test_numbers_and_sentences():
    assert numbers_as_digits("cien menos treinta y cinco son sesenta y cinco") == "100 menos 35 son 65"
    assert numbers_as_digits("dos mil veinticuatro y ciento doce") == "2024 y 112"
    assert numbers_as_digits("dos tres") == "2 3"  # two numbers, not one
    assert mentions("Tiene VEINTINUEVE días", "29") and not mentions("Tiene 129 días", "29")
    assert first_sentence("\n  El pH es 3.5 en total. Después, más.") == "El pH es 3.5 en total"
    assert first_sentence("¡Claro! Es París.") == "¡Claro"


def test_wilson_interval():
    lo, hi = wilson(12, 20)
    assert (round(lo, 3), round(hi, 3)) == (0.387, 0.781)  # the "roughly 39-78% around 12/20"
    assert wilson(0, 10)[0] == 0.0 and 0.25 < wilson(0, 10)[1] < 0.35  # never empty at 0/n
    assert wilson(10, 10)[1] == pytest.approx(1.0) and wilson(0, 0) == (0.0, 1.0)


def test_summary_counts_correct_over_facts_only(qs):
    rows = [
        judge("La capital de Francia es París.", qs[FRANCE]) | {"ended": True},
        judge("No lo sé.", qs[SEVEN_EIGHT]) | {"ended": False},
        judge("Pon agua en un cazo y cuenta diez minutos.", qs["¿Cómo se hace un huevo cocido?"]) | {"ended": True},
    ]  # fmt: skip
    s = summary(rows)
    assert (s["correct"]["k"], s["correct"]["n"]) == (1, 2)
    assert (s["ended"]["k"], s["ended"]["n"]) == (2, 3) and s["on_topic"]["n"] == 3
    assert s["correct"]["low"] < 0.5 < s["correct"]["high"]


def test_question_file_counts_and_structure():
    test, dev = read_questions(QUESTIONS, "test"), read_questions(QUESTIONS, "dev")
    kinds = {k: sum(q.kind == k for q in test) for k in ("fact", "advice", "writing")}
    assert len(test) >= 80 and kinds["fact"] >= 30 and kinds["advice"] >= 30 and kinds["writing"] >= 20
    assert 15 <= len(dev) <= 25 and {q.kind for q in dev} == {"fact", "advice", "writing"}
    every = test + dev
    assert len({q.id for q in every}) == len({q.question for q in every}) == len(every)
    for q in every:
        assert len(q.keywords) >= 3, q.question
        if q.kind == "fact":  # a key that competes with itself could never be right
            assert q.keys and not any(mentions(k, c) for k in q.keys for c in q.competitors), q.question


def _words(text: str) -> set[str]:
    return set(re.findall(r"\w+", fold(text)))


def test_no_question_is_in_a_training_file():
    """No question is an instruction of the training or validation set, or of the older unseen questions,
    nor a near copy of one (more than 60% of its words shared, Jaccard)."""
    seen = []
    for path in (ROOT / "assets" / "instruct").glob("*.jsonl"):
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            seen.append(row.get("instruction") or row["question"])
    assert len(seen) > 500
    seen_words = [_words(s) for s in seen]
    for q in read_questions(QUESTIONS, None):
        w = _words(q.question)
        near = [s for s, sw in zip(seen, seen_words, strict=True) if len(w & sw) / len(w | sw) > 0.6]
        assert near == [], (q.question, near)


def test_the_fact_set_teaches_the_form_and_never_a_judge_key():
    """The instruction set's short fact answers (`es_datos_train.jsonl`) are other facts: none states the key
    or an accepted variant of any judge fact question, dev or test ("Septiembre tiene 30 días.", never
    "París" or "56"), so training on them cannot hand the judge its answers."""
    rows = [
        json.loads(line) for line in (ROOT / "assets/instruct/es_datos_train.jsonl").open(encoding="utf-8")
    ]
    assert len(rows) >= 120 and {r["category"] for r in rows} == {"datos"}
    facts = [q for q in read_questions(QUESTIONS, None) if q.kind == "fact"]
    leaks = [
        (r["response"], q.id, key) for r in rows for q in facts for key in (q.answer, *q.accept)
        if mentions(r["response"], key)
    ]  # fmt: skip
    assert leaks == []


def test_question_file_refuses_a_fact_without_key_and_a_bad_split(tmp_path):
    base = {"question": "¿Cuántas ruedas tiene una bici?", "keywords": ["pedales", "cadena"]}
    with pytest.raises(DataError, match=r"q\.jsonl:1: a fact question needs an answer key"):
        read_questions(write_jsonl(tmp_path / "q.jsonl", [base | {"kind": "fact"}]))
    with pytest.raises(DataError, match=r"s\.jsonl:1: split 'train' is not one of dev, test"):
        read_questions(write_jsonl(tmp_path / "s.jsonl", [base | {"split": "train"}]))
    with pytest.raises(DataError, match=r"w\.jsonl:1: wrong must be a list"):
        read_questions(
            write_jsonl(tmp_path / "w.jsonl", [base | {"kind": "fact", "answer": "2", "wrong": "3"}])
        )


def test_preamble_renders_the_prompt_and_knows_its_stop(tmp_path):
    spec = load_spec(SPEC)
    folder = tiny_gemma_folder(tmp_path / "g")
    from enlace.hf.tokenizer import HFTokenizer

    tok = HFTokenizer(folder)
    msgs = [{"role": "user", "content": "  ¿Qué hora es?\n"}]
    text = spec.render(msgs)
    assert text.startswith(spec.system + "\n\n")
    assert text.endswith("\n\nUsuario: ¿Qué hora es?\nENLACE:")  # the model writes the answer's space
    assert text.count("Usuario: ") == len(spec.examples) + 1 and 3 <= len(spec.examples) <= 6
    ids = spec.encode(tok, msgs)
    assert ids[0] == tok.token_id("<bos>") == 2 and ids.count(2) == 1
    assert tok.decode(ids[1:]) == text
    assert spec.stop_ids(tok) == tok.eos_ids and 1 in spec.stop_ids(tok)
    # The answer ends where the model starts the next turn: each stop string cuts it there.
    reply = " Hace sol.\nUsuario: ¿Y mañana?"
    assert cut_at_stop(reply, spec.stop) == (" Hace sol.", True)
    assert cut_at_stop(" Hace sol.", spec.stop) == (" Hace sol.", False)
    # A system message replaces the spec's system line.
    assert spec.render([{"role": "system", "content": "Sé breve."}, *msgs]).startswith(
        "Sé breve.\n\nUsuario:"
    )


def test_no_preamble_example_is_a_judge_question():
    """Every spec's example turns are new to the judge: no example question is a judge question, nor shares
    more than 60% of its words with one (an example answer would then be a worked answer to a test item)."""
    from enlace.finetune.distill import near_copy

    questions = [q.question for q in read_questions(QUESTIONS, None)]
    for path in sorted(SPEC.parent.glob("*.yaml")):
        for e in load_spec(path).examples:
            near = [q for q in questions if near_copy(e.user, q) or _words(e.user) == _words(q)]
            assert near == [], (path.name, e.user, near)


def test_a_bad_spec_is_one_line_naming_file_and_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(SPEC.read_text(encoding="utf-8").replace("ENLACE: {content}", "ENLACE:"), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"bad\.yaml: assistant: .*\{content\} exactly once"):
        load_spec(bad)


def test_judge_run_on_a_preamble_assistant(tmp_path):
    """The whole path on a random tiny Gemma: the spec's assistant answers, each answer is judged, ends at a
    stop or the budget, and the partial result is handed over after every answer."""
    from enlace.config.extra import CHAT_SAMPLING
    from enlace.finetune.assistant import judge_assistant, load_assistant, summary_table
    from enlace.finetune.judge import interleave

    folder = tiny_gemma_folder(tmp_path / "g")
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        SPEC.read_text(encoding="utf-8").replace("models/gemma3-270m", str(folder)), encoding="utf-8"
    )
    a = load_assistant(spec)
    questions = interleave(read_questions(QUESTIONS, "dev"))[:3]
    assert [q.kind for q in questions] == ["fact", "advice", "writing"]
    seen = []
    r = judge_assistant(
        a, questions, ["greedy", "sample-1"], CHAT_SAMPLING, 6, progress=lambda x: seen.append(1)
    )
    assert len(seen) == 6 and list(r["decodings"]) == ["greedy", "sample-1"]
    g = r["decodings"]["greedy"]
    assert g["sampling"]["temperature"] == 0 and r["decodings"]["sample-1"]["sampling"]["seed"] == 1
    assert g["answered"] == "3/3" and g["summary"]["correct"]["n"] == 1 and g["summary"]["on_topic"]["n"] == 3
    for row in g["answers"]:
        assert 1 <= row["tokens"] <= 6 and (row["ended"] or row["tokens"] == 6)
        assert not any(s in row["answer"] for s in ("Usuario:", "ENLACE:"))
    assert "| gemma3-preamble | greedy |" in summary_table([r])
    # `enlace judge --weights auto` (its default): the decode weights the server would use here, named.
    from enlace import kernels
    from enlace.generate import KernelLinear

    served_like = load_assistant(spec, weights="fp32")
    assert served_like.what.endswith("; fp32 decode weights, as `enlace serve --weights fp32`")
    assert any(isinstance(m, KernelLinear) for m in served_like.model.modules()) == kernels.available()
    assert "decode weights" not in a.what


def test_a_bare_name_is_not_taken_for_another_language(qs):
    """ "Lisboa." has no function word to vote on: it counts as Spanish; "The capital is Lisbon." does not."""
    portugal = qs["¿Cuál es la capital de Portugal?"]
    assert judge("Lisboa.", portugal)["ok"] and not judge("Madrid.", portugal)["correct"]
    assert judge("Buenos Aires.", qs["¿Cuál es la capital de Argentina?"])["spanish"]
    english = judge("The capital is Lisbon.", portugal)
    assert not english["spanish"] and not english["ok"]
    assert not judge("Лиссабон.", portugal)["spanish"] and not judge("Clouds.", portugal)["spanish"]


def test_rejudge_applies_the_current_judge_to_stored_answers(qs):
    from enlace.finetune.assistant import rejudge

    q = qs["¿Cuál es la capital de Portugal?"]
    row = {
        "id": q.id,
        "kind": "fact",
        "question": q.question,
        "answer": "Lisboa.",
        "tokens": 4,
        "ended": True,
    }
    stored = {"decodings": {"greedy": {"answers": [row | {"ok": False, "spanish": False}]}}}
    d = rejudge(stored, list(qs.values()))["decodings"]["greedy"]
    assert d["answers"][0]["ok"] and d["summary"]["correct"]["k"] == 1 and d["rates"]["ok_rate"] == 1.0


def test_judge_table_puts_stored_results_side_by_side(qs, tmp_path, capsys):
    """`enlace judge --table A B --out T`: the results' rows in the order given, in the terminal and in T; a
    missing or foreign file is a one-line error, and T is not written."""
    from enlace.cli import main
    from enlace.finetune.assistant import rejudge

    q = qs["¿Cuál es la capital de Portugal?"]
    paths = []
    for name, answer in (("right", "Lisboa."), ("wrong", "Oporto.")):
        row = {
            "id": q.id,
            "kind": "fact",
            "question": q.question,
            "answer": answer,
            "tokens": 4,
            "ended": True,
        }
        stored = rejudge({"assistant": name, "decodings": {"greedy": {"answers": [row]}}}, list(qs.values()))
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(stored), encoding="utf-8")
    out = tmp_path / "table.md"
    assert main(["judge", "--table", *map(str, paths), "--out", str(out)]) == 0
    rows = [line for line in out.read_text(encoding="utf-8").splitlines() if line.startswith("| right") or
            line.startswith("| wrong")]  # fmt: skip
    assert [r.split(" | ")[0] for r in rows] == ["| right: right", "| wrong: wrong"]  # file: assistant
    assert "100% (1/1)" in rows[0].split(" | ")[3] and "0% (0/1)" in rows[1].split(" | ")[3]
    (tmp_path / "foreign.json").write_text("{}", encoding="utf-8")
    for bad in ("missing.json", "foreign.json"):
        assert main(["judge", "--table", str(tmp_path / bad), "--out", str(tmp_path / "t2.md")]) != 0
        assert bad in capsys.readouterr().err and not (tmp_path / "t2.md").exists()
