"""The judge of answers to unseen questions: Spanish, on topic (keywords in close variants, never echoes of
the question), free of loops; the held-out question file is well formed and disjoint from the training set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import write_jsonl

from enlace.errors import DataError
from enlace.finetune.judge import Question, fold, judge, keywords_found, rates, read_questions, variant_of

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT / "assets" / "instruct" / "es_preguntas_nuevas.jsonl"
CLOUDS = Question(
    "¿Por qué se forman las nubes?",
    ("vapor", "agua", "frío", "enfría", "gotas", "condensa", "aire", "evapora", "temperatura", "cristales"),
)


def test_on_topic_spanish_answer_passes():
    a = "Las nubes aparecen cuando el vapor de agua sube con el aire caliente, se enfría y se condensa en gotitas."
    v = judge(a, CLOUDS)
    assert v == {
        "spanish": True,
        "on_topic": True,
        "loops": False,
        "keywords_found": ["vapor", "agua", "enfría", "condensa", "aire"],
        "ok": True,
    }


def test_off_topic_spanish_answer_fails_on_topic_only():
    v = judge("Para la cena puedes preparar una tortilla de patatas con cebolla y una ensalada.", CLOUDS)
    assert v["spanish"] and not v["loops"] and not v["on_topic"] and not v["ok"]


def test_echoing_the_question_is_not_on_topic():
    v = judge("Las nubes se forman porque se forman las nubes, que es por lo que se forman.", CLOUDS)
    assert v["keywords_found"] == [] and not v["on_topic"]


def test_one_chance_keyword_is_not_enough():
    v = judge("Bebe mucha agua y descansa; mañana será otro día.", CLOUDS)
    assert v["keywords_found"] == ["agua"] and not v["on_topic"]


def test_english_answer_on_topic_fails_spanish():
    v = judge("Clouds form when the water vapour in the air cools and condenses into droplets.", CLOUDS)
    assert not v["spanish"] and not v["ok"]


def test_portuguese_answer_is_not_spanish():
    # The stopword vote alone takes it for Spanish ("de", "a", "que", "se"); lingua does not.
    v = judge(
        "As nuvens se formam quando o vapor de água sobe, esfria e se condensa em gotas minúsculas.", CLOUDS
    )
    assert v["on_topic"] and not v["spanish"] and not v["ok"]


def test_looping_answer_fails_even_on_topic():
    a = "El vapor de agua se enfría. El vapor de agua se enfría. El vapor de agua se enfría. El vapor de agua"
    v = judge(a, CLOUDS)
    assert v["loops"] and v["on_topic"] and not v["ok"]


def test_empty_answer_fails():
    v = judge("", CLOUDS)
    assert not v["spanish"] and not v["on_topic"] and not v["ok"]


@pytest.mark.parametrize(
    "word, keyword, same",
    [
        ("luces", "luz", True), ("soles", "sol", True), ("solo", "sol", False), ("sal", "sol", False),
        ("fria", "frio", True), ("aguas", "agua", True), ("aguacate", "agua", False),
        ("condensacion", "condensa", True), ("enfriar", "enfria", True), ("hidratarse", "hidratado", True),
        ("dispersa", "dispersion", True), ("calor", "caliente", False), ("mano", "manzana", False),
    ],
)  # fmt: skip
def test_close_variants(word, keyword, same):
    assert variant_of(word, keyword) is same


def test_keywords_fold_accents_and_case():
    assert fold("Dióxido CAMIÓN pingüino") == "dioxido camion pinguino"
    assert keywords_found("El DIOXIDO de carbono", ["dióxido", "carbono", "hielo"]) == ["dióxido", "carbono"]


def test_rates_count_each_check():
    vs = [judge("Clouds, clouds.", CLOUDS), judge("El vapor de agua se enfría y forma gotas.", CLOUDS)]
    assert rates(vs) == {
        "questions": 2, "spanish_rate": 0.5, "on_topic_rate": 0.5, "loops_rate": 0.0, "ok_rate": 0.5,
    }  # fmt: skip


def test_question_file_refuses_echoed_keywords_and_bad_rows(tmp_path):
    bad = write_jsonl(
        tmp_path / "q.jsonl", [{"question": "¿De dónde sale la lluvia?", "keywords": ["nubes", "lluvias"]}]
    )
    with pytest.raises(DataError, match=r"q\.jsonl:1: keywords \['lluvias'\] occur in the question itself"):
        read_questions(bad)
    short = write_jsonl(tmp_path / "s.jsonl", [{"question": "¿Qué es?", "keywords": ["uno"]}])
    with pytest.raises(DataError, match=r"s\.jsonl:1: keywords must be a list of at least 2"):
        read_questions(short)
    with pytest.raises(DataError, match="not found"):
        read_questions(tmp_path / "absent.jsonl")


def test_the_projects_questions_are_new():
    qs = read_questions(QUESTIONS)  # refuses echoed keywords
    assert len(qs) >= 20 and all(len(q.keywords) >= 6 for q in qs)
    seen = set()
    for name in ("es_familia_train.jsonl", "es_familia_val.jsonl"):
        for line in (ROOT / "assets" / "instruct" / name).read_text(encoding="utf-8").splitlines():
            seen.add(" ".join(fold(json.loads(line)["instruction"]).split()))
    assert [q.question for q in qs if " ".join(fold(q.question).split()) in seen] == []
    assert len({q.question for q in qs}) == len(qs)


def test_gemma_chat_template_is_what_the_data_code_trains_on(tmp_path):
    """LoRA data follow the base's own template (here Gemma's, as the importer writes it), not ChatML: the
    labels are the model turn and its end marker, and the prompt the answers are generated from is the same
    template's generation prompt."""
    from helpers import write_tokenizer
    from tokenizers import AddedToken, Tokenizer

    from enlace.finetune.data import dolly_messages, encode_conversation
    from enlace.hf.gguf_gemma import CHAT_TEMPLATE
    from enlace.hf.tokenizer import HFTokenizer
    from enlace.model import IGNORE_INDEX

    write_tokenizer(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok.add_special_tokens(
        [AddedToken(t, special=True) for t in ("<bos>", "<start_of_turn>", "<end_of_turn>")]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = {
        "bos_token": "<bos>",
        "eos_token": "<end_of_turn>",
        "pad_token": "<end_of_turn>",
        "chat_template": CHAT_TEMPLATE,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    hf = HFTokenizer(tmp_path)
    row = {"instruction": "¿Qué cenamos?", "context": "", "response": "Tortilla de patatas."}
    ex = encode_conversation(hf, dolly_messages(row))
    text = hf.decode(ex.input_ids)
    assert text.startswith("<bos><start_of_turn>user\n¿Qué cenamos?<end_of_turn>\n<start_of_turn>model\n")
    assert "<|im_start|>" not in text
    labelled = [t for t in ex.labels if t != IGNORE_INDEX]
    assert hf.decode(labelled) == "Tortilla de patatas.<end_of_turn>\n"
    prompt = hf.decode(hf.apply_chat_template([{"role": "user", "content": "¿Qué cenamos?"}], True))
    assert prompt == "<bos><start_of_turn>user\n¿Qué cenamos?<end_of_turn>\n<start_of_turn>model\n"


def test_answer_drifting_into_other_scripts_is_not_spanish():
    # What Gemma's base answered in the chat format: Spanish, then Japanese and Russian.
    mixed = "¿Cómo hago para que el agua del río se desengrasa de mi pie? に通い Мне нужно есть еду с мясом, а это не мясо."
    assert not judge(mixed, CLOUDS)["spanish"]
    assert judge("El vapor de agua se enfría y forma gotas en el aire, como dice el símbolo ∑ o 𒄠.", CLOUDS)[
        "spanish"
    ]
