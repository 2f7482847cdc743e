"""The preamble assistant's copy guard (generate.CopyTable, the spec's `copy_guard`): a reply never copies more
than n tokens in a row of an example answer, unless the user's own words hold that run. Checked on the
guard itself, on the spec's validation and tokenisation, and on a random tiny Gemma whose greedy reply does
copy an example answer: the guard changes that reply in `enlace judge`'s path, and `enlace serve` gives the
same tokens as the in-process path with the guard on."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch
from gemma_helpers import tiny_gemma_folder

from enlace.config.extra import CHAT_SAMPLING
from enlace.errors import ConfigError
from enlace.finetune.assistant import load_assistant, reply
from enlace.generate import CopyTable, RepeatGuard, generate
from enlace.hf.tokenizer import HFTokenizer
from enlace.load import load_model
from enlace.load.preamble import cut_at_stop, load_spec

SPEC = """name: tiny-preamble
base: {base}
start: "<bos>"
system: Un asistente que responde en español.
user: "Usuario: {{content}}\\n"
assistant: "ENLACE: {{content}}\\n\\n"
stop: ["\\nUsuario:"]
{guard}examples:
  - user: "¿Qué hora es?"
    assistant: "{answer}"
"""
QUESTION = "¿Dónde está el perro?"
GREEDY = {**CHAT_SAMPLING, "temperature": 0.0, "seed": 0}  # what `enlace judge --decodings greedy` uses
N = 2  # the guard's n in these tests: a copy may run 2 tokens, never 3


def write_spec(path: Path, base: Path, answer: str, guard: int | None = None) -> Path:
    line = "" if guard is None else f"copy_guard: {guard}\n"
    path.write_text(SPEC.format(base=base, guard=line, answer=answer.replace('"', '\\"')), encoding="utf-8")
    return path


def copied(table: CopyTable, reply_ids: list[int], prompt_ids: list[int]) -> list[tuple[int, ...]]:
    """The runs of n + 1 tokens of the reply that copy an example answer (and not the user's words)."""
    allowed = table.allowed(prompt_ids)
    runs = (tuple(reply_ids[i : i + table.n + 1]) for i in range(len(reply_ids) - table.n))
    return [g for g in runs if g in table.grams and g not in allowed]


@pytest.fixture(scope="module")
def copying(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Gemma and an example answer its greedy reply copies (a spec without the guard, one with it).

    A random model copies nothing on purpose, so the answer is found: start from a sentence, and take as the
    next example answer the reply the spec gave, until a reply copies its example answer over n tokens."""
    tmp = tmp_path_factory.mktemp("copy")
    folder = tiny_gemma_folder(tmp / "gemma")
    plain, guarded = tmp / "plain.yaml", tmp / "guarded.yaml"
    answer = "Son las diez de la mañana."
    for _ in range(8):
        write_spec(guarded, folder, answer, guard=N)
        table = load_spec(guarded).copy_table(HFTokenizer(folder))
        a = load_assistant(write_spec(plain, folder, answer))
        ids = a.encode([{"role": "user", "content": QUESTION}])
        out = list(generate(a.model, ids, 16, eos_ids=a.stop_ids, **GREEDY))
        if len(copied(table, out, ids)) >= 3:
            return plain, guarded
        answer = a.tok.decode(out, skip_special_tokens=True).strip().split("\n")[0]
    pytest.fail("no example answer that the tiny model copies was found")


def test_the_guard_bans_only_the_next_token_of_a_copy():
    table = CopyTable(2, [[10, 11, 12, 13]], preamble_ids=[1, 10, 11, 12, 13])
    assert table.follows == {(10, 11): {12}, (11, 12): {13}} and table.grams == {(10, 11, 12), (11, 12, 13)}

    def banned(ids: list[int], prompt: list[int] = (1, 10, 11, 12, 13, 5), keep=()) -> set[int]:
        guard = RepeatGuard(copy=table, prompt_ids=list(prompt), keep=keep)
        for t in ids:
            guard.push(t)
        logits = guard.apply(torch.zeros(1, 20))
        return {i for i in range(20) if logits[0, i] == float("-inf")}

    assert banned([10, 11]) == {12} and banned([5, 10, 11, 12]) == {13}
    assert banned([10]) == set() and banned([11, 10]) == set() and banned([10, 12]) == set()
    assert banned([10, 11], keep={12}) == set()  # an end-of-turn id is never banned
    # The user's question restates 10 11 12 (beyond the preamble's own copy): copying it is allowed.
    assert banned([10, 11], prompt=[1, 10, 11, 12, 13, 7, 10, 11, 12]) == set()
    assert banned([11, 12], prompt=[1, 10, 11, 12, 13, 7, 10, 11, 12]) == {13}
    assert not RepeatGuard().active and RepeatGuard(copy=table).active
    with pytest.raises(ValueError, match="n >= 1"):
        CopyTable(0, [[1, 2]], [])


def test_copy_guard_is_validated_and_off_by_default(tmp_path):
    folder = tiny_gemma_folder(tmp_path / "g")
    spec = write_spec(tmp_path / "spec.yaml", folder, "Son las diez.")
    assert load_spec(spec).copy_guard == 0 and load_model(spec).copy is None
    for bad, why in (
        ("-1", "greater than or equal to 0"),
        ('"6"', "valid integer"),
        ("true", "valid integer"),
    ):
        spec.write_text(
            spec.read_text(encoding="utf-8").replace("examples:", f"copy_guard: {bad}\nexamples:")
        )
        with pytest.raises(ConfigError, match=rf"spec\.yaml: copy_guard: .*{why}") as e:
            load_spec(spec)
        assert "\n" not in str(e.value)
        spec = write_spec(tmp_path / "spec.yaml", folder, "Son las diez.")


def test_the_table_holds_the_example_answers_as_the_prompt_tokenises_them(tmp_path):
    folder = tiny_gemma_folder(tmp_path / "g")
    spec = load_spec(write_spec(tmp_path / "s.yaml", folder, "Son las diez de la mañana.", guard=3))
    tok = HFTokenizer(folder)
    table = spec.copy_table(tok)
    preamble = spec.encode(tok, [])
    runs = {tuple(preamble[i : i + 4]) for i in range(len(preamble) - 3)}
    assert table.n == 3 and table.grams and table.grams <= runs
    # Not the question, nor the turn markers: only what follows "ENLACE:" in an example.
    assert tok.decode([t for g in table.grams for t in g]).count("Usuario") == 0


def test_the_guard_changes_a_copied_reply_in_the_judge_path(copying):
    plain, guarded = copying
    a, g = load_assistant(plain), load_assistant(guarded)
    assert a.copy is None and g.copy is not None and g.copy.n == N
    ids = a.encode([{"role": "user", "content": QUESTION}])
    want = list(generate(a.model, ids, 16, eos_ids=a.stop_ids, **GREEDY))
    got = list(generate(g.model, ids, 16, eos_ids=g.stop_ids, copy=g.copy, **GREEDY))
    assert len(copied(g.copy, want, ids)) >= 3 and copied(g.copy, got, ids) == []
    # The same up to the first token that would have made a copy of n + 1 tokens; another one there.
    first = next(i for i in range(N, len(want)) if tuple(want[i - N : i + 1]) in g.copy.grams)
    assert got[:first] == want[:first] and got[first] != want[first]
    # `enlace judge` answers through the same guard: its reply is the guarded one.
    text = reply(g, QUESTION, GREEDY, 16).text
    assert text == cut_at_stop(g.tok.decode(got, skip_special_tokens=True), ["\nUsuario:"])[0].strip()
    assert reply(a, QUESTION, GREEDY, 16).text != text


class _Ids:
    """A test double of the text stream: each token as <id>, so the text carries the ids exactly."""

    def push(self, token_id: int) -> str:
        return f"<{token_id}>"


def _served_tokens(served, reqs) -> list[list[int]]:
    from enlace.serve.engine import Engine

    async def one(engine, req):
        job = engine.admit(req)
        await engine.start(job, timeout=60)
        text = "".join([ev.text async for ev in engine.events(job) if ev.kind == "text"])
        return [int(t) for t in text.strip("<>").split("><")] if text else []

    async def run():
        engine = Engine(served, slots=2, queue=len(reqs))
        out = await asyncio.gather(*(one(engine, r) for r in reqs))
        engine.close()
        return out

    return asyncio.run(run())


def test_served_replies_equal_in_process_ones_with_the_guard_on(copying):
    """`enlace serve` opens the spec with its guard and answers, batched, what `generate` gives alone."""
    from enlace.serve.engine import GenRequest
    from enlace.serve.loader import load_served

    _, guarded = copying
    served = load_served(str(guarded), None, default=None, weights="fp32")
    assert served.copy is not None and served.copy.n == N
    served = dataclasses.replace(served, stream=lambda _p: _Ids())
    prompts = [served.encode_chat([{"role": "user", "content": q}]) for q in (QUESTION, "¿Qué hora es?")]
    settings = {k: v for k, v in GREEDY.items() if k != "seed"}
    reqs = [GenRequest(prompt_ids=p, max_tokens=16, seed=0, ignore_eos=True, **settings) for p in prompts]
    alone = [list(generate(served.model, p, 16, copy=served.copy, **GREEDY)) for p in prompts]
    plain = [list(generate(served.model, p, 16, **GREEDY)) for p in prompts]
    assert _served_tokens(served, reqs) == alone and alone[0] != plain[0]
