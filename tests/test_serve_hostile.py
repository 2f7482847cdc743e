"""`enlace serve` against hostile requests: other origins, other Hosts, other body types, bodies built to
cost the server time (deep nesting, 30,000 messages, a body that never ends), fields it does not act on.

One real server process on 127.0.0.1 (a tiny random model that all but never ends its answer, an API key,
one CORS origin allowed, short deadlines); each crafted request must get its 4xx with OpenAI's error body,
and the server must stay healthy. The engine's own guarantees (the stop buffer at EOS, generic errors,
"degraded" health) are checked in-process with a model that fails on purpose.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest
import torch
from helpers import make_folder
from serve_helpers import Server, quiet_eos

from enlace.cli import main

KEY = "sk-hostile"
ALLOWED = "http://allowed.example:3000"
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hola"}]
OK_BODY = {"messages": MSG, "max_tokens": 2}
LONG = 4000


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    return quiet_eos(make_folder(root / "base", tied=False, max_position_embeddings=LONG + 512))


@pytest.fixture(scope="module")
def server(folder):
    args = ["--model", str(folder), "--slots", "1", "--queue", "1", "--max-tokens", str(LONG)]
    args += ["--body-timeout", "1", "--queue-timeout", "1", "--cors-origin", ALLOWED]
    s = Server(args, cwd=folder.parent, log=folder.parent / "server.log", api_key=KEY)
    yield s
    s.stop()


def raw_post(
    path: str, body: bytes, headers: str = "Content-Type: application/json\r\n", host: str = "127.0.0.1"
):
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n{headers}"
    return head.encode() + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body


def chat(**fields) -> dict:
    return {**OK_BODY, **fields}


def msgs(n: int, text: str = "a") -> dict:
    return {"messages": [{"role": "user", "content": text}] * n, "max_tokens": 2}


def nested(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


EVIL = {"Origin": "http://evil.example"}
JSON_CT = {"Content-Type": "application/json"}

# (what, method, path, headers, body, status, code); a dict body is sent as JSON.
CASES = [
    # Host: only the server's own names (any port), case-insensitive.
    ("Host evil.example", "GET", "/v1/models", {"Host": "evil.example"}, None, 421, "invalid_host"),
    ("Host evil.example with a port", "GET", "/v1/models", {"Host": "evil.example:8080"}, None, 421, "invalid_host"),
    ("Host a rebinding name", "POST", CHAT, {"Host": "127.0.0.1.evil.example"}, OK_BODY, 421, "invalid_host"),
    ("Host evil on health", "GET", "/health", {"Host": "evil.example"}, None, 421, "invalid_host"),
    ("Host evil on the page", "GET", "/", {"Host": "evil.example"}, None, 421, "invalid_host"),
    ("Host with a path", "GET", "/v1/models", {"Host": "127.0.0.1/x"}, None, 421, "invalid_host"),
    ("Host localhost", "GET", "/v1/models", {"Host": "localhost"}, None, 200, None),
    ("Host LOCALHOST:1", "GET", "/v1/models", {"Host": "LOCALHOST:1"}, None, 200, None),
    ("Host [::1] with a port", "GET", "/v1/models", {"Host": "[::1]:8080"}, None, 200, None),
    # Origin: the server's own, or one --cors-origin allows.
    ("Origin evil on a POST", "POST", CHAT, EVIL, OK_BODY, 403, "forbidden_origin"),
    ("Origin evil on a GET", "GET", "/v1/models", EVIL, None, 403, "forbidden_origin"),
    ("Origin evil on health", "GET", "/health", EVIL, None, 403, "forbidden_origin"),
    ("Origin null", "POST", CHAT, {"Origin": "null"}, OK_BODY, 403, "forbidden_origin"),
    ("Origin on another port", "POST", CHAT, {"Origin": "http://127.0.0.1:1"}, OK_BODY, 403, "forbidden_origin"),
    ("cross-origin text/plain POST", "POST", CHAT, {**EVIL, "Content-Type": "text/plain"},
     json.dumps(OK_BODY).encode(), 403, "forbidden_origin"),
    ("preflight from evil", "OPTIONS", CHAT, {**EVIL, "Access-Control-Request-Method": "POST"}, None, 403,
     "forbidden_origin"),
    ("Origin allowed by --cors-origin", "POST", CHAT, {"Origin": ALLOWED}, OK_BODY, 200, None),
    # The body's type.
    ("text/plain POST", "POST", CHAT, {"Content-Type": "text/plain"}, json.dumps(OK_BODY).encode(), 415,
     "unsupported_media_type"),
    ("form POST", "POST", CHAT, {"Content-Type": "application/x-www-form-urlencoded"}, b"messages=x", 415,
     "unsupported_media_type"),
    ("multipart POST", "POST", CHAT, {"Content-Type": "multipart/form-data; boundary=x"}, b"--x--", 415,
     "unsupported_media_type"),
    ("no Content-Type", "POST", CHAT, {}, json.dumps(OK_BODY).encode(), 415, "unsupported_media_type"),
    ("JSON in latin-1", "POST", CHAT, {"Content-Type": "application/json; charset=latin-1"},
     json.dumps(OK_BODY).encode(), 415, "unsupported_media_type"),
    ("JSON with its charset", "POST", CHAT, {"Content-Type": "application/json; charset=UTF-8"},
     json.dumps(OK_BODY).encode(), 200, None),
    ("text/plain to an unknown path", "POST", "/v1/embeddings", {"Content-Type": "text/plain"}, b"x", 415,
     "unsupported_media_type"),
    # The API key.
    ("no key", "GET", "/v1/models", {"Authorization": ""}, None, 401, "invalid_api_key"),
    ("wrong key", "POST", CHAT, {"Authorization": "Bearer nope"}, OK_BODY, 401, "invalid_api_key"),
    # Bodies that cost time to take apart.
    ("100,000 brackets deep", "POST", CHAT, JSON_CT, nested(100_000), 400, "too_deep"),
    ("12 levels deep", "POST", CHAT, JSON_CT, nested(12), 400, "too_deep"),
    ("an integer of 5,000 digits", "POST", CHAT, JSON_CT, b'{"max_tokens": ' + b"9" * 5000 + b"}", 400, "invalid_json"),
    ("lone surrogate in content", "POST", CHAT, JSON_CT,
     b'{"messages": [{"role": "user", "content": "a\\udc80"}]}', 400, "invalid_unicode"),
    ("lone surrogate in a key", "POST", CHAT, JSON_CT, b'{"messages": [], "\\ud800": 1}', 400, "invalid_unicode"),
    ("body too large", "POST", CHAT, JSON_CT, b'{"x": "' + b"a" * (1 << 20) + b'"}', 413, "body_too_large"),
    ("1,025 messages", "POST", CHAT, None, msgs(1025), 400, "invalid_value"),
    ("too many characters", "POST", CHAT, None, msgs(2, "a" * 140_000), 400, "invalid_value"),
    ("too many text parts", "POST", CHAT, None,
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 257}]}, 400, "invalid_value"),
    ("65,537 token ids", "POST", "/v1/completions", None, {"prompt": [1] * 65_537}, 400, "invalid_value"),
    # Every string has its bound.
    ("a single stop string of 65 characters", "POST", CHAT, None, chat(stop="x" * 65), 400, "invalid_value"),
    ("a listed stop string of 65 characters", "POST", CHAT, None, chat(stop=["x" * 65]), 400, "invalid_value"),
    ("a model name of 300 characters", "POST", CHAT, None, chat(model="m" * 300), 400, "invalid_value"),
    ("a user of 300 characters", "POST", CHAT, None, chat(user="u" * 300), 400, "invalid_value"),
    ("top_k past any vocabulary", "POST", CHAT, None, chat(top_k=2**40), 400, "invalid_value"),
    ("max_tokens of 10**30", "POST", CHAT, None, chat(max_tokens=10**30), 400, "invalid_value"),
    # Fields the server does not act on are named, not ignored.
    ("an unknown field", "POST", CHAT, None, chat(frobnicate=1), 400, "unsupported_parameter"),
    ("a non-empty logit_bias", "POST", CHAT, None, chat(logit_bias={"50": 10}), 400, "unsupported_parameter"),
    ("response_format json_object", "POST", CHAT, None, chat(response_format={"type": "json_object"}), 400,
     "unsupported_parameter"),
    ("tools", "POST", CHAT, None, chat(tools=[{"type": "function"}]), 400, "invalid_value"),
    ("tool_choice auto", "POST", CHAT, None, chat(tool_choice="auto"), 400, "unsupported_parameter"),
    ("functions", "POST", CHAT, None, chat(functions=[]), 400, "unsupported_parameter"),
    ("a message's name", "POST", CHAT, None, chat(messages=[{"role": "user", "content": "a", "name": "x"}]), 400,
     "unsupported_parameter"),
    ("an unknown stream option", "POST", CHAT, None, chat(stream_options={"x": 1}), 400, "unsupported_parameter"),
    ("echo on a completion", "POST", "/v1/completions", None, {"prompt": "a", "echo": True}, 400, "invalid_value"),
    # Empty or null forms of them ask for nothing: accepted.
    ("an empty logit_bias", "POST", CHAT, None, chat(logit_bias={}), 200, None),
    ("response_format text", "POST", CHAT, None, chat(response_format={"type": "text"}), 200, None),
    ("tool_choice none, tools empty", "POST", CHAT, None, chat(tool_choice="none", tools=[]), 200, None),
    ("an earlier answer's null fields", "POST", CHAT, None,
     chat(messages=[*MSG, {"role": "assistant", "content": "b", "refusal": None, "tool_calls": None}, *MSG]), 200,
     None),
]  # fmt: skip


@pytest.mark.parametrize("what,method,path,headers,body,status,code", CASES, ids=[c[0] for c in CASES])
def test_hostile_request_is_refused(server, what, method, path, headers, body, status, code):
    got, answer_headers, raw = server.request(method, path, body=body, headers=headers)
    assert got == status, raw[:500]
    if status >= 400:
        assert answer_headers["content-type"] == "application/json"
        err = json.loads(raw)["error"]
        assert err["code"] == code and "\n" not in err["message"], err
    assert server.health()["status"] == "ok"


def test_the_key_covers_health_details(server):
    status, _, body = server.request("GET", "/health", auth=False)
    assert status == 200 and json.loads(body) == {"status": "ok"}
    assert {"slots", "failed", "model"} <= set(server.health())


def test_cors_answers_the_allowed_origin_only(server):
    pre = {"Origin": ALLOWED, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
    status, headers, _ = server.request("OPTIONS", CHAT, headers=pre, auth=False)
    assert status == 200 and headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in headers["access-control-allow-methods"]
    status, headers, _ = server.request("POST", CHAT, body=OK_BODY, headers={"Origin": ALLOWED})
    assert status == 200 and headers["access-control-allow-origin"] == ALLOWED
    status, headers, _ = server.request("POST", CHAT, body=OK_BODY)  # no Origin: no CORS headers
    assert status == 200 and "access-control-allow-origin" not in headers


def test_no_host_header_is_refused(server):
    status, _ = server.raw(b"GET /v1/models HTTP/1.0\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n")
    assert status == 400


def test_a_chunked_body_too_large_is_refused(server):
    chunk = b"a" * 65536
    body = b'{"x": "' + chunk * 17 + b'"}'
    pieces = b"".join(f"{len(body[i : i + 65536]):x}\r\n".encode() + body[i : i + 65536] + b"\r\n"
                      for i in range(0, len(body), 65536))  # fmt: skip
    head = f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
    head += "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    status, answer = server.raw(head.encode() + pieces + b"0\r\n\r\n")
    assert status == 413 and b"body_too_large" in answer


def test_a_slow_body_meets_its_deadline(server):
    body = json.dumps(OK_BODY).encode()
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(raw_post(CHAT, body)[: -len(body) // 2])  # half the body, then nothing
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout" in answer
    assert time.monotonic() - t0 < 10  # the deadline is 1 s
    assert server.health()["status"] == "ok"


def test_thirty_thousand_messages_are_refused_fast_and_health_answers_meanwhile(server):
    body = json.dumps(msgs(30_000)).encode()
    assert len(body) > 900_000
    result: dict = {}
    sent = threading.Event()

    def send() -> None:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            s.sendall(raw_post(CHAT, body)[:-1])
            sent.set()
            t0 = time.monotonic()
            s.sendall(body[-1:])  # the server has all but the last byte: its work starts now
            answer = s.recv(65536)
            result["seconds"] = time.monotonic() - t0
            while chunk := s.recv(65536):
                answer += chunk
            result["answer"] = answer

    sender = threading.Thread(target=send)
    sender.start()
    sent.wait(30)
    health = []
    while sender.is_alive():  # /health from another client, all the while the body is taken apart
        t0 = time.monotonic()
        server.request("GET", "/health", auth=False, timeout=5)
        health.append(time.monotonic() - t0)
    sender.join()
    assert result["answer"].startswith(b"HTTP/1.1 400") and b"at most 1024" in result["answer"]
    assert result["seconds"] < 1, result["seconds"]
    assert health and max(health) < 0.1, health
    print(f"refused in {result['seconds']:.3f} s; /health {len(health)} times, at most {max(health):.3f} s")


def test_waiting_too_long_for_a_slot_is_a_503(server):
    server.wait_for(lambda h: h["busy"] == 0 and h["queued"] == 0, what="idle server")
    conn, _ = server.open_stream(CHAT, {"messages": MSG, "max_tokens": LONG, "ignore_eos": True})
    try:
        server.wait_for(lambda h: h["busy"] == 1, what="the slot taken")
        t0 = time.monotonic()
        status, headers, raw = server.request("POST", CHAT, body=OK_BODY)
        assert status == 503 and headers["retry-after"] == "5"
        assert json.loads(raw)["error"]["code"] == "queue_timeout" and 0.9 < time.monotonic() - t0 < 10
    finally:
        conn.sock.close()
        conn.close()
    h = server.wait_for(lambda h: h["busy"] == 0 and h["queued"] == 0, what="every place given back")
    assert h["status"] == "ok"


def test_a_public_address_needs_a_key_or_no_api_key(tmp_path, capsys):
    args = ["serve", "--model", str(tmp_path / "nope"), "--host", "0.0.0.0"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--host 0.0.0.0" in err and "--no-api-key" in err and len(err.strip().splitlines()) == 1
    assert main([*args, "--no-api-key", "--api-key", "k"]) == 2
    assert "pass one of them" in capsys.readouterr().err
    assert main([*args, "--no-api-key"]) == 2  # past the key check: the model folder is what is missing
    assert "--model" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path), "--cors-origin", "evil.example"]) == 2
    assert "--cors-origin evil.example" in capsys.readouterr().err


# ---- in-process: the engine with a test double of the model ----


class _Failing(torch.nn.Module):
    """A model whose every forward pass raises, with a detail no client may see."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.cfg = model, model.cfg

    def forward(self, *args, **kwargs):
        raise RuntimeError("secret detail: /srv/weights at 0xdeadbeef")

    hidden_states = forward  # a prompt's chunk goes through it (generate.prompt_logits)


class _Letters:
    """Decodes a fixed token sequence to the letters given (a test double of the tokenizer's stream)."""

    def __init__(self, letters: dict[int, str]):
        self.letters = letters

    def push(self, token_id: int) -> str:
        return self.letters.get(token_id, "?")


def _served(folder, **changes):
    import dataclasses

    from enlace.serve.loader import load_served

    served = load_served(str(folder), None, default=None, weights="fp32")
    return dataclasses.replace(served, **changes)


def test_text_held_back_for_a_stop_string_is_sent_when_the_model_ends(folder):
    import asyncio

    from enlace.generate import generate
    from enlace.serve.engine import Engine, GenRequest

    served = _served(folder)
    prompt = served.encode_text("Había una vez")
    tokens = list(generate(served.model, prompt, 40, temperature=0.0, eos_ids=()))
    end = next(t for t in tokens if t != tokens[0])  # the model's second distinct token: its end here
    before = tokens.index(end)
    # Each token before the end reads "B", and "B" may start the stop string "BZ": the last one is held back
    # until the next token, which is the end.
    served = _served(folder, eos_ids=(end,), stream=lambda _p: _Letters({tokens[0]: "B"}))

    async def run() -> tuple[str, str]:
        engine = Engine(served, slots=1, queue=0)
        req = GenRequest(prompt_ids=prompt, max_tokens=40, temperature=0.0, top_p=1.0, top_k=0,
                         repetition_penalty=1.0, no_repeat_ngram=0, seed=0, stop=["BZ"])  # fmt: skip
        job = engine.admit(req)
        await engine.start(job, timeout=10)
        events = [ev async for ev in engine.events(job)]
        engine.close()
        return "".join(e.text for e in events if e.kind == "text"), events[-1].finish_reason

    text, finish = asyncio.run(run())
    assert (text, finish) == ("B" * before, "stop")


def test_failures_are_generic_to_clients_logged_and_turn_health_degraded(folder, caplog):
    from starlette.testclient import TestClient

    from enlace.serve.api import create_app
    from enlace.serve.engine import DEGRADED_AFTER, Engine

    served = _served(folder)
    served = _served(folder, model=_Failing(served.model))
    app = create_app(Engine(served, slots=1, queue=1))
    with (
        caplog.at_level(logging.ERROR, logger="enlace.serve"),
        TestClient(app, base_url="http://127.0.0.1") as c,
    ):
        assert c.get("/health").json()["status"] == "ok"
        for _ in range(DEGRADED_AFTER):
            r = c.post(CHAT, json=OK_BODY)
            assert r.status_code == 500 and "secret" not in r.text, r.text
            assert r.json()["error"]["type"] == "server_error"
            streamed = c.post(CHAT, json={**OK_BODY, "stream": True}).text
            assert "server_error" in streamed and "secret" not in streamed and streamed.endswith("[DONE]\n\n")
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "degraded"
        assert h.json()["consecutive_failures"] == 2 * DEGRADED_AFTER
    assert "secret detail" in caplog.text  # the details are in the server's log
