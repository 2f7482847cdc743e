"""enlace.load: every kind of model path opens through the one loader and generates what the low-level
readers it is built on give; a bad path is one line naming it; the sampling defaults live in one place."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import loaders_for, make_folder, tiny_config

from enlace.cli import build_parser, main
from enlace.config.extra import CHAT, GENERATE, GenerationConfig
from enlace.config.finetune import FinetuneConfig
from enlace.errors import CheckpointError, ModelError
from enlace.generate import generate
from enlace.hf.folder import load_hf_folder
from enlace.hf.tokenizer import HFTokenizer
from enlace.load import Loaded, ModelRef, load_model, locate
from enlace.model import Llama
from enlace.text import ByteCodec
from enlace.train.checkpoint import latest_checkpoint
from enlace.train.trainer import train

PROMPT = "¿Qué cenamos hoy, mamá?"


def greedy(model: torch.nn.Module, ids: list[int], n: int = 8) -> list[int]:
    return list(generate(model, ids, n, temperature=0.0))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    cfg = tiny_config({"train.max_steps": 2, "train.checkpoint.every": 2})
    out = tmp_path_factory.mktemp("run") / "pretrain"
    tr, va = loaders_for(cfg)
    train(cfg, out, loader=tr, val_loader=va, progress=False)
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_folder(tmp_path_factory.mktemp("hf") / "base")


@pytest.fixture(scope="module")
def adapter(folder, tmp_path_factory) -> Path:
    from enlace.lora import inject_lora, save_adapter

    model = load_hf_folder(folder)
    torch.manual_seed(1)
    for m in inject_lora(model, ["q_proj", "v_proj"], rank=4, alpha=8).values():
        torch.nn.init.normal_(m.lora_B.weight, std=0.5)  # B starts at zero: make the adapter matter
    return save_adapter(model, tmp_path_factory.mktemp("ad") / "adapter", str(folder))


def test_run_folder_opens_with_its_codec(run_dir):
    loaded = load_model(run_dir)
    path, tensors, meta = latest_checkpoint(run_dir / "checkpoints")
    ref = Llama(loaded.model.cfg)
    ref.load_state_dict(tensors["model"], strict=False)
    ids = loaded.encode("Había una vez")
    assert loaded.ref.kind == "run" and loaded.checkpoint == path and loaded.meta["step"] == meta["step"] == 2
    assert isinstance(loaded.codec, ByteCodec) and ids == list("Había una vez".encode())
    assert loaded.chat_template is None and loaded.generation == GenerationConfig()
    assert loaded.context == 32 and loaded.eos_ids == tuple(ByteCodec().eos_ids)
    assert greedy(loaded.model, ids) == greedy(ref.eval(), ids)
    assert "pretraining run" in loaded.source and str(path) in loaded.source


def test_hf_folder_opens_with_its_tokenizer_and_template(folder):
    loaded = load_model(folder)
    tok = HFTokenizer(folder)
    ids = loaded.chat_template([{"role": "user", "content": PROMPT}])
    assert ids == tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    assert loaded.ref.kind == "hf" and loaded.eos_ids == tok.eos_ids and loaded.generation == CHAT
    assert greedy(loaded.model, ids) == greedy(load_hf_folder(folder), ids)
    assert loaded.encode(PROMPT) == tok.encode(PROMPT) and loaded.name == "base"


def test_adapter_is_merged_in(folder, adapter):
    from enlace.lora import load_adapter, set_merged

    loaded = load_model(folder, adapter)
    ref = load_hf_folder(folder)
    load_adapter(ref, adapter, str(folder))
    set_merged(ref, True)
    ids = HFTokenizer(folder).encode(PROMPT)
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(loaded.model(x).logits, ref(x).logits)
        assert (loaded.model(x).logits - load_hf_folder(folder)(x).logits).abs().max() > 1e-3
    assert greedy(loaded.model, ids) == greedy(ref, ids)
    assert "with the LoRA adapter" in loaded.source and loaded.name == "base+ad0"


def test_adapter_scale_multiplies_the_delta(folder, adapter):
    ids = HFTokenizer(folder).encode(PROMPT)
    x = torch.tensor([ids])
    base = load_hf_folder(folder)
    full, half, none = (load_model(folder, adapter, adapter_scale=s) for s in (1.0, 0.5, 0.0))
    with torch.no_grad():
        b, f, h, z = (m(x).logits for m in (base, full.model, half.model, none.model))
    assert torch.allclose(z, b, atol=1e-5) and (f - b).abs().max() > 1e-3
    assert not torch.allclose(h, f, atol=1e-3) and not torch.allclose(h, b, atol=1e-3)
    assert half.name == "base+ad0@0.5" and "scaled by 0.5" in half.source and full.name == "base+ad0"
    with pytest.raises(ModelError, match="has no LoRA adapter to scale"):
        load_model(folder, adapter_scale=0.5)
    with pytest.raises(ModelError, match="finite"):
        load_model(folder, adapter, adapter_scale=float("nan"))


def test_lora_run_folder_is_its_base_plus_adapter(folder, adapter, tmp_path):
    import json
    import shutil

    run = tmp_path / "finetune"
    shutil.copytree(adapter, run / "adapter")
    (run / "checkpoints").mkdir()
    (run / "config.json").write_text(json.dumps({"config": {"finetune": {"base_model": str(folder)}}}))
    ref = locate(run)
    assert (ref.kind, ref.path, ref.adapter) == ("hf", folder, run / "adapter")


def test_gguf_file_opens_as_its_folder_does(folder, tmp_path, capsys):
    from enlace.hf.gguf_export import export_folder_gguf

    gguf = export_folder_gguf(folder, tmp_path / "base.gguf", "f32")
    loaded = load_model(gguf)
    ids = loaded.chat_template([{"role": "user", "content": PROMPT}])
    assert loaded.ref.kind == "gguf" and "imported from GGUF" in loaded.source and loaded.name == "base"
    assert greedy(loaded.model, ids) == greedy(load_hf_folder(folder), ids)
    # Through `enlace generate` too: the file and the folder print the same continuation.
    outs = []
    for model in (gguf, folder):
        argv = ["generate", "--model", str(model), "--raw", "Había una vez", "--temperature", "0"]
        assert main([*argv, "--max-new-tokens", "6", "--weights", "fp32"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].startswith("Había una vez")


def test_decode_weights_are_applied_and_recorded(folder):
    loaded = load_model(folder, weights="fp32")
    assert isinstance(loaded, Loaded) and loaded.weights == "fp32"
    assert next(loaded.model.parameters()).dtype == torch.float32


def test_the_kernel_choice_reaches_the_model_and_a_bad_one_is_named(folder):
    from enlace.generate import KernelLinear
    from enlace.serve.loader import load_served

    def takes_enlaces(kernels: str) -> bool:
        served = load_served(str(folder), None, default=None, weights="fp32", kernels=kernels)
        return any(isinstance(m, KernelLinear) for m in served.model.modules())

    assert takes_enlaces("auto") and not takes_enlaces("torch")  # the kernels are built where tests run
    with pytest.raises(ModelError, match="--kernels fastest: choose from auto, torch, enlace"):
        load_model(folder, weights="fp32", kernels="fastest")


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda p: p / "missing", "no such folder or file"),
        (lambda p: (p / "notes.txt").write_text("hola") and p / "notes.txt", "not a folder"),
        (lambda p: p, "neither a run folder"),
    ],
)
def test_bad_paths_are_one_line_errors_naming_them(tmp_path, make, needle, capsys):
    bad = make(tmp_path)
    with pytest.raises(ModelError, match=needle) as e:
        load_model(bad)
    assert str(bad) in str(e.value) and "\n" not in str(e.value)
    for argv in (["generate", "hola", "--model", str(bad)], ["chat", "--model", str(bad)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and str(bad) in err and "\n" not in err


def test_commands_refuse_a_model_they_cannot_use(run_dir, adapter, capsys):
    assert main(["chat", "--model", str(run_dir)]) == 2  # a run continues text: it has no chat template
    err = capsys.readouterr().err.strip()
    assert "no chat template" in err and "generate --raw" in err and str(run_dir) in err and "\n" not in err
    assert main(["generate", "hola", "--model", str(run_dir), "--adapter", str(adapter)]) == 2
    assert "--adapter applies to Hugging Face model folders" in capsys.readouterr().err
    assert main(["bench-es", str(run_dir)]) == 2
    assert "export a run first" in capsys.readouterr().err
    empty = run_dir.parent / "empty"
    (empty / "checkpoints").mkdir(parents=True, exist_ok=True)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_model(empty)


def test_sampling_defaults_come_from_one_place():
    from enlace.config.extra import CHAT_SAMPLING

    chat = build_parser().parse_args(["chat"])
    gen = build_parser().parse_args(["generate", "hola"])
    keys = (
        "max_new_tokens",
        "temperature",
        "top_k",
        "top_p",
        "repetition_penalty",
        "no_repeat_ngram",
        "seed",
    )
    # `enlace chat` leaves the sampler to the model (Loaded.chat_sampling: CHAT's, or an assistant spec's).
    assert {k: getattr(chat, k) for k in ("max_new_tokens", "seed")} == CHAT.model_dump(
        include={"max_new_tokens", "seed"}
    )
    assert all(getattr(chat, k) is None for k in CHAT_SAMPLING)
    assert {k: getattr(gen, k) for k in keys[:4]} == GENERATE.model_dump(include=set(keys[:4]))
    assert CHAT_SAMPLING == CHAT.model_dump(include=set(CHAT_SAMPLING))  # serve's request defaults
    ft = FinetuneConfig(name="x").generation
    assert ft.model_dump(exclude={"max_new_tokens"}) == CHAT.model_dump(exclude={"max_new_tokens"})
    assert GENERATE.model_dump(exclude={"max_new_tokens"}) == GenerationConfig().model_dump(
        exclude={"max_new_tokens"}
    )


def test_served_model_is_built_from_the_loaded_one(folder):
    from enlace.serve.loader import load_served

    served = load_served(str(folder), None, default=None, weights="fp32")
    assert served.generation == CHAT and served.encode_chat is not None and served.weights == "fp32"
    assert not served.trim  # a chat template's answer starts where the template ends
    assert served.name == "base" and served.context == load_hf_folder(folder).cfg.seq_len


def write_spec(path: Path, base: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"name: tiny-preamble\nbase: {base}\nsystem: Un asistente que responde en español.\n"
        'user: "Usuario: {content}\\n"\nassistant: "ENLACE: {content}\\n\\n"\nstop: ["\\nUsuario:"]\n'
        'examples:\n  - user: "¿De qué color es el cielo?"\n    assistant: "Azul."\n',
        encoding="utf-8",
    )
    return path


def test_assistant_spec_opens_its_base_with_the_preamble(folder, tmp_path):
    """An assistant spec is a model path: its base, rendered by the preamble, cut by its stop strings."""
    from enlace.load.preamble import load_spec

    spec_path = write_spec(tmp_path / "tiny.yaml", folder)
    loaded = load_model(spec_path)
    spec, tok = load_spec(spec_path), HFTokenizer(folder)
    msgs = [{"role": "user", "content": PROMPT}]
    assert loaded.ref.kind == "preamble" and loaded.name == "tiny-preamble" and loaded.generation == CHAT
    assert (
        loaded.chat_template(msgs)
        == spec.encode(tok, msgs)
        == tok.encode(spec.render(msgs), add_special_tokens=False)
    )
    assert spec.render(msgs).endswith(f"Usuario: {PROMPT}\nENLACE:")
    assert loaded.stops == ("\nUsuario:",) and "aligned in context" in loaded.source
    assert greedy(loaded.model, loaded.chat_template(msgs)) == greedy(
        load_hf_folder(folder), spec.encode(tok, msgs)
    )
    # An adapter goes on the spec's base (one trained in its format: tests/test_finetune_preamble.py).
    assert locate(spec_path, adapter=tmp_path) == ModelRef("preamble", spec_path, tmp_path)


def test_a_spec_sets_how_its_replies_sample_where_a_request_does_not(folder, tmp_path):
    """An assistant spec's `sampling:` replaces CHAT's sampler in `enlace chat` and in the server's requests
    (a request's own value still wins); a bad value is refused naming the file and the field."""
    import io

    from enlace.config.extra import CHAT_SAMPLING
    from enlace.errors import ConfigError
    from enlace.finetune.assistant import load_assistant, reply
    from enlace.finetune.chat import chat_repl
    from enlace.load.preamble import load_spec
    from enlace.serve.engine import Engine
    from enlace.serve.handlers import Limits, Serving
    from enlace.serve.loader import load_served
    from enlace.serve.schema import ChatRequest

    plain = write_spec(tmp_path / "plain.yaml", folder)
    greedy_spec = tmp_path / "greedy.yaml"
    greedy_spec.write_text(
        plain.read_text(encoding="utf-8") + "sampling:\n  temperature: 0.0\n", encoding="utf-8"
    )
    assert load_model(plain).chat_sampling == CHAT_SAMPLING
    assert load_model(greedy_spec).chat_sampling == {**CHAT_SAMPLING, "temperature": 0.0}

    def chat(spec_path: Path, seed: int) -> str:
        out = io.StringIO()
        return chat_repl(
            load_model(spec_path), io.StringIO(PROMPT + "\n"), out, max_new_tokens=12, seed=seed
        )[1]["content"]

    greedy_reply = reply(
        load_assistant(plain), PROMPT, {**CHAT_SAMPLING, "temperature": 0.0, "seed": 0}, 12
    ).text
    assert chat(greedy_spec, 0) == chat(greedy_spec, 1) == greedy_reply  # any seed: the spec's greedy
    sampled = [chat(plain, seed) for seed in range(3)]  # CHAT's sampler: the seed matters on a random model
    assert sampled[0] == reply(load_assistant(plain), PROMPT, {**CHAT_SAMPLING, "seed": 0}, 12).text
    assert len(set(sampled)) > 1

    msgs = [{"role": "user", "content": PROMPT}]
    for spec_path, default in ((greedy_spec, 0.0), (plain, CHAT_SAMPLING["temperature"])):
        served = load_served(str(spec_path), None, default=None, weights="fp32")
        serving = Serving(Engine(served), Limits())
        ids = served.encode_chat(msgs)
        assert serving.gen_request(ChatRequest(messages=msgs), ids, "messages").temperature == default
        asked = ChatRequest(messages=msgs, temperature=0.5)
        assert serving.gen_request(asked, ids, "messages").temperature == 0.5

    bad = tmp_path / "bad.yaml"
    bad.write_text(plain.read_text(encoding="utf-8") + "sampling:\n  temperature: -1\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*sampling\.temperature"):
        load_spec(bad)


def test_chat_answers_through_a_specs_preamble_and_stops_as_the_judge_does(folder, tmp_path):
    """`enlace chat --model SPEC`: the preamble renders the conversation, and the reply ends at a stop string
    (cut before it, nothing of it printed), as the judge's and the server's replies do."""
    import io

    from enlace.finetune.assistant import load_assistant, reply
    from enlace.finetune.chat import chat_repl

    plain = {"temperature": 0.0, "repetition_penalty": 1.0, "no_repeat_ngram": 0}

    def chat(spec_path: Path) -> tuple[str, str]:
        out = io.StringIO()
        msgs = chat_repl(load_model(spec_path), io.StringIO(PROMPT + "\n"), out, max_new_tokens=16, **plain)
        return msgs[1]["content"], out.getvalue()

    spec_path = write_spec(tmp_path / "tiny.yaml", folder)
    full, printed = chat(spec_path)
    assert full == reply(load_assistant(spec_path), PROMPT, {**plain, "seed": 0}, 16).text
    assert len(full) > 6 and printed.strip() == full
    stop = full[3:6]  # a stop string the tiny model is sure to write
    text = spec_path.read_text(encoding="utf-8").replace('stop: ["\\nUsuario:"]', f'stop: ["{stop}"]')
    cut_spec = tmp_path / "cut.yaml"
    cut_spec.write_text(text, encoding="utf-8")
    cut, printed = chat(cut_spec)
    assert (
        cut
        == full[: full.find(stop)].strip()
        == reply(load_assistant(cut_spec), PROMPT, {**plain, "seed": 0}, 16).text
    )
    assert printed == full[: full.find(stop)] + "\n"


def test_serve_answers_with_the_imported_preamble_by_default(folder, tmp_path, monkeypatch):
    """No --model: the in-context assistant once its base exists, named as such; else the finetune adapter."""
    from enlace.paths import DEFAULT_ASSISTANT
    from enlace.serve.loader import load_served, resolve

    monkeypatch.chdir(tmp_path)

    def finetune_default() -> tuple[Path, Path]:
        return folder, tmp_path / "runs/finetune/adapter"

    with pytest.raises(Exception, match="no assistant yet"):
        resolve(None, None, finetune_default)
    write_spec(tmp_path / DEFAULT_ASSISTANT, tmp_path / "models/none")
    with pytest.raises(Exception, match="no assistant yet"):  # the spec's base is not imported
        resolve(None, None, finetune_default)
    write_spec(tmp_path / DEFAULT_ASSISTANT, folder)
    assert resolve(None, None, finetune_default) == ("preamble", DEFAULT_ASSISTANT, None)
    served = load_served(None, None, finetune_default, weights="fp32")
    assert served.name == "tiny-preamble" and served.stops == ("\nUsuario:",) and served.trim
    assert "aligned in context" in served.source and served.encode_chat is not None


def test_serve_adds_the_lora_trained_in_the_specs_present_format(
    folder, adapter, tmp_path, monkeypatch, capsys
):
    """`make assistant`'s adapter joins the default spec only while the spec is the text it was trained with."""
    import shutil

    from enlace.load.preamble import load_spec
    from enlace.lora import inject_lora, save_adapter
    from enlace.paths import DEFAULT_ASSISTANT, DEFAULT_ASSISTANT_ADAPTER
    from enlace.serve.loader import load_served, resolve

    monkeypatch.chdir(tmp_path)
    spec = write_spec(tmp_path / DEFAULT_ASSISTANT, folder)
    lora = tmp_path / DEFAULT_ASSISTANT_ADAPTER
    model = load_hf_folder(folder)
    inject_lora(model, ["q_proj", "v_proj"], rank=4, alpha=8)
    save_adapter(model, lora, str(folder), {"preamble_text_sha256": load_spec(spec).text_fingerprint()})
    none = lambda: (folder, tmp_path / "none")  # noqa: E731
    assert resolve(None, None, none) == ("preamble", DEFAULT_ASSISTANT, DEFAULT_ASSISTANT_ADAPTER)
    served = load_served(None, None, none, weights="fp32")
    assert served.name == "tiny-preamble+assistant-preamble-mid" and "aligned in context" in served.source
    # A comment, the copy guard or the sampler leave the text the adapter learnt as it was.
    spec.write_text(
        spec.read_text(encoding="utf-8") + "# edited\ncopy_guard: 2\nsampling:\n  temperature: 0.0\n",
        encoding="utf-8",
    )
    assert resolve(None, None, none) == ("preamble", DEFAULT_ASSISTANT, DEFAULT_ASSISTANT_ADAPTER)
    assert not capsys.readouterr().err
    spec.write_text(spec.read_text(encoding="utf-8").replace("Azul.", "Es azul."), encoding="utf-8")
    assert resolve(None, None, none) == ("preamble", DEFAULT_ASSISTANT, None)  # trained for another text
    assert "not serving" in capsys.readouterr().err
    shutil.rmtree(lora)
    assert resolve(None, None, none) == ("preamble", DEFAULT_ASSISTANT, None) and not capsys.readouterr().err
