"""The served path's decode: incremental detokenisation, and batched slots that give each request the tokens
`generate` gives it alone (greedy, and sampled with its seed), whoever else decodes at the same time."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import torch
from helpers import make_folder

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


def test_served_greedy_tokens_equal_generate_alone_and_batched(folder):
    served = _served(folder)
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
