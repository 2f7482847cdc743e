"""The `enlace chat` REPL: streamed replies from a Hugging Face folder (loaded by enlace.hf.load)."""

from __future__ import annotations

import sys
from typing import TextIO

from ..hf.tokenizer import HFTokenizer, Message, StreamDecoder


def stream_reply(
    model, tok: HFTokenizer, messages: list[Message], out: TextIO, max_new_tokens: int = 256, **sampling
) -> str:
    """Generate the assistant's reply token by token, printing each piece as soon as it decodes."""
    from ..generate import generate

    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    dec = StreamDecoder(tok)
    for t in generate(model, ids, max_new_tokens, eos_ids=tok.eos_ids, **sampling):
        piece = dec.push(t)
        if piece:
            out.write(piece)
            out.flush()
    out.write("\n")
    out.flush()
    return tok.decode(dec.ids, skip_special_tokens=True).strip()


def chat_repl(
    model,
    tok: HFTokenizer,
    inp: TextIO = sys.stdin,
    out: TextIO = sys.stdout,
    system: str | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.7,
    top_k: int = 0,
    top_p: float = 0.9,
    seed: int = 0,
) -> list[Message]:
    """Read user turns from `inp` until EOF or /exit; keep the whole conversation as context."""
    messages: list[Message] = [{"role": "system", "content": system}] if system else []
    interactive = inp.isatty()
    turn = 0
    while True:
        if interactive:
            out.write("> ")
            out.flush()
        line = inp.readline()
        if not line or line.strip() == "/exit":
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply = stream_reply(
            model, tok, messages, out, max_new_tokens,
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed + turn,
        )  # fmt: skip
        messages.append({"role": "assistant", "content": reply})
        turn += 1
    return messages
