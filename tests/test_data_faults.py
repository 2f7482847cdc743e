"""Hostile inputs and faults in the data stages: one-line errors, nothing deleted before its replacement exists.

Covers issue 12's data items: binary and non-UTF-8 files, a corpus altered after fetch, a failing or killed
shard, tokenize with missing input, a corrupt tokenizer.model; and resuming a killed fetch or shard.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_data_pipeline import data_config, make_text_source

from enlace.config.data import TokenizerConfig
from enlace.data.corpus import build_corpus
from enlace.data.shard import build_shards
from enlace.data.tokenize import build_tokenizer
from enlace.errors import DataError
from enlace.io import sha256_file

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    src = make_text_source(tmp / "src", 60)
    data = data_config([{"name": "gen", "kind": "local", "path": str(src)}])
    build_corpus(data, "h", tmp / "raw", tmp / "corpus", None, workers=1)
    build_tokenizer(TokenizerConfig(type="bpe", vocab_size=400, num_threads=1), tmp / "corpus", tmp / "tok")
    build_shards(tmp / "corpus", tmp / "tok", tmp / "shards", "uint16", 400, 3000, workers=1, unit_docs=8)
    return tmp


def _snapshot(folder: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(folder.iterdir())}


def _copy_corpus(built: Path, dest: Path) -> Path:
    shutil.copytree(built / "corpus", dest)
    return dest


def _rewrite_manifest(corpus: Path) -> None:
    """Make the manifest agree with edited split files (a corpus that fetch would have written)."""
    m = json.loads((corpus / "manifest.json").read_text())
    for split in ("train", "val"):
        m["splits"][split]["sha256"] = sha256_file(corpus / f"{split}.jsonl")
    (corpus / "manifest.json").write_text(json.dumps(m))


def test_binary_file_is_refused_and_latin1_keeps_its_letters(tmp_path, capfd):
    src = make_text_source(tmp_path / "src", 4)
    (src / "ruido.txt").write_bytes(os.urandom(200_000))
    data = data_config([{"name": "gen", "kind": "local", "path": str(src)}])
    with pytest.raises(DataError, match=r"ruido.txt: binary data \(\d+ NUL bytes"):
        build_corpus(data, "h", tmp_path / "raw", tmp_path / "c", None, workers=1)
    assert not (tmp_path / "c" / "train.jsonl").exists()
    (src / "ruido.txt").unlink()
    latin = "La República de los pueblos del norte, según él, está en la montaña pequeña. " * 12
    (src / "latin1.txt").write_bytes(latin.encode("latin-1"))
    build_corpus(data, "h", tmp_path / "raw", tmp_path / "c", None, workers=1)
    text = (tmp_path / "c" / "train.jsonl").read_text(encoding="utf-8") + (
        tmp_path / "c" / "val.jsonl"
    ).read_text(encoding="utf-8")
    assert "República" in text and "Repblica" not in text
    # The per-file count is in the output, not only in the manifest.
    assert re.search(r"latin1.txt: \d+ bytes were not UTF-8; read as cp12", capfd.readouterr().err)


def test_shard_refuses_a_corpus_changed_after_fetch_and_keeps_old_shards(built, tmp_path):
    corpus = _copy_corpus(built, tmp_path / "corpus")
    out = tmp_path / "shards"
    shutil.copytree(built / "shards", out)
    before = _snapshot(out)
    (corpus / "val.jsonl").write_text("")
    with pytest.raises(DataError, match=r"val.jsonl: does not match the corpus manifest"):
        build_shards(corpus, built / "tok", out, "uint16", 400, 3000, workers=1)
    assert _snapshot(out) == before


def test_failing_shard_keeps_the_previous_good_shards(built, tmp_path):
    corpus = _copy_corpus(built, tmp_path / "corpus")
    lines = (corpus / "train.jsonl").read_text().splitlines()
    bad = 2 * len(lines) // 3
    lines.insert(bad, "{not json")
    (corpus / "train.jsonl").write_text("\n".join(lines) + "\n")
    _rewrite_manifest(corpus)
    out = tmp_path / "shards"
    shutil.copytree(built / "shards", out)
    before = _snapshot(out)
    with pytest.raises(DataError, match=rf"train.jsonl:{bad + 1}: not a corpus line"):
        build_shards(corpus, built / "tok", out, "uint16", 400, 3000, workers=2, unit_docs=8)
    assert _snapshot(out) == before


def test_corrupt_tokenizer_model_is_a_one_line_error(built, tmp_path):
    tok = tmp_path / "tok"
    shutil.copytree(built / "tok", tok)
    (tok / "tokenizer.model").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(DataError, match=r"tokenizer.model: size 80 does not match manifest\.json"):
        build_shards(built / "corpus", tok, tmp_path / "shards", "uint16", 400, 3000, workers=1)
    (tok / "manifest.json").unlink()  # a folder from before manifests: sentencepiece's own check
    with pytest.raises(DataError, match="tokenizer.model: not a valid sentencepiece model"):
        build_shards(built / "corpus", tok, tmp_path / "shards", "uint16", 400, 3000, workers=1)


def test_tokenize_keeps_its_output_when_the_input_is_missing(built, tmp_path):
    tok = tmp_path / "tok"
    shutil.copytree(built / "tok", tok)
    before = _snapshot(tok)
    with pytest.raises(DataError, match="train.jsonl: not found"):
        build_tokenizer(TokenizerConfig(type="bpe", vocab_size=400, num_threads=1), tmp_path / "nada", tok)
    assert _snapshot(tok) == before


KILL_AFTER = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {src!r})
from enlace.data import {module} as m
cls = getattr(m, {cls!r})
orig, n = cls._one, [0]
def one(self, *a):
    orig(self, *a)
    n[0] += 1
    if n[0] == {after}:
        os.kill(os.getpid(), signal.SIGKILL)  # a kill between two finished files
cls._one = one
"""


def _killed(script: str, log: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), ENLACE_NO_PROGRESS="1")
    with open(log, "w") as f:
        # Own session: the helper processes of datatrove's executor (a multiprocess Manager) outlive a
        # SIGKILL of their parent; the group is ended below.
        p = subprocess.Popen(
            [sys.executable, "-c", script], env=env, stdout=f, stderr=f, start_new_session=True
        )
        try:
            rc = p.wait(timeout=300)
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert rc == -9, log.read_text()[-2000:]


def test_killed_shard_resumes_its_units_and_ends_identical(built, tmp_path, capfd):
    out = tmp_path / "shards"
    shutil.copytree(built / "shards", out)
    before = _snapshot(out)
    head = textwrap.dedent(
        KILL_AFTER.format(src=str(ROOT / "src"), module="shard", cls="EncodeUnits", after=3)
    )
    call = (
        f"m.build_shards(Path({str(built / 'corpus')!r}), Path({str(built / 'tok')!r}), Path({str(out)!r}), "
        "'uint16', 400, 3000, workers=1, unit_docs=8)"
    )
    _killed(head + call, tmp_path / "killed.log")
    assert _snapshot(out) == before  # the old shards survive the kill
    units = sorted((tmp_path / ".shards.partial" / "units").glob("*.json"))
    assert len(units) == 3
    build_shards(built / "corpus", built / "tok", out, "uint16", 400, 3000, workers=2, unit_docs=8)
    assert "resuming: 3 of" in capfd.readouterr().err
    assert _snapshot(out) == before  # byte-identical to the uninterrupted run
    assert not (tmp_path / ".shards.partial").exists()


def test_unit_left_bad_by_a_power_loss_is_encoded_again(built, tmp_path, capfd):
    """Unit files are not fsynced: a power loss can leave a finished unit's tokens zeroed or truncated.
    The resume checks each against the sha256 in its counts file and encodes the bad ones again."""
    out = tmp_path / "shards"
    head = textwrap.dedent(
        KILL_AFTER.format(src=str(ROOT / "src"), module="shard", cls="EncodeUnits", after=3)
    )
    call = (
        f"m.build_shards(Path({str(built / 'corpus')!r}), Path({str(built / 'tok')!r}), Path({str(out)!r}), "
        "'uint16', 400, 3000, workers=1, unit_docs=8)"
    )
    _killed(head + call, tmp_path / "killed.log")
    units = tmp_path / ".shards.partial" / "units"
    bins = sorted(units.glob("*.bin"))
    assert len(bins) == 3
    bins[0].write_bytes(bytes(bins[0].stat().st_size))  # zeroed, as after a crash of the machine
    bins[1].write_bytes(bins[1].read_bytes()[:10])  # truncated
    build_shards(built / "corpus", built / "tok", out, "uint16", 400, 3000, workers=1, unit_docs=8)
    assert "resuming: 1 of" in capfd.readouterr().err
    assert _snapshot(out) == _snapshot(built / "shards")


def test_killed_fetch_resumes_per_file_and_ends_identical(tmp_path, capfd):
    src = make_text_source(tmp_path / "src", 12)
    data = data_config([{"name": "gen", "kind": "local", "path": str(src)}])
    straight = build_corpus(data, "h", tmp_path / "raw0", tmp_path / "c0", None, workers=1)
    head = textwrap.dedent(
        KILL_AFTER.format(src=str(ROOT / "src"), module="pipeline_steps", cls="ExtractClean", after=5)
    )
    call = (
        "from enlace.config.data import DataConfig\nfrom enlace.data.corpus import build_corpus\n"
        f"d = DataConfig.model_validate_json({data.model_dump_json()!r})\n"
        f"build_corpus(d, 'h', Path({str(tmp_path / 'raw')!r}), Path({str(tmp_path / 'c')!r}), None, workers=1)"
    )
    _killed(head + call, tmp_path / "killed.log")
    done = sorted((tmp_path / "raw" / ".work" / "docs").rglob("*.json"))
    assert len(done) == 5
    stamps = {p: p.stat().st_mtime_ns for p in done}
    resumed = build_corpus(data, "h", tmp_path / "raw", tmp_path / "c", None, workers=2)
    assert {p: p.stat().st_mtime_ns for p in done} == stamps  # finished files were not redone
    assert resumed == straight
    for name in ("train.jsonl", "val.jsonl", "manifest.json"):
        assert (tmp_path / "c" / name).read_bytes() == (tmp_path / "c0" / name).read_bytes()
