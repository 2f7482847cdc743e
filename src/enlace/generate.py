"""Sampling from a Llama with a KV cache: greedy, temperature, top-k and top-p, seeded, with optional
repetition controls (a repetition penalty and a no-repeat n-gram ban) so small models do not loop."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator

import torch

from .errors import EnlaceError
from .model import KVCache, Llama


def check_sampling(
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    no_repeat_ngram: int = 0,
) -> None:
    """Refuse values that would silently sample something other than what was asked (one-line errors,
    named as the command-line options are)."""
    problems = [
        (max_new_tokens <= 0, f"--max-new-tokens {max_new_tokens}: must be at least 1"),
        (not temperature >= 0, f"--temperature {temperature}: must be >= 0 (0 is greedy)"),
        (top_k < 0, f"--top-k {top_k}: must be >= 0 (0 is off)"),
        (not 0 < top_p <= 1, f"--top-p {top_p}: must be in (0, 1] (1 is off)"),
        (not repetition_penalty >= 1, f"--repetition-penalty {repetition_penalty}: must be >= 1 (1 is off)"),
        (no_repeat_ngram < 0, f"--no-repeat-ngram {no_repeat_ngram}: must be >= 0 (0 is off)"),
    ]
    for bad, message in problems:
        if bad:
            raise EnlaceError(message)


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids [B] from last-position logits [B, V]. temperature 0 is greedy."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
        drop = sorted_p.cumsum(-1) - sorted_p > top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class RepeatGuard:
    """Discourages repeating what this reply already said.

    Only the generated tokens count, not the prompt: a chat prompt holds the template's markers and the
    user's words, and penalising those would make the model avoid ending its turn or quoting the question.
    End-of-turn ids are never penalised for the same reason.
    - repetition_penalty (Keskar et al. 2019, CTRL): the logit of every token already generated is divided
      by the penalty when positive, multiplied when negative.
    - no_repeat_ngram n: a token that would complete an n-gram already generated is banned outright.
    """

    def __init__(self, penalty: float = 1.0, ngram: int = 0, keep: Iterable[int] = ()):
        self.penalty, self.ngram, self.keep = penalty, ngram, set(keep)
        self.ids: list[int] = []
        self.seen: set[int] = set()
        self.follows: dict[tuple[int, ...], set[int]] = {}  # (n-1)-gram -> tokens that followed it

    @property
    def active(self) -> bool:
        return self.penalty != 1.0 or self.ngram > 0

    def push(self, token: int) -> None:
        self.ids.append(token)
        if token not in self.keep:
            self.seen.add(token)
        n = self.ngram
        if n > 0 and len(self.ids) >= n:
            self.follows.setdefault(tuple(self.ids[-n:-1]), set()).add(token)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Adjusted copy of last-position logits [1, V]."""
        if not self.active or not self.ids:
            return logits
        logits = logits.float().clone()
        if self.penalty != 1.0 and self.seen:
            idx = torch.tensor(sorted(self.seen))
            row = logits[0, idx]
            logits[0, idx] = torch.where(row > 0, row / self.penalty, row * self.penalty)
        if 0 < self.ngram <= len(self.ids) + 1:
            # The last n-1 tokens, then every token that followed them before (n = 1: every token seen).
            recent = tuple(self.ids[len(self.ids) - self.ngram + 1 :])
            banned = self.follows.get(recent, set()) - self.keep
            if banned:
                logits[0, torch.tensor(sorted(banned))] = float("-inf")
        return logits


def fit_prompt(prompt_ids: list[int], max_new_tokens: int, window: int) -> tuple[list[int], int]:
    """The prompt tokens kept and the new-token budget within the model's context window.

    A prompt that leaves no room is cut from the left (the most recent context stays), keeping at least
    half the window for the prompt; the cut is announced on stderr, never silent.
    """
    keep = min(len(prompt_ids), max(window - max_new_tokens, window // 2))
    if keep < len(prompt_ids):
        print(
            f"warning: the prompt is {len(prompt_ids)} tokens and the model's context is {window}; "
            f"keeping its last {keep} tokens",
            file=sys.stderr,
            flush=True,
        )
    return list(prompt_ids)[len(prompt_ids) - keep :], min(max_new_tokens, window - keep)


@torch.inference_mode()
def generate(
    model: Llama,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    no_repeat_ngram: int = 0,
    seed: int = 0,
    eos_ids: Iterable[int] = (),
    device: str | torch.device = "cpu",
) -> Iterator[int]:
    """Stream new token ids one at a time. The prompt is prefilled once; each step feeds one token."""
    if not prompt_ids:
        raise ValueError("generate needs at least one prompt token")
    check_sampling(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        repetition_penalty=repetition_penalty, no_repeat_ngram=no_repeat_ngram,
    )  # fmt: skip
    model.eval()
    prompt_ids, max_new_tokens = fit_prompt(list(prompt_ids), max_new_tokens, model.cfg.seq_len)
    dtype = next(model.parameters()).dtype
    cache = KVCache.empty(model.cfg, 1, len(prompt_ids) + max_new_tokens, torch.device(device), dtype)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    stop = set(eos_ids)
    guard = RepeatGuard(repetition_penalty, no_repeat_ngram, keep=stop)
    logits = model(torch.tensor([prompt_ids], device=device), cache=cache).logits[:, -1]
    for _ in range(max_new_tokens):
        nxt = sample_next(guard.apply(logits.cpu()), temperature, top_k, top_p, gen)
        token = int(nxt.item())
        yield token
        if token in stop:
            return
        guard.push(token)
        logits = model(nxt.view(1, 1).to(device), cache=cache).logits[:, -1]
