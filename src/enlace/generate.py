"""Sampling from a Llama with a KV cache: greedy, temperature, top-k and top-p, seeded."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from .model import KVCache, Llama


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


@torch.inference_mode()
def generate(
    model: Llama,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_ids: Iterable[int] = (),
    device: str | torch.device = "cpu",
) -> Iterator[int]:
    """Stream new token ids one at a time. The prompt is prefilled once; each step feeds one token."""
    if not prompt_ids:
        raise ValueError("generate needs at least one prompt token")
    model.eval()
    window = model.cfg.seq_len
    prompt_ids = list(prompt_ids)[-window:]  # keep the most recent context that fits
    max_new_tokens = min(max_new_tokens, window - len(prompt_ids))
    if max_new_tokens <= 0:
        return
    dtype = next(model.parameters()).dtype
    cache = KVCache.empty(model.cfg, 1, len(prompt_ids) + max_new_tokens, torch.device(device), dtype)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    stop = set(eos_ids)
    logits = model(torch.tensor([prompt_ids], device=device), cache=cache).logits[:, -1]
    for _ in range(max_new_tokens):
        nxt = sample_next(logits.cpu(), temperature, top_k, top_p, gen)
        token = int(nxt.item())
        yield token
        if token in stop:
            return
        logits = model(nxt.view(1, 1).to(device), cache=cache).logits[:, -1]
