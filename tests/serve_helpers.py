"""Builders for the server tests (no tests here): a real `enlace serve` process on a free port of 127.0.0.1,
and raw HTTP requests through the standard library (for bytes no client library would send)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from helpers import free_port

ROOT = Path(__file__).resolve().parents[1]


class Server:
    """`enlace serve ARGS` in a child process; stopped (SIGTERM, then SIGKILL) by stop()."""

    def __init__(self, args: list[str], cwd: Path, log: Path, api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = log
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        env.pop("ENLACE_API_KEY", None)
        cmd = [sys.executable, "-m", "enlace.cli", "serve", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self._log = open(log, "w", encoding="utf-8")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300  # loading torch and the model on a busy 2-core machine: a ceiling
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"enlace serve exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if self.health()["status"] == "ok":
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                text = self.log_text()  # before stop() closes the log
                self.stop()
                raise AssertionError(f"enlace serve did not come up in time:\n{text}")
            time.sleep(0.3)

    def log_text(self) -> str:
        self._log.flush()
        return self.log.read_text(encoding="utf-8", errors="replace")

    def request(
        self, method: str, path: str, body: bytes | dict | None = None, headers: dict[str, str] | None = None,
        auth: bool = True, timeout: float = 60,
    ) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        h = dict(headers or {})
        if auth and self.api_key:
            h.setdefault("Authorization", f"Bearer {self.api_key}")
        if isinstance(body, dict):
            body = json.dumps(body).encode()
            h.setdefault("Content-Type", "application/json")
        try:
            conn.request(method, path, body=body, headers=h)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def health(self) -> dict[str, Any]:
        """/health's details (they need the key, when the server has one)."""
        status, _, body = self.request("GET", "/health", timeout=10)
        assert status == 200, body
        return json.loads(body)

    def raw(self, data: bytes, timeout: float = 30) -> tuple[int, bytes]:
        """Send bytes as they are (a request no client library would make); the status and the whole answer."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        return int(answer.split(b" ", 2)[1]), answer

    def send_stream(self, path: str, body: dict) -> http.client.HTTPConnection:
        """A streaming request sent, its answer not awaited (it begins once the request has a slot)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        conn.request("POST", path, body=json.dumps({**body, "stream": True}).encode(), headers=h)
        return conn

    def open_stream(
        self, path: str, body: dict
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """A streaming request left open: read events with next_event(), hang up with conn.close()."""
        conn = self.send_stream(path, body)
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        return conn, resp

    def wait_for(self, check, timeout: float = 120, what: str = "condition") -> dict[str, Any]:
        """Poll /health until check(it) holds; the timeout is a ceiling that only a broken server reaches, and a
        /health call that a busy machine answers late is asked again, not counted as a failure."""
        deadline = time.monotonic() + timeout
        h: dict[str, Any] | str = "no answer yet"
        while True:
            try:
                h = self.health()
                if check(h):
                    return h
            except OSError as e:  # a timed-out or refused /health call: ask again until the deadline
                h = f"/health: {e!r}"
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not reached in {timeout} s: {h}\n{self.log_text()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def next_event(resp: http.client.HTTPResponse) -> Any:
    """The next server-sent event's data: a dict, or "[DONE]"."""
    while True:
        line = resp.readline()
        if not line:
            raise AssertionError("stream ended without [DONE]")
        line = line.decode("utf-8").strip()
        if line.startswith("data:"):
            data = line[5:].strip()
            return data if data == "[DONE]" else json.loads(data)


def quiet_eos(folder: Path, eos_ids: tuple[int, ...] = (2,)) -> Path:
    """Make a random test model (untied head) all but unable to end its answer: the stop tokens' logits are 0
    while the others are scaled up, so their probability is about 1e-6 per token. For tests that need an
    answer long enough to stop it by hand."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state = load_file(str(path))
    head = state["lm_head.weight"] * 30
    head[list(eos_ids)] = 0
    state["lm_head.weight"] = head.contiguous()
    save_file(state, str(path), metadata={"format": "pt"})
    return folder
