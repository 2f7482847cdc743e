"""The server's prompt prefix cache (enlace.serve.prefix): a prompt that starts with tokens whose KV the engine
computed before prefills only the rest, and answers as if it had prefilled everything. Checked on a Llama and
on a tiny Gemma 3 whose sliding window (6) is far shorter than the shared prefixes, through the model, the
engine (greedy tokens and log-probabilities with and without the cache, against `generate` alone) and the
HTTP API (usage.prompt_tokens_details.cached_tokens, /health's counters)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
import torch
from gemma_helpers import tiny_gemma_folder
from helpers import make_folder

from enlace.generate import generate
from enlace.hf.folder import load_hf_folder
from enlace.model import KVCache
from enlace.serve.prefix import PrefixCache, common_prefix

SPEC = """name: tiny-preamble
base: {base}
start: "<bos>"
system: Esta es una conversación entre un usuario y ENLACE, un asistente que responde en español.
user: "Usuario: {{content}}\\n"
assistant: "ENLACE: {{content}}\\n\\n"
stop: ["\\nUsuario:"]
examples:
  - user: "¿Qué hora es?"
    assistant: "Son las diez de la mañana."
  - user: "¿De qué color es el río?"
    assistant: "El río es verde en el jardín."
"""


@pytest.fixture(scope="module")
def gemma_spec(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefix")
    folder = tiny_gemma_folder(tmp / "gemma")
    spec = tmp / "tiny-preamble.yaml"
    spec.write_text(SPEC.format(base=folder), encoding="utf-8")
    return spec


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("prefix-llama") / "base", max_position_embeddings=512)


# ---- the cache itself ----


def _row(cfg, values: list[float]) -> KVCache:
    """A batch-1 cache whose position i holds values[i] everywhere."""
    row = KVCache.empty(cfg, 1, 64, torch.device("cpu"), torch.float32)
    for t in row.k + row.v:
        t[0, :, : len(values)] = torch.tensor(values)[None, :, None]
    return row


def test_the_cache_keeps_the_longest_prefix_within_its_limit(llama_folder):
    cfg = load_hf_folder(llama_folder).cfg
    cache = PrefixCache(limit=20, entries=2)
    a = list(range(10))
    cache.store(a, _row(cfg, [float(i) for i in a]), 10)
    out = KVCache.empty(cfg, 1, 64, torch.device("cpu"), torch.float32)
    # A prompt sharing 6 ids: 6 positions copied, the row set to go on from there.
    assert cache.load([0, 1, 2, 3, 4, 5, 99, 98], out) == 6 and out.pos == 6
    assert torch.equal(out.k[0][0, 0, :7, 0], torch.tensor([0.0, 1, 2, 3, 4, 5, 0]))
    # The same prompt: all but its last id (the prefill needs one token to give logits).
    assert cache.load(a, KVCache.empty(cfg, 1, 64, torch.device("cpu"), torch.float32)) == 9
    assert cache.load([7, 7], KVCache.empty(cfg, 1, 64, torch.device("cpu"), torch.float32)) == 0
    # A longer sequence replaces the one it extends; one already covered only refreshes it.
    longer = a + [10, 11, 12]
    cache.store(longer, _row(cfg, [float(i) for i in longer]), 13)
    assert len(cache) == 1 and cache.tokens == 13
    cache.store(a[:5], _row(cfg, [float(i) for i in a]), 5)
    assert len(cache) == 1 and cache.tokens == 13
    # Over the limit in positions, the least recently used goes; a sequence beyond the limit keeps its head.
    cache.store([50, 51, 52, 53, 54, 55, 56, 57], _row(cfg, [0.0] * 8), 8)
    assert len(cache) == 1 and cache.tokens == 8
    cache.store(list(range(100, 140)), _row(cfg, [0.0] * 40), 40)
    assert len(cache) == 1 and cache.tokens == 20
    assert common_prefix([1, 2, 3], [1, 2]) == 2 and common_prefix([], [1]) == 0


# ---- the model: a prefill after a copied prefix ----


@pytest.mark.parametrize("kind", ["llama", "gemma"])
@pytest.mark.parametrize("reuse", [1, 5, 6, 7, 40])
def test_a_prefill_after_a_copied_prefix_equals_a_whole_one(kind, reuse, llama_folder, gemma_spec):
    """Positions on both sides of the sliding window (6): the suffix's queries see the copied keys the
    whole prefill's queries saw, no more (the local layers' mask) and no fewer."""
    folder = llama_folder if kind == "llama" else gemma_spec.parent / "gemma"
    model = load_hf_folder(folder).eval()
    cfg = model.cfg
    torch.manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (1, 60))
    other = torch.cat([ids[:, :reuse], torch.randint(3, cfg.vocab_size, (1, 9))], dim=1)  # shares `reuse`
    with torch.inference_mode():
        whole = KVCache.empty(cfg, 1, 64, torch.device("cpu"), torch.float32)
        want = model(ids, cache=whole, last_only=True).logits[:, -1]
        seen = KVCache.empty(cfg, 1, 64, torch.device("cpu"), torch.float32)
        model(other, cache=seen)
        prefix = PrefixCache(limit=100)
        prefix.store(other[0].tolist(), seen, other.shape[1])
        row = KVCache.empty(cfg, 1, 64, torch.device("cpu"), torch.float32)
        assert prefix.load(ids[0].tolist(), row) == reuse
        got = model(ids[:, reuse:], cache=row, last_only=True).logits[:, -1]
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    for a, b in zip(row.k + row.v, whole.k + whole.v, strict=True):
        assert torch.allclose(a[:, :, :60], b[:, :, :60], atol=1e-4)
    assert got.argmax() == want.argmax()


# ---- the engine: answers with and without a hit ----


class _Ids:
    """A test double of the text stream: each token as <id>, so the text carries the ids exactly."""

    def push(self, token_id: int) -> str:
        return f"<{token_id}>"


def _served(path):
    from enlace.serve.loader import load_served

    served = load_served(str(path), None, default=None, weights="fp32")
    return dataclasses.replace(served, stream=lambda _p: _Ids())


def _request(ids: list[int], n: int = 12):
    from enlace.serve.engine import GenRequest

    return GenRequest(prompt_ids=ids, max_tokens=n, temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0,
                      no_repeat_ngram=0, seed=0, ignore_eos=True, logprobs=0)  # fmt: skip


def _one_by_one(served, reqs, prompt_cache: int) -> list[tuple[list[int], list[float], int]]:
    """Each request's tokens, their log-probabilities and its cached prompt positions, one after another."""
    from enlace.serve.engine import Engine

    async def run():
        engine = Engine(served, slots=2, queue=2, prompt_cache=prompt_cache)
        out = []
        for req in reqs:
            job = engine.admit(req)
            await engine.start(job, timeout=60)
            text, lps, cached = "", [], -1
            async for ev in engine.events(job):
                if ev.kind == "text":
                    text += ev.text
                    lps += [e["logprob"] for e in ev.logprobs]
                elif ev.kind == "done":
                    cached = ev.usage["prompt_tokens_details"]["cached_tokens"]
            out.append(([int(t) for t in text.strip("<>").split("><")], lps, cached))
        status = engine.status()
        engine.close()
        return out, status

    return asyncio.run(run())


def _turns(served, tokens_text: str) -> list[list[int]]:
    """Prompts of a preamble assistant: two first questions, the second twice, and a conversation going on
    from the first answer."""
    chat = served.encode_chat
    first = [{"role": "user", "content": "¿Qué hora es en la ciudad?"}]
    return [
        chat(first),
        chat([{"role": "user", "content": "¿Dónde está el perro?"}]),
        chat([{"role": "user", "content": "¿Dónde está el perro?"}]),
        chat([*first, {"role": "assistant", "content": tokens_text}, {"role": "user", "content": "¿Y hoy?"}]),
    ]


def test_served_answers_with_a_prefix_hit_equal_those_without(gemma_spec):
    served = _served(gemma_spec)
    prompts = _turns(served, "Son las diez de la mañana.")
    reqs = [_request(p) for p in prompts]
    (hit, status), (cold, _) = _one_by_one(served, reqs, 2048), _one_by_one(served, reqs, 0)
    for (tokens, lps, _), (want_tokens, want_lps, cached) in zip(hit, cold, strict=True):
        assert tokens == want_tokens and cached == 0
        assert lps == pytest.approx(want_lps, abs=1e-4)
    alone = [list(generate(served.model, r.prompt_ids, r.max_tokens, temperature=0.0)) for r in reqs]
    assert [t for t, _, _ in hit] == alone
    # What was reused: nothing at first; then the preamble and what the two questions share; all but the
    # last token of a prompt seen before; the first prompt and more for the conversation going on.
    cached = [c for _, _, c in hit]
    assert cached[0] == 0
    assert cached[1] == common_prefix(prompts[0], prompts[1]) > 40
    assert cached[2] == len(prompts[2]) - 1
    assert cached[3] >= len(prompts[0]) - 3  # the answer's text is tokenised again in the new prompt
    assert status["prompt_cache_hits"] == 3 and status["prompt_tokens_cached"] == sum(cached)
    assert status["prompt_tokens"] == sum(map(len, prompts)) and 0 < status["prompt_cache_tokens"] <= 2048


def test_batched_requests_share_a_prefix_prefilled_a_step_before(llama_folder):
    """n choices of one prompt: the first prefills it, the others copy it; each is what generate gives."""
    from enlace.serve.engine import Engine

    served = _served(llama_folder)
    req = _request(served.encode_text("Había una vez una ciudad junto al río"), n=10)

    async def run():
        engine = Engine(served, slots=3, queue=0)
        jobs = [engine.admit(dataclasses.replace(req)) for _ in range(3)]
        for job in jobs:
            await engine.start(job, timeout=60)

        async def collect(job):
            evs = [ev async for ev in engine.events(job)]
            return "".join(e.text for e in evs), evs[-1].usage["prompt_tokens_details"]["cached_tokens"]

        out = await asyncio.gather(*(collect(j) for j in jobs))
        engine.close()
        return out

    out = asyncio.run(run())
    want = "".join(f"<{t}>" for t in generate(served.model, req.prompt_ids, 10, temperature=0.0))
    assert [text for text, _ in out] == [want] * 3
    assert sorted(c for _, c in out) == [0, len(req.prompt_ids) - 1, len(req.prompt_ids) - 1]


# ---- the API: usage and /health ----


def test_the_api_reports_cached_prompt_tokens(gemma_spec):
    from starlette.testclient import TestClient

    from enlace.serve.api import create_app
    from enlace.serve.commands import DEFAULT_PROMPT_CACHE
    from enlace.serve.engine import PROMPT_CACHE, Engine
    from enlace.serve.loader import load_served

    assert DEFAULT_PROMPT_CACHE == PROMPT_CACHE
    engine = Engine(load_served(str(gemma_spec), None, default=None, weights="fp32"), slots=1, queue=2)
    body = {"messages": [{"role": "user", "content": "Hola"}], "max_tokens": 4, "ignore_eos": True}
    with TestClient(create_app(engine), base_url="http://127.0.0.1") as c:
        first = c.post("/v1/chat/completions", json=body).json()["usage"]
        again = c.post("/v1/chat/completions", json=body).json()["usage"]
        streamed = c.post(
            "/v1/chat/completions",
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        ).text
        health = c.get("/health").json()
    engine.close()
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["prompt_tokens_details"] == {"cached_tokens": again["prompt_tokens"] - 1}
    last = json.loads([x for x in streamed.split("\n\n") if x.startswith("data: {")][-1][len("data: ") :])
    assert last["choices"] == [] and last["usage"]["prompt_tokens_details"] == again["prompt_tokens_details"]
    assert health["prompt_cache_hits"] == 2 and health["prompt_cache_limit"] == PROMPT_CACHE
    assert health["prompt_tokens_cached"] == 2 * (again["prompt_tokens"] - 1)
