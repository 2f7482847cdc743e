"""A LoRA trained in a preamble spec's own format (finetune.preamble) and served as that spec plus the adapter.

On a random tiny Gemma: every training example is the prompt `enlace serve` feeds the model for the same
question (the served encode, not a copy of its logic), then the answer and its end, the only labelled ids; a
short run's adapter opens on the spec's base in `enlace serve`, `enlace judge` and enlace.load alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gemma_helpers import tiny_gemma_folder
from helpers import write_jsonl

from enlace.cli import main
from enlace.config.extra import GenerationConfig
from enlace.config.finetune import FinetuneConfig
from enlace.config.hardware import HardwareConfig
from enlace.errors import ConfigError, EnlaceError
from enlace.finetune.assistant import load_assistant
from enlace.finetune.data import dolly_messages
from enlace.finetune.evaluate import finetune_eval
from enlace.finetune.train import finetune, prepare
from enlace.load import load_model
from enlace.load.preamble import cut_at_stop, load_spec
from enlace.model import IGNORE_INDEX
from enlace.serve.loader import load_served

HW = HardwareConfig(name="cpu", device="cpu")
SPEC = """name: tiny-preamble
base: {base}
start: "<bos>"
system: Un asistente que responde en español.
user: "Usuario: {{content}}\\n"
assistant: "ENLACE: {{content}}\\n\\n"
stop: [{stop}]
examples:
  - user: "¿Qué hora es?"
    assistant: "Son las diez."
"""
ROWS = [
    {"instruction": "¿Dónde está el perro?", "context": "", "response": "El perro está en el jardín."},
    {"instruction": "Escribe un aviso corto.", "context": "Para los vecinos.", "response": "Aquí tienes:\n«Hoy no hay agua.»"},
    {"instruction": "¿Cuántas patas tiene un gato?", "context": "", "response": "Un gato tiene cuatro patas."},
]  # fmt: skip


def write_spec(path: Path, base: Path, stop: str = '"\\nUsuario:", "\\nENLACE:"') -> Path:
    path.write_text(SPEC.format(base=base, stop=stop), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path, Path]:
    tmp = tmp_path_factory.mktemp("preamble-ft")
    folder = tiny_gemma_folder(tmp / "gemma")
    return folder, write_spec(tmp / "spec.yaml", folder), write_jsonl(tmp / "train.jsonl", ROWS)


def cfg_for(tiny, out: Path, **kw) -> FinetuneConfig:
    folder, spec, train = tiny
    base = dict(
        name="t", base_model=str(folder), preamble=str(spec), train_data=str(train), val_data=str(train),
        max_steps=3, micro_batch_size=2, optimizer={"lr": 5e-2}, schedule={"warmup_steps": 0}, max_len=256,
        rank=4, alpha=8, dropout=0.0, targets=["q_proj", "v_proj"], out=str(out), judge_base=False,
        generation=GenerationConfig(max_new_tokens=4),
    )  # fmt: skip
    return FinetuneConfig(**{**base, **kw})


def no_default() -> tuple[Path, Path]:
    raise AssertionError("serve's default assistant is not asked for here")


def test_each_training_example_is_the_served_prompt_then_the_answer_and_its_end(tiny, tmp_path):
    folder, spec_path, _ = tiny
    _, tok, data = prepare(cfg_for(tiny, tmp_path / "run"), torch.device("cpu"))  # `enlace finetune`'s data
    served = load_served(str(spec_path), None, no_default)  # what `enlace serve --model SPEC` encodes with
    spec = load_spec(spec_path)
    assert len(data.examples) == len(ROWS)  # max_len keeps them all; none without an answer
    for row, ex in zip(ROWS, data.examples, strict=True):
        msgs = dolly_messages(row)
        prompt = served.encode_chat(msgs[:-1])
        n = len(prompt)
        assert ex.input_ids[:n] == prompt and set(ex.labels[:n]) == {IGNORE_INDEX}
        assert ex.labels[n:] == ex.input_ids[n:]  # the loss: the answer and its end, all of it
        taught = tok.decode(ex.input_ids[n:])
        assert taught == f" {row['response']}\n\nUsuario:"
        # Serving cuts the taught text at its stop string: the answer, whole, and nothing after it.
        assert cut_at_stop(taught, list(served.stops)) == (f" {row['response']}\n", True)
        assert tok.decode(ex.input_ids) == "<bos>" + spec.render(msgs[:-1]) + taught


def test_a_spec_whose_stop_strings_never_end_a_turn_cannot_teach_an_answer(tiny, tmp_path):
    folder, _, _ = tiny
    spec = load_spec(write_spec(tmp_path / "bad.yaml", folder, stop='"\\nPregunta:"'))
    tok = load_model(folder).hf_tokenizer("test")
    with pytest.raises(EnlaceError, match="no stop string occurs between an answer and the next user turn"):
        spec.training_ids(tok, dolly_messages(ROWS[0]))


def test_the_preamble_must_align_the_layers_own_base(tiny, tmp_path):
    folder, _, _ = tiny
    other = write_spec(tmp_path / "other.yaml", tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="preamble: .* aligns .*elsewhere, not base_model"):
        prepare(cfg_for(tiny, tmp_path / "run", preamble=str(other)), torch.device("cpu"))


def test_the_adapter_is_served_and_judged_on_the_specs_base(tiny, tmp_path, capsys):
    folder, spec_path, _ = tiny
    out = tmp_path / "run"
    finetune(cfg_for(tiny, out), HW, progress=False)
    adapter = out / "adapter"
    # The manifest records the spec's text it learnt (enlace serve adds it to that spec only while unchanged).
    from enlace.load.preamble import load_spec
    from enlace.manifest import read_manifest

    trained = read_manifest(adapter / "manifest.json")["provenance"]
    assert (
        trained["preamble_text_sha256"] == load_spec(spec_path).text_fingerprint() and trained["steps"] == 3
    )
    plain, tuned = load_assistant(spec_path), load_assistant(spec_path, adapter=adapter)
    msgs = [{"role": "user", "content": "¿Dónde está el gato?"}]
    ids = torch.tensor([tuned.encode(msgs)])
    assert tuned.encode(msgs) == plain.encode(msgs) and tuned.stops == plain.stops
    assert tuned.name == "tiny-preamble+run" and f"+ adapter {adapter}" in tuned.what
    # The adapter is merged into the spec's base: the same logits as the base folder with it, not the base's.
    with_adapter = load_model(folder, adapter).model
    with torch.no_grad():
        got = tuned.model(ids).logits
        assert torch.allclose(got, with_adapter(ids).logits, atol=1e-5)
        assert not torch.allclose(got, plain.model(ids).logits, atol=1e-3)
    served = load_served(
        str(spec_path), str(adapter), no_default, weights="fp32"
    )  # got's precision, any kind
    assert served.encode_chat(msgs) == plain.encode(msgs) and "aligned in context" in served.source
    with torch.no_grad():
        assert torch.allclose(served.model(ids).logits, got, atol=1e-5)
    # `enlace judge --assistant SPEC --adapter DIR`: answers with both, written as it goes.
    result = tmp_path / "judge.json"
    main(["judge", "--assistant", str(spec_path), "--adapter", str(adapter), "--split", "dev", "--limit", "2",
          "--decodings", "greedy", "--max-new-tokens", "3", "--out", str(result)])  # fmt: skip
    stored = json.loads(result.read_text(encoding="utf-8"))
    assert stored["assistant"] == "tiny-preamble+run" and len(stored["decodings"]["greedy"]["answers"]) == 2
    assert f"+ adapter {adapter}" in capsys.readouterr().out


def test_finetune_eval_gives_the_held_out_loss_in_the_preamble_format(tiny, tmp_path):
    """`enlace finetune-eval` on such a layer: the held-out loss of every example rendered as served (the
    preamble in the prompt), the base's then the adapter's, and the judge's command for its answers."""
    from enlace.finetune.data import load_dataset
    from enlace.finetune.evaluate import heldout_loss
    from enlace.hf.tokenizer import HFTokenizer
    from enlace.load.preamble import load_spec

    folder, spec_path, train = tiny
    cfg = cfg_for(tiny, tmp_path / "run")
    finetune(cfg, HW, progress=False)
    r = finetune_eval(cfg, HW)
    tok = HFTokenizer(folder)
    in_format = load_dataset(tok, train, cfg.format, cfg.max_len, None, None, load_spec(spec_path))
    assert r["loss_before"] == round(heldout_loss(load_model(folder).model, in_format, tok.pad_id), 5)
    assert r["loss_after"] < r["loss_before"]  # val is the training data here, at a high rate
    assert r["judge_with"] == f"enlace judge --assistant {spec_path} --adapter {tmp_path / 'run' / 'adapter'}"
    assert json.loads((tmp_path / "run" / "eval.json").read_text(encoding="utf-8")) == r


def test_a_full_fine_tune_trains_the_blocks_and_is_served_by_its_own_spec(tiny, tmp_path):
    """`method: full`: every block weight moves, the tied embedding does not; model/ is a verified Hugging
    Face folder with the trained weights, and assistant.yaml serves it in the format it learnt. The layer's
    own spec refuses that folder once its text changes (the model learnt the old one)."""
    folder, spec_path, _ = tiny
    out = tmp_path / "full"
    finetune(cfg_for(tiny, out, method="full", optimizer={"lr": 1e-3}), HW, progress=False)
    base, tuned = load_model(folder).model, load_model(out / "model").model
    before, after = base.state_dict(), tuned.state_dict()
    assert torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    moved = [k for k in before if "layers." in k and not torch.equal(before[k], after[k])]
    assert any(".q_proj." in k for k in moved) and any(".down_proj." in k for k in moved)
    assert not (out / "adapter").exists()
    served = load_assistant(out / "assistant.yaml")
    msgs = [{"role": "user", "content": "¿Dónde está el gato?"}]
    ids = torch.tensor([served.encode(msgs)])
    assert served.encode(msgs) == load_assistant(spec_path).encode(msgs)
    with torch.no_grad():
        assert torch.allclose(served.model(ids).logits, tuned(ids).logits, atol=1e-6)
    # A byte of the weights changed: the manifest refuses the folder before it is served.
    with pytest.raises(EnlaceError, match="model.safetensors"):
        corrupt = out / "model" / "model.safetensors"
        data = bytearray(corrupt.read_bytes())
        data[-1] ^= 1
        corrupt.write_bytes(bytes(data))
        load_assistant(out / "assistant.yaml")
    other = tmp_path / "other.yaml"
    other.write_text(SPEC.format(base=out / "model", stop='"\\nUsuario:"'), encoding="utf-8")
    with pytest.raises(EnlaceError, match="fine-tuned in another preamble's text"):
        load_assistant(other)
    with pytest.raises(EnlaceError, match="full fine-tune"):
        finetune_eval(cfg_for(tiny, out, method="full"), HW)
