"""CPU precision from the hardware: native-bf16 detection, the cpu-bf16 and cpu-auto profiles, the check that
refuses emulated bf16, and the bf16 training path (deterministic, recorded in config, checkpoint, metrics)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from helpers import checkpoint_digests, loaders_for, synthetic_text, tiny_config

from enlace import runtime
from enlace.cli import main
from enlace.config import load_config
from enlace.errors import ConfigError
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


AVX2_ONLY = frozenset({"sse2", "avx", "avx2", "fma"})  # most laptops and many cloud EPYCs


def test_auto_stays_in_the_config_and_the_run_resolves_it(cpu):
    # The config layer never looks at the machine: the same config and hash on every CPU.
    cpu(NATIVE)
    native = load_config(ROOT / "params.yaml")
    cpu(NO_BF16)
    plain = load_config(ROOT / "params.yaml")
    assert native.hash == plain.hash and native.hardware.dtype == "auto" and native.hardware.compile == "auto"
    assert native.hardware.name == "cpu-auto"  # the default pipeline selects cpu-auto
    # The run resolves it: the CPU (passed in here, this machine's by default) chooses dtype, compile, recipe.
    bf16 = runtime.resolve_run(native, NATIVE, "AVX512")
    fp32 = runtime.resolve_run(native, AVX2_ONLY, "AVX2")
    assert (bf16.kind, bf16.cfg.hardware.dtype, bf16.cfg.hardware.compile) == ("bf16", "bf16", True)
    assert (fp32.kind, fp32.cfg.hardware.dtype, fp32.cfg.hardware.compile) == ("fp32", "fp32", False)
    # The bf16 kind trains the layer files' recipe, unchanged; the fp32 kind its own shorter one.
    assert bf16.recipe == {} and bf16.cfg.to_dict()["train"] == native.to_dict()["train"]
    assert bf16.cfg.to_dict()["model"] == native.to_dict()["model"]
    assert fp32.recipe["train.max_steps"] == fp32.cfg.train.max_steps < native.train.max_steps
    assert fp32.cfg.provenance["train.max_steps"] == "configs/hardware/cpu-auto.yaml (kinds.fp32)"
    assert fp32.cfg.to_dict()["model"] == native.to_dict()["model"]
    assert bf16.cfg.hash != fp32.cfg.hash  # what a run records is what it ran
    assert "the fp32 CPU kind: fp32, eager; the fp32 kind's recipe for train cpu-small: " in fp32.line()
    assert "train.max_steps=" in fp32.line() and "PyTorch AVX2" in fp32.line()
    assert "the bf16 CPU kind: bf16, compiled; train cpu-small as configured" in bf16.line()
    # Resolving a resolved config changes nothing; the same CPU gives the same config.
    again = runtime.resolve_run(fp32.cfg, NATIVE, "AVX512")
    assert again.cfg == fp32.cfg and again.recipe == fp32.recipe and again.kind == "fp32"
    assert runtime.resolve_run(native, AVX2_ONLY, "AVX2").cfg.hash == fp32.cfg.hash
    # What a user sets wins over the kind's recipe; the smoke stage's layers take the recipe named for them.
    mine = load_config(ROOT / "params.yaml", overrides=["train.max_steps=1000", "hardware.compile=true"])
    mine = runtime.resolve_run(mine, AVX2_ONLY, "AVX2")
    assert mine.cfg.train.max_steps == 1000 and mine.cfg.hardware.compile is True
    assert "train.max_steps" not in mine.recipe and "train.schedule.decay_steps" in mine.recipe
    smoke = runtime.resolve_run(load_config(ROOT / "params.yaml", stage="smoke"), AVX2_ONLY, "AVX2")
    assert (
        smoke.cfg.hardware.compile is False and smoke.cfg.hardware.dtype == "fp32"
    )  # params.yaml's smoke.set
    assert smoke.recipe["train.max_steps"] == smoke.cfg.train.max_steps < 300  # the smoke layer's own recipe
    assert "train.seed" not in smoke.recipe and smoke.cfg.train.seed == 1337


def test_the_fine_tune_takes_its_kinds_recipe_too():
    cfg = load_config(ROOT / "params.yaml", layers=("hardware", "finetune"))
    fp32 = runtime.resolve_run(cfg, AVX2_ONLY, "AVX2")
    bf16 = runtime.resolve_run(cfg, NATIVE, "AVX512")
    assert bf16.cfg.finetune == cfg.finetune and bf16.recipe == {}
    assert fp32.cfg.finetune.max_steps == fp32.recipe["finetune.max_steps"] < cfg.finetune.max_steps
    assert "recipe for finetune smollm2-es: finetune.max_steps=" in fp32.line()
    # The assistant stage's layer (`enlace finetune --finetune gemma3-preamble-mid` in `make run`) has its own.
    mid = load_config(
        ROOT / "params.yaml", layers=("hardware", "finetune"), select={"finetune": "gemma3-preamble-mid"}
    )
    fp32, bf16 = runtime.resolve_run(mid, AVX2_ONLY, "AVX2"), runtime.resolve_run(mid, NATIVE, "AVX512")
    assert bf16.cfg.finetune.max_steps == mid.finetune.max_steps == 48 and bf16.recipe == {}
    assert fp32.cfg.finetune.max_steps == 24 and fp32.cfg.finetune.schedule.warmup_steps == 2


def test_make_run_leaves_the_assistant_out_on_the_fp32_kind_only(capsys):
    """`make run` asks `enlace hardware run-stages` which of its stages to run: the fp32 kind leaves out the
    assistant's LoRA (kinds.fp32.run_skips), every name there is a DVC stage, and a profile with its dtype
    set by hand keeps them all."""
    from enlace.commands import run_stages

    hw = load_config(ROOT / "params.yaml", layers=("hardware",)).hardware
    stages = ["eval", "export", "bench-es", "import-gemma3", "assistant"]
    assert run_stages(hw, stages, "fp32") == (stages[:-1], ["assistant"], "fp32")
    assert run_stages(hw, stages, "bf16") == (stages, [], "bf16")
    assert run_stages(hw.model_copy(update={"dtype": "fp32"}), stages, "fp32")[0] == stages
    dvc_stages = yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
    assert all(s in dvc_stages for kind in hw.kinds.values() for s in kind.run_skips)
    assert main(["hardware", "run-stages", *stages]) == 0
    kept = capsys.readouterr().out.split()
    assert kept == run_stages(hw, stages)[0]


def test_a_dtype_set_by_hand_on_cpu_auto_takes_its_kinds_compile_and_no_recipe():
    cfg = load_config(ROOT / "params.yaml", overrides=["hardware.dtype=fp32"])
    r = runtime.resolve_run(cfg, NATIVE, "AVX512")
    assert r.cfg.hardware.dtype == "fp32" and r.cfg.hardware.compile is False and r.recipe == {}
    assert r.cfg.train == cfg.train and runtime.resolve_run(r.cfg).cfg == r.cfg
    assert runtime.resolve_hardware(cfg.hardware, NATIVE, "AVX512").compile is False


def test_profiles_that_name_their_dtype_resolve_to_themselves():
    cfg = load_config(ROOT / "params.yaml", select={"hardware": "cpu-bf16"})
    r = runtime.resolve_run(cfg, AVX2_ONLY, "AVX2")
    assert r.cfg is cfg and r.kind is None and r.line() == "hardware: cpu-bf16 (cpu): bf16, compiled"
    assert runtime.resolve_hardware(cfg.hardware, AVX2_ONLY, "AVX2") is cfg.hardware


def _hardware_file(tmp_path, kinds: str, extra: str = "") -> Path:
    (tmp_path / "hw.yaml").write_text(
        f"name: k\ndevice: cpu\ndtype: auto\ncompile: auto\n{extra}kinds:\n{kinds}", encoding="utf-8"
    )
    return tmp_path / "hw.yaml"


@pytest.mark.parametrize(
    "kinds,extra,where,message",
    [
        # a recipe that breaks the cross-layer checks fails on every machine, naming where it came from
        (
            "  bf16: {compile: true}\n  fp32: {compile: false, recipes: {cpu-small: {train.max_steps: 50}}}\n",
            "",
            "hw.yaml: kinds.fp32.recipes.cpu-small: gives configs/train/cpu-small.yaml: train.schedule.decay_steps",
            "exceeds max_steps (50)",
        ),
        (
            "  bf16: {compile: true}\n  fp32: {compile: false, recipes: {cpu-small: {train.nope: 1}}}\n",
            "",
            "hw.yaml: kinds.fp32.recipes.cpu-small",
            "train.nope: Extra inputs are not permitted",
        ),
        (
            "  bf16: {compile: true}\n  fp32: {compile: false, recipes: {cpu-small: {data.name: x}}}\n",
            "",
            "hw.yaml: hardware",
            "a recipe sets model.KEY, train.KEY or finetune.KEY values only",
        ),
        (
            "  bf16: {compile: true}\n",
            "",
            "hw.yaml: hardware",
            "declare every CPU kind (bf16, fp32); missing fp32",
        ),
        ("  bf16: {compile: true}\n  fp32: {compile: false}\n", "", None, None),
    ],
)
def test_kinds_are_checked_when_the_config_is_read(tmp_path, kinds, extra, where, message):
    hw = _hardware_file(tmp_path, kinds, extra)
    if where is None:
        load_config(ROOT / "params.yaml", select={"hardware": str(hw)})
        return
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "params.yaml", select={"hardware": str(hw)})
    assert where in str(e.value) and message in str(e.value)


@pytest.mark.parametrize(
    "body,message",
    [
        ("name: k\ndevice: cpu\ndtype: fp32\ncompile: auto\n", "compile: auto takes its value from kinds"),
        (
            "name: k\ndevice: cuda\ndtype: fp32\nkinds: {bf16: {compile: true}, fp32: {compile: false}}\n",
            "kinds: CPU kinds are for device cpu",
        ),
    ],
)
def test_auto_compile_needs_kinds_and_kinds_a_cpu(tmp_path, body, message):
    (tmp_path / "hw.yaml").write_text(body, encoding="utf-8")
    with pytest.raises(ConfigError, match=message):
        load_config(ROOT / "params.yaml", select={"hardware": str(tmp_path / "hw.yaml")})


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
def test_default_pipeline_trains_in_the_resolved_precision(
    cpu, tmp_path, monkeypatch, capsys, flags, precision
):
    cpu(flags)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    # The real cpu-auto profile, its fp32 kind given a recipe for the train layer this test runs.
    hw_file = tmp_path / "configs/hardware/cpu-auto.yaml"
    hw = yaml.safe_load(hw_file.read_text())
    hw["kinds"]["fp32"]["recipes"]["smoke"]["train.seed"] = 7
    hw_file.write_text(yaml.safe_dump(hw))
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
        # Eager on both kinds: what each kind compiles is checked above (resolve_run) and compiled bf16 training
        # below; compiling here costs minutes on 2 cores and crashes under the AVX2 approximation (inductor).
        "--set", "hardware.compile=false",
    ]  # fmt: skip
    args = ["pretrain", "--no-progress", "--run-dir", "out/p", "--model", "smoke", "--train", "smoke", *tiny]
    assert main(args) == 0
    run = tmp_path / "out/p"
    # Printed when the run starts, recorded in metrics.json, the config and the run identity.
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("hardware: cpu-auto on "))
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["precision"] == precision and metrics["hardware"] == line
    assert metrics["compiled"] is False  # --set wins over the kind's compile
    assert f"the {precision} CPU kind: {precision}, eager" in line
    saved = json.loads((run / "config.json").read_text())["config"]
    assert saved["hardware"]["dtype"] == precision
    assert saved["train"]["seed"] == (7 if precision == "fp32" else 1337)
    _, meta = load_checkpoint(list_checkpoints(run / "checkpoints")[-1])
    assert meta["identity_keys"]["hardware.dtype"] == precision
    if precision == "fp32":
        assert "the fp32 kind's recipe for train smoke: " in line and "train.seed=7" in line
        assert "train.seed" in meta["identity_keys"]["hardware.recipe"]
        assert meta["identity_keys"]["hardware.recipe"].startswith("cpu-auto fp32: ")
    else:
        assert "train smoke as configured" in line and "hardware.recipe" not in meta["identity_keys"]
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
