"""An assistant with no adapter: a base model aligned in context by a fixed preamble (URIAL, Lin et al. 2023,
"The Unlocking Spell on Base LLMs").

A base model continues text. Given a system line and a few short question-answer turns in a plain format, it
continues the next answer in the same style, and, having seen each answer followed by the next user turn,
starts one itself when it is done: the spec's stop strings cut it there, so an answer ends by itself. The spec
(configs/assistant/*.yaml) names the base folder, the system line, the turn format, the example turns and the
stop strings; `encode` renders messages to prompt ids with the base's own tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import Field, StrictInt, ValidationError, field_validator

from ..config.base import Strict
from ..config.extra import SamplingDefaults
from ..errors import ConfigError, EnlaceError

if TYPE_CHECKING:
    from ..generate import CopyTable

CONTENT = "{content}"
# A spec's fields that shape the text a model reads and a fine-tune in its format learns (text_fingerprint).
TEXT_FIELDS = ("start", "system", "user", "assistant", "examples", "stop")


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
    # How its replies sample where a request sets nothing (`enlace serve`, `enlace chat`); unset: CHAT's.
    sampling: SamplingDefaults = SamplingDefaults()

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

    def text_fingerprint(self) -> str:
        """sha256 of the fields that make the prompt and a fine-tune's training text (`training_ids`): an
        adapter trained in this format fits the spec while they are unchanged; its name, copy guard, sampling
        and comments may change."""
        text = self.model_dump(include=set(TEXT_FIELDS), mode="json")
        return hashlib.sha256(json.dumps(text, sort_keys=True, ensure_ascii=False).encode()).hexdigest()

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
        return self._start_ids(tok) + tok.encode(self.render(messages), add_special_tokens=False)

    def _start_ids(self, tok: Any) -> list[int]:
        start = [] if self.start is None else [tok.token_id(self.start)]
        if None in start:
            raise EnlaceError(f"assistant {self.name}: the tokenizer has no start token {self.start!r}")
        return start

    @property
    def answer_end(self) -> str:
        """What follows an answer up to where serving cuts it: the rest of its turn and the next user turn's
        head, through the first stop string found there ("\n\nUsuario:"). A fine-tune in this format
        (finetune.preamble) is taught to write it, so that its answers end as the base's do."""
        tail = self.assistant.split(CONTENT)[1] + self.user.split(CONTENT)[0].rstrip(" ")
        hits = sorted((i, i + len(s)) for s in self.stop if (i := tail.find(s)) >= 0)
        if not hits:
            raise EnlaceError(
                f"assistant {self.name}: no stop string occurs between an answer and the next user turn "
                f"({tail!r}), so a taught answer could never end"
            )
        return tail[: hits[0][1]]

    def answer_ids(self, tok: Any, text: str) -> list[int]:
        """`text` tokenised as the model writes it: in place after the answer prefix, less the prefix's own
        ids (a merge across the prefix's end stays with the text)."""
        head = tok.encode(self.answer_prefix, add_special_tokens=False)
        ids = tok.encode(self.assistant.split(CONTENT)[0] + text, add_special_tokens=False)
        shared = 0
        while shared < min(len(head), len(ids)) and head[shared] == ids[shared]:
            shared += 1
        return ids[shared:]

    def training_ids(self, tok: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        """A conversation ending in an assistant turn as a fine-tune in this format sees it: the prompt ids
        serving feeds for the turns before it (`encode`, the same call), and the ids of the answer and its end
        (`answer_end`), which the model is taught to write. The joint text is tokenised once; its prompt part
        must be the served prompt's ids, or the training text would differ from what serving feeds."""
        if not messages or messages[-1].get("role") != "assistant":
            raise EnlaceError(
                f"assistant {self.name}: a training conversation must end with an assistant turn"
            )
        answer = messages[-1].get("content")
        if not isinstance(answer, str) or not answer.strip():
            raise EnlaceError(f"assistant {self.name}: the last assistant turn has no text")
        prompt = self.encode(tok, messages[:-1])
        head = self.assistant.split(CONTENT)[0][len(self.answer_prefix) :]  # the space the model writes
        text = self.render(messages[:-1]) + head + answer.strip() + self.answer_end
        whole = self._start_ids(tok) + tok.encode(text, add_special_tokens=False)
        if whole[: len(prompt)] != prompt:
            raise EnlaceError(
                f"assistant {self.name}: the answer's first token merges with the prompt's end "
                f"({self.answer_prefix!r}); the training text would not start with the served prompt"
            )
        return prompt, whole[len(prompt) :]

    def copy_table(self, tok: Any) -> CopyTable | None:
        """The example answers' runs of copy_guard + 1 tokens, tokenised as the model writes them (after the
        answer prefix, in context; not the turn's end, which every answer shares); None when copy_guard is 0."""
        from ..generate import CopyTable

        if self.copy_guard == 0:
            return None
        answers = [self.answer_ids(tok, e.assistant) for e in self.examples]
        return CopyTable(self.copy_guard, answers, self.encode(tok, []))

    def stop_ids(self, tok: Any) -> tuple[int, ...]:
        """Ids that end an answer as well as the stop strings: the base's own end-of-text ids."""
        return tuple(tok.eos_ids)


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text before the first stop string, and whether there was one."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


class StopScanner:
    """Cuts the text at the first stop string, holding back any tail that could still become one.
    trim: the text's leading and trailing whitespace is not emitted (a preamble's answer: its prompt ends at
    "ENLACE:", the model writes the space after it as part of its first token, and ends with the blank line
    before the next turn); whitespace inside the text is, once more text follows it."""

    def __init__(self, stops: list[str], trim: bool = False):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.trim = trim
        self.lstrip = trim  # until the first text that is not whitespace has gone out

    def feed(self, piece: str) -> tuple[str, bool]:
        """The text safe to emit now, and whether a stop string ended it."""
        self.pending += piece
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return self._lead(out.rstrip() if self.trim else out), True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        cut = len(self.pending) - hold
        if self.trim:  # whitespace before what is held back waits for the text after it
            cut = len(self.pending[:cut].rstrip())
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return self._lead(out), False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return self._lead(out.rstrip() if self.trim else out)

    def _lead(self, out: str) -> str:
        if self.lstrip:
            out = out.lstrip()
            self.lstrip = not out
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
