"""WSD schedule values at known steps, and AdamW parameter groups."""

import math

import pytest
import torch
from helpers import tiny_config

from enlace.model import Llama
from enlace.train.optim import build_optimizer, param_groups
from enlace.train.schedule import lr_at, wsd_lr

KW = dict(max_steps=100, peak_lr=1.0, warmup_steps=10, decay_steps=20)


def test_warmup_is_linear_and_never_zero():
    assert wsd_lr(0, **KW) == pytest.approx(0.1)
    assert wsd_lr(4, **KW) == pytest.approx(0.5)
    assert wsd_lr(9, **KW) == pytest.approx(1.0)


def test_stable_plateau():
    assert all(wsd_lr(s, **KW) == 1.0 for s in range(10, 81))


@pytest.mark.parametrize("shape,at90", [("linear", 0.5), ("cosine", 0.5), ("1-sqrt", 1 - math.sqrt(0.5))])
def test_decay_shapes(shape, at90):
    assert wsd_lr(80, decay_shape=shape, **KW) == pytest.approx(1.0)
    assert wsd_lr(90, decay_shape=shape, **KW) == pytest.approx(at90)
    assert wsd_lr(100, decay_shape=shape, **KW) == pytest.approx(0.0)
    values = [wsd_lr(s, decay_shape=shape, **KW) for s in range(80, 101)]
    assert values == sorted(values, reverse=True)


def test_final_lr_frac():
    assert wsd_lr(100, decay_shape="linear", final_lr_frac=0.1, **KW) == pytest.approx(0.1)
    assert wsd_lr(90, decay_shape="linear", final_lr_frac=0.1, **KW) == pytest.approx(0.55)


def test_cosine_quarter():
    assert wsd_lr(85, decay_shape="cosine", **KW) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_lr_at_reads_the_config():
    cfg = tiny_config(
        {"train.max_steps": 10, "train.schedule.warmup_steps": 2, "train.schedule.decay_steps": 4}
    )
    lr = cfg.train.optimizer.lr
    assert lr_at(cfg.train, 0) == pytest.approx(lr / 2)
    assert lr_at(cfg.train, 5) == pytest.approx(lr)
    assert lr_at(cfg.train, 8) == pytest.approx(lr * (1 - math.sqrt(0.5)))


def _groups(overrides=None):
    cfg = tiny_config(overrides)
    torch.manual_seed(0)
    model = Llama(cfg.model)
    return model, {g["name"]: g for g in param_groups(model, cfg.train.optimizer)}


def test_norms_and_embedding_get_no_decay():
    model, groups = _groups()
    no_decay, decay = groups["no_decay"]["param_names"], groups["decay"]["param_names"]
    assert groups["no_decay"]["weight_decay"] == 0.0
    assert groups["decay"]["weight_decay"] == 0.1
    assert "model.embed_tokens.weight" in no_decay
    assert all(n.endswith(("norm.weight", "embed_tokens.weight")) for n in no_decay)
    assert any(n.endswith("q_norm.weight") for n in no_decay)
    assert all(p.dim() == 2 for p in groups["decay"]["params"])
    assert "model.layers.0.mlp.down_proj.weight" in decay
    # Tied: the embedding is the head, listed once; every parameter is in exactly one group.
    assert "lm_head.weight" not in decay + no_decay
    assert len(decay) + len(no_decay) == len(list(model.parameters()))


def test_decay_embeddings_and_untied_head():
    _, groups = _groups({"train.optimizer.decay_embeddings": True})
    assert "model.embed_tokens.weight" in groups["decay"]["param_names"]
    _, groups = _groups({"model.tie_embeddings": False})
    assert "lm_head.weight" in groups["decay"]["param_names"]
    assert "model.embed_tokens.weight" in groups["no_decay"]["param_names"]


def test_optimizer_uses_the_groups():
    cfg = tiny_config()
    model = Llama(cfg.model)
    opt = build_optimizer(model, cfg.train.optimizer)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert opt.defaults["betas"] == (0.9, 0.95)
