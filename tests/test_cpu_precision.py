"""CPU precision from the hardware: native-bf16 detection, the cpu-bf16 and cpu-auto profiles, the check that
refuses emulated bf16, and the bf16 training path (deterministic, recorded in config, checkpoint, metrics)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import checkpoint_digests, loaders_for, synthetic_text, tiny_config

from enlace import runtime
from enlace.cli import main
from enlace.config import load_config
from enlace.train.checkpoint import list_checkpoints, load_checkpoint
from enlace.train.trainer import train

ROOT = Path(__file__).resolve().parents[1]
NATIVE = frozenset({"avx512f", "avx512_bf16", "avx512_vnni"})
NO_BF16 = frozenset({"avx2", "avx512f", "avx512_vnni"})  # AVX-512 without its BF16 extension


@pytest.fixture
def cpu(monkeypatch):
    """Pose as a CPU with the given flags (PyTorch dispatching AVX-512), whatever this machine has."""

    def pose(flags: frozenset[str], capability: str = "AVX512") -> None:
        monkeypatch.setattr(runtime, "cpu_flags", lambda: flags)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)

    return pose


def test_cpuinfo_flags_are_read(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512_bf16 amx_tile\n\nprocessor\t: 1\n"
    )
    assert runtime.cpu_flags.__wrapped__(info) == {"fpu", "avx2", "avx512_bf16", "amx_tile"}
    assert runtime.cpu_flags.__wrapped__(tmp_path / "missing") == frozenset()


def test_native_bf16_needs_the_flag_and_avx512_kernels(cpu):
    cpu(NATIVE)
    assert runtime.cpu_bf16_native() == "avx512_bf16"
    assert runtime.cpu_bf16_native(frozenset({"amx_bf16", "amx_tile"})) == "amx_bf16"
    assert runtime.cpu_bf16_native(NO_BF16) is None
    cpu(NATIVE, capability="AVX2")  # e.g. ATEN_CPU_CAPABILITY=avx2: oneDNN's bf16 kernels are not used
    assert runtime.cpu_bf16_native() is None


def test_hardware_check_refuses_emulated_bf16(cpu, capsys):
    cpu(NO_BF16)
    assert main(["hardware", "check", "--hardware", "cpu-bf16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "configs/hardware/cpu-bf16.yaml: hardware.dtype" in err and "emulated" in err
    assert "neither avx512_bf16 nor amx_bf16" in err
    cpu(NATIVE, capability="AVX2")
    assert main(["hardware", "check", "--hardware", "cpu-bf16"]) == 2
    assert "has avx512_bf16 but PyTorch dispatches AVX2" in capsys.readouterr().err
    # fp32 and auto run anywhere.
    for profile in ("cpu", "cpu-auto"):
        assert main(["hardware", "check", "--hardware", profile]) == 0
        assert json.loads(capsys.readouterr().out)["dtype"] == "fp32"
    cpu(NATIVE)
    assert main(["hardware", "check", "--hardware", "cpu-bf16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dtype"] == "bf16" and "bf16 native: avx512_bf16" in out["name"]


def test_auto_resolves_at_config_time_and_is_recorded(cpu):
    cpu(NATIVE)
    native = load_config(ROOT / "params.yaml", layers=("hardware",), select={"hardware": "cpu-auto"})
    cpu(NO_BF16)
    plain = load_config(ROOT / "params.yaml", layers=("hardware",), select={"hardware": "cpu-auto"})
    assert native.hardware.dtype == "bf16" and plain.hardware.dtype == "fp32"
    assert native.to_dict()["hardware"]["dtype"] == "bf16"
    assert native.hash != plain.hash  # the precision is part of the run's identity
    # The default pipeline selects cpu-auto.
    assert load_config(ROOT / "params.yaml", layers=("hardware",)).hardware.name == "cpu-auto"


def test_auto_is_cpu_only(cpu, capsys):
    assert main(["config", "check", "--hardware", "cpu-auto", "--set", "hardware.device=cuda"]) == 2
    assert "dtype: auto is for device cpu" in capsys.readouterr().err


def test_bf16_training_is_deterministic_and_differs_from_fp32(tmp_path):
    digests = []
    for name, dtype in (("a", "bf16"), ("b", "bf16"), ("fp32", "fp32")):
        cfg = tiny_config({"hardware.dtype": dtype, "train.max_steps": 6})
        loader, val = loaders_for(cfg)
        res = train(cfg, tmp_path / name, loader=loader, val_loader=val, progress=False)
        assert res.step == 6 and res.skipped == 0
        last = list_checkpoints(tmp_path / name / "checkpoints")[-1]
        digests.append(checkpoint_digests(last)["model.safetensors"])
        _, meta = load_checkpoint(last)
        assert meta["config"]["hardware"]["dtype"] == dtype
    assert digests[0] == digests[1]  # the same sha256 twice
    assert digests[0] != digests[2]  # and bf16 really ran: fp32 gives other weights


@pytest.mark.parametrize("flags,precision", [(NATIVE, "bf16"), (NO_BF16, "fp32")])
def test_default_pipeline_trains_in_the_resolved_precision(cpu, tmp_path, monkeypatch, flags, precision):
    cpu(flags)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    corpus = tmp_path / "data" / "corpus"
    corpus.mkdir(parents=True)
    text = synthetic_text(40_000).decode()
    docs = [text[i : i + 1000] for i in range(0, len(text), 1000)]
    for split, part in (("train", docs[:-5]), ("val", docs[-5:])):
        (corpus / f"{split}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    monkeypatch.chdir(tmp_path)
    tiny = [
        "--set", "model.d_model=32", "--set", "model.n_layer=2", "--set", "model.seq_len=32",
        "--set", "model.ffn_multiple_of=16", "--set", "hardware.num_threads=1",
        "--set", "train.max_steps=4", "--set", "train.checkpoint.every=2",
        "--set", "train.schedule.warmup_steps=1", "--set", "train.schedule.decay_steps=1",
        "--set", "train.micro_batch_size=2", "--set", "train.global_batch_size=4", "--set", "train.eval_batches=1",
    ]  # fmt: skip
    args = ["pretrain", "--no-progress", "--run-dir", "out/p", "--model", "smoke", "--train", "smoke", *tiny]
    assert main(args) == 0
    run = tmp_path / "out/p"
    assert json.loads((run / "metrics.json").read_text())["precision"] == precision
    assert json.loads((run / "config.json").read_text())["config"]["hardware"]["dtype"] == precision
    _, meta = load_checkpoint(list_checkpoints(run / "checkpoints")[-1])
    assert meta["config"]["hardware"] == {
        **meta["config"]["hardware"],
        "name": "cpu-auto",
        "dtype": precision,
    }


@pytest.mark.skipif(runtime.cpu_bf16_native() is None, reason="needs a CPU with native bf16")
@pytest.mark.skipif(runtime.cpp_compiler() is None, reason="torch.compile needs a C++ compiler")
def test_compiled_bf16_training_is_deterministic_and_resumes_bit_exact(tmp_path):
    # The default CPU profile compiles the model (hardware.compile): the same sha256 twice, and a run
    # stopped at step 3 and resumed ends on the same weights and optimizer state as a straight one.
    o = {"hardware.dtype": "bf16", "hardware.compile": True, "train.max_steps": 6}

    def run(name, stop_after=None):
        cfg = tiny_config(o)
        loader, val = loaders_for(cfg)
        return train(
            cfg, tmp_path / name, loader=loader, val_loader=val, stop_after=stop_after, progress=False
        )

    run("a")
    run("b")
    assert run("c", stop_after=3).step == 3
    assert run("c").resumed_from == 3
    digests = [checkpoint_digests(list_checkpoints(tmp_path / n / "checkpoints")[-1]) for n in "abc"]
    assert (
        digests[0]["model.safetensors"] == digests[1]["model.safetensors"] == digests[2]["model.safetensors"]
    )
    assert digests[0]["optimizer.safetensors"] == digests[2]["optimizer.safetensors"]


def test_hardware_check_refuses_compiling_without_a_cpp_compiler(cpu, capsys, monkeypatch):
    # torch.compile builds CPU kernels with g++: without one the default profile fails at the check,
    # in one line naming the field, not minutes later inside the first training step.
    cpu(NATIVE)
    monkeypatch.setattr(runtime, "cpp_compiler", lambda: None)
    assert main(["hardware", "check", "--hardware", "cpu-auto"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "hardware.compile" in err and "C++ compiler" in err
    assert main(["hardware", "check", "--hardware", "cpu"]) == 0  # the eager fp32 reference needs none
