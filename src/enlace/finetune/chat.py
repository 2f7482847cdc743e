"""The `enlace chat` REPL: streamed replies from a model opened by enlace.load, rendered as `enlace serve`
renders a chat: the folder's chat template, or an assistant spec's preamble, its stop strings and its copy
guard."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TextIO

from ..config.extra import CHAT
from ..errors import EnlaceError
from ..hf.tokenizer import Message
from ..load.preamble import StopScanner

if TYPE_CHECKING:
    from ..load import Loaded


def stream_reply(
    loaded: Loaded,
    messages: list[Message],
    out: TextIO,
    max_new_tokens: int = CHAT.max_new_tokens,
    **sampling,
) -> str:
    """Generate the assistant's reply token by token, printing each piece as soon as it decodes. It ends at
    an end id or at a stop string (a preamble's next turn: cut before it, never printed)."""
    from ..generate import generate

    encode = loaded.chat_template
    if encode is None:
        raise EnlaceError(
            f"{loaded.ref.path}: no chat template; use `enlace generate --raw` to continue text"
        )
    ids = encode(messages)
    dec, scan, eos = (
        loaded.stream(ids),
        StopScanner(list(loaded.stops), trim=loaded.preamble is not None),
        set(loaded.eos_ids),
    )
    reply, hit = "", False
    for t in generate(loaded.model, ids, max_new_tokens, eos_ids=eos, copy=loaded.copy, **sampling):
        if t in eos:
            break
        piece, hit = scan.feed(dec.push(t))
        reply += piece
        out.write(piece)
        out.flush()
        if hit:
            break
    if not hit:  # the model ended, or the budget did: a tail held back as a possible stop is text
        tail = scan.flush()
        reply += tail
        out.write(tail)
    out.write("\n")
    out.flush()
    return reply.strip()


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
    loaded: Loaded,
    inp: TextIO | None = None,
    out: TextIO | None = None,
    system: str | None = None,
    max_new_tokens: int = CHAT.max_new_tokens,
    seed: int = CHAT.seed,
    **sampling,
) -> list[Message]:
    """Read user turns from `inp` until EOF or /exit; keep the whole conversation as context.

    `sampling` overrides the model's own defaults (Loaded.chat_sampling: CHAT_SAMPLING, or an assistant
    spec's): temperature, top_k, top_p, repetition_penalty, no_repeat_ngram.
    """
    inp, out = inp or sys.stdin, out or sys.stdout  # looked up per call: a redirected stdin counts
    sampling = {**loaded.chat_sampling, **sampling}
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
        reply = stream_reply(loaded, messages, out, max_new_tokens, seed=seed + turn, **sampling)
        messages.append({"role": "assistant", "content": reply})
        turn += 1
    return messages
