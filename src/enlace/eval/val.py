"""Validation loss during training: the trainer's in-run evaluation."""

from __future__ import annotations

import torch

from ..config.hardware import HardwareConfig
from ..runtime import autocast, sdpa_backend


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list, hw: HardwareConfig, device: torch.device) -> float:
    """Mean cross-entropy (nats/token, without z-loss) over fixed validation batches."""
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast(hw), sdpa_backend(hw):
            total += model(x, y).ce.item()
    model.train(was_training)
    return total / max(len(batches), 1)
