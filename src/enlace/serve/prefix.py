"""The prompt prefix cache of the server (what llama.cpp's `cache_prompt` does).

Every request to the in-context assistant starts with the same preamble, and each turn of a conversation
resends the turns before it. Their keys and values were computed already: the engine keeps them here and a
new prompt that starts with the same tokens gets that prefix's KV copied into its slot's row, so only the
rest of the prompt is prefilled.

What is kept: the token ids of a sequence the engine prefilled or decoded (a prompt once prefilled, then the
prompt and its answer once the job leaves) and, per layer, its keys and values. A sequence that extends a
kept one replaces it; one already covered by a kept one only refreshes it. At most `limit` positions are
held in all, in at most `entries` sequences (least recently used dropped first); a sequence longer than the
limit keeps its first `limit` positions (a long conversation still keeps its preamble). Memory is at most
limit x bytes_per_token (2 x layers x KV heads x head_dim x the cache dtype's size).

Reuse is exact in what it computes: position i's keys and values depend only on tokens 0..i, and the cache
holds every position (a sliding-window layer masks old ones, it does not drop them), so a prefill that
starts at position n after a copy attends to what a whole prefill would. Only the float sums' order
differs (a chunk of T tokens against one of n + T), as between any two prefill lengths. A prompt's last
token always goes in as a decode step (generate.prompt_logits), so a request repeated exactly gets the same
first logits, and with its seed the same tokens, whether or not its prompt was kept here.
Only the compute thread touches it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config.model import ModelConfig
from ..model import KVCache, Llama

DEFAULT_ENTRIES = 4  # sequences kept: the preamble's requests and a few conversations


@dataclass
class _Entry:
    ids: list[int]
    k: list[torch.Tensor]  # per layer [KV heads, n, head_dim]
    v: list[torch.Tensor]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids a and b share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """Token prefixes with their KV, at most `limit` positions in `entries` sequences (0: off)."""

    def __init__(self, limit: int, entries: int = DEFAULT_ENTRIES):
        if limit < 0 or entries < 1:
            raise ValueError(f"prefix cache of {limit} positions in {entries} entries")
        self.limit, self.max_entries = limit, entries
        self._entries: list[_Entry] = []  # least recently used first

    @property
    def tokens(self) -> int:
        """Positions held now."""
        return sum(len(e.ids) for e in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def load(self, ids: list[int], row: KVCache) -> int:
        """Copy the longest kept prefix of `ids` (all but its last token at most: the prefill needs one to
        give logits) into `row` (batch 1, empty) and set its position; how many positions were copied."""
        best, n = None, 0
        for e in self._entries:
            m = common_prefix(e.ids, ids)
            if m > n:
                best, n = e, m
        n = min(n, len(ids) - 1)
        if best is None or n <= 0:
            return 0
        for dst, src in zip(row.k + row.v, best.k + best.v, strict=True):
            dst[0, :, :n] = src[:, :n]
        row.pos = n
        self._entries.remove(best)
        self._entries.append(best)  # the most recently used
        return n

    def store(self, ids: list[int], row: KVCache, length: int) -> None:
        """Keep the first `length` positions of `row` (batch 1), which hold the KV of ids[:length]."""
        n = min(length, len(ids), self.limit)
        if n <= 0:
            return
        ids = list(ids[:n])
        for e in self._entries:
            if len(e.ids) >= n and common_prefix(e.ids, ids) == n:  # already covered: refresh it
                self._entries.remove(e)
                self._entries.append(e)
                return
        # A kept prefix of this sequence is superseded by it.
        self._entries = [e for e in self._entries if common_prefix(e.ids, ids) < len(e.ids)]
        k = [t[0, :, :n].clone() for t in row.k]
        v = [t[0, :, :n].clone() for t in row.v]
        self._entries.append(_Entry(ids, k, v))
        while len(self._entries) > self.max_entries or self.tokens > self.limit:
            self._entries.pop(0)


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """What one position of KV takes in all layers (keys and values)."""
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * size


def prompt_cache_words(model: Llama, limit: int) -> str:
    """The prompt cache's bound in words, for the start-up line."""
    if not limit:
        return "no prompt cache"
    mib = limit * bytes_per_token(model.cfg, next(model.parameters()).dtype) / 2**20
    return f"prompt cache {limit} tokens ({mib:.0f} MiB at most)"
