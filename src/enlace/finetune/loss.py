"""Assistant-only loss that runs the LM head only where a label exists.

The head (vocab x d) is the single largest matmul of a small model, and its logits' softmax is the
largest activation; prompt and padding positions carry no label, so their logits are never computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model import IGNORE_INDEX, Llama, rope_cos_sin


def hidden_states(model: Llama, idx: torch.Tensor) -> torch.Tensor:
    """The decoder's output before the final norm and the head (Llama.forward without them)."""
    T = idx.shape[1]
    if T > model.cfg.seq_len:
        raise ValueError(f"sequence of {T} tokens exceeds the window of {model.cfg.seq_len}")
    cos, sin = rope_cos_sin(model.cfg.head_dim, torch.arange(T, device=idx.device), model.cfg.rope_theta)
    x = model.model.embed_tokens(idx)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    for i, block in enumerate(model.model.layers):
        x = block(x, cos, sin, None, i)
    return x


def assistant_loss_sum(
    model: Llama, input_ids: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy over labelled next tokens, and their count (labels aligned with input_ids)."""
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    n = int(keep.sum())
    if n == 0:
        return input_ids.new_zeros((), dtype=torch.float32), 0
    # Positions after the last label influence no labelled token under causal attention: skip them.
    last = int(keep.any(0).nonzero().max()) + 1
    h = hidden_states(model, input_ids[:, :last])
    sel = h[keep[:, :last]]
    logits = model.lm_head(model.model.norm(sel)).float()
    return F.cross_entropy(logits, targets[:, :last][keep[:, :last]], reduction="sum"), n
