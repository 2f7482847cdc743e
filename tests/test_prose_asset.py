"""The prose yardsticks (assets/eval/prosa-es.txt, eval.prose, and assets/eval/prosa-es-nueva.txt,
eval.prose_new) stay held-out texts: big enough, clean UTF-8, distinct from each other, named by params.yaml,
and never reachable from a corpus or instruction-set config."""

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PROSE = ROOT / "assets" / "eval" / "prosa-es.txt"
PROSE_NEW = ROOT / "assets" / "eval" / "prosa-es-nueva.txt"
# Each text with its least size in bytes and least count of accented letters and inverted marks.
TEXTS = {PROSE: (20_000, 300), PROSE_NEW: (12_000, 200)}


def sentences(path: Path) -> list[str]:
    """Every sentence of 40+ characters: long enough that a match elsewhere is a copy, not chance."""
    text = path.read_text(encoding="utf-8")
    return [s.strip() for s in text.replace("\n", " ").split(".") if len(s.strip()) >= 40]


@pytest.mark.parametrize("path", list(TEXTS), ids=lambda p: p.name)
def test_prose_text_is_large_clean_utf8(path):
    least_bytes, least_marks = TEXTS[path]
    raw = path.read_bytes()
    assert len(raw) >= least_bytes
    text = raw.decode("utf-8")  # raises on a bad byte
    assert "\r" not in text and "\ufffd" not in text
    # Everyday Spanish, not an ASCII placeholder: accents and inverted marks occur.
    assert sum(text.count(c) for c in "áéíóúñ¿¡") > least_marks
    # Pieces separated by a blank line, each opening with a short title line.
    pieces = text.strip().split("\n\n")
    assert len(pieces) > 20 and len(pieces[0].splitlines()[0]) < 80


def test_params_score_both_texts():
    ev = yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8"))["eval"]
    assert ROOT / ev["prose"] == PROSE and ROOT / ev["prose_new"] == PROSE_NEW
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))
    deps = dvc["stages"]["eval"]["deps"]
    assert "assets/eval/prosa-es.txt" in deps and "assets/eval/prosa-es-nueva.txt" in deps


def test_no_training_config_reads_the_prose_texts():
    training_files = [
        *sorted((ROOT / "configs" / "data").glob("*.yaml")),
        *sorted((ROOT / "configs" / "finetune").glob("*.yaml")),
    ]
    assert training_files
    for path in training_files:
        text = path.read_text(encoding="utf-8")
        # "prosa-es" also matches prosa-es-nueva.
        assert "prosa-es" not in text, path
        # The eval folder only as the judge's questions (answered after training, never trained on).
        evals = {k: v for k, v in yaml.safe_load(text).items() if isinstance(v, str) and "assets/eval" in v}
        assert set(evals) <= {"questions"}, (path, evals)


@pytest.mark.parametrize("path", list(TEXTS), ids=lambda p: p.name)
def test_instruction_set_shares_no_sentence_with_the_prose_text(path):
    found = sentences(path)
    assert len(found) > 100
    for data_path in sorted((ROOT / "assets" / "instruct").glob("*.jsonl")):
        data = data_path.read_text(encoding="utf-8")
        leaked = [s for s in found if s in data]
        assert not leaked, (data_path, leaked[:3])


def test_the_new_text_shares_no_sentence_with_the_old():
    # A second yardstick measures something only if it is new text, not the first one again.
    old = PROSE.read_text(encoding="utf-8")
    repeated = [s for s in sentences(PROSE_NEW) if s in old]
    assert not repeated, repeated[:3]
