"""Sampling from a Llama with a KV cache: greedy, temperature, top-k and top-p, seeded, with optional
repetition controls (a repetition penalty and a no-repeat n-gram ban) so small models do not loop; and the
decode weights. Decoding one token reads every weight once, so on a CPU its speed is set by the weights'
bytes: bf16 halves them, int8 weight-only quarters them. `decode_weights` converts a model in place.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .errors import EnlaceError, HardwareError
from .model import KVCache, Llama

# auto: bf16 on a CPU with native bf16 (avx512_bf16 or AMX), else fp32 as loaded.
DECODE_WEIGHTS = ("auto", "fp32", "bf16", "int8")
# The output head's weights: as the rest of the model, or int8 whatever the rest is (decode_weights).
HEAD_WEIGHTS = ("same", "int8")


def resolve_decode_weights(
    weights: str, device: str | torch.device = "cpu", flags: frozenset[str] | None = None
) -> str:
    """The decode weights `weights` means here; refuses bf16 on a CPU whose oneDNN cannot pack it.

    flags: the CPU's instruction-set flags (default: this machine's /proc/cpuinfo).
    """
    from .runtime import cpu_bf16_native, onednn_bf16_missing

    if weights not in DECODE_WEIGHTS:
        raise ValueError(f"decode weights {weights!r}: choose from {', '.join(DECODE_WEIGHTS)}")
    cpu = torch.device(device).type == "cpu"
    if weights == "auto":
        return "bf16" if cpu and cpu_bf16_native(flags) else "fp32"
    if weights == "bf16" and cpu and torch.backends.mkldnn.is_available():
        missing = onednn_bf16_missing(flags)
        if missing:
            raise HardwareError(f"decode weights bf16: {missing}; use --weights fp32 or int8")
    return weights


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
    """Weight-only int8 (symmetric, one scale per output row); activations in the scales' dtype (bf16, or
    fp32 for an int8 head on an fp32 model), as is the output.

    torch's CPU kernel for this (_weight_int8pack_mm) reads a quarter of fp32's bytes and is the fastest
    decode path here; quantisation error is reported by bench_generate next to its speed, and the head's
    in bits per byte by bench/bench_head_int8.py.
    """

    def __init__(self, linear: nn.Linear, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.register_buffer("weight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(self.scales.dtype)
        y = torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scales)
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel multiplies by, as an fp32 matrix (a new tensor: for scoring, not decoding)."""
        return self.weight.float() * self.scales.float()[:, None]


class Int8Embedding(nn.Module):
    """The input embedding of a tied model read from its int8 output head: one copy of the weights.

    A row is the head's int8 row times its scale, in the scales' dtype (the model's after decode_weights).
    """

    def __init__(self, head: Int8Linear):
        super().__init__()
        self.head = [head]  # a list: not a submodule, so its buffers are not listed twice

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        head = self.head[0]
        return head.weight[idx].to(head.scales.dtype) * head.scales[idx].unsqueeze(-1)


@torch.no_grad()
def decode_weights(
    model: Llama,
    weights: str = "auto",
    device: str | torch.device = "cpu",
    flags: frozenset[str] | None = None,
    head: str = "same",
) -> Llama:
    """Convert `model` in place for inference with `weights` (see DECODE_WEIGHTS); returns it.

    fp32 leaves it as it is. bf16 and int8 turn norms, embedding, activations and KV cache into bf16 and
    every linear layer into a packed bf16 or an int8 module: the model can no longer be trained. A tied
    model keeps one copy in int8 (the embedding reads the head's int8 rows); in bf16 the packed head is a
    second copy, as oneDNN's blocked layout cannot be read by rows. Off CPU, bf16 is a plain cast and int8
    is refused.
    head "int8": the output head in int8 whatever `weights` is (quantised from the fp32 weights, its
    activations in the model's dtype), and a tied embedding reads its rows: one int8 copy where Gemma 3
    270M's 262k x 640 head and embedding were 63% of its fp32 bytes.
    flags: the CPU's instruction-set flags, as resolve_decode_weights takes them.
    """
    weights = resolve_decode_weights(weights, device, flags)
    cpu = torch.device(device).type == "cpu"
    if head not in HEAD_WEIGHTS:
        raise ValueError(f"head weights {head!r}: choose from {', '.join(HEAD_WEIGHTS)}")
    if "int8" in (weights, head) and not cpu:
        raise ValueError("int8 decode weights use torch's CPU kernel; use bf16 on a GPU")
    if head == "int8" and weights != "int8":
        int8_head(model.eval())
    if weights == "fp32":
        return model
    model.eval().to(torch.bfloat16)  # an int8 head's scales too: its activations follow the model's
    if not cpu or (weights == "bf16" and not torch.backends.mkldnn.is_available()):
        return model
    make = PackedLinear if weights == "bf16" else Int8Linear
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, make(child))
    if weights == "int8" and model.cfg.tie_embeddings:
        model.model.embed_tokens = Int8Embedding(model.lm_head)
    return model


def int8_head(model: Llama) -> Llama:
    """The output head in int8 with one fp32 scale per row, in place; a tied embedding then reads the same
    int8 rows (dequantised), so the fp32 matrix is freed and one int8 copy serves both."""
    model.lm_head = Int8Linear(model.lm_head, dtype=torch.float32)
    if model.cfg.tie_embeddings:
        model.model.embed_tokens = Int8Embedding(model.lm_head)
    return model


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
    """Next token ids [B] from last-position logits [B, V]. temperature 0 is greedy.

    With top_k, only the k largest logits are kept, softmaxed and (for top_p) sorted: topk returns them
    in order, so a 262k vocabulary is never sorted whole."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k and top_k < logits.size(-1):
        values, ids = torch.topk(logits, top_k, dim=-1)  # sorted, largest first
        return ids.gather(-1, _sample_sorted(torch.softmax(values, dim=-1), top_p, generator)).squeeze(-1)
    probs = torch.softmax(logits, dim=-1)
    if top_p >= 1.0:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    return order.gather(-1, _sample_sorted(sorted_p, top_p, generator)).squeeze(-1)


def _sample_sorted(sorted_p: torch.Tensor, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """Positions [B, 1] drawn from probabilities sorted largest first, within the top_p nucleus."""
    if top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
        drop = sorted_p.cumsum(-1) - sorted_p > top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.multinomial(sorted_p, 1, generator=generator)


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
    # The head on the last position only: a prefill needs no other logits (for a 262k vocabulary and a long
    # prompt the rest would be most of its work).
    logits = model(torch.tensor([prompt_ids], device=device), cache=cache, last_only=True).logits[:, -1]
    for _ in range(max_new_tokens):
        nxt = sample_next(guard.apply(logits.cpu()), temperature, top_k, top_p, gen)
        token = int(nxt.item())
        yield token
        if token in stop:
            return
        guard.push(token)
        logits = model(nxt.view(1, 1).to(device), cache=cache).logits[:, -1]


@dataclass
class Prefilled:
    """A prompt's keys and values (batch 1): a later prompt that starts with the same ids (a preamble)
    copies them instead of computing them again."""

    ids: list[int]
    cache: KVCache


@torch.inference_mode()
def prefill(model: Llama, ids: list[int], device: str | torch.device = "cpu") -> Prefilled:
    """The keys and values of `ids`, computed once."""
    model.eval()
    dtype = next(model.parameters()).dtype
    cache = KVCache.empty(model.cfg, 1, len(ids), torch.device(device), dtype)
    model(torch.tensor([ids], device=device), cache=cache, last_only=True)
    return Prefilled(list(ids), cache)


def _start(model: Llama, prompt_ids: list[int], size: int, prefix: Prefilled | None, device) -> tuple:
    """A batch-1 cache of `size` positions holding the prompt, and the logits after it [1, V]: the positions
    it shares with `prefix` are copied (at least the last prompt token is computed, for its logits)."""
    dtype = next(model.parameters()).dtype
    cache = KVCache.empty(model.cfg, 1, size, torch.device(device), dtype)
    shared = 0
    if prefix is not None:
        limit = min(len(prefix.ids), len(prompt_ids) - 1)
        while shared < limit and prefix.ids[shared] == prompt_ids[shared]:
            shared += 1
        for dst, src in zip(cache.k + cache.v, prefix.cache.k + prefix.cache.v, strict=True):
            dst[:, :, :shared] = src[:, :, :shared]
        cache.pos = shared
    rest = torch.tensor([prompt_ids[shared:]], device=device)
    return cache, model(rest, cache=cache, last_only=True).logits[:, -1]


@torch.inference_mode()
def sample_many(
    model: Llama,
    prompt_ids: list[int],
    max_new_tokens: int,
    seeds: list[int],
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    no_repeat_ngram: int = 0,
    eos_ids: Iterable[int] = (),
    done: Callable[[list[int]], bool] | None = None,
    prefix: Prefilled | None = None,
    device: str | torch.device = "cpu",
) -> list[list[int]]:
    """One continuation of the prompt per seed, decoded together: the prompt is prefilled once (after the
    positions it shares with `prefix`), then every step feeds one token per unfinished row, so the weights
    are read once for all of them. Row i samples as `generate(..., seed=seeds[i])` does (its own generator
    and repetition guard); a batched matmul may round differently, so a row can differ from `generate`'s
    where two tokens are nearly tied. A row ends at an eos id, when `done(its ids)` says so, or at the
    budget."""
    if not prompt_ids or not seeds:
        raise ValueError("sample_many needs at least one prompt token and one seed")
    check_sampling(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        repetition_penalty=repetition_penalty, no_repeat_ngram=no_repeat_ngram,
    )  # fmt: skip
    model.eval()
    prompt_ids, max_new_tokens = fit_prompt(list(prompt_ids), max_new_tokens, model.cfg.seq_len)
    one, logits = _start(model, prompt_ids, len(prompt_ids) + max_new_tokens, prefix, device)
    n = len(seeds)
    cache = KVCache([k.repeat(n, 1, 1, 1) for k in one.k], [v.repeat(n, 1, 1, 1) for v in one.v], one.pos)
    logits = logits.expand(n, -1)
    stop = set(eos_ids)
    gens = [torch.Generator(device="cpu").manual_seed(s) for s in seeds]
    guards = [RepeatGuard(repetition_penalty, no_repeat_ngram, keep=stop) for _ in seeds]
    out: list[list[int]] = [[] for _ in seeds]
    live = list(range(len(seeds)))  # the rows still decoding, in cache order
    for _ in range(max_new_tokens):
        feed, keep = [], []
        for row, i in enumerate(live):
            nxt = sample_next(
                guards[i].apply(logits[row : row + 1].cpu()), temperature, top_k, top_p, gens[i]
            )
            token = int(nxt.item())
            out[i].append(token)
            if token in stop or (done is not None and done(out[i])):
                continue
            guards[i].push(token)
            feed.append(token)
            keep.append(row)
        if not keep:
            break
        if len(keep) < len(live):  # finished rows leave the batch
            idx = torch.tensor(keep, device=device)
            cache = KVCache(
                [k.index_select(0, idx) for k in cache.k],
                [v.index_select(0, idx) for v in cache.v],
                cache.pos,
            )
            live = [live[r] for r in keep]
        logits = model(torch.tensor(feed, device=device).view(-1, 1), cache=cache).logits[:, -1]
    return out
