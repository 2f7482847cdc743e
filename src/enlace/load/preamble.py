"""An assistant with no adapter: a base model aligned in context by a fixed preamble (URIAL, Lin et al. 2023,
"The Unlocking Spell on Base LLMs").

A base model continues text. Given a system line and a few short question-answer turns in a plain format, it
continues the next answer in the same style, and, having seen each answer followed by the next user turn,
starts one itself when it is done: the spec's stop strings cut it there, so an answer ends by itself. The spec
(configs/assistant/*.yaml) names the base folder, the system line, the turn format, the example turns and the
stop strings; `encode` renders messages to prompt ids with the base's own tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import Field, StrictInt, ValidationError, field_validator

from ..config.base import Strict
from ..errors import ConfigError, EnlaceError

if TYPE_CHECKING:
    from ..generate import CopyTable

CONTENT = "{content}"


class Turn(Strict):
    user: str = Field(min_length=1)
    assistant: str = Field(min_length=1)


class PreambleSpec(Strict):
    """A servable assistant: a base folder (no adapter) and the text that aligns it in context."""

    name: str = Field(min_length=1)
    base: str  # the base model's Hugging Face folder (e.g. models/gemma3-270m)
    start: str | None = None  # a token the prompt starts with (Gemma's <bos>); null: none
    system: str = Field(min_length=1)
    user: str  # each user turn: CONTENT is where the text goes
    assistant: str  # each assistant turn, the examples' and the live one's: the prompt ends before CONTENT
    examples: list[Turn] = Field(min_length=1)
    stop: list[str] = Field(min_length=1)  # strings that end an answer (the start of the next turn)
    licence: str = ""  # what the answers are under (a Gemma base's: the Gemma Terms of Use)
    # An answer may copy at most this many tokens in a row of an example answer (generate.CopyTable): the next
    # token of such a copy is never sampled. 0: off.
    copy_guard: StrictInt = Field(default=0, ge=0)

    @field_validator("user", "assistant")
    @classmethod
    def _one_slot(cls, v: str) -> str:
        if v.count(CONTENT) != 1:
            raise ValueError(f"must hold {CONTENT} exactly once")
        return v

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("a stop string may not be empty")
        return v

    @property
    def answer_prefix(self) -> str:
        """What the prompt ends with: the assistant turn up to its content, less a trailing space (the model
        writes it, as the first token of its answer: " El" is one token in the examples, "El" after a lone
        " " another)."""
        return self.assistant.split(CONTENT)[0].rstrip(" ")

    def render(self, messages: list[dict[str, str]]) -> str:
        """The preamble, the conversation so far in the same turn format, and the start of the next answer.
        A system message replaces the spec's system line."""
        system = self.system
        turns = [t for e in self.examples for t in (("user", e.user), ("assistant", e.assistant))]
        for i, m in enumerate(messages):
            role, content = m.get("role"), m.get("content")
            if role not in ("system", "user", "assistant") or not isinstance(content, str):
                raise EnlaceError(f"messages[{i}]: expected a system, user or assistant message with text")
            if role == "system":
                system = content
            else:
                turns.append((role, content.strip()))
        body = "".join(
            (self.user if role == "user" else self.assistant).replace(CONTENT, text) for role, text in turns
        )
        return f"{system}\n\n{body}{self.answer_prefix}"

    def encode(self, tok: Any, messages: list[dict[str, str]]) -> list[int]:
        """Prompt ids for the base's tokenizer (an enlace.hf.tokenizer.HFTokenizer): the start token, then the
        rendered text without the tokenizer's own special tokens."""
        start = [] if self.start is None else [tok.token_id(self.start)]
        if None in start:
            raise EnlaceError(f"assistant {self.name}: the tokenizer has no start token {self.start!r}")
        return start + tok.encode(self.render(messages), add_special_tokens=False)

    def copy_table(self, tok: Any) -> CopyTable | None:
        """The example answers' runs of copy_guard + 1 tokens, tokenised as the model writes them (after the
        answer prefix, in context; not the turn's end, which every answer shares); None when copy_guard is 0."""
        from ..generate import CopyTable

        if self.copy_guard == 0:
            return None
        head = tok.encode(self.answer_prefix, add_special_tokens=False)
        answers = []
        for e in self.examples:
            text = self.assistant.split(CONTENT)[0] + e.assistant
            ids = tok.encode(text, add_special_tokens=False)
            shared = 0  # the ids the answer prefix alone has: a merge across its end stays with the answer
            while shared < min(len(head), len(ids)) and head[shared] == ids[shared]:
                shared += 1
            answers.append(ids[shared:])
        return CopyTable(self.copy_guard, answers, self.encode(tok, []))

    def stop_ids(self, tok: Any) -> tuple[int, ...]:
        """Ids that end an answer as well as the stop strings: the base's own end-of-text ids."""
        return tuple(tok.eos_ids)


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text before the first stop string, and whether there was one."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


class StopScanner:
    """Cuts the text at the first stop string, holding back any tail that could still become one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """The text safe to emit now, and whether a stop string ended it."""
        self.pending += piece
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def load_spec(path: str | Path) -> PreambleSpec:
    """A spec file; a missing file or a bad field is a one-line error naming it."""
    path = Path(path)
    if not path.is_file():
        raise EnlaceError(f"{path}: no such assistant spec")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(str(path), "(file)", f"not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(str(path), "(file)", "expected a mapping of the spec's fields")
    try:
        return PreambleSpec.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "(file)"
        raise ConfigError(str(path), field, err["msg"]) from None
