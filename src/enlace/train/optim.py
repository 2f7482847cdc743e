"""AdamW with parameter groups: weight decay only where it regularises.

Decay pulls weights towards zero. On norm gains (1-D, initialised to 1) that fights the normalisation
itself; on embeddings it mostly shrinks rows of rare tokens, which get few gradient updates to push back.
So both go to a no-decay group, embeddings unless optimizer.decay_embeddings.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config.train import OptimizerConfig

EMBEDDING_SUFFIXES = ("embed_tokens.weight",)


def is_embedding(name: str, module_types: dict[str, type]) -> bool:
    owner = name.rsplit(".", 1)[0]
    return module_types.get(owner) is nn.Embedding or name.endswith(EMBEDDING_SUFFIXES)


def param_groups(model: nn.Module, opt: OptimizerConfig) -> list[dict]:
    """Two groups, "decay" and "no_decay", each listing its parameters in model order.

    named_parameters() yields a tied weight once (under the embedding's name), so it gets one update.
    """
    module_types = {name: type(m) for name, m in model.named_modules()}
    decay, no_decay = [], []
    decay_names, no_decay_names = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dim() < 2 or (is_embedding(name, module_types) and not opt.decay_embeddings):
            no_decay.append(p)
            no_decay_names.append(name)
        else:
            decay.append(p)
            decay_names.append(name)
    groups = [
        {"name": "decay", "params": decay, "param_names": decay_names, "weight_decay": opt.weight_decay},
        {"name": "no_decay", "params": no_decay, "param_names": no_decay_names, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, opt: OptimizerConfig, device_type: str = "cpu") -> torch.optim.AdamW:
    # fused on CUDA (one kernel for all params); foreach on CPU, which is deterministic there and
    # matches the reference loop bit for bit run after run.
    kwargs = {"fused": True} if device_type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(
        param_groups(model, opt), lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, **kwargs
    )
