"""The prose yardstick (assets/eval/prosa-es.txt) stays a held-out text: big enough, clean UTF-8, and
never reachable from a corpus or instruction-set config."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROSE = ROOT / "assets" / "eval" / "prosa-es.txt"


def test_prose_text_is_large_clean_utf8():
    raw = PROSE.read_bytes()
    assert len(raw) >= 20_000
    text = raw.decode("utf-8")  # raises on a bad byte
    assert "\r" not in text and "\ufffd" not in text
    # Everyday Spanish, not an ASCII placeholder: accents and inverted marks occur.
    assert sum(text.count(c) for c in "áéíóúñ¿¡") > 300


def test_no_training_config_reads_the_prose_text():
    training_files = [
        *sorted((ROOT / "configs" / "data").glob("*.yaml")),
        *sorted((ROOT / "configs" / "finetune").glob("*.yaml")),
    ]
    assert training_files
    for path in training_files:
        text = path.read_text(encoding="utf-8")
        assert "assets/eval" not in text and "prosa-es" not in text, path


def test_instruction_set_shares_no_sentence_with_the_prose_text():
    prose = PROSE.read_text(encoding="utf-8")
    # Every sentence of 40+ characters from the yardstick must be absent from the instruction data.
    sentences = [s.strip() for s in prose.replace("\n", " ").split(".") if len(s.strip()) >= 40]
    assert len(sentences) > 100
    for path in sorted((ROOT / "assets" / "instruct").glob("*.jsonl")):
        data = path.read_text(encoding="utf-8")
        leaked = [s for s in sentences if s in data]
        assert not leaked, (path, leaked[:3])
