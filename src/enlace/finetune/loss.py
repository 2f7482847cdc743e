"""Assistant-only loss that runs the LM head only where a label exists.

The head (vocab x d) is the single largest matmul of a small model, and its logits' softmax is the
largest activation; prompt and padding positions carry no label, so their logits are never computed.
The head and cross-entropy run fused and chunked (model.fused_lm_loss): with the head frozen under LoRA,
its [vocab, d] gradient is never formed either.
"""

from __future__ import annotations

import torch

from ..model import IGNORE_INDEX, Llama, fused_lm_loss


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
    h = model.hidden_states(input_ids[:, :last])
    mask = keep[:, :last]
    loss, _, _ = fused_lm_loss(
        h[mask], model.lm_head.weight, targets[:, :last][mask], 0.0, model.cfg.logit_softcap
    )
    return loss * n, n
