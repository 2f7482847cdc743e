"""A Hugging Face folder's tokenizer without transformers: `tokenizers` for the ids, jinja2 for the chat
template (rendered the way transformers renders it: sandboxed, trim_blocks, lstrip_blocks)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from ..errors import EnlaceError
from ..manifest import verify_manifest

Message = dict[str, str]
# What HFTokenizer reads, checked against the folder's manifest.json before it reads them.
FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


def _token_str(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class HFTokenizer:
    """tokenizer.json + tokenizer_config.json (+ generation_config.json for extra stop ids)."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise EnlaceError(f"{path}: not found (only fast tokenizers, tokenizer.json, are supported)")
        verify_manifest(folder, FILES)
        self.folder = folder
        self.tok = Tokenizer.from_file(str(path))
        cfg_path = folder / "tokenizer_config.json"
        self.config: dict[str, Any] = (
            json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
        )
        self.chat_template = self._find_template()
        self.special = {
            k: _token_str(self.config.get(k))
            for k in ("bos_token", "eos_token", "unk_token", "pad_token")
            if _token_str(self.config.get(k)) is not None
        }
        gen_path = folder / "generation_config.json"
        self.generation_config = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.exists() else {}

    def _find_template(self) -> str | None:
        t = self.config.get("chat_template")
        if isinstance(t, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {d.get("name"): d.get("template") for d in t}
            t = named.get("default") or next(iter(named.values()), None)
        jinja_file = self.folder / "chat_template.jinja"
        if t is None and jinja_file.exists():
            t = jinja_file.read_text(encoding="utf-8")
        return t

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tok.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self.token_id(self.special.get("bos_token"))

    @property
    def eos_id(self) -> int | None:
        return self.token_id(self.special.get("eos_token"))

    @property
    def pad_id(self) -> int:
        pad = self.token_id(self.special.get("pad_token"))
        if pad is None:
            pad = self.eos_id  # padded positions are masked out of the loss, so any id works
        if pad is None:
            raise EnlaceError(f"{self.folder}: tokenizer has neither a pad nor an eos token")
        return pad

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Ids that end an answer: the tokenizer's eos plus generation_config.json's eos_token_id(s)."""
        ids = [self.eos_id] if self.eos_id is not None else []
        extra = self.generation_config.get("eos_token_id")
        ids += extra if isinstance(extra, list) else [extra] if extra is not None else []
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self.tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @cached_property
    def _template(self):
        if self.chat_template is None:
            raise EnlaceError(f"{self.folder}: tokenizer_config.json has no chat_template")
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env.from_string(self.chat_template)

    def render_chat(self, messages: list[Message], add_generation_prompt: bool = False, **kwargs: Any) -> str:
        extra = self.config.get("additional_special_tokens") or []
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            additional_special_tokens=[_token_str(t) for t in extra],
            **self.special,
            **kwargs,
        )

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = False) -> list[int]:
        # The template writes any BOS itself, so the post-processor must not add another (as transformers).
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


class IncrementalDecoder:
    """Token ids to text pieces, decoding only the last few ids at each step (not the whole answer again).

    Each step decodes a short window, from where the last emitted piece began to the end, and emits what it
    adds to the window without the new ids: decoding a token alone would drop the space a piece like
    "\u2581los" carries at the start of a decoded string, and the window gives it its left context. A
    piece that ends in an incomplete UTF-8 sequence (a character split across byte tokens) is held back
    until the rest comes. `context`: ids before the first new one (a prompt's tail), decoded, never emitted.
    """

    def __init__(self, decode: Callable[[list[int]], str], context: Sequence[int] = ()):
        self.decode = decode
        self.ids = list(context)
        self.start = 0  # where the decoded window begins
        self.read = len(self.ids)  # ids before this one have been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        done = self.decode(self.ids[self.start : self.read])
        text = self.decode(self.ids[self.start :])
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""  # nothing new yet (a skipped special token), or a multi-byte character half-way
        self.start, self.read = self.read, len(self.ids)
        return text[len(done) :]


class StreamDecoder(IncrementalDecoder):
    """A Hugging Face tokenizer's stream of new token ids as text pieces."""

    def __init__(self, tokenizer: HFTokenizer, skip_special_tokens: bool = True):
        super().__init__(lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
