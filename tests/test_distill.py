"""The distillation filter (issue 40, item 3): which sampled answers of the in-context assistant are kept, on
crafted sample sets (agreeing, disagreeing, looping, not Spanish, unended, too short, a copy of an example),
the distillation question file (nothing from the judge, the instruction set or a preamble), the written
folder (instruction-set format, manifest with licence) and `enlace distill` end to end on a tiny Gemma."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from gemma_helpers import tiny_gemma_folder
from helpers import write_jsonl

from enlace.errors import DataError
from enlace.finetune.distill import (
    DistillQuestion,
    distill,
    filter_question,
    majority,
    near_copy,
    read_distill_questions,
    short_answer,
    write_distilled,
)
from enlace.finetune.judge import fold, read_questions
from enlace.finetune.text_checks import Reply
from enlace.load.preamble import load_spec

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT / "assets" / "distill" / "preguntas-destilar.jsonl"
JUDGE = ROOT / "assets" / "eval" / "preguntas-juez.jsonl"

HEXAGON = DistillQuestion("t1", "fact", "¿Cuántos lados tiene un hexágono?")
MENINAS = DistillQuestion("t2", "fact", "¿Quién pintó Las Meninas?")
TEA = DistillQuestion("t3", "advice", "¿Cómo se hace una infusión de manzanilla?")
NOTE = DistillQuestion(
    "t4", "writing", "Escribe una nota para el fontanero con la hora a la que puede venir."
)
ADVICE = (
    "Calienta agua hasta que empiece a hervir y apágala. Pon una cucharada de flores secas de manzanilla o una "
    "bolsita en la taza, echa el agua encima y déjala reposar cinco minutos antes de colarla."
)
EXAMPLE = "¡Enhorabuena, Marta! Te lo mereces. Seguro que lo harás genial. ¡Lo celebramos pronto!"


def replies(*texts: str, ended: bool = True) -> list[Reply]:
    return [Reply(t, 20, ended) for t in texts]


def test_agreeing_fact_samples_are_kept_and_the_odd_one_out_is_not():
    r = filter_question(
        HEXAGON,
        replies("Un hexágono tiene seis lados.", "Tiene 6 lados, como una celda.", "Tiene siete lados."),
    )
    assert r["agreed"] and r["short_answer"] == ["6"] and r["support"] == 2
    assert r["kept"] == [0, 1]
    assert [s["short_answer"] for s in r["samples"]] == [["6"], ["6"], ["7"]]


def test_disagreeing_fact_samples_are_all_dropped():
    r = filter_question(
        MENINAS,
        replies("Las Meninas las pintó Velázquez.", "Las pintó Goya en su taller.", "Las pintó Picasso."),
    )
    assert not r["agreed"] and r["support"] == 1 and r["kept"] == []
    assert all(s["passes"] for s in r["samples"])  # each answer is fine alone: only agreement is missing


def test_a_majority_is_of_all_samples_and_a_failing_sample_still_votes():
    # Two of four agree: not more than half.
    r = filter_question(
        MENINAS, replies("Las pintó Velázquez.", "Fue Velázquez.", "Goya.", "Las pintó Murillo.")
    )
    assert not r["agreed"] and r["kept"] == []
    # Three of four agree, but one of them did not end by itself: it votes and is not kept.
    texts = [
        "Las Meninas las pintó Diego Velázquez.",
        "Las pintó Velázquez, en 1656.",
        "Velázquez las pintó.",
    ]
    r = filter_question(MENINAS, [*replies(*texts[:2]), Reply(texts[2], 128, False), *replies("Goya.")])
    assert r["agreed"] and r["short_answer"] == ["velazquez"] and r["support"] == 3
    assert r["kept"] == [0, 1]


def test_short_answers_ignore_the_question_its_filler_and_what_follows_the_first_clause():
    assert short_answer(
        "La tercera parte de treinta es diez.", "¿Cuánto es la tercera parte de treinta?"
    ) == {"10"}
    assert short_answer("Un siglo tiene cien años, claro.", "¿Cuántos años tiene un siglo?") == {"100"}
    assert short_answer("Roma es la capital de Italia. Milán no.", "¿Cuál es la capital de Italia?") == {
        "roma"
    }
    assert short_answer("No lo sé.", "¿Quién pintó Las Meninas?") == frozenset()  # nothing answered
    assert majority([frozenset({"roma"}), frozenset({"roma", "eterna"}), frozenset()]) == ({"roma"}, 2)
    assert majority([frozenset(), frozenset()]) == (frozenset(), 0)


@pytest.mark.parametrize(
    "question, reply, failed",
    [
        (TEA, Reply("Pon agua. Pon agua. Pon agua. Pon agua. " + ADVICE, 90, True), "loops"),
        (TEA, Reply("Boil some water, then put a camomile bag in the cup and wait five minutes.", 20, True),
         "spanish"),
        (TEA, Reply(ADVICE, 128, False), "ended"),
        (TEA, Reply("Con agua caliente.", 5, True), "length_ok"),
        (NOTE, Reply(EXAMPLE, 25, True), "copies_example"),
    ],
)  # fmt: skip
def test_a_sample_failing_a_check_is_not_kept(question, reply, failed):
    r = filter_question(
        question, [reply, Reply(ADVICE if question is TEA else NOTE_TEXT, 60, True)], [EXAMPLE]
    )
    first = r["samples"][0]
    assert not first["passes"] and r["kept"] == [1]
    assert first[failed] is (failed in ("loops", "copies_example"))


NOTE_TEXT = "Hola, Julián: le espero el martes a las diez en la calle del Olmo, 8, tercero B. Gracias."


def test_distill_draws_each_seed_keeps_distinct_answers_and_reports(tmp_path):
    calls: list[tuple[str, int]] = []
    texts = {0: ADVICE, 1: ADVICE, 2: ADVICE.replace("cinco", "tres")}

    def answer(q: str, seed: int) -> Reply:  # a stand-in for the model: the filter under test is the real one
        calls.append((q, seed))
        if q == HEXAGON.question:
            return Reply(["Tiene seis lados.", "Un hexágono tiene 6 lados.", "Tiene ocho."][seed], 9, True)
        return Reply(texts[seed], 60, True)

    records, rows = distill(answer, [HEXAGON, TEA], 3, per_question=2)
    assert calls == [(HEXAGON.question, s) for s in range(3)] + [(TEA.question, s) for s in range(3)]
    assert [(r["id"], r["seed"]) for r in records] == [("t1", 0), ("t1", 1), ("t3", 0), ("t3", 2)]
    assert records[0] == {"instruction": HEXAGON.question, "context": "", "response": "Tiene seis lados.",
                          "category": "destilado-fact", "id": "t1", "seed": 0}  # fmt: skip
    assert len(distill(answer, [TEA], 3)[0]) == 1  # one a question by default
    saved: list[tuple[int, int]] = []  # after every question: what a stopped run keeps
    distill(
        answer,
        [HEXAGON, TEA],
        3,
        per_question=2,
        progress=lambda rec, rows: saved.append((len(rec), len(rows))),
    )
    assert saved == [(2, 1), (4, 2)]
    with pytest.raises(DataError, match="must be >= 1"):
        distill(answer, [TEA], 0)

    out = tmp_path / "distilled"
    counts = write_distilled(out, records, rows, {"licence": "Gemma Terms of Use", "samples": 3})
    assert counts["fact"] == {"questions": 1, "with_answer": 1, "kept": 2} and counts["samples"] == 6
    from enlace.finetune.data import read_conversations
    from enlace.manifest import verify_manifest

    convs = read_conversations(out / "distilled.jsonl", "dolly")
    assert [m["role"] for m in convs[0]] == ["user", "assistant"] and convs[2][1]["content"] == ADVICE
    doc = verify_manifest(out)
    assert doc["kind"] == "distilled-data" and doc["provenance"]["licence"] == "Gemma Terms of Use"
    assert set(doc["files"]) == {"distilled.jsonl", "report.json"}
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert report["questions"][0]["agreed"] and report["counts"]["facts_disagreeing"] == 0


def test_question_file_errors_name_file_and_line(tmp_path):
    ok = {"id": "a", "kind": "advice", "question": "¿Cómo se riega un cactus?"}
    cases = [
        ([ok | {"kind": "poem"}], r"q\.jsonl:1: kind 'poem' is not one of fact, advice, writing"),
        ([ok, ok | {"id": "b"}], r"q\.jsonl:2: question .* repeats line 1"),
        ([{"id": "a", "kind": "fact"}], r"q\.jsonl:1: expected"),
    ]
    for rows, message in cases:
        with pytest.raises(DataError, match=message):
            read_distill_questions(write_jsonl(tmp_path / "q.jsonl", rows))


def _normalized(text: str) -> str:
    return " ".join(re.findall(r"\w+", fold(text)))


def test_the_distillation_questions_are_new():
    """At least 150 questions across the kinds, none equal (normalized: folded, punctuation and spacing
    ignored) or near-equal (more than 60% of words shared) to a judge question, an instruction of
    assets/instruct, or an example of a preamble spec."""
    qs = read_distill_questions(QUESTIONS)
    kinds = {k: sum(q.kind == k for q in qs) for k in ("fact", "advice", "writing")}
    assert len(qs) >= 150 and min(kinds.values()) >= 40, kinds
    seen = [q.question for q in read_questions(JUDGE, None)]
    for path in sorted((ROOT / "assets" / "instruct").glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        seen += [row.get("instruction") or row["question"] for row in rows]
    for spec in sorted((ROOT / "configs" / "assistant").glob("*.yaml")):
        seen += [e.user for e in load_spec(spec).examples]
    assert len(seen) > 600
    normalized = {_normalized(s) for s in seen}
    for q in qs:
        assert _normalized(q.question) not in normalized, q.question
        near = [s for s in seen if near_copy(q.question, s)]
        assert near == [], (q.question, near)


def test_enlace_distill_end_to_end_on_a_tiny_gemma(tmp_path, capsys):
    """The command on a random tiny Gemma: every question sampled with each seed, the folder written with its
    manifest and licence, whatever (if anything) the random model's answers let through."""
    from enlace.cli import main

    folder = tiny_gemma_folder(tmp_path / "g")
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"name: tiny\nbase: {folder}\nstart: <bos>\nsystem: Responde en español.\n"
        'user: "Usuario: {content}\\n"\nassistant: "ENLACE: {content}\\n\\n"\nstop: ["\\nUsuario:"]\n'
        "licence: Gemma Terms of Use (the base's answers)\n"
        'examples:\n  - {user: "¿Qué hora es?", assistant: "Son las diez."}\n',
        encoding="utf-8",
    )
    out = tmp_path / "out"
    args = ["distill", "--assistant", str(spec), "--questions", str(QUESTIONS), "--out", str(out)]
    assert main([*args, "--limit", "2", "--samples", "2", "--max-new-tokens", "4"]) == 0
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert [len(q["samples"]) for q in report["questions"]] == [2, 2]
    assert all(1 <= s["tokens"] <= 4 for q in report["questions"] for s in q["samples"])
    prov = json.loads((out / "manifest.json").read_text(encoding="utf-8"))["provenance"]
    assert prov["licence"].startswith("Gemma Terms of Use") and prov["seeds"] == [0, 1]
    assert prov["sampler"]["temperature"] > 0 and prov["questions_used"] == 2
    assert main([*args, "--samples", "0"]) != 0  # refused before the model loads, in one line
    assert "enlace distill: --samples 0: must be at least 1" in capsys.readouterr().err


def test_sample_many_draws_each_seed_as_generate_does(tmp_path):
    """The distillation's batched decoding: each row is generate's sample for its seed (the preamble's keys
    and values copied from a prefill, the rest computed; rows leaving the batch as they end), on a random tiny
    Gemma whose sliding window (6) the prompt outgrows."""
    from enlace.generate import generate, prefill, sample_many
    from enlace.load import load_model

    model = load_model(tiny_gemma_folder(tmp_path / "g")).model
    preamble = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48]
    prompt = [*preamble[:-1], 50, 51, 52]  # shares all but the preamble's last id
    sampling = {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1, "no_repeat_ngram": 4}
    seeds = [0, 1, 2, 3]
    alone = [list(generate(model, prompt, 12, seed=s, **sampling)) for s in seeds]
    assert len({tuple(a) for a in alone}) > 1  # the seeds draw different samples
    for prefix in (None, prefill(model, preamble)):
        assert sample_many(model, prompt, 12, seeds, prefix=prefix, **sampling) == alone
    # A row that ends (an eos id, or `done`) leaves; the others go on as before.
    eos = alone[1][4]
    ended = sample_many(model, prompt, 12, seeds, eos_ids=[eos], done=lambda ids: len(ids) == 7, **sampling)
    for got, full in zip(ended, alone, strict=True):
        cut = next((i + 1 for i, t in enumerate(full) if t == eos), len(full))
        assert got == full[: min(cut, 7)]
