"""The data-budget preflight: planned tokens against the tokens in the shards (or an estimate)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from enlace.cli import main
from enlace.config import load_config
from enlace.data.budget import check_budget
from enlace.errors import DataError

ROOT = Path(__file__).resolve().parents[1]


def _cfg(*overrides: str):
    return load_config(ROOT / "params.yaml", overrides=list(overrides))


def _shards(folder: Path, train_tokens: int) -> dict[str, Path]:
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"splits": {"train": {"tokens": train_tokens}}}))
    return {"shards": folder, "corpus": folder / "nada", "tokenizer": folder / "nada"}


def test_epochs_from_the_shards_and_the_error_names_both_numbers_and_the_keys(tmp_path):
    # cpu-small plans 1100 steps x 16 x 256 = 4,505,600 tokens.
    cfg = _cfg()
    ok = check_budget(cfg, require_data=True, **_shards(tmp_path / "a", 2_000_000))
    assert ok.planned == 4_505_600 and ok.exact and ok.epochs == pytest.approx(2.2528)
    with pytest.raises(DataError) as e:
        check_budget(cfg, require_data=True, **_shards(tmp_path / "b", 400_000))
    msg = str(e.value)
    assert "4,505,600 tokens" in msg and "400,000 training tokens" in msg and "11.3 epochs" in msg
    for key in ("train.max_steps", "train.global_batch_size", "model.seq_len", "data.max_epochs"):
        assert key in msg
    # The limit is a setting.
    loose = _cfg("data.max_epochs=15")
    assert check_budget(loose, require_data=True, **_shards(tmp_path / "c", 400_000)).epochs < 15


def test_missing_shards_tell_the_user_to_build_them_and_config_check_estimates(tmp_path):
    where = {"shards": tmp_path / "s", "corpus": tmp_path / "c", "tokenizer": tmp_path / "t"}
    with pytest.raises(DataError, match="no shards in .*build them first"):
        check_budget(_cfg(), require_data=True, **where)
    # Before any data exists, the data config's estimate is used (es-debian: 4.3 M tokens).
    b = check_budget(_cfg(), **where)
    assert not b.exact and b.available == 4_300_000 and "about" in b.line()
    # A corpus without shards: characters / chars-per-token.
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "manifest.json").write_text(json.dumps({"splits": {"train": {"chars": 8_000_000}}}))
    assert check_budget(_cfg(), **where).available == 2_000_000


def test_config_check_refuses_a_plan_that_loops_over_a_tiny_corpus(tmp_path, monkeypatch, capsys):
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    # The GPU plan (2.6 B tokens) on the offline corpus (about 5 M tokens): hundreds of epochs.
    args = ["config", "check", "--hardware", "rtx2060", "--model", "tiny-50m", "--train", "tiny-50m-2060"]
    assert main([*args, "--data", "es-debian-full"]) == 2
    err = capsys.readouterr().err
    assert "2,621,440,000 tokens" in err and "about 5,000,000" in err and "524.3 epochs" in err
    assert main(["config", "check"]) == 0
    assert "1.05 epochs" in capsys.readouterr().out  # 4,505,600 planned over about 4.3 M


def test_data_built_for_another_config_is_not_counted(tmp_path):
    # data/ holds es-debian's corpus and shards; checking another data config must not read them.
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "manifest.json").write_text(
        json.dumps({"name": "es-debian", "splits": {"train": {"chars": 4_000_000}}})
    )
    _shards(tmp_path / "s", 3_000_000)
    where = {"shards": tmp_path / "s", "corpus": tmp_path / "c", "tokenizer": tmp_path / "t"}
    assert check_budget(_cfg(), **where).available == 3_000_000  # es-debian's own shards count
    other = _cfg("data.name=another-corpus")
    b = check_budget(other, **where)
    assert not b.exact and b.available == other.data.estimated_tokens
    with pytest.raises(DataError, match="no shards"):
        check_budget(other, require_data=True, **where)
