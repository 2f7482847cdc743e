"""The pretraining optimizer: AdamW with parameter groups, or Muon for the hidden matrices plus AdamW.

Decay pulls weights towards zero. On norm gains (1-D, initialised to 1) that fights the normalisation
itself; on embeddings it mostly shrinks rows of rare tokens, which get few gradient updates to push back.
So both go to a no-decay group, embeddings unless optimizer.decay_embeddings.

With optimizer.name "muon", the attention and MLP matrices (the 2-D weights inside the decoder blocks) get
their own group, stepped by torch.optim.Muon; embeddings, the head and the norms keep the AdamW groups.
`OptimizerChain` steps both as one optimizer, so train_step, the GradScaler, clipping and the checkpoint
layout see one list of parameter groups. The schedule sets every group's lr; a group's "lr_scale" (Muon's
peak lr over AdamW's) gives it its own peak.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..config.train import OptimizerConfig
from ..errors import CheckpointError

EMBEDDING_SUFFIXES = ("embed_tokens.weight",)
# The decoder blocks' modules: a 2-D weight under one of them mixes hidden features (q/k/v/o, gate/up/down).
HIDDEN_PREFIX = "model.layers."


def is_embedding(name: str, module_types: dict[str, type]) -> bool:
    owner = name.rsplit(".", 1)[0]
    return module_types.get(owner) is nn.Embedding or name.endswith(EMBEDDING_SUFFIXES)


def is_hidden_matrix(name: str, p: torch.Tensor, module_types: dict[str, type]) -> bool:
    """A Linear weight inside a decoder block: what Muon orthogonalises. Not the embedding, not the head
    (its rows are per-token outputs, like the embedding's), not norm gains (1-D)."""
    owner = name.rsplit(".", 1)[0]
    return p.dim() == 2 and name.startswith(HIDDEN_PREFIX) and module_types.get(owner) is nn.Linear


def param_groups(model: nn.Module, opt: OptimizerConfig, exclude: frozenset[str] = frozenset()) -> list[dict]:
    """Two groups, "decay" and "no_decay", each listing its parameters in model order (less `exclude`).

    named_parameters() yields a tied weight once (under the embedding's name), so it gets one update.
    """
    module_types = {name: type(m) for name, m in model.named_modules()}
    decay, no_decay = [], []
    decay_names, no_decay_names = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad or name in exclude:
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


def muon_group(model: nn.Module, opt: OptimizerConfig) -> dict:
    """The hidden matrices, in model order, as Muon's one group."""
    module_types = {name: type(m) for name, m in model.named_modules()}
    named = [
        (n, p)
        for n, p in model.named_parameters()
        if p.requires_grad and is_hidden_matrix(n, p, module_types)
    ]
    return {
        "name": "muon",
        "params": [p for _, p in named],
        "param_names": [n for n, _ in named],
        # train_step sets lr = schedule(step) * lr_scale: the schedule is AdamW's, so Muon's peak is muon.lr.
        "lr_scale": opt.muon.lr / opt.lr,
    }


class OptimizerChain:
    """Several optimizers over disjoint parameters, used as one: steps in a fixed order, one list of
    parameter groups (the same dicts, so setting a group's lr reaches its optimizer), one state_dict whose
    parameter indices run on across the optimizers as torch.optim.Optimizer's do across groups.

    Not a torch.optim.Optimizer: GradScaler only needs param_groups (unscale_, the inf check) and step().
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def state_dict(self) -> dict[str, Any]:
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for o in self.optimizers:
            sd = o.state_dict()
            state.update({offset + i: s for i, s in sd["state"].items()})
            groups += [{**g, "params": [offset + i for i in g["params"]]} for g in sd["param_groups"]]
            offset += sum(len(g["params"]) for g in o.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        groups = sd["param_groups"]
        if len(groups) != len(self.param_groups):
            raise CheckpointError(
                f"optimizer state has {len(groups)} parameter groups, the optimizers {len(self.param_groups)}"
            )
        first, offset = 0, 0
        for o in self.optimizers:
            mine = groups[first : first + len(o.param_groups)]
            n = sum(len(g["params"]) for g in o.param_groups)
            o.load_state_dict(
                {
                    "state": {i - offset: s for i, s in sd["state"].items() if offset <= i < offset + n},
                    "param_groups": [{**g, "params": [i - offset for i in g["params"]]} for g in mine],
                }
            )
            first, offset = first + len(o.param_groups), offset + n


Optimizer = torch.optim.Optimizer | OptimizerChain


def orthogonalize(update: torch.Tensor, group: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """Newton-Schulz's quintic iteration towards the nearest orthogonal matrix, in `dtype`: the same
    operations, in the same order, as torch.optim.Muon's (which always uses bf16), so bf16 gives its bits."""
    a, b, c = group["ns_coefficients"]
    x = update.to(dtype)
    wide = update.size(0) > update.size(1)
    if wide:
        x = x.T
    x.div_(x.norm().clamp(min=group["eps"]))  # spectral norm at most 1, where the iteration converges
    for _ in range(group["ns_steps"]):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if wide else x


class Muon(torch.optim.Muon):
    """torch.optim.Muon with the Newton-Schulz iteration in a chosen dtype: fp32 where the CPU has no bf16
    units (it would emulate them). The state and parameter groups are torch's, so checkpoints carry over."""

    def __init__(self, params: list[dict], ns_dtype: torch.dtype, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            buffers: list[torch.Tensor] = []
            self._init_group(group, params, grads, buffers)
            lr, momentum = group["lr"], group["momentum"]
            for p, grad, buf in zip(params, grads, buffers, strict=True):
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                ortho = orthogonalize(update, group, self.ns_dtype)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(ortho, alpha=-lr * shape_scale(group["adjust_lr_fn"], p.shape))


def shape_scale(adjust_lr: str, shape: torch.Size) -> float:
    """Muon's lr factor for a rows x cols matrix, as torch.optim.Muon's adjust_lr_fn defines it."""
    rows, cols = shape[:2]
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols))


def build_optimizer(model: nn.Module, opt: OptimizerConfig, device_type: str = "cpu") -> Optimizer:
    # fused on CUDA (one kernel for all params); foreach on CPU, which is deterministic there and
    # matches the reference loop bit for bit run after run.
    kwargs = {"fused": True} if device_type == "cuda" else {"foreach": True}
    if opt.name == "adamw":
        return torch.optim.AdamW(
            param_groups(model, opt), lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, **kwargs
        )
    matrices = muon_group(model, opt)
    m = opt.muon
    # A loop over the matrices (torch 2.13's Muon has no foreach/fused path either), deterministic on CPU:
    # the Newton-Schulz matmuls give the same bits for the same shapes and threads, in bf16 or fp32.
    muon = Muon(
        [matrices],
        ns_dtype=torch.float32 if m.ns_dtype == "fp32" else torch.bfloat16,
        lr=m.lr,
        weight_decay=m.weight_decay,
        momentum=m.momentum,
        nesterov=m.nesterov,
        ns_steps=m.ns_steps,
        adjust_lr_fn=m.adjust_lr,
    )
    rest = param_groups(model, opt, exclude=frozenset(matrices["param_names"]))
    adamw = torch.optim.AdamW(rest, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, **kwargs)
    return OptimizerChain([muon, adamw])
