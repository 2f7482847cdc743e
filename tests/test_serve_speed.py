"""The served path's decode: incremental detokenisation, and batched slots that give each request the tokens
`generate` gives it alone (greedy, and sampled with its seed), whoever else decodes at the same time."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import torch
from helpers import make_folder

from enlace import kernels, runtime
from enlace.generate import generate, sample_next
from enlace.hf.tokenizer import HFTokenizer, IncrementalDecoder, StreamDecoder
from enlace.load.run import RunStream
from enlace.text import ByteCodec, continuation


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("speed") / "base", max_position_embeddings=1024)


def test_incremental_pieces_join_to_the_whole_decode(folder):
    tok = HFTokenizer(folder)
    rng = random.Random(0)
    ids = tok.encode(
        "¿Qué cenamos hoy, mamá? Una tortilla de patatas, señor Ñúñez.", add_special_tokens=False
    )
    for trial in range(5):
        stream = ids if trial == 0 else [rng.randrange(tok.vocab_size) for _ in range(80)]
        dec = StreamDecoder(tok)
        pieces = [dec.push(t) for t in stream]
        whole = tok.decode(stream, skip_special_tokens=True)
        assert "".join(pieces) == whole.rstrip("\ufffd") or "".join(pieces) == whole


def test_incremental_decoder_decodes_a_short_window_only():
    calls: list[int] = []

    def decode(ids: list[int]) -> str:
        calls.append(len(ids))
        return "".join(chr(97 + i % 26) for i in ids)

    whole = decode(list(range(500)))
    calls.clear()
    dec = IncrementalDecoder(decode)
    assert "".join(dec.push(i) for i in range(500)) == whole
    assert max(calls) <= 2  # never the whole answer again


def test_a_run_stream_equals_the_continuation_of_the_prompt():
    codec = ByteCodec()
    prompt = codec.encode("La ciudad de ")
    new = codec.encode("los niños ñoños: ¿qué? €")
    stream = RunStream(codec, prompt)
    assert "".join(stream.push(t) for t in new) == continuation(codec, prompt, new)


def test_top_k_then_top_p_samples_only_the_nucleus():
    logits = torch.tensor([[5.0, 4.0, 3.0, -1.0, 2.0, 4.5]])
    gen = torch.Generator().manual_seed(0)
    drawn = {int(sample_next(logits, 1.0, top_k=3, top_p=0.7, generator=gen)) for _ in range(200)}
    assert drawn <= {0, 5} and 0 in drawn  # 5.0 and 4.5 hold over 70% of the top three's mass
    drawn = {int(sample_next(logits, 1.0, top_k=0, top_p=0.99, generator=gen)) for _ in range(300)}
    assert 3 not in drawn and len(drawn) >= 4


def test_greedy_picks_torchs_argmax_ties_and_nans_included():
    from enlace.generate import greedy_ids

    rows = torch.randn(3, 262144)
    rows[1, 7] = rows[1, 9] = rows[1].max() + 1  # a tie: the first wins
    rows[2, 11] = float("nan")  # a NaN counts as largest
    assert torch.equal(greedy_ids(rows), rows.argmax(dim=-1)) and greedy_ids(rows).tolist()[1:] == [7, 11]
    assert torch.equal(greedy_ids(rows.bfloat16()), rows.bfloat16().argmax(dim=-1))


def _kept(sorted_p: torch.Tensor, top_p: float) -> int:
    """How many of the largest probabilities _sample_sorted keeps (the most over the rows)."""
    return int((sorted_p.cumsum(-1) - sorted_p <= top_p).sum(-1).max())


@pytest.mark.parametrize("spread", [0.5, 3.0, 30.0])  # a flat row needs the whole sort, a peaked one 256
def test_top_p_alone_keeps_the_nucleus_a_whole_sort_keeps(spread):
    from enlace.generate import _nucleus_candidates

    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(2, 262144) * spread, dim=-1)
    for top_p in (0.5, 0.9, 0.99):
        values, ids = _nucleus_candidates(probs, top_p)
        full_p, full_ids = probs.sort(dim=-1, descending=True)
        n = _kept(full_p, top_p)
        assert values.size(-1) >= n and _kept(values, top_p) == n
        assert torch.equal(values[:, :n], full_p[:, :n])  # the same probabilities, in the same order
        assert torch.equal(probs.gather(-1, ids[:, :n]), values[:, :n])  # each is its id's own
        for row in range(2):  # the same ids, but for the order of equal probabilities (topk and sort differ)
            assert len(set(ids[row, :n].tolist())) == n
            above = full_p[row, n - 1]
            assert {i for i in ids[row, :n].tolist() if probs[row, i] > above} == {
                i for i in full_ids[row, :n].tolist() if probs[row, i] > above
            }


class _Ids:
    """A test double of the text stream: each token as <id>, so the text carries the ids exactly."""

    def push(self, token_id: int) -> str:
        return f"<{token_id}>"


def _ids(text: str) -> list[int]:
    return [int(t) for t in text.strip("<>").split("><")] if text else []


def _served(folder, weights: str = "fp32"):
    from enlace.serve.loader import load_served

    served = load_served(str(folder), None, default=None, weights=weights)
    return dataclasses.replace(served, stream=lambda _p: _Ids())


def _request(served, prompt: str, n: int, **kw):
    from enlace.serve.engine import GenRequest

    sampling = dict(temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.1, no_repeat_ngram=3, seed=0)
    sampling.update(kw)
    return GenRequest(prompt_ids=served.encode_text(prompt), max_tokens=n, ignore_eos=True, **sampling)


def _alone(served, req) -> list[int]:
    return list(generate(served.model, req.prompt_ids, req.max_tokens, temperature=req.temperature,
                         top_k=req.top_k, top_p=req.top_p, repetition_penalty=req.repetition_penalty,
                         no_repeat_ngram=req.no_repeat_ngram, seed=req.seed))  # fmt: skip


def _served_tokens(served, reqs, slots: int, stagger: int = 0) -> list[list[int]]:
    """Each request's tokens from an engine with `slots` rows; with stagger, each after the one before has
    had that many text events (so requests join a batch under way)."""
    from enlace.serve.engine import Engine

    async def one(engine, req, started: asyncio.Event | None, mine: asyncio.Event):
        if started is not None:
            await started.wait()
        job = engine.admit(req)
        await engine.start(job, timeout=60)
        text, seen = "", 0
        async for ev in engine.events(job):
            text += ev.text if ev.kind == "text" else ""
            seen += ev.kind == "text"
            if seen >= stagger:
                mine.set()
        mine.set()
        return _ids(text)

    async def run():
        engine = Engine(served, slots=slots, queue=len(reqs))
        gates = [asyncio.Event() for _ in reqs]
        tasks = [
            one(engine, r, gates[i - 1] if stagger and i else None, gates[i]) for i, r in enumerate(reqs)
        ]
        out = await asyncio.gather(*tasks)
        status = engine.status()
        engine.close()
        assert status["completed"] == len(reqs) and status["busy"] == 0, status
        return out

    return asyncio.run(run())


PROMPTS = ["Había una vez", "¿Qué cenamos hoy?", "La ciudad de los niños", "Uno, dos, tres"]


# Where ENLACE's kernels decode a precision (all three on a CPU without native bf16), a row's products do not
# depend on the rows beside it, so batched tokens must equal generate's exactly; oneDNN's batched bf16
# matmuls (a CPU with native bf16) may round a row differently, and are not held to it.
ON_KERNELS = pytest.mark.skipif(
    runtime.cpu_bf16_native() is not None or not kernels.available(),
    reason="bf16 and int8 decode on oneDNN or torch's kernels here, not ENLACE's",
)


@pytest.mark.parametrize(
    "weights", ["fp32", pytest.param("bf16", marks=ON_KERNELS), pytest.param("int8", marks=ON_KERNELS)]
)
def test_served_greedy_tokens_equal_generate_alone_and_batched(folder, weights):
    served = _served(folder, weights)
    reqs = [_request(served, p, n) for p, n in zip(PROMPTS, (24, 9, 30, 17), strict=True)]
    want = [_alone(served, r) for r in reqs]
    assert _served_tokens(served, reqs[:1], slots=1) == want[:1]
    assert _served_tokens(served, reqs[:3], slots=3) == want[:3]  # three at once, leaving at different steps
    assert _served_tokens(served, reqs, slots=3, stagger=3) == want  # joining a batch under way


def test_a_sampled_request_keeps_its_seed_in_a_batch(folder):
    served = _served(folder)
    reqs = [
        _request(served, p, 20, temperature=0.9, top_k=20, top_p=0.9, seed=i) for i, p in enumerate(PROMPTS)
    ]
    want = [_alone(served, r) for r in reqs]
    assert _served_tokens(served, reqs, slots=4) == want


def test_the_head_runs_on_the_last_position_only_in_a_prefill(folder):
    served = _served(folder)
    ids = torch.tensor([served.encode_text("Había una vez una ciudad")])
    with torch.inference_mode():
        full = served.model(ids).logits[:, -1]
        last = served.model(ids, last_only=True).logits
    assert last.shape == (1, 1, full.shape[-1]) and torch.allclose(last[:, -1], full, atol=1e-5)


# ---- the API's optional parts: n, logprobs, stream_options.include_usage (in process, through the app) ----


@pytest.fixture(scope="module")
def app_client(folder):
    from starlette.testclient import TestClient

    from enlace.serve.api import create_app
    from enlace.serve.engine import Engine
    from enlace.serve.loader import load_served

    engine = Engine(load_served(str(folder), None, default=None, weights="fp32"), slots=3, queue=2)
    with TestClient(create_app(engine), base_url="http://127.0.0.1") as c:
        yield c
    engine.close()


CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hola"}]


def _events(raw: str) -> list[dict]:
    lines = [x[len("data: ") :] for x in raw.split("\n\n") if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [__import__("json").loads(x) for x in lines[:-1]]


def test_n_choices_each_with_its_own_seed(app_client):
    body = {
        "prompt": "Había una vez",
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 5,
        "n": 3,
        "ignore_eos": True,
    }
    r = app_client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert (
        r["usage"]["completion_tokens"] == 24
        and r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + 24
    )
    again = app_client.post("/v1/completions", json=body).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in r["choices"]]  # the seed decides
    one = app_client.post("/v1/completions", json={**body, "n": 1, "seed": 6}).json()
    assert one["choices"][0]["text"] == r["choices"][1]["text"]  # choice i is seed + i


def test_streamed_n_with_include_usage(app_client):
    body = {"messages": MSG, "max_tokens": 6, "n": 2, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = _events(app_client.post(CHAT, json=body).text)
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])  # null until the last chunk
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    finals = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(f["index"] for f in finals) == [0, 1]
    plain = _events(app_client.post(CHAT, json={**body, "n": 1, "stream_options": None}).text)
    assert all("usage" not in c for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 6


def test_chat_logprobs_and_top_logprobs(app_client):
    body = {"messages": MSG, "max_tokens": 5, "temperature": 0, "repetition_penalty": 1.0, "no_repeat_ngram": 0,
            "logprobs": True, "top_logprobs": 3, "ignore_eos": True}  # fmt: skip
    r = app_client.post(CHAT, json=body).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for entry in content:
        tops = entry["top_logprobs"]
        assert len(tops) == 3 and tops[0]["logprob"] >= tops[1]["logprob"] >= tops[2]["logprob"]
        assert entry["logprob"] == pytest.approx(tops[0]["logprob"])  # greedy: the likeliest token
        assert entry["logprob"] <= 0 and entry["bytes"] == list(entry["token"].encode())
    streamed = _events(app_client.post(CHAT, json={**body, "stream": True}).text)
    got = [
        e
        for c in streamed
        if c["choices"] and c["choices"][0].get("logprobs")
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert [e["logprob"] for e in got] == pytest.approx([e["logprob"] for e in content])


def test_completion_logprobs_in_the_older_shape(app_client):
    body = {"prompt": "Había una vez", "max_tokens": 4, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    lp = app_client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert all(len(t) <= 2 for t in lp["top_logprobs"]) and lp["text_offset"][0] == 0


@pytest.mark.parametrize(
    "path,body,param",
    [
        (CHAT, {"messages": MSG, "n": 4}, "n"),  # more choices than slots
        (CHAT, {"messages": MSG, "n": 17}, "n"),
        (CHAT, {"messages": MSG, "n": 0}, "n"),
        (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (CHAT, {"messages": MSG, "top_logprobs": 2}, None),  # without logprobs: true
        ("/v1/completions", {"prompt": "a", "logprobs": 6}, "logprobs"),
        ("/v1/completions", {"prompt": "a", "logprobs": True}, "logprobs"),
    ],
)
def test_out_of_bound_optional_parts_are_refused(app_client, path, body, param):
    r = app_client.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", r.text
    assert param is None or r.json()["error"]["param"] == param
