"""Sampling from a Llama with a KV cache: greedy, temperature, top-k and top-p, seeded; decode weights.

Decoding one token reads every weight once, so on a CPU its speed is set by the weights' bytes: bf16 halves
them, int8 weight-only quarters them. `decode_weights` converts a model for inference in place.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from .model import KVCache, Llama

# auto: bf16 on a CPU with native bf16 (avx512_bf16 or AMX), else fp32 as loaded.
DECODE_WEIGHTS = ("auto", "fp32", "bf16", "int8")


def resolve_decode_weights(weights: str, device: str | torch.device = "cpu") -> str:
    if weights not in DECODE_WEIGHTS:
        raise ValueError(f"decode weights {weights!r}: choose from {', '.join(DECODE_WEIGHTS)}")
    if weights != "auto":
        return weights
    from .runtime import cpu_bf16_native

    return "bf16" if torch.device(device).type == "cpu" and cpu_bf16_native() else "fp32"


class PackedLinear(nn.Module):
    """A frozen bf16 linear whose weight oneDNN has reordered once, ahead of time.

    A plain bf16 F.linear on CPU reorders the weight into oneDNN's blocked layout on every call, which costs
    as much as the product itself for one token; packing once makes decoding about twice as fast, with
    bit-identical outputs.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().to(torch.bfloat16)
        # batch-size hint 1: decoding feeds one token per step (any batch size still works).
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(w, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, self.in_features), self.packed, None, "none", [], ""
        )
        return y.view(*x.shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    """Weight-only int8 (symmetric, one scale per output row); activations stay bf16.

    torch's CPU kernel for this (_weight_int8pack_mm) reads a quarter of fp32's bytes and is the fastest
    decode path here; quantisation error is reported by bench_generate next to its speed.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.register_buffer("weight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scales)
        return y.view(*x.shape[:-1], self.out_features)


@torch.no_grad()
def decode_weights(model: Llama, weights: str = "auto", device: str | torch.device = "cpu") -> Llama:
    """Convert `model` in place for inference with `weights` (see DECODE_WEIGHTS); returns it.

    fp32 leaves it as it is. bf16 and int8 turn norms, embedding, activations and KV cache into bf16 and
    every linear layer (the tied output head included, which gets its own copy) into a packed bf16 or an
    int8 module: the model can no longer be trained. Off CPU, bf16 is a plain cast and int8 is refused.
    """
    weights = resolve_decode_weights(weights, device)
    if weights == "fp32":
        return model
    cpu = torch.device(device).type == "cpu"
    if weights == "int8" and not cpu:
        raise ValueError("int8 decode weights use torch's CPU kernel; use bf16 on a GPU")
    model.eval().to(torch.bfloat16)
    if not cpu or (weights == "bf16" and not torch.backends.mkldnn.is_available()):
        return model
    make = PackedLinear if weights == "bf16" else Int8Linear
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, make(child))
    return model


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
