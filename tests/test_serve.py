"""`enlace serve`: a real server process on 127.0.0.1, reached through the real `openai` client and raw HTTP.

The server serves the default assistant (no --model): the finetune layer's base model, here a tiny random
Llama, with the LoRA adapter a 3-step fine-tune wrote into the run folder. Its answers must be what ENLACE's
own generate() gives for the same prompt; every bad input gets a 4xx with OpenAI's error body and the server
goes on serving; a client that hangs up stops its generation; a full queue answers 429 at once.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from export_helpers import chat_rows, write_jsonl
from helpers import make_folder
from serve_helpers import ROOT, Server, next_event

from enlace.cli import main

KEY = "sk-test-enlace"
LAYER = "smollm2-es"  # a finetune layer in dolly format
LONG = 4000  # tokens a stream may run for; the tiny model needs several seconds for them


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    base = make_folder(root / "base", max_position_embeddings=4096)
    train = write_jsonl(root / "train.jsonl", chat_rows(8))
    val = write_jsonl(root / "val.jsonl", chat_rows(10)[8:])
    # The layer is named: another default layer (another base, another data format) must not change the test.
    args = ["finetune", "--params", str(ROOT / "params.yaml"), "--finetune", LAYER, "--model", str(base)]
    args += ["--data", str(train)]
    args += ["--val-data", str(val), "--steps", "3", "--batch", "2", "--max-len", "192", "--rank", "4"]
    args += ["--out", str(root / "runs" / "finetune"), "--quiet", "--set", "finetune.schedule.warmup_steps=1"]
    args += ["--set", "finetune.optimizer.lr=0.05", "--targets", "q_proj,v_proj"]
    assert main(args) == 0
    return root


@pytest.fixture(scope="module")
def server(project):
    # No --model: the default assistant of the finetune layer, pointed at the tiny base and its run.
    args = ["--params", str(ROOT / "params.yaml"), "--finetune", LAYER]
    args += ["--set", f"finetune.base_model={project / 'base'}"]
    args += ["--set", f"finetune.out={project / 'runs' / 'finetune'}", "--slots", "1", "--queue", "1"]
    args += ["--max-tokens", str(LONG), "--max-prompt-tokens", "256"]
    s = Server(args, cwd=project, log=project / "server.log", api_key=KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["base+finetune"]
    h = server.health()
    assert h["status"] == "ok" and h["model"] == "base+finetune" and h["slots"] == 1 and h["queue"] == 1
    status, _, body = server.request("GET", "/health", auth=False)  # without the key: whether it serves
    assert status == 200 and json.loads(body) == {"status": "ok"}
    # What answers, down to how long its adapter trained (the adapter's manifest records the steps).
    assert "serving base+finetune" in server.log_text()
    assert "/runs/finetune/adapter (3 steps)" in server.log_text()


def ours(project, messages, max_new):
    """What ENLACE's own generate() answers, greedy with the server's default repetition controls."""
    from enlace.config.extra import CHAT_SAMPLING
    from enlace.generate import decode_weights, generate
    from enlace.hf.tokenizer import StreamDecoder
    from enlace.load import load_model

    loaded = load_model(project / "base", project / "runs" / "finetune" / "adapter")
    model, tok = loaded.model, loaded.tokenizer
    decode_weights(model, "auto")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server runs: a different thread count may round a bf16 sum differently
    try:
        dec = StreamDecoder(tok)
        pieces = []
        for t in generate(model, ids, max_new, temperature=0.0, top_p=CHAT_SAMPLING["top_p"],
                          repetition_penalty=CHAT_SAMPLING["repetition_penalty"],
                          no_repeat_ngram=CHAT_SAMPLING["no_repeat_ngram"], eos_ids=tok.eos_ids):  # fmt: skip
            if t in tok.eos_ids:
                break
            pieces.append(dec.push(t))
    finally:
        torch.set_num_threads(threads)
    return "".join(pieces), len(ids)


def test_chat_completion_is_our_generation(project, client):
    messages = [{"role": "user", "content": "¿Qué cenamos hoy, mamá?"}]
    r = client.chat.completions.create(model="base+finetune", messages=messages, max_tokens=12, temperature=0)
    text, n_prompt = ours(project, messages, 12)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == n_prompt and 1 <= r.usage.completion_tokens <= 12
    assert r.model == "base+finetune" and r.id.startswith("chatcmpl-")


def test_streamed_chat_equals_the_whole_answer(client):
    kw = dict(model="base+finetune", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    messages = [{"role": "system", "content": "Responde en español."}, {"role": "user", "content": "Hola"}]
    whole = client.chat.completions.create(messages=messages, **kw)
    chunks = list(
        client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) > 1 and "".join(content) == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16  # include_usage's last chunk


def test_completion_plain_and_streamed(client):
    kw = dict(model="base+finetune", prompt="Había una vez", max_tokens=10, temperature=0.8, seed=7)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text  # seeded sampling repeats
    assert a.usage.completion_tokens <= 10 and a.object == "text_completion"
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(pieces) == a.choices[0].text
    stopped = client.completions.create(**{**kw, "stop": [a.choices[0].text[2:4]]})
    if len(a.choices[0].text) >= 4 and a.choices[0].text[2:4].strip():
        assert stopped.choices[0].finish_reason == "stop"
        assert a.choices[0].text.startswith(stopped.choices[0].text)
        assert a.choices[0].text[2:4] not in stopped.choices[0].text


def test_api_key(server, client):
    import openai

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        status, _, body = server.request("GET", "/v1/models", headers=headers, auth=False)
        err = json.loads(body)["error"]
        assert status == 401 and err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    status, _, page = server.request("GET", "/", auth=False)
    assert status == 200 and b"<title>ENLACE" in page  # the page itself is open; it asks for the key


CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hola"}]

BAD = [
    # (what, path, body, status, param or None, code or None)
    ("malformed JSON", CHAT, b'{"messages": [', 400, None, "invalid_json"),
    ("not an object", CHAT, b"[1, 2]", 400, None, "invalid_json"),
    ("NaN", CHAT, b'{"messages": [{"role": "user", "content": "a"}], "temperature": NaN}', 400, None, "invalid_json"),
    ("invalid UTF-8", CHAT, b'{"messages": [{"role": "user", "content": "a\xff\xfe"}]}', 400, None, "invalid_utf8"),
    ("lone surrogate", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     "messages.0.content", "invalid_unicode"),
    ("temperature a string", CHAT, {"messages": MSG, "temperature": "hot"}, 400, "temperature", "invalid_value"),
    ("max_tokens a string", CHAT, {"messages": MSG, "max_tokens": "5"}, 400, "max_tokens", "invalid_value"),
    ("stream a string", CHAT, {"messages": MSG, "stream": "yes"}, 400, "stream", "invalid_value"),
    ("messages a string", CHAT, {"messages": "hola"}, 400, "messages", "invalid_value"),
    ("content a number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, None, "invalid_value"),
    ("no messages", CHAT, {"model": "base+finetune"}, 400, "messages", "invalid_value"),
    ("empty messages", CHAT, {"messages": []}, 400, "messages", "invalid_value"),
    ("unknown role", CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0.role", "invalid_value"),
    ("no user message", CHAT, {"messages": [{"role": "system", "content": "x"}]}, 400, "messages", "invalid_value"),
    ("unknown model", CHAT, {"model": "gpt-4o", "messages": MSG}, 404, "model", "model_not_found"),
    ("oversize prompt", CHAT, {"messages": [{"role": "user", "content": "hola " * 400}]}, 400, "messages",
     "context_length_exceeded"),
    ("max_tokens over the limit", CHAT, {"messages": MSG, "max_tokens": LONG + 1}, 400, "max_tokens", "invalid_value"),
    ("max_tokens zero", CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("temperature too high", CHAT, {"messages": MSG, "temperature": 2.5}, 400, "temperature", "invalid_value"),
    ("top_p zero", CHAT, {"messages": MSG, "top_p": 0}, 400, "top_p", "invalid_value"),
    ("top_p over one", CHAT, {"messages": MSG, "top_p": 1.5}, 400, "top_p", "invalid_value"),
    ("n of two", CHAT, {"messages": MSG, "n": 2}, 400, "n", "invalid_value"),
    ("too many stops", CHAT, {"messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
    ("prompt missing", "/v1/completions", {"max_tokens": 3}, 400, "prompt", "invalid_value"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt", "empty_prompt"),
    ("token id outside the vocabulary", "/v1/completions", {"prompt": [1, 10**6]}, 400, "prompt", "invalid_value"),
    ("too large body", CHAT, b'{"messages": [{"role": "user", "content": "' + b"a" * (1 << 20) + b'"}]}', 413,
     None, "body_too_large"),
    ("unknown path", "/v1/embeddings", {"input": "x"}, 404, None, None),
]  # fmt: skip


@pytest.mark.parametrize("what,path,body,status,param,code", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_4xx_with_an_openai_error(server, what, path, body, status, param, code):
    got, headers, raw = server.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    assert got == status, raw
    assert headers["content-type"] == "application/json"
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "\n" not in err["message"]
    if param is not None:
        assert err["param"] == param or err["param"].startswith(param), err
    assert err["code"] == code, err
    assert server.health()["status"] == "ok"  # and the server goes on


def test_bad_input_through_the_openai_client(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="base+finetune", messages=MSG, temperature=3)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=MSG)
    r = client.chat.completions.create(model="base+finetune", messages=MSG, max_tokens=2)
    assert r.usage.completion_tokens <= 2  # still serving


def test_disconnect_stops_the_generation(server):
    before = server.wait_for(lambda h: h["busy"] == 0 and h["queued"] == 0, what="idle server")
    conn, resp = server.open_stream(CHAT, {"messages": MSG, "max_tokens": LONG, "ignore_eos": True})
    assert next_event(resp)["choices"][0]["delta"]["role"] == "assistant"
    while not next_event(resp)["choices"][0]["delta"].get("content"):
        pass  # generation has started
    t0 = time.monotonic()
    conn.sock.close()  # hang up mid-answer
    conn.close()
    after = server.wait_for(lambda h: h["busy"] == 0, what="generation stopped")
    assert time.monotonic() - t0 < 20
    assert after["cancelled"] == before["cancelled"] + 1
    made = after["tokens_generated"] - before["tokens_generated"]
    assert 0 < made < LONG, made  # stopped between tokens, long before its budget
    assert "cancelled" in server.log_text()


def test_full_queue_answers_429_at_once(server, client):
    server.wait_for(lambda h: h["busy"] == 0 and h["queued"] == 0, what="idle server")
    long = {"messages": MSG, "max_tokens": LONG, "ignore_eos": True}
    a = server.open_stream(CHAT, long)  # takes the one slot
    server.wait_for(lambda h: h["busy"] == 1, what="first request running")
    b = server.send_stream(CHAT, long)  # waits in the queue of one (its answer begins once it has the slot)
    server.wait_for(lambda h: h["queued"] == 1, what="second request queued")
    t0 = time.monotonic()
    status, headers, raw = server.request("POST", CHAT, body={"messages": MSG, "max_tokens": 2})
    elapsed = time.monotonic() - t0
    err = json.loads(raw)["error"]
    assert status == 429 and err["code"] == "queue_full" and headers.get("retry-after") == "1"
    assert elapsed < 5, elapsed  # refused at once, not after the running ones
    for conn in (b, a[0]):  # the waiting one hangs up first: its queue place is given back at once
        conn.sock.close()
        conn.close()
    h = server.wait_for(lambda h: h["busy"] == 0 and h["queued"] == 0, what="queue drained")
    assert h["refused"] >= 1
    assert client.chat.completions.create(model="base+finetune", messages=MSG, max_tokens=2).choices


def test_non_streamed_request_that_hangs_up_is_stopped(server):
    before = server.wait_for(lambda h: h["busy"] == 0, what="idle server")
    body = json.dumps({"messages": MSG, "max_tokens": LONG, "ignore_eos": True}).encode()
    import socket

    s = socket.create_connection(("127.0.0.1", server.port))
    head = f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    s.sendall(head.encode() + f"Authorization: Bearer {KEY}\r\n\r\n".encode() + body)
    server.wait_for(lambda h: h["busy"] == 1, what="request running")
    s.close()
    after = server.wait_for(lambda h: h["busy"] == 0, what="generation stopped")
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["tokens_generated"] - before["tokens_generated"] < LONG


def test_clients_that_hang_up_at_once_leave_no_place_taken(server, client):
    import socket

    body = json.dumps({"messages": MSG, "max_tokens": LONG, "ignore_eos": True, "stream": True}).encode()
    head = f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    before = server.health()
    for _ in range(8):  # more than the slot and the queue hold
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(head.encode() + f"Authorization: Bearer {KEY}\r\n\r\n".encode() + body)
        s.close()

    def arrived(h: dict) -> int:  # each request is admitted or refused once its body is parsed (off the loop)
        return h["requests"] + h["refused"] - before["requests"] - before["refused"]

    server.wait_for(
        lambda h: arrived(h) >= 8 and h["busy"] == 0 and h["queued"] == 0, what="all 8 seen, every place back"
    )
    assert client.chat.completions.create(model="base+finetune", messages=MSG, max_tokens=2).choices


def test_concurrent_requests_all_answered(server, client):
    # More requests than slot plus queue hold are refused; the rest are answered; nothing hangs.
    results: list[object] = []

    def one():
        import openai

        try:
            results.append(client.chat.completions.create(model="base+finetune", messages=MSG, max_tokens=3))
        except openai.RateLimitError as e:
            results.append(e)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 4 and not any(t.is_alive() for t in threads)
    assert sum(not isinstance(r, Exception) for r in results) >= 1
    server.wait_for(lambda h: h["busy"] == 0 and h["queued"] == 0, what="idle server")


def test_serve_cli_errors_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no models/gemma3-270m here: the in-context assistant is not the default
    assert main(["serve", "--model", str(tmp_path / "nope")]) == 2
    assert "--model" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path), "--slots", "0"]) == 2
    assert "--slots 0: must be at least 1" in capsys.readouterr().err
    # No --model, no imported Gemma and no fine-tuned adapter yet: say what to run, do not serve something else.
    args = ["serve", "--params", str(ROOT / "params.yaml"), "--set", f"finetune.out={tmp_path / 'ft'}"]
    assert main(args) == 2
    assert "no assistant yet" in capsys.readouterr().err


def test_a_pretraining_run_is_served_as_text_continuation(tmp_path):
    from helpers import loaders_for, tiny_config

    from enlace.train.trainer import train

    cfg = tiny_config({"train.max_steps": 2, "train.checkpoint.every": 2})
    tr, va = loaders_for(cfg)
    train(cfg, tmp_path / "run", loader=tr, val_loader=va, progress=False)
    s = Server(["--model", str(tmp_path / "run")], cwd=tmp_path, log=tmp_path / "server.log")
    try:
        status, _, body = s.request("GET", "/v1/models")
        card = json.loads(body)["data"][0]
        assert (
            status == 200 and card["id"] == "run" and card["chat"] is False and card["context_length"] == 32
        )
        status, _, body = s.request("POST", CHAT, body={"messages": MSG})
        assert status == 400 and json.loads(body)["error"]["code"] == "no_chat_template"
        body = {"prompt": "Había una vez", "max_tokens": 5, "temperature": 0}
        status, _, raw = s.request("POST", "/v1/completions", body=body)
        r = json.loads(raw)
        assert status == 200 and r["usage"]["prompt_tokens"] == len("Había una vez".encode())
        assert r["usage"]["completion_tokens"] == 5 and isinstance(r["choices"][0]["text"], str)
        status, _, raw = s.request("POST", "/v1/completions", body={**body, "max_tokens": 30})
        assert status == 400 and json.loads(raw)["error"]["code"] == "context_length_exceeded"
    finally:
        s.stop()


def test_model_folders_are_told_apart(project, tmp_path):
    from enlace.errors import EnlaceError
    from enlace.serve.loader import default_name, resolve

    def never():
        raise AssertionError("the default is only for no --model")

    run = project / "runs" / "finetune"
    kind, base, adapter = resolve(str(run), None, never)  # a LoRA run: its base from its resolved config
    assert (kind, base, adapter) == ("hf", project / "base", run / "adapter")
    assert default_name(kind, base, adapter) == "base+finetune"
    assert resolve(str(project / "base"), None, never) == ("hf", project / "base", None)
    assert resolve(str(project / "base"), str(run / "adapter"), never)[2] == run / "adapter"
    (tmp_path / "ckpt" / "checkpoints").mkdir(parents=True)
    assert resolve(str(tmp_path / "ckpt"), None, never)[0] == "run"
    with pytest.raises(EnlaceError, match="--adapter applies to Hugging Face model folders"):
        resolve(str(tmp_path / "ckpt"), str(run / "adapter"), never)
    with pytest.raises(EnlaceError, match="neither a run folder"):
        resolve(str(tmp_path), None, never)


@pytest.mark.parametrize(
    "stops,pieces,want,hit",
    [
        ([], ["ab", "cd"], "abcd", False),
        (["cd"], ["ab", "c", "de"], "ab", True),  # a stop split across pieces
        (["xyz"], ["abx", "y", "q"], "abxyq", False),  # a false start is released
        (["\n\n", "FIN"], ["Hola", "\n", "\nadiós"], "Hola", True),
        (["FIN"], ["aFI"], "a", False),  # held back: "FI" may still become "FIN" (flush releases it)
    ],
)
def test_stop_strings(stops, pieces, want, hit):
    from enlace.load.preamble import StopScanner

    scan, out, ended = StopScanner(stops), "", False
    for p in pieces:
        text, ended = scan.feed(p)
        out += text
        if ended:
            break
    assert (out, ended) == (want, hit)


@pytest.mark.parametrize(
    "pieces,want",
    [
        ([" ", " La", " casa.", "\n", "\nUsu", "ario:"], "La casa."),  # the space, the blank line: not sent
        ([" La", "\n", " casa", " \n"], "La\n casa"),  # the budget ended it: inner whitespace is text
        ([" La", "\nUsu"], "La\nUsu"),  # a tail held back as a possible stop is text at the end
        (["\n", "\nUsuario:"], ""),  # nothing but whitespace before the stop
    ],
)
def test_a_preamble_answer_is_sent_without_the_whitespace_around_it(pieces, want):
    """The prompt ends at "ENLACE:" and the model writes the space after it, and a blank line before the next
    turn: what is sent is the answer's text, streamed, with the whitespace inside it."""
    from enlace.load.preamble import StopScanner

    scan, sent, hit = StopScanner(["\nUsuario:"], trim=True), [], False
    for p in pieces:
        text, hit = scan.feed(p)
        sent.append(text)
        if hit:
            break
    sent.append("" if hit else scan.flush())
    assert "".join(sent) == want and not any(s.isspace() for s in sent)


def test_explicit_nulls_are_the_defaults(server):
    nulls = {
        k: None for k in ("model", "temperature", "top_p", "stop", "stream", "n", "seed", "logprobs", "user")
    }
    status, _, raw = server.request("POST", CHAT, body={"messages": MSG, "max_tokens": 2, **nulls})
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] <= 2


def test_two_slots_generate_at_once(project):
    import asyncio

    from enlace.serve.engine import Engine, GenRequest, QueueFull
    from enlace.serve.loader import load_served

    served = load_served(str(project / "base"), None, default=None, weights="fp32")

    def req(n):
        return GenRequest(prompt_ids=served.encode_text("Había una vez"), max_tokens=n, temperature=0.0, top_p=1.0,
                          top_k=0, repetition_penalty=1.0, no_repeat_ngram=0, seed=0, ignore_eos=True)  # fmt: skip

    async def run():
        engine = Engine(served, slots=2, queue=0)
        jobs = [engine.admit(req(LONG)), engine.admit(req(LONG))]
        with pytest.raises(QueueFull):
            engine.admit(req(1))  # both slots taken, no queue
        for j in jobs:
            await engine.start(j, timeout=10)
        streams = [engine.events(j) for j in jobs]
        firsts = [await s.__anext__() for s in streams]
        assert [e.kind for e in firsts] == ["text", "text"] and engine.status()["busy"] == 2
        for s in streams:
            await s.aclose()  # both hang up: both stop between tokens
        while engine.status()["busy"]:
            await asyncio.sleep(0.01)
        engine.close()
        return engine.status()

    status = asyncio.run(run())
    assert status["cancelled"] == 2 and status["queued"] == 0 and status["tokens_generated"] < 2 * LONG
