"""A Llama-style decoder in one file.

RMSNorm, SwiGLU, rotary embeddings in the Hugging Face half-split convention, grouped-query attention,
optional QK-norm and z-loss, tied input/output embeddings, and a KV cache for generation.

Config switches (config/model.py; all off by default) make the same decoder Gemma 3: RMSNorm by
(1 + weight), sandwich norms, GeGLU, embeddings scaled by sqrt(d_model), a stated head_dim and attention
scale, and local sliding-window layers with their own RoPE base between the global ones.
Others are the small-scale speedrun changes the ablations try: a squared-ReLU gate, zero-initialised
output projections, soft-capped logits and per-layer value embeddings.

Module names mirror Hugging Face's LlamaForCausalLM (Qwen3's q_norm/k_norm, Gemma3ForCausalLM's
pre/post-feedforward norms), so a state dict maps one to one: `model.layers.3.self_attn.q_proj.weight` here
is the same tensor there. Precision and parallelism are the trainer's business; this file only describes
the computation.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config.model import ModelConfig

IGNORE_INDEX = -100  # label value that contributes nothing to the loss (prompt tokens, padding)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: under fp16 autocast the mean of squares overflows easily.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            # Gemma: scale by (1 + weight) in fp32, then cast (as Gemma's reference does).
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(head_dim: int, positions: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [T, head_dim], the two halves repeated (half-split convention)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + head_dim/2) of x [B, H, T, D] by position-dependent angles."""
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


def zeros_on_touch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that take memory only where written, on the CPU.

    A cache is sized for the longest sequence a slot may hold, and most slots never fill it: torch.zeros
    writes every byte (so every page counts in resident memory from the start), where a fresh anonymous
    mapping reads as zeros and the kernel gives it a page only when one is first written. Where the kernel
    backs memory with 2 MiB pages by default (transparent huge pages set to "always"), one written key would
    take 2 MiB; the mapping asks for small pages. It lives as long as the tensor does. Elsewhere, plain
    torch.zeros."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < mmap.PAGESIZE:
        return torch.zeros(shape, device=device, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


@dataclass
class KVCache:
    """Preallocated keys and values per layer; `pos` is how many positions are filled."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    pos: int = 0

    @classmethod
    def empty(
        cls, cfg: ModelConfig, batch: int, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> KVCache:
        shape = (batch, cfg.n_kv_head, max_len, cfg.head_dim)
        k = [zeros_on_touch(shape, dtype, device) for _ in range(cfg.n_layer)]
        v = [zeros_on_touch(shape, dtype, device) for _ in range(cfg.n_layer)]
        return cls(k, v)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def row(self, i: int) -> KVCache:
        """Row i as a cache of batch 1 (views: what it is given is written into this cache)."""
        return KVCache([k[i : i + 1] for k in self.k], [v[i : i + 1] for v in self.v])


@dataclass
class SlotCache:
    """The KV cache of independent sequences decoded together (the server's slots), one row each.

    Rows 0..B-1 are the active ones; row i holds lengths[i] positions. A decode step feeds one new token
    per active row, written at its own position; each row sees its own positions only (a mask, where the
    rows' lengths differ). A sequence is prefilled alone through `cache.row(i)`, generate's own path.
    """

    cache: KVCache  # [slots, KV, capacity, D] per layer
    lengths: list[int]
    # Set by Llama.hidden_states for the step under way: the positions written, the masks (None: no mask).
    positions: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    local_mask: torch.Tensor | None = None

    def prepare(self, window: int | None, device: torch.device) -> None:
        """The step's positions and masks: [B, 1, 1, max length + 1] booleans, row i true up to its own."""
        self.positions = torch.tensor(self.lengths, device=device)
        span = max(self.lengths) + 1
        j = torch.arange(span, device=device)[None, :]
        pos = self.positions[:, None]
        self.mask = None if min(self.lengths) == span - 1 else (j <= pos)[:, None, None, :]
        self.local_mask = None
        if window is not None and span > window:
            self.local_mask = ((j <= pos) & (j > pos - window))[:, None, None, :]


# On CPU, up to this many tokens, attention runs as two batched matmuls around a softmax rather than through
# PyTorch's CPU flash kernel. Measured forward+backward in bf16 on this project's 2-core EPYC (median of 31):
# cpu-small's layer (B16 H4 KV2 T256) 14 vs 26 ms, T512 (B4 H8 KV4) 29 vs 41 ms, SmolLM2's at T128 3 vs 12 ms.
# At T2048 flash wins (97 vs 181 ms): its tiling avoids the T x T scores, which dominate there.
CPU_MATMUL_ATTENTION_MAX_LEN = 512


def uses_matmul_attention(device_type: str, sdpa_backend: str, seq_len: int) -> bool:
    """Whether a forward pass without KV cache takes matmul_attention; a pinned SDPA backend is honoured."""
    return device_type == "cpu" and sdpa_backend == "auto" and seq_len <= CPU_MATMUL_ATTENTION_MAX_LEN


def matmul_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal softmax(q k^T * scale) v for q [B, H, T, D] and k, v [B, KV, T, D]; scale defaults to
    1/sqrt(D). With a window, each query sees only the last `window` positions, its own included.

    Each KV head serves H / KV consecutive query heads (SDPA's enable_gqa grouping): viewing those query
    heads as one sequence of group * T rows shares the KV head without repeating it in memory.
    """
    B, H, T, D = q.shape
    kv_heads = k.shape[1]
    group = H // kv_heads
    q = (q * (D**-0.5 if scale is None else scale)).reshape(B, kv_heads, group * T, D)
    scores = (q @ k.transpose(-1, -2)).view(B, kv_heads, group, T, T)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    if window is not None and window < T:
        future |= torch.ones(T, T, dtype=torch.bool, device=q.device).tril(-window)
    # In place: the matmul's backward needs its inputs, not its output.
    probs = torch.softmax(scores.masked_fill_(future, float("-inf")), dim=-1)
    if dropout_p:
        probs = F.dropout(probs, dropout_p)
    return (probs.view(B, kv_heads, group * T, T) @ v).view(B, H, T, D)


def one_query_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """softmax(q k^T * scale) v for one query per row, q [B, H, 1, D], over all of k, v [B, KV, L, D]; each KV
    head serves its group of H / KV query heads, viewed as rows of one matrix (no repeat in memory)."""
    B, H, _, D = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(B, kv_heads, H // kv_heads, D) * (D**-0.5 if scale is None else scale)
    probs = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
    return (probs @ v).view(B, H, 1, D)


def visible(start: int, T: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Boolean [T, start + T]: which positions the queries at start..start+T-1 attend to (causal, and
    within the sliding window if there is one)."""
    i = torch.arange(start, start + T, device=device)[:, None]
    j = torch.arange(start + T, device=device)[None, :]
    allowed = j <= i
    return allowed & (j > i - window) if window is not None else allowed


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, sdpa_backend: str = "auto", window: int | None = None):
        super().__init__()
        self.sdpa_backend = sdpa_backend
        self.window = window  # None: global attention
        s = cfg.query_pre_attn_scalar
        self.scale = None if s is None else s**-0.5  # None: SDPA's own 1/sqrt(head_dim)
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)
        # QK-norm (as in Qwen3): RMSNorm over head_dim bounds the attention logits.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.norm_unit_offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.norm_unit_offset) if cfg.qk_norm else None
        self.dropout = cfg.dropout
        # Decoding only: q, k and v in one product (set by fuse_projections, which removes the three).
        self.qkv: nn.Module | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
        value_embed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """value_embed: this layer's value embedding of the tokens [B, T, KV * D], added to the values."""
        B, T, _ = x.shape
        if self.qkv is not None:
            qd, kd = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
            q, k, v = self.qkv(x).split([qd, kd, kd], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if value_embed is not None:
            v = v + value_embed.to(v.dtype)
        q = q.view(B, T, self.n_head, self.head_dim)
        k = k.view(B, T, self.n_kv_head, self.head_dim)
        v = v.view(B, T, self.n_kv_head, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        if isinstance(cache, SlotCache):
            return self.o_proj(self._rows(q, k, v, cache, layer).transpose(1, 2).reshape(B, T, -1))
        dropout_p = self.dropout if self.training else 0.0
        if cache is None and uses_matmul_attention(x.device.type, self.sdpa_backend, T):
            y = matmul_attention(q, k, v, dropout_p, self.scale, self.window)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))
        mask, causal, start = None, True, 0
        if cache is not None:
            start = cache.pos
            cache.k[layer][:, :, start : start + T] = k
            cache.v[layer][:, :, start : start + T] = v
            k, v = cache.k[layer][:, :, : start + T], cache.v[layer][:, :, : start + T]
            if start > 0:
                # New queries see every cached position and the causal part of their own chunk.
                causal = False
                if T > 1:
                    mask = visible(start, T, None, x.device)
        if T == 1 and cache is not None and x.device.type == "cpu":
            # One new query: it sees every cached position (a local layer's last `window` only). Two small
            # matmuls around a softmax cost a fraction of the flash kernel's set-up for one row.
            if self.window is not None and start + 1 > self.window:
                k, v = k[:, :, -self.window :], v[:, :, -self.window :]
            y = one_query_attention(q, k, v, self.scale)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))
        if self.window is not None and start + T > self.window:
            # A local layer: positions older than the window are hidden too. (The cache keeps them: the
            # mask is cheap next to a rolling buffer, and both kinds of layer share one cache layout.)
            mask, causal = visible(start, T, self.window, x.device), False
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal and mask is None,
            dropout_p=dropout_p,
            scale=self.scale,
            # GQA without materialising repeated KV heads, where the backend supports it.
            enable_gqa=self.n_kv_head != self.n_head,
        )
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))

    def _rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: SlotCache, layer: int):
        """One new token per active row, each at its own position (SlotCache): written, then attended."""
        B = q.shape[0]
        rows = torch.arange(B, device=q.device)
        ck, cv = slots.cache.k[layer], slots.cache.v[layer]
        ck[rows, :, slots.positions] = k[:, :, 0]
        cv[rows, :, slots.positions] = v[:, :, 0]
        span = max(slots.lengths) + 1
        mask = slots.local_mask if self.window is not None and slots.local_mask is not None else slots.mask
        return F.scaled_dot_product_attention(
            q, ck[:B, :, :span], cv[:B, :, :span], attn_mask=mask, scale=self.scale,
            enable_gqa=self.n_kv_head != self.n_head,
        )  # fmt: skip


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


MLP_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": gelu_tanh,
    "relu2": relu_squared,
}


class MLP(nn.Module):
    """Gated: down(act(gate(x)) * up(x)); SwiGLU with silu, GeGLU with GELU (tanh approximation), or the
    squared ReLU."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)
        self.act = MLP_ACTIVATIONS[cfg.mlp_act]
        # Decoding only: gate and up in one product (set by fuse_projections, which removes the two).
        self.gate_up: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


@torch.no_grad()
def fuse_projections(model: nn.Module) -> None:
    """For decoding: q, k and v (and gate and up) as one linear each, their weights stacked by rows, in place.

    Each output is still its own row's dot product, so the values are those of the separate products; a
    decode step makes two calls where it made five, and each reads one larger matrix. The model can no
    longer be trained, loaded from or saved to a state dict.
    """

    def stacked(*linears: nn.Linear) -> nn.Linear:
        w = torch.cat([lin.weight for lin in linears])
        fused = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        fused.weight = nn.Parameter(w, requires_grad=False)
        return fused

    def plain(*linears: nn.Module) -> bool:  # an unmerged LoRA adapter keeps its own products
        return all(type(lin) is nn.Linear for lin in linears)

    for module in model.modules():
        if (
            isinstance(module, Attention)
            and module.qkv is None
            and plain(module.q_proj, module.k_proj, module.v_proj)
        ):
            module.qkv = stacked(module.q_proj, module.k_proj, module.v_proj)
            del module.q_proj, module.k_proj, module.v_proj
        elif isinstance(module, MLP) and module.gate_up is None and plain(module.gate_proj, module.up_proj):
            module.gate_up = stacked(module.gate_proj, module.up_proj)
            del module.gate_proj, module.up_proj


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, sdpa_backend: str = "auto", layer: int = 0):
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_unit_offset)

        window = cfg.sliding_window if cfg.is_local(layer) else None
        self.sandwich = cfg.sandwich_norm
        # Hugging Face's names: in Llama post_attention_layernorm is the norm before the MLP; in Gemma it is
        # the norm on the attention output, and pre_/post_feedforward_layernorm wrap the MLP.
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, sdpa_backend, window)
        self.post_attention_layernorm = norm()
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

    def forward(self, x, cos, sin, cache=None, layer=0, value_embed=None):
        if self.sandwich:
            h = self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, value_embed)
            x = x + self.dropout(self.post_attention_layernorm(h))
            h = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
            return x + self.dropout(h)
        x = x + self.dropout(self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, value_embed))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, sdpa_backend: str = "auto"):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, sdpa_backend, i) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_unit_offset)
        if cfg.value_embeds:
            kv_dim = cfg.n_kv_head * cfg.head_dim
            self.value_embeds = nn.ModuleList(
                nn.Embedding(cfg.vocab_size, kv_dim) for _ in range(cfg.n_layer)
            )


@dataclass
class Output:
    logits: torch.Tensor | None  # None when targets were given: the loss never materialises all logits
    loss: torch.Tensor | None = None  # ce + z_loss_weight * z_loss: what backward() sees
    ce: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig, sdpa_backend: str = "auto"):
        """sdpa_backend: the hardware profile's; "auto" takes matmul_attention where it is faster (CPU, short
        sequences) and otherwise lets PyTorch choose, any other value keeps every pass on SDPA."""
        super().__init__()
        self.cfg = cfg
        # Decoding only: one step of one new token per row through every layer at once, given the embedded
        # rows [B, d], their positions [B] and the caches' keys and values (generate.KernelDecode sets it).
        self.layers_step: Callable[[torch.Tensor, torch.Tensor, list, list], None] | None = None
        # Fine-tuning only: NEFTune's noise [B, T, d] for the next forward's embeddings (finetune.train.neftune
        # sets and clears it); a tensor input rather than a hook, so a compiled step takes it as one.
        self.embed_noise: torch.Tensor | None = None
        self.model = Decoder(cfg, sdpa_backend)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() == 1 and self.cfg.norm_unit_offset:  # norm weights: the identity scale
                nn.init.zeros_(p)
            elif p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")) and self.cfg.zero_init_proj:
                nn.init.zeros_(p)  # each block starts as the identity; its input gradients start at zero too
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                # Residual-branch outputs: scaled so the residual stream's variance does not grow with depth.
                nn.init.normal_(p, mean=0.0, std=std / math.sqrt(2 * self.cfg.n_layer))
            else:
                nn.init.normal_(p, mean=0.0, std=std)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights are counted once

    def hidden_states(self, idx: torch.Tensor, cache: KVCache | SlotCache | None = None) -> torch.Tensor:
        """The final-normed hidden states [B, T, d]: everything but the output head."""
        if isinstance(cache, SlotCache):
            return self._rows_hidden_states(idx, cache)
        B, T = idx.shape
        start = cache.pos if cache is not None else 0
        if start + T > (cache.max_len if cache is not None else self.cfg.seq_len):
            raise ValueError(f"sequence of {start + T} tokens exceeds the window of {self.cfg.seq_len}")
        x = self.embed(idx)
        if T == 1 and cache is not None and self.layers_step is not None and not torch.is_grad_enabled():
            x = x.view(B, -1).contiguous()
            self.layers_step(x, torch.full((B,), start, dtype=torch.long), cache.k, cache.v)
            cache.pos += 1
            return self.model.norm(x.view(B, 1, -1))
        if cache is not None:  # decoding: the tables are built once, not at each step
            rope = [(cos[start : start + T], sin[start : start + T]) for cos, sin in self._rope(x, start + T)]
        else:
            positions = torch.arange(start, start + T, device=idx.device)
            rope = [rope_cos_sin(self.cfg.head_dim, positions, self.cfg.rope_theta)]
            if self.cfg.rope_local_theta is not None:
                rope.append(rope_cos_sin(self.cfg.head_dim, positions, self.cfg.rope_local_theta))
            rope = [(cos.to(x.dtype), sin.to(x.dtype)) for cos, sin in rope]
        for i, block in enumerate(self.model.layers):
            cos, sin = rope[1] if len(rope) > 1 and self.cfg.is_local(i) else rope[0]
            x = block(x, cos, sin, cache, i, self.value_embed(idx, i))
        if cache is not None:
            cache.pos += T
        return self.model.norm(x)

    def value_embed(self, idx: torch.Tensor, layer: int) -> torch.Tensor | None:
        """Layer `layer`'s value embedding of the tokens (None without value embeddings)."""
        return self.model.value_embeds[layer](idx) if self.cfg.value_embeds else None

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(idx)
        if self.cfg.embed_scale:
            # The scale in the embedding's dtype, as Gemma's reference rounds it (25.25 for 640 in bf16).
            x = x * torch.tensor(self.cfg.d_model**0.5, dtype=x.dtype)
        if self.embed_noise is not None:  # its length is the batch's; the loss may feed all but the last
            x = x + self.embed_noise[:, : x.shape[1]].to(x.dtype)
        return x

    def _rope(self, x: torch.Tensor, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """cos and sin tables [n, head_dim] in x's dtype and device, global then local, for n >= `length`
        positions, kept on the model (not in its state dict) once made. They grow by doubling, up to seq_len,
        as positions are asked for: Gemma 3's 32k-position tables would take 128 MiB in fp32."""
        key = (x.device, x.dtype)
        tables = self.__dict__.setdefault("_rope_tables", {})
        if key not in tables or tables[key][0][0].shape[0] < length:
            have = tables[key][0][0].shape[0] if key in tables else 0
            n = min(self.cfg.seq_len, max(length, 2 * have, 256))
            positions = torch.arange(n, device=x.device)
            thetas = [self.cfg.rope_theta, self.cfg.rope_local_theta]
            tables[key] = [
                tuple(t.to(x.dtype) for t in rope_cos_sin(self.cfg.head_dim, positions, theta))
                for theta in thetas
                if theta is not None
            ]
        return tables[key]

    def _rows_hidden_states(self, idx: torch.Tensor, slots: SlotCache) -> torch.Tensor:
        """hidden_states for one new token per active row of a SlotCache, each at its own position."""
        B, T = idx.shape
        if T != 1 or B != len(slots.lengths):
            raise ValueError(
                f"a slot step takes one token per active row: got {B}x{T} for {len(slots.lengths)}"
            )
        if max(slots.lengths) >= slots.cache.max_len:
            raise ValueError(f"a row of {max(slots.lengths)} positions fills the slot cache")
        x = self.embed(idx)
        if self.layers_step is not None and not torch.is_grad_enabled():
            x = x.view(B, -1).contiguous()
            self.layers_step(x, torch.tensor(slots.lengths), slots.cache.k, slots.cache.v)
            return self.model.norm(x.view(B, 1, -1))
        slots.prepare(self.cfg.sliding_window, idx.device)
        # [B, 1, 1, D]: each row's own angles, broadcast over its heads.
        pos = slots.positions
        tables = self._rope(x, max(slots.lengths) + 1)
        rope = [(cos[pos][:, None, None], sin[pos][:, None, None]) for cos, sin in tables]
        for i, block in enumerate(self.model.layers):
            cos, sin = rope[1] if len(rope) > 1 and self.cfg.is_local(i) else rope[0]
            x = block(x, cos, sin, slots, i, self.value_embed(idx, i))
        return self.model.norm(x)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | SlotCache | None = None,
        last_only: bool = False,
    ) -> Output:
        """Logits without targets; with targets only the loss, since the full logits are never needed.
        last_only: the logits of the last position only [B, 1, V] (a prefill needs no others)."""
        h = self.hidden_states(idx, cache)
        if targets is None:
            logits = self.lm_head(h[:, -1:] if last_only else h)
            cap = self.cfg.logit_softcap
            return Output(logits if cap is None else cap * torch.tanh(logits / cap))
        loss, ce, z = fused_lm_loss(
            h, self.head_weight(), targets, self.cfg.z_loss_weight, self.cfg.logit_softcap
        )
        return Output(None, loss, ce, z)

    def head_weight(self) -> torch.Tensor:
        """The output head's weight [vocab, d]. A quantised head (generate.Int8Linear: its `weight` is the
        int8 codes) gives the matrix it multiplies by, so a loss scores what decoding computes."""
        dequantized = getattr(self.lm_head, "dequantized", None)
        return dequantized() if dequantized is not None else self.lm_head.weight


# Logits computed at once by fused_lm_loss: 2^24 fp32 values (64 MiB) whatever the vocabulary. Smaller
# chunks save little memory but add a pass over the head's gradient per chunk.
LOSS_CHUNK_ELEMENTS = 1 << 24


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype autocast would run a matmul on t in (t's own dtype outside autocast)."""
    kind = t.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else t.dtype


def _head_chunks(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    keep: torch.Tensor,
    z_weight: float,
    dtype: torch.dtype,
    grad_scale: torch.Tensor | None = None,
    grad_h: torch.Tensor | None = None,
    grad_w: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over the rows in chunks: the sums of ce and of log Z^2, and optionally the gradients.

    The matmuls run in `dtype` (autocast's), with autocast off so that a pass in backward computes
    exactly what the pass in forward did. With grad_scale, d loss/d logits of each row,
    grad_scale * keep * (softmax * (1 + 2 w log Z) - onehot(target)), is built in fp32, cast to `dtype`
    once and carried back into grad_h[rows] and into grad_w (an fp32 sum over chunks). With softcap c the
    loss sees c * tanh(logits / c), and d loss/d logits takes the factor 1 - tanh^2.
    """
    chunk = max(1, LOSS_CHUNK_ELEMENTS // weight.shape[0])
    ce_sum = h.new_zeros((), dtype=torch.float32)
    z_sum = h.new_zeros((), dtype=torch.float32)
    w = weight.to(dtype)
    with torch.autocast(h.device.type, enabled=False):
        for s in range(0, h.shape[0], chunk):
            hc, tc, kc = h[s : s + chunk].to(dtype), targets[s : s + chunk], keep[s : s + chunk]
            logits = (hc @ w.t()).float()
            squashed = None
            if softcap is not None:
                squashed = logits.div_(softcap).tanh_()
                logits = squashed * softcap
            target_logit = logits.gather(-1, tc.unsqueeze(-1)).squeeze(-1)
            # log Z = max + log(sum exp(logits - max)), in place of the logits: the exponentials are the
            # unnormalised softmax the gradient needs, and no [rows, vocab] temporary is allocated
            # (torch.logsumexp makes one, and the softmax then took two more passes).
            top = logits.amax(dim=-1, keepdim=True)
            exps = logits.sub_(top).exp_()
            total = exps.sum(dim=-1)
            log_z = top.squeeze(-1) + total.log()
            ce_sum += ((log_z - target_logit) * kc).sum()
            z_sum += (log_z.pow(2) * kc).sum()
            if grad_scale is None:
                continue
            row_scale = grad_scale * kc
            # softmax * (1 + 2 w log Z) * row_scale = exps * that / total: one pass over the chunk.
            exps.mul_(((1.0 + 2.0 * z_weight * log_z) * row_scale / total).unsqueeze(-1))
            exps.scatter_add_(-1, tc.unsqueeze(-1), (-row_scale).unsqueeze(-1))
            if squashed is not None:
                exps.mul_(1.0 - squashed.square_())
            g = exps.to(dtype)
            if grad_h is not None:
                grad_h[s : s + chunk] = g @ w
            if grad_w is not None:
                if g.dtype == grad_w.dtype:
                    grad_w.addmm_(g.t(), hc)  # accumulate in place: no [vocab, d] temporary
                else:
                    grad_w += (g.t() @ hc).float()  # chunk sums in fp32: [vocab, d] partials add up
    return ce_sum, z_sum


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Output head, cross-entropy and z-loss in chunks of rows, never materialising all logits.

    Same value and gradient as cross-entropy plus z-loss over the full logits h @ W.T (tests/test_model.py's
    reference), but the [N, vocab] logits exist one chunk at a
    time: at vocab 32k they are the largest buffers of a training step. d loss / d logits is
    grad_loss * keep/n * (softmax * (1 + 2 w log Z) - onehot(target)).

    Where it is built depends on the matmul dtype. In fp32 and bf16 (fp32's exponent range) it is built
    in forward with grad_loss = 1 and the two matmuls that carry it back to h and W run on the way, so
    backward only multiplies by grad_loss: no recomputation. In fp16 that would be wrong: values of
    keep/n * softmax, around 1e-8 at 8192 rows and vocab 8192, are below fp16's normal range and the cast
    before the matmul flushes them, so gradients came out up to 75% off. In fp16, backward therefore
    recomputes each chunk's logits and builds d loss/d logits with the incoming grad_loss, which carries
    GradScaler's scale, exactly as autograd through plain logits does: one extra head matmul, and the
    same memory (h is kept instead of the finished grad_h).
    """

    @staticmethod
    def forward(ctx, h, weight, targets, z_weight: float, need_grad_h: bool, need_grad_w: bool, softcap=None):
        keep = (targets != IGNORE_INDEX).float()
        targets = targets.clamp_min(0)
        count = keep.sum().clamp_min(1.0)
        dtype = _compute_dtype(h)
        eager = (need_grad_h or need_grad_w) and dtype != torch.float16
        grad_h = torch.empty_like(h) if eager and need_grad_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if eager and need_grad_w else None
        scale = 1.0 / count if eager else None
        ce_sum, z_sum = _head_chunks(
            h, weight, targets, keep, z_weight, dtype, scale, grad_h, grad_w, softcap
        )
        ctx.eager, ctx.dtype, ctx.z_weight, ctx.weight_dtype = eager, dtype, z_weight, weight.dtype
        ctx.softcap = softcap
        ctx.need = (need_grad_h, need_grad_w)
        if eager:
            ctx.save_for_backward(grad_h, grad_w)
        else:
            ctx.save_for_backward(h, weight, targets, keep)
        ce, z = ce_sum / count, z_sum / count
        ctx.mark_non_differentiable(ce, z)
        return ce + z_weight * z, ce, z

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_z):
        if ctx.eager:
            grad_h, grad_w = ctx.saved_tensors
            gh = grad_h * grad_loss.to(grad_h.dtype) if grad_h is not None else None
            gw = grad_w * grad_loss if grad_w is not None else None
        else:
            h, weight, targets, keep = ctx.saved_tensors
            need_h, need_w = ctx.need
            gh = torch.empty_like(h) if need_h else None
            gw = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
            scale = grad_loss.float() / keep.sum().clamp_min(1.0)
            _head_chunks(h, weight, targets, keep, ctx.z_weight, ctx.dtype, scale, gh, gw, ctx.softcap)
        if gw is not None:
            gw = gw.to(ctx.weight_dtype)
        return gh, gw, None, None, None, None, None


def fused_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    z_loss_weight: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, ce, z_loss) of the head `weight` on `hidden` [..., d], its logits soft-capped at `softcap` if
    given; ce and z_loss are for logging only."""
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    grad = torch.is_grad_enabled()
    fn = _FusedLinearCrossEntropy
    need_h, need_w = grad and h.requires_grad, grad and weight.requires_grad
    return fn.apply(h, weight, t, z_loss_weight, need_h, need_w, softcap)


def closed_form_num_parameters(cfg: ModelConfig) -> int:
    """Parameter count from the config alone; a test holds the module to it."""
    d, hd = cfg.d_model, cfg.head_dim
    attn = d * cfg.n_head * hd * 2 + d * cfg.n_kv_head * hd * 2  # q, o and k, v
    mlp = 3 * d * cfg.ffn_dim
    norms = (4 if cfg.sandwich_norm else 2) * d + (2 * hd if cfg.qk_norm else 0)
    embed = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    value_embeds = cfg.vocab_size * cfg.n_kv_head * hd if cfg.value_embeds else 0
    return cfg.n_layer * (attn + mlp + norms + value_embeds) + embed + d
