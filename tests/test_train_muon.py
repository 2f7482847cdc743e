"""Muon for the hidden matrices, AdamW for the rest: group membership, bit-exact resume, GradScaler and skips.

(The SIGKILL-and-resume case with Muon is in test_train_signals.py, beside AdamW's.)
"""

import functools
import math

import pytest
import torch
from helpers import checkpoint_digests, loaders_for, logged_losses, nan_at_steps, tiny_config
from safetensors.torch import load_file
from test_train_resume import assert_same_checkpoint, final

from enlace.train.checkpoint import latest_checkpoint, list_checkpoints, step_dirname
from enlace.train.optim import OptimizerChain, build_optimizer
from enlace.train.step import StepSettings, TrainState, make_scaler, train_step
from enlace.train.trainer import init_model, lm_forward, micro_batches, train

MUON = {"train.optimizer.name": "muon", "train.optimizer.muon.lr": 0.02}
CPU = torch.device("cpu")
MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def run(tmp, overrides=None, stop_after=None):
    cfg = tiny_config({**MUON, **(overrides or {})})
    tr, va = loaders_for(cfg)
    return train(cfg, tmp, loader=tr, val_loader=va, stop_after=stop_after, progress=False)


def is_matrix(name: str) -> bool:
    return name.startswith("model.layers.") and name.rsplit(".", 2)[-2] in MATRICES


@pytest.mark.parametrize("tied", [True, False])
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(tied):
    cfg = tiny_config({**MUON, "model.tie_embeddings": tied})
    model = init_model(cfg, CPU)
    opt = build_optimizer(model, cfg.train.optimizer)
    assert isinstance(opt, OptimizerChain)
    muon, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    muon_names = [n for g in muon.param_groups for n in g["param_names"]]
    adamw_names = [n for g in adamw.param_groups for n in g["param_names"]]
    every = [n for n, _ in model.named_parameters()]
    assert muon_names == [n for n in every if is_matrix(n)]
    assert len(muon_names) == cfg.model.n_layer * len(MATRICES)
    assert sorted(adamw_names) == sorted(n for n in every if not is_matrix(n))  # disjoint, nothing left out
    assert "model.embed_tokens.weight" in adamw_names and "model.norm.weight" in adamw_names
    assert ("lm_head.weight" in adamw_names) == (not tied)  # an untied head is AdamW's too (decayed)
    decay = next((g for g in adamw.param_groups if g["name"] == "decay"), {"param_names": []})
    assert decay["param_names"] == ([] if tied else ["lm_head.weight"])

    # Each optimizer moves its own parameters and nothing else.
    tr, _ = loaders_for(cfg)
    x, y = tr.get_batch(0, 0)
    for stepped in (muon, adamw):
        mine = {n for g in stepped.param_groups for n in g["param_names"]}
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.zero_grad()
        model(x, y).loss.backward()
        stepped.step()
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n]) != (n in mine), n
    assert set(muon.state) == set(muon.param_groups[0]["params"])  # a momentum buffer per matrix
    assert all(set(s) == {"momentum_buffer"} for s in muon.state.values())


def test_schedule_gives_each_group_its_own_peak(tmp_path):
    run(tmp_path, {"train.optimizer.lr": 3e-3, "train.optimizer.muon.lr": 0.03}, stop_after=3)
    _, _, meta = latest_checkpoint(tmp_path / "checkpoints")
    lr = {g["name"]: g["lr"] for g in meta["optimizer_groups"]}
    assert lr["no_decay"] == pytest.approx(meta["lr"])  # step 3 is on the plateau: the peak
    assert lr["no_decay"] == pytest.approx(3e-3) and lr["muon"] == pytest.approx(0.03)


@pytest.mark.parametrize("micro,accum", [(4, 2), (8, 1)])
def test_muon_resume_is_bit_exact(tmp_path, micro, accum):
    o = {"train.micro_batch_size": micro, "train.grad_accum_steps": accum}
    straight = run(tmp_path / "a", o)
    run(tmp_path / "b", o, stop_after=4)
    resumed = run(tmp_path / "b", o)
    assert resumed.resumed_from == 4 and resumed.step == straight.step == 8
    assert_same_checkpoint(final(tmp_path / "a"), final(tmp_path / "b"))
    assert logged_losses(tmp_path / "a") == logged_losses(tmp_path / "b")
    tensors = load_file(str(final(tmp_path / "b") / "optimizer.safetensors"))
    assert "model.layers.0.mlp.down_proj.weight.momentum_buffer" in tensors  # Muon's state is saved
    assert "model.embed_tokens.weight.exp_avg_sq" in tensors  # and AdamW's


def test_muon_same_config_twice_gives_identical_files(tmp_path):
    run(tmp_path / "a")
    run(tmp_path / "b")
    ca, cb = (
        list_checkpoints(tmp_path / "a" / "checkpoints"),
        list_checkpoints(tmp_path / "b" / "checkpoints"),
    )
    assert [p.name for p in ca] == [p.name for p in cb] and ca
    for a, b in zip(ca, cb, strict=True):
        assert checkpoint_digests(a) == checkpoint_digests(b)


def test_muon_is_not_adamw(tmp_path):
    """The optimizer name reaches the weights (and the run identity: a switch starts a fresh run)."""
    run(tmp_path / "muon")
    cfg = tiny_config()
    tr, va = loaders_for(cfg)
    train(cfg, tmp_path / "adamw", loader=tr, val_loader=va, progress=False)
    a = load_file(str(final(tmp_path / "muon") / "model.safetensors"))
    b = load_file(str(final(tmp_path / "adamw") / "model.safetensors"))
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], b["model.layers.0.mlp.up_proj.weight"])
    _, _, meta = latest_checkpoint(tmp_path / "muon" / "checkpoints")
    assert meta["identity_keys"]["train.optimizer.name"] == "muon"


def test_fp16_scaler_covers_both_optimizers_and_skips_nonfinite_steps():
    """fp16 autocast + GradScaler on CPU: an inf in one Muon matrix's gradient alone is found by unscale_
    (the scale backs off), skips the whole update (no parameter of either optimizer moves), and the next
    finite step updates everything."""
    cfg = tiny_config({**MUON, "hardware.dtype": "fp16", "hardware.loss_scaler": True})
    t, hw = cfg.train, cfg.hardware
    model = init_model(cfg, CPU)
    state = TrainState(model, build_optimizer(model, t.optimizer), make_scaler(CPU, hw), CPU)
    tr, _ = loaders_for(cfg)
    next_batch = functools.partial(next, micro_batches(tr, 0, t.grad_accum_steps, CPU))
    forward = functools.partial(lm_forward, accum=t.grad_accum_steps)
    settings = StepSettings(t.grad_accum_steps, t.optimizer.grad_clip, hw)
    poison = {"on": False}
    target = model.model.layers[1].mlp.down_proj.weight  # one of Muon's
    target.register_hook(lambda g: g * float("inf") if poison["on"] else g)

    batch = next_batch()
    out, batch = train_step(state, model, batch, next_batch, forward, 1e-3, settings)
    assert out.ok and state.scaler.is_enabled()
    scale = state.scaler.get_scale()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    poison["on"] = True
    out, batch = train_step(state, model, batch, next_batch, forward, 1e-3, settings)
    assert not out.ok and not math.isfinite(out.grad_norm) and state.skipped == 1
    assert state.scaler.get_scale() == scale * state.scaler.get_backoff_factor()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    poison["on"] = False
    out, batch = train_step(state, model, batch, next_batch, forward, 1e-3, settings)
    assert out.ok and state.nonfinite_in_row == 0
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all() and not torch.equal(p, before[n]), n


def test_fp16_muon_run_skips_a_nan_step_and_resumes_exactly(tmp_path, monkeypatch):
    o = {"hardware.dtype": "fp16", "hardware.loss_scaler": True, "train.max_steps": 6}
    nan_at_steps(monkeypatch, {2}, accum=2)
    straight = run(tmp_path / "a", o)
    assert straight.step == 6 and straight.skipped == 1 and math.isfinite(straight.end_loss)
    monkeypatch.undo()
    nan_at_steps(monkeypatch, {2}, accum=2)
    run(tmp_path / "b", o, stop_after=3)
    monkeypatch.undo()  # the resumed process counts forward calls from 0: no NaN after step 3 either way
    run(tmp_path / "b", o)
    assert_same_checkpoint(final(tmp_path / "a"), final(tmp_path / "b"))
    assert final(tmp_path / "b").name == step_dirname(6)


def stepped_matrices(make, shapes, steps=3):
    """The matrices after `steps` updates of the same fixed gradients, by the optimizer `make` builds."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen) * 0.02) for s in shapes]
    grads = [[torch.randn(*s, generator=gen) for s in shapes] for _ in range(steps)]
    opt = make(params)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach().clone() for p in params], opt


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_muon_in_bf16_is_torchs_bit_for_bit_and_fp32_is_more_exact(adjust):
    """ENLACE's Muon with bf16 Newton-Schulz gives torch.optim.Muon's bits (wide, tall and square matrices,
    decay on); in fp32 it differs, and its orthogonalised update is closer to the fp64 iteration's."""
    from enlace.train.optim import Muon, orthogonalize

    shapes = [(24, 16), (16, 24), (16, 16)]
    args = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5, adjust_lr_fn=adjust)
    ours, opt = stepped_matrices(lambda ps: Muon([{"params": ps}], ns_dtype=torch.bfloat16, **args), shapes)
    theirs, _ = stepped_matrices(lambda ps: torch.optim.Muon([{"params": ps}], **args), shapes)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    fp32, _ = stepped_matrices(lambda ps: Muon([{"params": ps}], ns_dtype=torch.float32, **args), shapes)
    assert not any(torch.equal(a, b) for a, b in zip(fp32, theirs, strict=True))

    group = opt.param_groups[0]
    update = torch.randn(24, 16, generator=torch.Generator().manual_seed(1))
    exact = orthogonalize(update.double(), group, torch.float64)
    err = {
        dt: (orthogonalize(update, group, dt).double() - exact).abs().max().item()
        for dt in (torch.bfloat16, torch.float32)
    }
    assert err[torch.float32] < 1e-5 < err[torch.bfloat16]


def test_fp32_newton_schulz_trains_and_resumes_bit_exactly(tmp_path):
    """optimizer.muon.ns_dtype=fp32 through the real training loop: stopped and resumed equals uninterrupted,
    and the run is not the bf16 one."""
    fp32 = {"train.optimizer.muon.ns_dtype": "fp32"}
    straight = run(tmp_path / "a", fp32)
    run(tmp_path / "b", fp32, stop_after=4)
    resumed = run(tmp_path / "b", fp32)
    assert resumed.resumed_from == 4 and resumed.step == straight.step == 8
    assert_same_checkpoint(final(tmp_path / "a"), final(tmp_path / "b"))
    run(tmp_path / "bf16")
    assert logged_losses(tmp_path / "bf16") != logged_losses(tmp_path / "a")
