"""Hugging Face sources through huggingface_hub against a local server: pin, lock, verify, refuse, resume."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil

import pytest
from hub_server import serve_hub

from enlace.config.data import DataConfig
from enlace.data.corpus import build_corpus
from enlace.errors import DataError

SPANISH = (
    "La ciudad de los muchos puentes es conocida por sus mercados y por la historia de su puerto. "
    "Los viajeros que llegan desde el norte cuentan que el río se desborda cada primavera."
)


def _word(i: int) -> str:
    return "".join("bcdfglmnprst"[int(c)] for c in str(i)) + "a"


def _jsonl_gz(rows: list[dict[str, str]]) -> bytes:
    return gzip.compress("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode(), mtime=0)


def _rows(n: int, tag: str = "") -> list[dict[str, str]]:
    return [
        {"id": str(i), "text": f"{SPANISH} Documento {_word(i)} {tag} de la colección."} for i in range(n)
    ]


def _config(hub, files, revision="main", max_files=None, column="text", extractor="jsonl") -> DataConfig:
    return DataConfig.model_validate(
        {
            "name": "hf-test",
            "val_fraction": 0.2,
            "cleaning": {"min_doc_chars": 50, "near_dedup": False},
            "sources": [
                {
                    "name": "wiki",
                    "kind": "hf",
                    "repo": "org/wiki",
                    "revision": revision,
                    "files": files,
                    "max_files": max_files,
                    "endpoint": hub.url,
                    "text_column": column,
                    "extractor": extractor,
                    "timeout_s": 5,
                }
            ],
        }
    )


@pytest.fixture()
def hub():
    with serve_hub() as h:
        yield h


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def test_main_is_resolved_locked_verified_and_an_upstream_change_refused(hub, tmp_path):
    parts = {f"data/part-{i}.jsonl.gz": _jsonl_gz(_rows(15, _word(100 + i))) for i in range(3)}
    commit = hub.publish("org/wiki", {**parts, "README.md": b"# wiki\n"})
    lock = tmp_path / "hf-test.lock.json"
    data = _config(hub, ["data/*.jsonl.gz"], max_files=2)
    m = build_corpus(data, "h", tmp_path / "raw", tmp_path / "c1", lock, workers=1)
    entry = json.loads(lock.read_text())["sources"]["wiki"]
    assert entry["commit"] == commit and entry["revision"] == "main"
    # max_files takes the first two paths in sorted order; each with its size and sha256.
    assert entry["files"] == {
        p: {"size": len(parts[p]), "sha256": _sha(parts[p])}
        for p in ("data/part-0.jsonl.gz", "data/part-1.jsonl.gz")
    }
    assert m["total"]["docs"] == 30
    # main moves on upstream: the lock keeps the run on its commit, and the files verify.
    hub.publish("org/wiki", {"data/part-0.jsonl.gz": _jsonl_gz(_rows(3, "nuevo"))})
    shutil.rmtree(tmp_path / "raw")
    build_corpus(data, "h", tmp_path / "raw", tmp_path / "c2", lock, workers=1)
    assert (tmp_path / "c1" / "train.jsonl").read_bytes() == (tmp_path / "c2" / "train.jsonl").read_bytes()
    # The locked commit now serves other bytes (history rewritten): refused, naming both hashes.
    hub.repos["org/wiki"]["commits"][commit]["data/part-1.jsonl.gz"] = _jsonl_gz(_rows(4, "otro"))
    shutil.rmtree(tmp_path / "raw")
    with pytest.raises(DataError, match=f"upstream changed.*{_sha(parts['data/part-1.jsonl.gz'])}"):
        build_corpus(data, "h", tmp_path / "raw", tmp_path / "c3", lock, workers=1)
    assert json.loads(lock.read_text())["sources"]["wiki"] == entry  # the lock is not rewritten


def test_missing_revision_repo_and_files_are_one_line_errors(hub, tmp_path):
    hub.publish("org/wiki", {"data/a.jsonl.gz": _jsonl_gz(_rows(3))})
    with pytest.raises(DataError, match="org/wiki@v9.*revision not found"):
        build_corpus(_config(hub, ["data/*"], revision="v9"), "h", tmp_path / "raw", tmp_path / "c", None)
    with pytest.raises(DataError, match="no file of commit .* matches"):
        build_corpus(_config(hub, ["nada/*"]), "h", tmp_path / "raw", tmp_path / "c", None)


def test_interrupted_download_resumes_with_a_range_request(hub, tmp_path, monkeypatch):
    import huggingface_hub.constants

    # Small chunks, so that the bytes received before the cut reach the disk (the default is 10 MB).
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 256)
    blob = _jsonl_gz(_rows(400, "largo"))
    hub.publish("org/wiki", {"data/big.jsonl.gz": blob})
    hub.drop_after["data/big.jsonl.gz"] = len(blob) // 3
    m = build_corpus(_config(hub, ["data/*"]), "h", tmp_path / "raw", tmp_path / "c", tmp_path / "l.json")
    assert m["total"]["docs"] == 400
    gets = [h for h in hub.hits if h[0] == "GET" and h[1].endswith("big.jsonl.gz")]
    assert gets[0][2] is None and gets[-1][2] == f"bytes={len(blob) // 3 // 256 * 256}-"


def test_parquet_text_column_and_a_wrong_column(hub, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {"id": [str(i) for i in range(12)], "text": [f"{SPANISH} Parte {_word(i)}." for i in range(12)]}
    )
    buf = io.BytesIO()
    pq.write_table(table, buf)
    hub.publish("org/wiki", {"es/train-0.parquet": buf.getvalue()})
    data = _config(hub, ["es/*.parquet"], extractor="parquet")
    assert build_corpus(data, "h", tmp_path / "raw", tmp_path / "c", None)["total"]["docs"] == 12
    bad = _config(hub, ["es/*.parquet"], extractor="parquet", column="contenido")
    with pytest.raises(DataError, match="'contenido'.*id, text"):
        build_corpus(bad, "h", tmp_path / "raw", tmp_path / "c2", None)
