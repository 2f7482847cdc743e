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
import torch.nn.functional as F
from torch import nn

from . import kernels
from .choices import DecodeKernels, values
from .errors import EnlaceError, HardwareError
from .model import KVCache, Llama, fuse_projections
from .runtime import drop_mapped_pages

# auto: bf16 on a CPU with native bf16 (avx512_bf16 or AMX), else fp32 as loaded.
DECODE_WEIGHTS = ("auto", "fp32", "bf16", "int8")
# The output head's weights: as the rest of the model, or int8 whatever the rest is (decode_weights).
HEAD_WEIGHTS = ("same", "int8")
# Which kernels decode (choices.DecodeKernels): "auto" takes ENLACE's (enlace.kernels) where the CPU kind gains
# by them, "torch" keeps torch's own everywhere (the reference they are measured against), "enlace" takes
# ENLACE's at every precision (the other path on a CPU with native bf16, so that both can be measured there).
KERNEL_CHOICES = values(DecodeKernels)


def resolve_decode_weights(
    weights: str, device: str | torch.device = "cpu", flags: frozenset[str] | None = None
) -> str:
    """The decode weights `weights` means here; refuses bf16 on a CPU whose oneDNN cannot pack it, unless
    ENLACE's kernels are built there (they read bf16 weights with fp32 activations).

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
        if missing and not kernels.available():  # else ENLACE's kernels read the bf16 weights (Bf16Linear)
            raise HardwareError(
                f"decode weights bf16: {missing}, and ENLACE's kernels are unavailable "
                f"({kernels.why_unavailable()}); use --weights fp32 or int8"
            )
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


def decode_rows(x: torch.Tensor, in_features: int) -> bool:
    """Whether x is a decode step's few activation rows, which ENLACE's kernels take (kernels.MAX_ROWS)."""
    return x.numel() // in_features <= kernels.MAX_ROWS


class KernelLinear(nn.Module):
    """A frozen fp32 linear whose decode steps run ENLACE's kernel (kernels/decode_linear.cpp), which
    streams the weight at close to the memory's rate where torch's fp32 F.linear reaches about half of it
    on one token; a prefill's many rows stay with torch's GEMM. The weight is the linear's own tensor (a tied
    head still shares the embedding's)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if decode_rows(x, self.in_features):
            return torch.ops.enlace.linear_f32(x, self.weight)
        return F.linear(x, self.weight)


PREFILL_BLOCK = 1 << 22  # int8 or bf16 weights widened at once by a prefill on fp32 activations (16 MiB)


class Bf16Linear(nn.Module):
    """bf16 weights, everything else fp32: a decode step's products run ENLACE's kernel, which widens each
    bf16 weight to fp32 exactly (a shift) before its multiply-add, so a token reads half the bytes of fp32
    weights. A prefill's rows go to torch's fp32 GEMM on the weight widened a block of rows at a time, or,
    with `bf16_prefill` (a CPU with native bf16), to oneDNN's bf16 GEMM on the weight as it is (activations
    rounded to bf16, sums in fp32, as llama.cpp's BF16 does). The weight is a buffer (the model's parameters
    stay fp32: its KV cache follows them). `release`: the fp32 rows' pages read from a mapped file are given
    back as they are converted."""

    def __init__(self, linear: nn.Linear, release: bool = False, bf16_prefill: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bf16_prefill = bf16_prefill
        w = linear.weight.detach()
        weight = torch.empty(w.shape, dtype=torch.bfloat16, device=w.device)
        rows = max(1, PREFILL_BLOCK // self.in_features)
        for r in range(0, self.out_features, rows):
            weight[r : r + rows] = w[r : r + rows]
            if release:
                drop_mapped_pages([w[r : r + rows]])
        self.register_buffer("weight", weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if decode_rows(x, self.in_features):
            return torch.ops.enlace.linear_bf16(x, self.weight)
        if self.bf16_prefill:
            return F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)
        rows = max(1, PREFILL_BLOCK // self.in_features)
        parts = [F.linear(x, self.weight[r : r + rows].float()) for r in range(0, self.out_features, rows)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


class Bf16Embedding(nn.Module):
    """The input embedding of a tied model read from its bf16 head's rows, widened to fp32: one copy."""

    def __init__(self, head: Bf16Linear):
        super().__init__()
        self.head = [head]  # a list: not a submodule, so its buffer is not listed twice

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head[0].weight[idx].float()


class Int8Linear(nn.Module):
    """Weight-only int8 (symmetric, one scale per output row); activations in the scales' dtype (bf16, or
    fp32 where the CPU has no native bf16 or for an int8 head on an fp32 model), as is the output.

    With bf16 activations torch's CPU kernel (_weight_int8pack_mm) does the product. With fp32 ones a decode
    step runs ENLACE's kernel where it is built (`kernel`): torch's reaches about 2 GB/s of int8 weights on an
    AVX2 CPU. Quantisation error is reported by bench_generate next to its speed, and the head's in bits per
    byte by bench/bench_head_int8.py.
    """

    def __init__(
        self,
        linear: nn.Linear,
        dtype: torch.dtype = torch.bfloat16,
        kernel: bool = False,
        release: bool = False,
        bf16_prefill: bool = False,
    ):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = kernel and dtype == torch.float32
        self.bf16_prefill = bf16_prefill
        w = linear.weight.detach()
        codes = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
        # A block of rows at a time: the fp32 temporaries of Gemma 3's 262k-row head would be GiBs at once.
        rows = max(1, PREFILL_BLOCK // self.in_features)
        for r in range(0, self.out_features, rows):
            block = w[r : r + rows].float()
            scale[r : r + rows] = block.abs().amax(dim=1).clamp_min(1e-12) / 127.0
            codes[r : r + rows] = torch.round(block / scale[r : r + rows, None]).clamp(-127, 127)
            if release:  # the caller discards `linear`: its rows' pages read from a mapped file go back now
                drop_mapped_pages([w[r : r + rows]])
        self.register_buffer("weight", codes)
        self.register_buffer("scales", scale.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel and decode_rows(x, self.in_features):
            return torch.ops.enlace.linear_i8(x, self.weight, self.scales)
        if self.kernel:
            return self._prefill(x)
        x2 = x.reshape(-1, self.in_features).to(self.scales.dtype)
        y = torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scales)
        return y.view(*x.shape[:-1], self.out_features)

    def _prefill(self, x: torch.Tensor) -> torch.Tensor:
        """Many fp32 rows (a prompt): torch's fp32 GEMM on the weight dequantised a block of rows at a time,
        or with `bf16_prefill` (a CPU with native bf16) oneDNN's bf16 GEMM on bf16 activations and blocks.
        torch's int8 kernel takes fp32 activations at a few GB/s (a 500-token SmolLM2 prompt took 34 s);
        a block of at most PREFILL_BLOCK values bounds the extra memory."""
        rows = max(1, PREFILL_BLOCK // self.in_features)
        dtype = torch.bfloat16 if self.bf16_prefill else torch.float32
        xs = x.to(dtype)
        parts = [
            F.linear(xs, (self.weight[r : r + rows].float() * self.scales[r : r + rows, None]).to(dtype))
            for r in range(0, self.out_features, rows)
        ]
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return y.to(x.dtype)

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


class KernelDecode:
    """A decode step through every layer in one call of ENLACE's kernel (kernels/decode_layers.cpp), for a
    model whose linears are KernelLinear or fp32-activation Int8Linear: what eager PyTorch spent between the
    products (about fifty operator calls and a dozen module calls per layer) becomes plain loops.

    Set as the model's `layers_step` by decode_weights; the embedding, the final norm and the head stay in
    Python. Rows go through in groups of at most kernels.MAX_ROWS, each with its own cache rows.
    """

    # The per-layer order decode_layers.cpp reads (its enum Weight).
    def __init__(self, model: Llama):
        cfg, none = model.cfg, torch.empty(0)
        self.weights: list[torch.Tensor] = []
        for block in model.model.layers:
            attn, mlp = block.self_attn, block.mlp
            sandwich = cfg.sandwich_norm
            products = [
                attn.q_proj,
                attn.k_proj,
                attn.v_proj,
                attn.o_proj,
                mlp.gate_proj,
                mlp.up_proj,
                mlp.down_proj,
            ]
            self.weights += [
                block.input_layernorm.weight,
                block.post_attention_layernorm.weight,
                block.pre_feedforward_layernorm.weight if sandwich else none,
                block.post_feedforward_layernorm.weight if sandwich else none,
                attn.q_norm.weight if attn.q_norm is not None else none,
                attn.k_norm.weight if attn.k_norm is not None else none,
                *(lin.weight for lin in products),
                *(lin.scales if isinstance(lin, Int8Linear) else none for lin in products),
            ]  # fmt: skip
        self.weights = [w.detach().contiguous() for w in self.weights]
        self.model = model
        local = [cfg.is_local(i) for i in range(cfg.n_layer)]
        self.table = [1 if is_local and cfg.rope_local_theta is not None else 0 for is_local in local]
        self.windows = [cfg.sliding_window if is_local else 0 for is_local in local]
        attn = model.model.layers[0].self_attn
        self.dims = [cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.d_model, cfg.ffn_dim,
                     int(cfg.sandwich_norm), int(cfg.qk_norm), int(cfg.norm_unit_offset), int(cfg.mlp_act != "silu")]  # fmt: skip
        self.floats = [cfg.norm_eps, attn.scale if attn.scale is not None else cfg.head_dim**-0.5]

    @staticmethod
    def fits(model: Llama) -> bool:
        """Whether every layer's products are ones the kernel runs (not an unmerged adapter, say)."""
        cfg = model.cfg
        if cfg.mlp_act not in ("silu", "gelu_tanh") or cfg.value_embeds:
            return False  # the kernel knows SwiGLU and GeGLU, and no value embeddings
        for block in model.model.layers:
            attn, mlp = block.self_attn, block.mlp
            for lin in (
                attn.q_proj,
                attn.k_proj,
                attn.v_proj,
                attn.o_proj,
                mlp.gate_proj,
                mlp.up_proj,
                mlp.down_proj,
            ):
                if not (
                    isinstance(lin, KernelLinear | Bf16Linear) or (isinstance(lin, Int8Linear) and lin.kernel)
                ):
                    return False
        return next(model.model.norm.parameters()).dtype == torch.float32

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, keys: list, values: list) -> None:
        tables = self.model._rope(x, int(positions.max()) + 1)  # fp32 [n, head_dim]: global, then local
        cos, sin = [c for c, _ in tables], [s for _, s in tables]
        step = kernels.MAX_ROWS
        for r in range(0, x.shape[0], step):
            rows = slice(r, r + step)
            torch.ops.enlace.decode_layers(
                x[rows], self.weights, [k[rows] for k in keys], [v[rows] for v in values], positions[rows],
                cos, sin, self.table, self.windows, self.dims, self.floats,
            )  # fmt: skip


@torch.no_grad()
def decode_weights(
    model: Llama,
    weights: str = "auto",
    device: str | torch.device = "cpu",
    flags: frozenset[str] | None = None,
    head: str = "same",
    kernel_choice: str = "auto",
) -> Llama:
    """Convert `model` in place for inference with `weights` (see DECODE_WEIGHTS); returns it.

    Where ENLACE's decode kernels build, kernel_choice "auto" (and "enlace", which is refused where they do
    not) decodes every precision through them: fp32 keeps the weights; bf16 turns the linear weights alone
    into bf16 (Bf16Linear, one copy of a tied head) and int8 into int8 (Int8Linear, its fp32-activation
    kernel), the rest staying fp32. On a CPU with native bf16 their prefills run oneDNN's bf16 GEMM. On 2 Zen
    4 cores (native bf16) this decoded served SmolLM2 at 101 tokens/s in bf16 and 138 in int8, against 41
    and 52 through torch's own kernels (docs/llama-cpp.md). kernel_choice "torch", or a CPU where the
    kernels do not build, keeps torch's: bf16 turns norms, embedding, activations and KV cache into bf16 and
    every linear layer into a packed bf16 module (oneDNN), int8 does the same with torch's int8 kernel on
    bf16 activations. Either way the model can no longer be trained. A tied model keeps one copy in int8
    (the embedding reads the head's int8 rows); in packed bf16 the head is a second copy, as oneDNN's
    blocked layout cannot be read by rows. Off CPU, bf16 is a plain cast and int8 is refused.
    head "int8": the output head in int8 whatever `weights` is (quantised from the fp32 weights, its
    activations in the model's dtype), and a tied embedding reads its rows: one int8 copy where Gemma 3
    270M's 262k x 640 head and embedding were 63% of its fp32 bytes.
    flags: the CPU's instruction-set flags, as resolve_decode_weights takes them.
    """
    from .runtime import cpu_bf16_native, onednn_bf16_missing

    weights = resolve_decode_weights(weights, device, flags)
    cpu = torch.device(device).type == "cpu"
    bf16_own = _bf16_on_own_kernels(weights, device, kernel_choice, flags)
    if head not in HEAD_WEIGHTS:
        raise ValueError(f"head weights {head!r}: choose from {', '.join(HEAD_WEIGHTS)}")
    if "int8" in (weights, head) and not cpu:
        raise ValueError("int8 decode weights use torch's CPU kernel; use bf16 on a GPU")
    own = cpu and kernel_choice != "torch" and (weights != "bf16" or bf16_own) and kernels.available()
    if not own:
        # torch's kernels: q, k and v (gate and up) as one product each. ENLACE's kernels read the separate
        # weights in one pass instead, so no stacked copy is made (the loaded ones stay memory-mapped).
        fuse_projections(model.eval())
    if head == "int8" and weights != "int8":
        int8_head(model.eval(), kernel=own)
    if weights == "fp32":
        return _with_layers_step(_replace_linears(model.eval(), KernelLinear)) if own else model
    # Prefills (many rows) on a CPU with native bf16: oneDNN's bf16 GEMM, at several times fp32's rate.
    bf16_prefill = cpu and cpu_bf16_native(flags) is not None and onednn_bf16_missing(flags) is None
    if bf16_own:  # the rest stays fp32: the kernels take fp32 activations
        _replace_linears(model.eval(), lambda linear: Bf16Linear(linear, True, bf16_prefill))
        if model.cfg.tie_embeddings and isinstance(model.lm_head, Bf16Linear):
            model.model.embed_tokens = Bf16Embedding(model.lm_head)
        return _with_layers_step(model)
    fp32_int8 = weights == "int8" and own
    if not fp32_int8:
        model.eval().to(torch.bfloat16)  # an int8 head's scales too: its activations follow the model's
    if not cpu or (weights == "bf16" and not torch.backends.mkldnn.is_available()):
        return model
    if weights == "bf16":
        return _replace_linears(model, PackedLinear)
    act = torch.float32 if fp32_int8 else torch.bfloat16
    _replace_linears(
        model,
        lambda linear: Int8Linear(linear, act, kernel=fp32_int8, release=True, bf16_prefill=bf16_prefill),
    )
    if model.cfg.tie_embeddings:
        model.model.embed_tokens = Int8Embedding(model.lm_head)
    return _with_layers_step(model) if fp32_int8 else model


def _bf16_on_own_kernels(weights: str, device: str | torch.device, kernel_choice: str, flags) -> bool:
    """Whether bf16 weights decode on ENLACE's kernels: where oneDNN has no bf16 kernels
    (resolve_decode_weights allowed it: they are built), and wherever they build unless torch's are asked
    for. Refuses a kernel choice that cannot run here."""
    from .runtime import onednn_bf16_missing

    cpu = torch.device(device).type == "cpu"
    if kernel_choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels {kernel_choice!r}: choose from {', '.join(KERNEL_CHOICES)}")
    everywhere = kernel_choice == "enlace"
    if everywhere and not (cpu and kernels.available()):
        raise HardwareError(
            f"--kernels enlace on {device}: ENLACE's decode kernels are not available "
            f"({kernels.why_unavailable() if cpu else 'they are CPU kernels'}); use --kernels auto"
        )
    bf16_own = (
        weights == "bf16"
        and cpu
        and torch.backends.mkldnn.is_available()
        and (
            everywhere
            or bool(onednn_bf16_missing(flags))
            or (kernel_choice == "auto" and kernels.available())
        )
    )
    if bf16_own and kernel_choice == "torch":
        raise HardwareError(
            f"decode weights bf16, kernel_choice {kernel_choice!r}: {onednn_bf16_missing(flags)}"
        )
    return bf16_own


def _with_layers_step(model: Llama) -> Llama:
    model.layers_step = KernelDecode(model) if KernelDecode.fits(model) else None
    return model


def _replace_linears(model: Llama, make: Callable[[nn.Linear], nn.Module]) -> Llama:
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, make(child))
    return model


def int8_head(model: Llama, kernel: bool = False) -> Llama:
    """The output head in int8 with one fp32 scale per row, in place; a tied embedding then reads the same
    int8 rows (dequantised), so the fp32 matrix is freed and one int8 copy serves both. kernel: decode steps
    through ENLACE's kernel (Int8Linear)."""
    model.lm_head = Int8Linear(model.lm_head, dtype=torch.float32, kernel=kernel, release=True)
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
    in order. With top_p alone, only as many of the largest probabilities as the nucleus needs are taken
    (_nucleus_candidates). Either way a 262k vocabulary is never sorted whole."""
    if temperature <= 0:
        return greedy_ids(logits)
    logits = logits.float() / temperature
    if top_k and top_k < logits.size(-1):
        values, ids = torch.topk(logits, top_k, dim=-1)  # sorted, largest first
        return ids.gather(-1, _sample_sorted(torch.softmax(values, dim=-1), top_p, generator)).squeeze(-1)
    probs = torch.softmax(logits, dim=-1)
    if top_p >= 1.0:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    sorted_p, order = _nucleus_candidates(probs, top_p)
    return order.gather(-1, _sample_sorted(sorted_p, top_p, generator)).squeeze(-1)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest logit [B] (a NaN counts as largest), as torch.argmax gives it.

    On the CPU through NumPy: torch's CPU argmax walks a row one element at a time (0.31-0.44 ms for one row
    of Gemma 3's 262,144 logits on 2 Zen 3 cores, against 0.03 ms for NumPy's vectorised one), and a served
    token is otherwise about 16 ms."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    rows = logits.detach().float().contiguous().numpy()
    return torch.from_numpy(rows.argmax(axis=-1))


def _nucleus_candidates(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest probabilities of each row [B, V], largest first, and their ids: at least the top_p nucleus.

    Sorting Gemma 3's 262,144 probabilities took 36 ms a token, twice its forward. The nucleus is usually a
    few dozen tokens, so topk takes k of them, k growing until the k kept carry more than top_p: every later
    token then has more than top_p of mass before it, and _sample_sorted would drop it. Where no k short of
    the vocabulary does, the whole row is sorted, as before."""
    k = 256
    while k < probs.size(-1):
        values, ids = torch.topk(probs, k, dim=-1)  # sorted, largest first
        if bool((values.cumsum(-1)[..., -1] > top_p).all()):  # the sum _sample_sorted's cumsum would reach
            return values, ids
        k *= 8
    return probs.sort(dim=-1, descending=True)


def _sample_sorted(sorted_p: torch.Tensor, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """Positions [B, 1] drawn from probabilities sorted largest first, within the top_p nucleus."""
    if top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
        drop = sorted_p.cumsum(-1) - sorted_p > top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.multinomial(sorted_p, 1, generator=generator)


def _grams(ids: list[int], n: int) -> Iterator[tuple[int, ...]]:
    return (tuple(ids[i : i + n]) for i in range(len(ids) - n + 1))


class CopyTable:
    """What a reply may not copy verbatim beyond n tokens: a preamble assistant's example answers.

    A base aligned in context (load/preamble.py) tends to answer a writing task with the example answer
    nearest to it, word for word. `follows` maps every n tokens in a row of an example answer to the tokens
    that came next there; RepeatGuard bans those after the reply's own last n tokens, so a copy stops at n
    tokens (and may go on only with other words). Built once per assistant; each step costs one lookup.

    The user's words are not the examples': an (n+1)-gram the prompt holds more often than the preamble alone
    does (the question restates part of an example: "un mensaje para avisar a ...") is allowed (`allowed`).
    """

    def __init__(self, n: int, answers: Iterable[list[int]], preamble_ids: list[int]):
        if n < 1:
            raise ValueError(f"a copy table needs n >= 1, not {n}")
        self.n = n
        self.follows: dict[tuple[int, ...], set[int]] = {}
        for ids in answers:
            for gram in _grams(ids, n + 1):
                self.follows.setdefault(gram[:-1], set()).add(gram[-1])
        self.grams = {k + (t,) for k, ts in self.follows.items() for t in ts}
        self.preamble_counts = self._counts(preamble_ids)

    def _counts(self, ids: list[int]) -> dict[tuple[int, ...], int]:
        """How often each banned (n+1)-gram occurs in `ids`."""
        out: dict[tuple[int, ...], int] = {}
        for gram in _grams(ids, self.n + 1):
            if gram in self.grams:
                out[gram] = out.get(gram, 0) + 1
        return out

    def allowed(self, prompt_ids: list[int]) -> set[tuple[int, ...]]:
        """The banned (n+1)-grams this prompt's own text (beyond the preamble) holds: copying them is
        restating the user, not the examples. One pass over the prompt, once per reply."""
        counts = self._counts(prompt_ids)
        return {g for g, c in counts.items() if c > self.preamble_counts.get(g, 0)}


class RepeatGuard:
    """Discourages repeating what this reply already said, and copying a preamble's example answers.

    Only the generated tokens count, not the prompt: a chat prompt holds the template's markers and the
    user's words, and penalising those would make the model avoid ending its turn or quoting the question.
    End-of-turn ids are never penalised for the same reason.
    - repetition_penalty (Keskar et al. 2019, CTRL): the logit of every token already generated is divided
      by the penalty when positive, multiplied when negative.
    - no_repeat_ngram n: a token that would complete an n-gram already generated is banned outright.
    - copy (a CopyTable of n, given the prompt): a token that would make the reply's last n+1 tokens a run
      of an example answer is banned outright (unless the prompt's own words hold that run).
    """

    def __init__(
        self,
        penalty: float = 1.0,
        ngram: int = 0,
        keep: Iterable[int] = (),
        copy: CopyTable | None = None,
        prompt_ids: Iterable[int] = (),
    ):
        self.penalty, self.ngram, self.keep = penalty, ngram, set(keep)
        self.ids: list[int] = []
        self.seen: set[int] = set()
        self._seen_ids: torch.Tensor | None = None  # `seen` as an index tensor, rebuilt when it grows
        self.follows: dict[tuple[int, ...], set[int]] = {}  # (n-1)-gram -> tokens that followed it
        self.copy = copy
        self.allowed = copy.allowed(list(prompt_ids)) if copy is not None else set()

    @property
    def active(self) -> bool:
        return self.penalty != 1.0 or self.ngram > 0 or self.copy is not None

    def push(self, token: int) -> None:
        self.ids.append(token)
        if token not in self.keep and token not in self.seen:
            self.seen.add(token)
            self._seen_ids = None
        n = self.ngram
        if n > 0 and len(self.ids) >= n:
            self.follows.setdefault(tuple(self.ids[-n:-1]), set()).add(token)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Last-position logits [1, V], adjusted (a copy) where a rule applies at this step; as given (no
        copy: 1 MiB a token for Gemma's vocabulary) where none does."""
        if not self.active or not self.ids:
            return logits
        banned: set[int] = set()
        if 0 < self.ngram <= len(self.ids) + 1:
            # The last n-1 tokens, then every token that followed them before (n = 1: every token seen).
            recent = tuple(self.ids[len(self.ids) - self.ngram + 1 :])
            banned |= self.follows.get(recent, set())
        if self.copy is not None and len(self.ids) >= self.copy.n:
            suffix = tuple(self.ids[len(self.ids) - self.copy.n :])
            banned |= {t for t in self.copy.follows.get(suffix, ()) if suffix + (t,) not in self.allowed}
        banned -= self.keep
        penalise = self.penalty != 1.0 and bool(self.seen)
        if not banned and not penalise:
            return logits
        logits = logits.float().clone()
        if penalise:
            if self._seen_ids is None:  # a token seen again changes nothing: most steps reuse the index
                self._seen_ids = torch.tensor(sorted(self.seen))
            idx = self._seen_ids
            row = logits[0, idx]
            logits[0, idx] = torch.where(row > 0, row / self.penalty, row * self.penalty)
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
    copy: CopyTable | None = None,
) -> Iterator[int]:
    """Stream new token ids one at a time. The prompt is prefilled once; each step feeds one token.
    copy: a preamble assistant's example answers, copied at most copy.n tokens in a row (RepeatGuard)."""
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
    guard = RepeatGuard(repetition_penalty, no_repeat_ngram, keep=stop, copy=copy, prompt_ids=prompt_ids)
    logits = prompt_logits(model, torch.tensor([prompt_ids], device=device), cache)
    for _ in range(max_new_tokens):
        nxt = sample_next(guard.apply(logits.cpu()), temperature, top_k, top_p, gen)
        token = int(nxt.item())
        yield token
        if token in stop:
            return
        guard.push(token)
        logits = model(nxt.view(1, 1).to(device), cache=cache).logits[:, -1]


def prompt_logits(model: Llama, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """The logits [B, V] after `ids` [B, T], their keys and values written into `cache` from its position on.

    All but the last id go in as one chunk with no head at all (for a 262k vocabulary and a long prompt the
    head's other rows would be most of the work); the last id goes in as a decode step. So the first new
    token's logits come from the same computation however the positions before it got into the cache
    (prefilled here, copied from a prefix cache, or written by an earlier turn): a seeded request repeated
    gives the same tokens whatever the server's prompt cache held. A prefill chunk and a decode step differ
    in their float sums' order (and on a CPU with native bf16 in precision: the chunk runs bf16 GEMMs).
    """
    if ids.shape[1] > 1:
        model.hidden_states(ids[:, :-1], cache)
    return model(ids[:, -1:], cache=cache).logits[:, -1]


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
    model.hidden_states(torch.tensor([ids], device=device), cache)
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
    return cache, prompt_logits(model, torch.tensor([prompt_ids[shared:]], device=device), cache)


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
    copy: CopyTable | None = None,
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
    guards = [RepeatGuard(repetition_penalty, no_repeat_ngram, stop, copy, prompt_ids) for _ in seeds]
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
