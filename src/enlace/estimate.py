"""Memory preflight: predict the peak device memory of a training step before starting it.

A 6 GB card fails a badly sized run minutes in, after data loading and compilation; this module says so in
a second, from the config alone, and names the micro-batch that fits.

What a step holds at its peak (forward + backward of one micro-batch, grads of earlier micro-batches alive):
- weights in fp32 (they are the master weights: autocast computes in fp16/bf16 from fp32 parameters),
- gradients in fp32 (with grad_accum_steps > 1 they persist across micro-batches),
- AdamW's two fp32 moments,
- under autocast, the fp16/bf16 copies of every matmul weight, which the backward pass keeps,
- the activations autograd saves for backward, counted tensor by tensor for this model's code
  (src/enlace/model.py); the math attention backend also keeps the B*H*T*T attention probabilities,
- the fused head + loss (model.fused_lm_loss): one chunk of logits at a time (LOSS_CHUNK_ELEMENTS values)
  and the gradients it produces for the hidden states and the head, never the full B*T*V logits.
The optimizer step is a second, smaller peak: weights, grads, moments and AdamW's temporaries (foreach on
CPU: one per parameter; fused on CUDA: none worth counting).

The per-token counts were checked against saved-tensor hooks and against measured CPU peaks
(tests/test_estimate.py); CUDA adds its context and allocator slack, covered by a fixed reserve and a
safety fraction. torch.compile fuses ops and saves fewer activations, so for compiled runs this is an upper bound.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from .config.hardware import HardwareConfig
from .config.model import ModelConfig
from .errors import EnlaceError

if TYPE_CHECKING:
    from .config.resolve import Config

GIB = 2**30
FP32 = 4
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
# Share of the device the plan may use: the CUDA caching allocator fragments, and allocations of other
# libraries (cuBLAS workspaces, NCCL buffers) are not in the count.
SAFETY_FRACTION = 0.90
# Memory outside PyTorch's tensors: the CUDA context and kernels (0.3-0.5 GiB), or on CPU the Python
# process with torch imported.
RUNTIME_RESERVE_GIB = {"cuda": 0.5, "cpu": 0.5}
# The fused loss (model.fused_lm_loss) holds one chunk of logits at a time: in fp32 the chunk and a
# logsumexp temporary; under autocast the half-precision chunk, its fp32 copy (turned into the softmax
# in place) and the half-precision gradient copy (measured, see tests).
# Beside the chunks: the gradient of the hidden states and two [vocab, d] fp32 head gradients (the
# accumulator and the scaled copy backward returns).


class MemoryPreflightError(EnlaceError):
    """The run is predicted not to fit the hardware profile's memory."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak of one training step, in bytes, with its parts."""

    profile: str
    device: str
    dtype: str
    attention: str  # the SDPA backend the estimate assumes
    micro_batch: int
    seq_len: int
    parts: dict[str, int]
    step_peak: int  # optimizer step phase (weights, grads, moments, temporaries)
    peak: int  # the larger of the forward/backward and the optimizer-step phases
    capacity: int  # hardware.memory_gib
    budget: int  # what the plan may use: capacity * SAFETY_FRACTION - runtime reserve
    kv_cache: int = 0  # generation with batch micro_batch and seq_len positions, not part of training
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.peak <= self.budget

    def to_dict(self) -> dict:
        return {**asdict(self), "fits": self.fits}


def matmul_weights(m: ModelConfig) -> int:
    """Weights that enter matmuls: the blocks' projections and the output head. Not the norms, and not an
    untied input embedding: it is read by rows (a lookup, no multiply), so counting it would credit an
    untied model with FLOPs it never does (and an MFU above the tied one's for the same work)."""
    d, hd = m.d_model, m.head_dim
    per_layer = d * m.n_head * hd * 2 + d * m.n_kv_head * hd * 2 + 3 * d * m.ffn_dim
    return m.n_layer * per_layer + m.vocab_size * d


def train_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """FLOPs of a training step per token: 6 * N + 12 * L * d * T, N = matmul_weights.

    6N: forward (2N) and backward (4N) matmuls. 12*L*d*T: attention scores and the weighted sum, forward and
    backward, counted non-causal (PaLM's MFU convention: comparable across implementations even though
    causal kernels skip half the work).
    """
    return 6.0 * matmul_weights(m) + 12.0 * m.n_layer * m.d_model * seq_len


def resolve_attention(hw: HardwareConfig, seq_len: int) -> str:
    """The attention a profile ends up with at this length; 'auto' picks a fused kernel on both CPU and
    CUDA, except the model's plain matmuls for short sequences on CPU."""
    from .model import uses_matmul_attention

    if uses_matmul_attention(hw.device, hw.sdpa_backend, seq_len):
        return "matmul"
    if hw.sdpa_backend != "auto":
        return hw.sdpa_backend
    if hw.device == "cpu":
        return "flash"  # PyTorch's CPU flash kernel handles causal GQA without a T x T matrix
    cc = tuple(hw.min_compute_capability or (0, 0))
    return "flash" if cc >= (8, 0) else "efficient"


def layer_activation_bytes_per_token(m: ModelConfig, dtype: str, attention: str, seq_len: int) -> int:
    """Bytes autograd saves per token and layer for src/enlace/model.py's Block.

    fp32: every saved tensor is fp32. Under autocast the residual stream and the norms stay fp32 (the model
    normalises in fp32 and adds fp16 branch outputs to an fp32 residual), matmul outputs are fp16/bf16, and
    autocast casts a norm's output once per consuming linear (q, k, v; gate, up), each cast saved.
    """
    d, kv, f, h = m.d_model, m.n_kv_head * m.head_dim, m.ffn_dim, m.n_head
    if dtype == "fp32":
        # norms: input, normalised and output, twice (6d); q: pre-norm, normalised, rotated; SDPA output and
        # o_proj's contiguous copy; k: pre-norm, normalised, rotated; v; MLP: gate, silu, up, product.
        if m.qk_norm:
            total = FP32 * (10 * d + 4 * kv + 4 * f)
        else:
            total = FP32 * (8 * d + 2 * kv + 4 * f)
    else:
        a = DTYPE_BYTES[dtype]
        # fp32: two norms' input and normalised (4d), QK-norm's fp32 upcasts of q and k;
        # half: 5 casts of norm outputs, q/k after QK-norm, SDPA's q, k, v, output; MLP's four.
        if m.qk_norm:
            total = FP32 * (5 * d + kv) + a * (8 * d + 3 * kv + 4 * f)
        else:
            total = FP32 * (4 * d) + a * (7 * d + 2 * kv + 4 * f)
    # per-row scalars: two norms' rsqrt, SDPA's logsumexp per head, QK-norm's rsqrt per head
    total += FP32 * (2 + h + ((h + m.n_kv_head) if m.qk_norm else 0))
    if attention == "math":
        # The math backend materialises softmax(QK^T) per head (kept for backward, fp32: PyTorch upcasts
        # half inputs in the math path), repeats the KV heads for GQA, and returns no separate output copy.
        total += FP32 * h * seq_len + FP32 * 2 * d - DTYPE_BYTES[dtype] * d
    elif attention == "matmul":
        # model.matmul_attention keeps the softmax per head (in the autocast dtype) and no logsumexp; its
        # output is not saved (only o_proj's contiguous copy), which in fp32 was a separate SDPA output.
        a = FP32 if dtype == "fp32" else DTYPE_BYTES[dtype]
        total += a * h * seq_len - FP32 * h - (FP32 * d if dtype == "fp32" else 0)
    return total


def activation_bytes(m: ModelConfig, dtype: str, attention: str, batch: int, seq_len: int) -> int:
    tokens = batch * seq_len
    per_token = m.n_layer * layer_activation_bytes_per_token(m, dtype, attention, seq_len)
    # final norm: input + normalised (+ its output in fp32, or the cast for the fp16 lm_head)
    per_token += FP32 * 2 * m.d_model + (FP32 if dtype == "fp32" else DTYPE_BYTES[dtype]) * m.d_model
    total = tokens * per_token
    if attention == "math":
        total += FP32 * batch * m.n_head * seq_len * seq_len  # one layer's pre-softmax scores, transient
    elif attention == "matmul":
        scores = FP32 if dtype == "fp32" else DTYPE_BYTES[dtype]
        total += scores * batch * m.n_head * seq_len * seq_len  # the same, in the matmul's output dtype
    return total


def logits_loss_bytes(m: ModelConfig, dtype: str, batch: int, seq_len: int) -> int:
    """The fused head + loss at its peak: one chunk of logits and the gradients it produces.

    Per logit: the fp32 chunk, whose exponentials and gradient are computed in place, and under a 16-bit
    autocast its 16-bit copy for the matmuls. Per head weight: grad_w in fp32 and the copy kept for
    backward, and under a 16-bit autocast each chunk's 16-bit product and its fp32 copy, added to grad_w.
    """
    from .model import LOSS_CHUNK_ELEMENTS

    rows = min(batch * seq_len, max(1, LOSS_CHUNK_ELEMENTS // m.vocab_size))
    half = 0 if dtype == "fp32" else DTYPE_BYTES[dtype]
    chunk = rows * m.vocab_size * (FP32 + half)
    head = m.vocab_size * m.d_model * (2 * FP32 + (half + FP32 if half else 0))
    return chunk + FP32 * batch * seq_len * m.d_model + head


def kv_cache_bytes(m: ModelConfig, batch: int, seq_len: int, dtype: str) -> int:
    """Generation's KV cache: keys and values of every layer, 2 * L * B * n_kv * T * head_dim values."""
    return 2 * m.n_layer * batch * m.n_kv_head * seq_len * m.head_dim * DTYPE_BYTES[dtype]


def estimate_training_memory(
    model: ModelConfig, hw: HardwareConfig, micro_batch: int, seq_len: int | None = None
) -> MemoryEstimate:
    """Predicted peak memory of one training step of `model` on `hw` with this micro-batch."""
    from .model import closed_form_num_parameters
    from .runtime import resolve_hardware

    hw = resolve_hardware(hw)  # `dtype: auto`: the precision a run on this CPU trains in

    t = seq_len or model.seq_len
    n = closed_form_num_parameters(model)
    attention = resolve_attention(hw, t)
    parts = {
        "weights (fp32)": FP32 * n,
        "gradients (fp32)": FP32 * n,
        "AdamW moments (2 x fp32)": 2 * FP32 * n,
    }
    if hw.dtype != "fp32":
        parts[f"autocast {hw.dtype} weight copies"] = DTYPE_BYTES[hw.dtype] * matmul_weights(model)
    parts[f"activations ({attention} attention)"] = activation_bytes(
        model, hw.dtype, attention, micro_batch, t
    )
    parts["logits + loss"] = logits_loss_bytes(model, hw.dtype, micro_batch, t)
    # train.optim.build_optimizer: foreach AdamW on CPU builds one temporary per parameter (the sqrt of the
    # second moment); the fused CUDA kernel updates in place, bounded here by the largest parameter.
    if hw.device == "cuda":
        step_temp = FP32 * max(model.vocab_size * model.d_model, model.d_model * model.ffn_dim)
    else:
        step_temp = FP32 * n
    step_peak = 4 * FP32 * n + step_temp
    peak = max(sum(parts.values()), step_peak)
    capacity = int(hw.memory_gib * GIB)
    budget = int(capacity * SAFETY_FRACTION - RUNTIME_RESERVE_GIB[hw.device] * GIB)
    notes = []
    if hw.compile:
        notes.append("torch.compile saves fewer activations: the estimate is an upper bound")
    if model.dropout > 0:
        notes.append("dropout masks are not counted")
    return MemoryEstimate(
        profile=hw.name,
        device=hw.device,
        dtype=hw.dtype,
        attention=attention,
        micro_batch=micro_batch,
        seq_len=t,
        parts=parts,
        step_peak=step_peak,
        peak=peak,
        capacity=capacity,
        budget=budget,
        kv_cache=kv_cache_bytes(model, micro_batch, t, hw.dtype),
        notes=notes,
    )


def largest_fitting_micro_batch(
    model: ModelConfig, hw: HardwareConfig, seq_len: int | None = None, limit: int = 4096
) -> int:
    """The largest micro-batch predicted to fit (0 if not even one sequence does). Memory grows with B."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimate_training_memory(model, hw, mid, seq_len).fits:
            lo = mid
        else:
            hi = mid - 1
    return lo


def suggest_geometry(fitting: int, global_batch: int, world_size: int) -> tuple[int, int] | None:
    """(micro_batch, grad_accum_steps) with micro_batch <= fitting that keeps the global batch exactly."""
    per_rank, rem = divmod(global_batch, world_size)
    if rem:
        return None
    for mb in range(min(fitting, per_rank), 0, -1):
        if per_rank % mb == 0:
            return mb, per_rank // mb
    return None


def preflight(cfg: Config, micro_batch: int | None = None) -> MemoryEstimate:
    """Check before training that one step of `cfg` fits `cfg.hardware.memory_gib`.

    Returns the estimate when it fits; raises MemoryPreflightError (an EnlaceError) otherwise, naming the
    largest micro-batch that fits and the grad_accum_steps that keep train.global_batch_size.
    """
    model, hw, train = cfg.layers["model"], cfg.layers["hardware"], cfg.layers["train"]
    mb = micro_batch or train.micro_batch_size
    est = estimate_training_memory(model, hw, mb)
    if est.fits:
        return est
    fitting = largest_fitting_micro_batch(model, hw)
    head = (
        f"memory preflight: micro_batch_size {mb} x seq_len {est.seq_len} of model '{model.name}' needs "
        f"about {est.peak / GIB:.2f} GiB at peak, more than the {est.budget / GIB:.2f} GiB usable of "
        f"profile '{hw.name}' ({hw.memory_gib:g} GiB; run `enlace estimate` for the breakdown)"
    )
    if fitting == 0:
        raise MemoryPreflightError(
            f"{head}; not even micro_batch_size 1 fits: shorten model.seq_len or use a smaller model"
        )
    geometry = suggest_geometry(fitting, train.global_batch_size, train.world_size)
    if geometry is None:
        raise MemoryPreflightError(
            f"{head}; the largest micro_batch_size that fits is {fitting}, but no divisor of "
            f"global_batch_size/world_size ({train.global_batch_size}/{train.world_size}) is at most {fitting}"
        )
    new_mb, accum = geometry
    raise MemoryPreflightError(
        f"{head}; the largest micro_batch_size that fits is {fitting}: keep global_batch_size "
        f"{train.global_batch_size} with --set train.micro_batch_size={new_mb} "
        f"--set train.grad_accum_steps={accum}"
    )


def format_estimate(est: MemoryEstimate) -> str:
    """A breakdown table and the verdict, for `enlace estimate`."""
    rows = [(name, b) for name, b in est.parts.items()]
    width = max(len(r[0]) for r in rows) + 2
    lines = [
        f"memory estimate: profile {est.profile} ({est.device}, {est.dtype}), {est.attention} attention, "
        f"micro_batch {est.micro_batch} x seq_len {est.seq_len}",
        f"{'part':<{width}}{'GiB':>8}",
    ]
    lines += [f"{name:<{width}}{b / GIB:>8.3f}" for name, b in rows]
    lines.append(f"{'forward/backward peak':<{width}}{sum(est.parts.values()) / GIB:>8.3f}")
    lines.append(f"{'optimizer step peak':<{width}}{est.step_peak / GIB:>8.3f}")
    lines.append(f"{'predicted peak':<{width}}{est.peak / GIB:>8.3f}")
    lines.append(
        f"{'usable':<{width}}{est.budget / GIB:>8.3f}  "
        f"({est.capacity / GIB:g} GiB x {SAFETY_FRACTION:g} - {RUNTIME_RESERVE_GIB[est.device]:g} GiB runtime)"
    )
    lines.append(
        f"(generation KV cache at batch {est.micro_batch} x {est.seq_len}: {est.kv_cache / GIB:.3f} GiB, not in training)"
    )
    lines += [f"note: {n}" for n in est.notes]
    verdict = "fits" if est.fits else "does NOT fit"
    lines.append(f"verdict: {verdict} ({est.peak / est.budget:.0%} of usable memory)")
    return "\n".join(lines)
