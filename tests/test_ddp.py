"""Data parallelism on CPU (gloo, torchrun --nproc-per-node 2).

Two processes with micro-batch 4 see the same 8 rows per step as one process with micro-batch 4 and
accumulation 2. Gradients match up to float summation order (DDP averages the two ranks' gradients, one
process sums two halves), so weights are only promised to agree within a tolerance (in practice they come
out bit-identical). A 2-process run resumed with 2 processes is bit-exact; with 1 process it is refused.
"""

import pytest
import torch
from helpers import (
    checkpoint_digests,
    config_from_dict,
    free_port,
    loaders_for,
    logged_losses,
    spawn_trainer,
    tiny_dict,
    write_config,
)
from safetensors.torch import load_file

from enlace.train.checkpoint import list_checkpoints, step_dirname
from enlace.train.trainer import train

BASE = {"train.max_steps": 6, "train.micro_batch_size": 4, "train.global_batch_size": 8}
ATOL = 1e-6  # fp32 weights after 6 AdamW steps; observed: bit-identical (max diff 0.0) on torch 2.13 CPU


def torchrun(cfg_json, run_dir, stop_after=None):
    p = spawn_trainer(cfg_json, run_dir, nproc=2, port=free_port(), stop_after=stop_after)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ddp")
    single = config_from_dict(tiny_dict({**BASE, "train.grad_accum_steps": 2}))
    tr, va = loaders_for(single)
    train(single, d / "single", loader=tr, val_loader=va, progress=False)
    cfg_json = write_config(
        tiny_dict({**BASE, "train.grad_accum_steps": 1, "train.world_size": 2}), d / "ddp.json"
    )
    torchrun(cfg_json, d / "ddp")
    return d, cfg_json


def final(run_dir):
    return list_checkpoints(run_dir / "checkpoints")[-1]


def test_two_processes_match_one(runs):
    d, _ = runs
    a, b = final(d / "single"), final(d / "ddp")
    assert a.name == b.name == step_dirname(6)
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    for k in ta:
        torch.testing.assert_close(ta[k], tb[k], atol=ATOL, rtol=0, msg=k)
    for (s1, l1), (s2, l2) in zip(logged_losses(d / "single"), logged_losses(d / "ddp"), strict=True):
        assert s1 == s2 and abs(l1 - l2) < 1e-4


@pytest.mark.slow  # 30 s on 2 busy cores (pytest --durations)
def test_two_process_resume_is_exact(runs, tmp_path):
    d, cfg_json = runs
    torchrun(cfg_json, tmp_path / "run", stop_after=3)
    assert final(tmp_path / "run").name == step_dirname(3)
    torchrun(cfg_json, tmp_path / "run")
    assert checkpoint_digests(final(tmp_path / "run")) == checkpoint_digests(final(d / "ddp"))
    assert logged_losses(tmp_path / "run") == logged_losses(d / "ddp")


def test_another_world_size_is_another_run(runs, tmp_path, capsys):
    """Exact resume needs the same number of processes: a checkpoint of 2 ranks is not continued by 1."""
    d, _ = runs
    import shutil

    shutil.copytree(d / "ddp" / "checkpoints" / step_dirname(4), tmp_path / "checkpoints" / step_dirname(4))
    single = config_from_dict(tiny_dict({**BASE, "train.grad_accum_steps": 2}))
    tr, va = loaders_for(single)
    r = train(single, tmp_path, loader=tr, val_loader=va, stop_after=1, progress=False)
    assert r.resumed_from is None and r.step == 1
    assert "world_size: 2 -> 1" in capsys.readouterr().out
    assert (tmp_path / "previous").is_dir()


def test_config_world_size_must_match_env(monkeypatch):
    from enlace.errors import ConfigError
    from enlace.train.dist import init_distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="plans for 1 process.* WORLD_SIZE is 2"):
        init_distributed("cpu", 1)


@pytest.mark.slow  # over 15 s on 2 busy cores (pytest --durations)
def test_two_processes_match_one_with_muon(tmp_path):
    """Muon + AdamW under DDP: every rank orthogonalises the same all-reduced gradients."""
    muon = {**BASE, "train.optimizer.name": "muon"}
    single = config_from_dict(tiny_dict({**muon, "train.grad_accum_steps": 2}))
    tr, va = loaders_for(single)
    train(single, tmp_path / "single", loader=tr, val_loader=va, progress=False)
    cfg_json = write_config(
        tiny_dict({**muon, "train.grad_accum_steps": 1, "train.world_size": 2}), tmp_path / "ddp.json"
    )
    torchrun(cfg_json, tmp_path / "ddp")
    a, b = final(tmp_path / "single"), final(tmp_path / "ddp")
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    for k in ta:
        torch.testing.assert_close(ta[k], tb[k], atol=ATOL, rtol=0, msg=k)
    oa, ob = load_file(str(a / "optimizer.safetensors")), load_file(str(b / "optimizer.safetensors"))
    assert "model.layers.1.self_attn.o_proj.weight.momentum_buffer" in ob and oa.keys() == ob.keys()
