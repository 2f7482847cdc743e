"""Fetching: HTTP download (checksums, 404, resume) and .deb unpacking. Hugging Face: test_data_hub.py."""

from __future__ import annotations

import hashlib
import http.server
import shutil
import subprocess
import threading

import pytest

from enlace.config.data import DataConfig
from enlace.data.corpus import build_corpus
from enlace.data.download import download
from enlace.errors import DataError

SPANISH = (
    "La ciudad de los muchos puentes es conocida por sus mercados y por la historia de su puerto. "
    "Los viajeros que llegan desde el norte cuentan que el río se desborda cada primavera."
)


class _Handler(http.server.BaseHTTPRequestHandler):
    files: dict[str, bytes] = {}
    drop_first: set[str] = set()
    hits: list[tuple[str, str | None]] = []

    def log_message(self, *args: object) -> None:  # keep test output quiet
        pass

    def do_GET(self) -> None:  # noqa: N802
        rng = self.headers.get("Range")
        type(self).hits.append((self.path, rng))
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404, "Not Found")
            return
        start = 0
        if rng and rng.startswith("bytes="):
            start = int(rng[6:].split("-")[0])
            if start >= len(body):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(body)}")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        chunk = body[start:]
        self.send_header("Content-Length", str(len(chunk)))
        self.end_headers()
        if self.path in self.drop_first:
            # Send half, then drop the connection: the client must resume with a Range request.
            self.drop_first.discard(self.path)
            self.wfile.write(chunk[: len(chunk) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(chunk)


@pytest.fixture()
def server():
    _Handler.files, _Handler.drop_first, _Handler.hits = {}, set(), []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", _Handler
    httpd.shutdown()
    httpd.server_close()


def _word(i: int) -> str:
    """A distinct letters-only word per number (dedup ignores digits)."""
    return "".join("bcdfglmnprst"[int(c)] for c in str(i)) + "a"


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def test_checksum_mismatch_names_expected_and_actual(server, tmp_path):
    base, h = server
    h.files["/a.txt"] = b"hola mundo"
    wrong = "0" * 64
    with pytest.raises(DataError) as e:
        download(f"{base}/a.txt", tmp_path / "a.txt", wrong, timeout=5, retries=0)
    assert wrong in str(e.value) and _sha(b"hola mundo") in str(e.value)
    assert not (tmp_path / "a.txt").exists() and not (tmp_path / "a.txt.part").exists()


def test_404_is_an_error_without_retries(server, tmp_path):
    base, h = server
    with pytest.raises(DataError, match="404"):
        download(f"{base}/missing.bin", tmp_path / "m.bin", None, timeout=5, retries=3)
    assert len(h.hits) == 1
    assert not (tmp_path / "m.bin").exists()


def test_interrupted_download_resumes_with_range(server, tmp_path):
    base, h = server
    body = bytes(range(256)) * 4000
    h.files["/big.bin"] = body
    h.drop_first.add("/big.bin")
    got = download(f"{base}/big.bin", tmp_path / "big.bin", _sha(body), timeout=5, retries=3)
    assert got == _sha(body)
    assert (tmp_path / "big.bin").read_bytes() == body
    assert len(h.hits) == 2 and h.hits[0][1] is None and h.hits[1][1] == f"bytes={len(body) // 2}-"


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")
def test_deb_source_unpacks_a_tiny_package(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "DEBIAN" / "control").write_text(
        "Package: enlace-test\nVersion: 1.0\nArchitecture: all\nMaintainer: t <t@example.org>\nDescription: test\n"
    )
    docs = pkg / "usr/share/doc/enlace-test"
    docs.mkdir(parents=True)
    (docs / "guia.html").write_text(
        f"<html><head><title>x</title><script>var a = 1;</script></head><body><nav>Inicio Siguiente</nav>"
        f"<p>{SPANISH}</p><p>{SPANISH.upper()} Y otra frase más para el párrafo.</p></body></html>",
        encoding="utf-8",
    )
    raw = tmp_path / "raw" / "deb"
    raw.mkdir(parents=True)
    deb = raw / "enlace-test_1.0.deb"
    subprocess.run(
        ["dpkg-deb", "--build", "--root-owner-group", str(pkg), str(deb)], check=True, capture_output=True
    )
    data = DataConfig.model_validate(
        {
            "name": "deb-test",
            "val_fraction": 0.01,
            "cleaning": {"min_doc_chars": 50, "dedup": False},
            "sources": [
                {
                    "name": "tiny",
                    "kind": "deb",
                    "package": "enlace-test",
                    "version": "1.0",
                    "sha256": _sha(deb.read_bytes()),
                    "include": ["usr/share/doc/*.html"],
                }
            ],
        }
    )
    build_corpus(data, "h", tmp_path / "raw", tmp_path / "corpus", None, workers=1)
    text = (tmp_path / "corpus" / "train.jsonl").read_text(encoding="utf-8")
    assert "puentes" in text and "var a" not in text and "Siguiente" not in text
    # A pinned checksum that does not match is an error naming both values.
    bad = data.model_copy(update={"sources": [data.sources[0].model_copy(update={"sha256": "f" * 64})]})
    with pytest.raises(DataError, match="f" * 64):
        build_corpus(bad, "h", tmp_path / "raw", tmp_path / "corpus2", None, workers=1)
