"""Loss and bits per byte of a model on fixed token windows: the one scoring path.

The trainer's in-run validation, the eval stage and the prose yardstick all call `evaluate`, so the same
weights on the same windows give the same numbers everywhere. Windows carry the exact UTF-8 bytes their
scored targets stand for (enlace.scoring.token_bytes), so bits per byte is total bits over those bytes.

Two ways to lay windows over tokens:
- `spread_windows`: n windows of seq_len targets at evenly spaced starts over a whole split (validation),
  the first at its start and the last at its end; with n at least the split's capacity, the split is
  tiled and every token after the first is scored once.
- `sliding_windows`: one long text in windows of `context` tokens moved by `stride`; every window after the
  first scores only its last `stride` targets, so each scored token sees at least context - stride tokens
  before it (all earlier ones inside the first window).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..model import IGNORE_INDEX
from ..runtime import autocast, sdpa_backend
from .token_bytes import TokenBytes


@dataclass(frozen=True)
class Windows:
    """Inputs and targets [n, T]; a target of IGNORE_INDEX is context only, never scored."""

    x: torch.Tensor
    y: torch.Tensor
    bytes: int  # UTF-8 bytes of the scored targets

    @property
    def tokens(self) -> int:
        return int((self.y != IGNORE_INDEX).sum())

    def __len__(self) -> int:
        return self.x.shape[0]


def _as_windows(rows: list[np.ndarray], scored_from: list[int], counter: TokenBytes) -> Windows:
    block = torch.from_numpy(np.stack(rows).astype(np.int64))
    x, y = block[:, :-1].clone(), block[:, 1:].clone()
    n_bytes = 0
    for i, first in enumerate(scored_from):
        y[i, :first] = IGNORE_INDEX
        n_bytes += counter.count(x[i, first:].numpy(), y[i, first:].numpy())
    return Windows(x, y, n_bytes)


def spread_starts(size: int, seq_len: int, n: int) -> np.ndarray:
    """Starts of n windows of seq_len + 1 tokens, evenly spread over `size` tokens and never overlapping
    in their targets; capped at the size // seq_len windows that tile the split."""
    capacity = (size - 1) // seq_len
    if n <= 0 or capacity <= 0:
        raise ValueError(f"cannot lay {n} windows of {seq_len} + 1 tokens over {size} tokens")
    if n >= capacity:
        return np.arange(capacity, dtype=np.int64) * seq_len
    if n == 1:
        return np.zeros(1, dtype=np.int64)
    last = size - 1 - seq_len  # the last window ends at the split's last token
    return (np.arange(n, dtype=np.int64) * last) // (n - 1)


def spread_windows(tokens: Any, seq_len: int, n: int, counter: TokenBytes) -> Windows:
    """`tokens`: a 1-D array, or anything with .size and .window(start, length) (a sharded split)."""
    window = getattr(tokens, "window", None) or (lambda s, length: tokens[s : s + length])
    starts = spread_starts(int(tokens.size), seq_len, n)
    rows = [np.asarray(window(int(s), seq_len + 1)) for s in starts]
    return _as_windows(rows, [0] * len(rows), counter)


def sliding_windows(ids: list[int] | np.ndarray, context: int, stride: int, counter: TokenBytes) -> Windows:
    """Windows over one token sequence; targets are ids[1:], each scored exactly once."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size < 2:
        raise ValueError("a text of fewer than 2 tokens has nothing to score")
    if not 0 < stride <= context:
        raise ValueError(f"stride {stride} must be in 1..context ({context})")
    length = min(context, ids.size - 1)  # targets per window
    rows, scored_from, done = [], [], 0  # done: targets ids[1 : done + 1] already scored
    while done < ids.size - 1:
        end = min(done + (length if not rows else stride), ids.size - 1)  # last target index (in ids)
        start = end - length
        rows.append(ids[start : end + 1])
        scored_from.append(done - start)
        done = end
    return _as_windows(rows, scored_from, counter)


@contextlib.contextmanager
def precision(hw: Any) -> Iterator[None]:
    """The forward's context, in validation as in training: the hardware profile's autocast and attention."""
    with autocast(hw), sdpa_backend(hw):
        yield


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    windows: Windows,
    *,
    batch_size: int,
    precision: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    device: torch.device | str | None = None,
) -> dict[str, float | int]:
    """Mean cross-entropy (nats per scored token, without z-loss), bits per byte, tokens and bytes.

    precision: a factory of the context the forward runs in (autocast and attention backend), so scoring
    is done as the model trains or serves.
    """
    if len(windows) == 0 or windows.tokens == 0:
        raise ValueError("no windows to score")
    if device is None:
        device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    nats = 0.0
    try:
        for i in range(0, len(windows), batch_size):
            x = windows.x[i : i + batch_size].to(device)
            y = windows.y[i : i + batch_size].to(device)
            with precision():
                out = model(x, targets=y)
            nats += out.ce.double().item() * int((y != IGNORE_INDEX).sum())
    finally:
        model.train(was_training)
    loss = nats / windows.tokens
    return {
        "loss": loss,
        "bpb": nats / math.log(2) / windows.bytes,
        "tokens": windows.tokens,
        "bytes": windows.bytes,
    }
