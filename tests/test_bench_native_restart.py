"""The serving table's llama.cpp peer when the native llama-server dies at load: on 2 cores of an Intel Xeon with
AMX, the native build's repacked Q8_0 weights crash it with SIGSEGV. The benchmark starts it again with
--no-repack and says so in the table, and still stops on any other failure. A stand-in `llama-server` (below)
crashes, or serves /health, as the real one did there."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from bench.bench_llamacpp_serve import NativeCrash, Sizes, start_native

STAND_IN = """#!{python}
import http.server, os, signal, sys
args = sys.argv[1:]
if {crash_when} and "--no-repack" not in args:
    os.kill(os.getpid(), signal.SIGSEGV)
if {fail}:
    sys.exit(3)
port = int(args[args.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *a):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def stand_in(tmp_path: Path, crash_when: bool, fail: bool = False) -> Path:
    bins = tmp_path / "bin"
    bins.mkdir()
    path = bins / "llama-server"
    path.write_text(STAND_IN.format(python=sys.executable, crash_when=crash_when, fail=fail))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return bins


def test_a_crash_at_load_starts_llama_server_again_without_repacking(tmp_path):
    server, note = start_native(
        stand_in(tmp_path, crash_when=True), tmp_path / "m.gguf", Sizes(), dict(os.environ)
    )
    try:
        assert "--no-repack" in server.cmd and server.proc.poll() is None
        assert note == "--no-repack (with weight repacking it died with SIGSEGV on this CPU)"
    finally:
        server.stop()


def test_a_server_that_starts_is_started_as_a_user_would(tmp_path):
    server, note = start_native(
        stand_in(tmp_path, crash_when=False), tmp_path / "m.gguf", Sizes(), dict(os.environ)
    )
    try:
        assert note == "" and "--no-repack" not in server.cmd
    finally:
        server.stop()


def test_a_failure_that_is_not_a_crash_still_stops_the_benchmark(tmp_path):
    with pytest.raises(SystemExit, match="exited with 3") as raised:
        start_native(
            stand_in(tmp_path, crash_when=False, fail=True), tmp_path / "m.gguf", Sizes(), dict(os.environ)
        )
    assert not isinstance(raised.value, NativeCrash)
