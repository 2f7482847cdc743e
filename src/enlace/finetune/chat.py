"""The `enlace chat` REPL: streamed replies from a model with a chat template (opened by enlace.load)."""

from __future__ import annotations

import sys
from typing import TextIO

from ..config.extra import CHAT
from ..errors import EnlaceError
from ..hf.tokenizer import HFTokenizer, Message, StreamDecoder

# `enlace chat` decoding, as config.extra.CHAT defines it (the repetition controls and why: there).
CHAT_SAMPLING = CHAT.model_dump(
    include={"temperature", "top_k", "top_p", "repetition_penalty", "no_repeat_ngram"}
)


def stream_reply(
    model,
    tok: HFTokenizer,
    messages: list[Message],
    out: TextIO,
    max_new_tokens: int = CHAT.max_new_tokens,
    **sampling,
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


def read_turn(inp: TextIO, lineno: int) -> str:
    """One line of user input; bytes that are not UTF-8 become a one-line error naming the line."""
    try:
        line = inp.readline()
        line.encode("utf-8")  # lone surrogates: what a surrogateescape stdin makes of invalid bytes
    except (UnicodeDecodeError, UnicodeEncodeError) as e:
        raise EnlaceError(
            f"input line {lineno}: not valid UTF-8 ({e.reason} at position {e.start})"
        ) from None
    return line


def chat_repl(
    model,
    tok: HFTokenizer,
    inp: TextIO | None = None,
    out: TextIO | None = None,
    system: str | None = None,
    max_new_tokens: int = CHAT.max_new_tokens,
    seed: int = CHAT.seed,
    **sampling,
) -> list[Message]:
    """Read user turns from `inp` until EOF or /exit; keep the whole conversation as context.

    `sampling` overrides CHAT_SAMPLING (temperature, top_k, top_p, repetition_penalty, no_repeat_ngram).
    """
    inp, out = inp or sys.stdin, out or sys.stdout  # looked up per call: a redirected stdin counts
    sampling = {**CHAT_SAMPLING, **sampling}
    messages: list[Message] = [{"role": "system", "content": system}] if system else []
    interactive = inp.isatty()
    turn = lineno = 0
    while True:
        if interactive:
            out.write("> ")
            out.flush()
        lineno += 1
        try:
            line = read_turn(inp, lineno)
        except EnlaceError as e:
            if not interactive:
                raise
            out.write(f"error: {e}; type it again\n")  # a typing slip must not end the conversation
            continue
        if not line or line.strip() == "/exit":
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply = stream_reply(model, tok, messages, out, max_new_tokens, seed=seed + turn, **sampling)
        messages.append({"role": "assistant", "content": reply})
        turn += 1
    return messages
