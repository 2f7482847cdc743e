"""Layered configs: every invalid config fails with status 2 and names its file and field."""

import copy
import types
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from enlace.cli import main
from enlace.config import EvalConfig, load_config, show
from enlace.config.resolve import LAYERS
from enlace.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


INVALID = [
    # (overrides, field named in the error, words the message must contain)
    (["model.n_head=3"], "model.n_head", "not divisible by n_head"),
    (["model.n_kv_head=3"], "model.n_kv_head", "not divisible by n_kv_head"),
    (["model.d_model=96", "model.n_head=32", "model.n_kv_head=8"], "model.n_head", "odd"),
    (
        ["data.shard.dtype=uint16", "data.tokenizer.vocab_size=70000", "model.vocab_size=70000"],
        "data.shard.dtype",
        "does not fit uint16",
    ),
    (["data.tokenizer.vocab_size=4096"], "data.tokenizer.vocab_size", "differs from model vocab_size"),
    (
        ["train.schedule.warmup_steps=2500", "train.schedule.decay_steps=500"],
        "train.schedule.decay_steps",
        "exceeds max_steps",
    ),
    (["train.grad_accum_steps=3"], "train", "global_batch_size"),
    (["hardware.dtype=fp16"], "hardware.loss_scaler", "needs a loss scaler"),
    (["hardware.dtype=fp8"], "hardware.dtype", "'fp32', 'fp16', 'bf16' or 'auto'"),
    (["model.n_layer=zero"], "model.n_layer", "integer"),
    (["model.n_layer=0"], "model.n_layer", "greater than 0"),
    (["model.colour=blue"], "model.colour", "unknown key"),
    (["train.optimizer.momentum=0.9"], "train.optimizer.momentum", "allowed: betas"),
    (["train.schedule.decay_shape=exp"], "train.schedule.decay_shape", "'linear', 'cosine' or '1-sqrt'"),
    (["train.optimizer.name=sgd"], "train.optimizer.name", "'adamw' or 'muon'"),
    (["train.optimizer.muon.momentum=1.0"], "train.optimizer.muon.momentum", "less than 1"),
    (["train.optimizer.muon.ns_steps=0"], "train.optimizer.muon.ns_steps", "greater than or equal to 1"),
    (["train.optimizer.muon.adjust_lr=none"], "train.optimizer.muon.adjust_lr", "'match_rms_adamw'"),
]


@pytest.mark.parametrize("overrides,field,words", INVALID)
def test_invalid_config_exits_2_naming_field(capsys, overrides, field, words):
    args = ["config", "check"]
    for o in overrides:
        args += ["--set", o]
    code, out, err = run_cli(capsys, *args)
    assert code == 2
    assert f": {field}" in err and words in err
    assert "Traceback" not in err and err.count("\n") == 1  # one line, no traceback


def test_error_names_the_layer_file_that_set_the_value(tmp_path, capsys):
    bad = tmp_path / "bad-model.yaml"
    bad.write_text(
        "name: bad\nvocab_size: 8192\nn_layer: 2\nn_head: 5\nn_kv_head: 1\nd_model: 256\nseq_len: 64\n"
    )
    code, _, err = run_cli(capsys, "config", "check", "--model", str(bad))
    assert code == 2 and f"{bad}: model.n_head: d_model 256 is not divisible by n_head 5" in err


def test_bf16_on_a_turing_profile_is_refused(capsys):
    code, _, err = run_cli(
        capsys,
        "config",
        "check",
        "--hardware",
        "rtx2060",
        "--set",
        "hardware.dtype=bf16",
        "--set",
        "hardware.loss_scaler=false",
    )
    assert code == 2 and "hardware.dtype" in err and "compute capability >= 8.0" in err


def test_unknown_nested_data_source_key(tmp_path, capsys):
    bad = tmp_path / "d.yaml"
    bad.write_text(
        "name: d\nsources:\n  - {name: x, kind: local, path: /tmp, colour: red}\ntokenizer: {vocab_size: 8192}\n"
    )
    code, _, err = run_cli(capsys, "config", "check", "--data", str(bad))
    assert code == 2 and "data.sources.0.colour: unknown key" in err and str(bad) in err


def test_missing_file_and_invalid_yaml(tmp_path, capsys):
    code, _, err = run_cli(capsys, "config", "check", "--model", "does-not-exist")
    assert code == 2 and "configs/model/does-not-exist.yaml" in err and "file not found" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    code, _, err = run_cli(capsys, "config", "check", "--train", str(broken))
    assert code == 2 and "not valid YAML" in err


def test_malformed_set_is_a_user_error(capsys):
    code, _, err = run_cli(capsys, "config", "check", "--set", "model.n_layer")
    assert code == 2 and "section.key=value" in err
    code, _, err = run_cli(capsys, "config", "check", "--set", "nolayer=1")
    assert code == 2 and "section one of" in err


def test_show_names_the_origin_of_each_value(capsys):
    code, out, _ = run_cli(capsys, "config", "show", "--set", "train.max_steps=1500")
    assert code == 0
    assert "max_steps: 1500  # --set" in out
    assert "n_layer: 3  # configs/model/cpu-small.yaml" in out
    assert "min_compute_capability: null  # default" in out


def test_stage_selection_and_override_precedence():
    smoke = load_config("params.yaml", select={"model": "smoke", "train": "smoke"})
    assert smoke.model.vocab_size == 256 and smoke.files["model"] == "configs/model/smoke.yaml"
    cfg = load_config("params.yaml", overrides=["train.optimizer.lr=0.01"])
    assert cfg.train.optimizer.lr == 0.01 and cfg.provenance["train.optimizer.lr"] == "--set"


def test_hash_is_stable_and_changes_with_any_value():
    a, b = load_config("params.yaml"), load_config("params.yaml")
    assert a.hash == b.hash and len(a.hash) == 16
    c = load_config("params.yaml", overrides=["train.seed=1"])
    assert c.hash != a.hash and c.section_hash("model") == a.section_hash("model")
    assert "# config hash: " + a.hash in show(a)


def test_shipped_configs_all_validate():
    for hw in ("cpu", "rtx2060", "rtx5090"):
        load_config("params.yaml", layers=("hardware",), select={"hardware": hw})
    for model, train in (("tiny-50m", "tiny-50m-2060"), ("tiny-50m", "tiny-50m-5090")):
        cfg = load_config("params.yaml", layers=("model", "train"), select={"model": model, "train": train})
        assert cfg.model.seq_len == 2048


def test_config_error_carries_file_and_field():
    with pytest.raises(ConfigError) as e:
        load_config("params.yaml", overrides=["model.n_kv_head=3"])
    assert e.value.field == "model.n_kv_head" and e.value.source == "--set"


def test_rtx2060_profile_fails_at_once_without_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, _, err = run_cli(capsys, "hardware", "check", "--hardware", "rtx2060")
    assert code == 2 and "configs/hardware/rtx2060.yaml" in err and "needs a CUDA GPU" in err
    code, out, _ = run_cli(capsys, "hardware", "check", "--hardware", "cpu")
    assert code == 0 and '"ok": true' in out


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "fetch -> tokenize -> shard -> smoke -> pretrain -> eval" in out and "config" in out


# Hostile inputs (issue 12): each is one line on stderr, exit 2, no traceback, naming what and where.
def check_one_line_error(capsys, args: list[str], *words: str) -> str:
    code, _, err = run_cli(capsys, *args)
    assert code == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)
    return err


def test_unknown_and_unread_keys_are_refused_by_finetune(capsys):
    # finetune reads the hardware and finetune layers: a train override would be silently ignored.
    check_one_line_error(capsys, ["finetune", "--set", "train.bogus=1"], "--set: train.bogus", "reads only")
    check_one_line_error(capsys, ["finetune", "--set", "finetune.bogus=1"], "finetune.bogus: unknown key")
    check_one_line_error(capsys, ["hardware", "check", "--set", "model.n_layer=2"], "model.n_layer")


@pytest.mark.parametrize(
    "override,field,words",
    [
        ("train.max_steps=true", "train.max_steps", "valid integer"),
        ("train.optimizer.lr=true", "train.optimizer.lr", "valid number"),
        ("model.n_layer=2.0", "model.n_layer", "valid integer"),
        ("hardware.compile=1", "hardware.compile", "valid boolean"),
        ("train.optimizer.betas=[true, 0.95]", "train.optimizer.betas.0", "valid number"),
        ("train.optimizer.lr=.nan", "train.optimizer.lr", "finite number"),
    ],
)
def test_booleans_and_numbers_never_coerce(capsys, override, field, words):
    check_one_line_error(capsys, ["config", "check", "--set", override], f": {field}: ", words)


def scalar_fields(schema: type[BaseModel], prefix: tuple[str, ...] = ()):
    """(path, "number" | "bool") for every int/float/bool field of a config model, nested models included."""
    for name, field in schema.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from scalar_fields(ann, (*prefix, name))
            continue
        todo, bases = [ann], set()
        while todo:  # unwrap Optional/Union and Annotated (StrictInt is Annotated[int, Strict()])
            t = todo.pop()
            if typing.get_origin(t) in (typing.Union, types.UnionType, typing.Annotated):
                todo.extend(
                    typing.get_args(t)[:1] if typing.get_origin(t) is typing.Annotated else typing.get_args(t)
                )
            else:
                bases.add(t)
        bases.discard(type(None))
        if bases == {bool}:
            yield (*prefix, name), "bool"
        elif bases and bases <= {int, float}:
            yield (*prefix, name), "number"


def test_numbers_and_booleans_are_strict_in_every_config_model():
    """Each int/float field of every layer (and of params.yaml's eval section) refuses `true`, and each bool field refuses `1`, starting from a
    shipped layer file (which itself validates)."""
    checked = 0
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for layer, schema in [*LAYERS.items(), ("eval", EvalConfig)]:
        if layer == "eval":  # params.yaml's own section
            raw = params["eval"]
        else:
            shipped = sorted((ROOT / "configs" / layer).glob("*.yaml"))
            assert shipped, layer
            raw = yaml.safe_load(shipped[0].read_text())
        schema.model_validate(raw)
        for path, kind in scalar_fields(schema):
            broken = copy.deepcopy(raw)
            d = broken
            for part in path[:-1]:
                d = d.setdefault(part, {})
            d[path[-1]] = 1 if kind == "bool" else True
            with pytest.raises(ValidationError) as e:
                schema.model_validate(broken)
            types_at = {err["type"] for err in e.value.errors() if err["loc"][: len(path)] == path}
            assert types_at & {"int_type", "float_type", "bool_type"}, (layer, path, e.value.errors())
            checked += 1
    assert checked > 80


def test_scientific_notation_without_a_dot_is_a_float():
    cfg = load_config("params.yaml", overrides=["train.optimizer.lr=3e-4", "train.optimizer.eps=1E-8"])
    assert cfg.train.optimizer.lr == 3e-4 and cfg.train.optimizer.eps == 1e-8


def test_unreadable_files_name_the_file(tmp_path, capsys):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("name: Repœblica\n".encode("cp1252"))
    check_one_line_error(capsys, ["config", "check", "--model", str(latin1)], str(latin1), "not UTF-8")
    # A folder where a YAML file is meant: as a layer and as the params file.
    check_one_line_error(
        capsys, ["config", "check", "--model", "configs/model"], "configs/model", "is a folder"
    )
    check_one_line_error(capsys, ["config", "check", "--params", str(tmp_path)], str(tmp_path), "is a folder")
    check_one_line_error(capsys, ["finetune", "--params", str(tmp_path)], "is a folder")
    check_one_line_error(capsys, ["smoke", "--params", str(tmp_path)], "is a folder")  # reads its stage block


def test_missing_params_file_is_reported_as_missing(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    for cmd in (["config", "check"], ["config", "show", "--stage", "smoke"], ["finetune"]):
        err = check_one_line_error(
            capsys, [*cmd, "--params", str(missing)], f"{missing}: params: file not found"
        )
        assert "no hardware config selected" not in err


@pytest.mark.parametrize(
    "text,line,quoted",
    [
        # The parser notices these one or more lines later; the message points at the mistake.
        ("name: x\nmax_steps 3\nseed: 1\n", 2, "'max_steps 3'"),
        ('name: "x\nmax_steps: 3\nseed: 1\n', 1, "'name: \"x'"),
        ("name: x\nsources: [a, b\nseed: 1\n", 2, "'sources: [a, b'"),
        ("optimizer:\n  lr: 1.0\n eps: 2.0\nseed: 1\n", 3, "'eps: 2.0'"),
    ],
)
def test_yaml_syntax_error_shows_the_offending_line(tmp_path, capsys, text, line, quoted):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    check_one_line_error(
        capsys, ["config", "check", "--train", str(bad)], f"not valid YAML at line {line}: {quoted}"
    )


def test_finetune_flag_errors_name_the_flag(capsys):
    check_one_line_error(
        capsys, ["finetune", "--max-len", "1"], "--max-len: finetune.max_len", "greater than 1"
    )
    check_one_line_error(capsys, ["finetune", "--targets", "wq"], "--targets: finetune.targets", "wq")
    check_one_line_error(capsys, ["finetune", "--steps", "0"], "--steps: finetune.max_steps")


def test_a_stage_section_selects_layers_and_sets_values():
    # params.yaml's `smoke:` section: the byte-level layers, and compile off for that short run only.
    smoke = load_config("params.yaml", stage="smoke")
    assert smoke.files["model"] == "configs/model/smoke.yaml" and smoke.hardware.compile is False
    assert smoke.provenance["hardware.compile"] == "params.yaml (smoke.set)"
    default = load_config("params.yaml")
    # cpu-auto compiles or not by CPU kind, decided when a run starts (tests/test_cpu_precision.py)
    assert default.hardware.compile == "auto" and default.files["model"] == "configs/model/cpu-small.yaml"
    # the command line still wins over the stage's section
    forced = load_config("params.yaml", stage="smoke", overrides=["hardware.compile=true"])
    assert forced.hardware.compile is True and forced.provenance["hardware.compile"] == "--set"
