"""Loading Hugging Face folders: logits and tokenizer parity with transformers, refusals, export, GGUF q/k."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import CHATML, SENTENCES, llamacpp_permute, make_folder
from safetensors.torch import load_file, save_file

from enlace.errors import EnlaceError
from enlace.hf.arch.llama import permute_qk, unpermute_qk
from enlace.hf.folder import load_hf_folder, save_hf_folder
from enlace.hf.tokenizer import HFTokenizer
from enlace.model import Llama


def hf_logits(folder, ids):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize(
    "kind,tied,shard", [("llama", True, False), ("llama", False, True), ("qwen3", False, False)]
)
def test_logits_match_transformers(tmp_path, kind, tied, shard):
    folder = make_folder(tmp_path / "m", kind=kind, tied=tied, shard=shard)
    if shard:
        assert (folder / "model.safetensors.index.json").exists()
    tok = HFTokenizer(folder)
    ids = tok.encode(" ".join(SENTENCES))
    ours = load_hf_folder(folder)
    assert ours.cfg.qk_norm == (kind == "qwen3") and ours.cfg.tie_embeddings == tied
    with torch.no_grad():
        got = ours(torch.tensor([ids])).logits[0]
    assert (got - hf_logits(folder, ids)).abs().max().item() < 1e-4


def test_bf16_weights_become_fp32_or_stay(tmp_path):
    folder = make_folder(tmp_path / "m", dtype=torch.bfloat16)
    stored = load_file(str(folder / "model.safetensors"))
    m = load_hf_folder(folder)
    w = m.model.layers[0].self_attn.q_proj.weight
    assert w.dtype == torch.float32
    assert torch.equal(w, stored["model.layers.0.self_attn.q_proj.weight"].float())
    assert load_hf_folder(folder, dtype=torch.bfloat16).lm_head.weight.dtype == torch.bfloat16


def test_tokenizer_and_chat_template_match_transformers(tmp_path):
    from transformers import AutoTokenizer

    folder = make_folder(tmp_path / "m")
    ours, ref = HFTokenizer(folder), AutoTokenizer.from_pretrained(folder)
    for s in [*SENTENCES, "<|im_start|>user\nhola<|im_end|>\n", "  dos  espacios\n\ty tab 123"]:
        assert ours.encode(s) == ref(s)["input_ids"]
        assert ours.decode(ours.encode(s)) == ref.decode(ref(s)["input_ids"])
    msgs = [
        {"role": "user", "content": "¿Qué cenamos?"},
        {"role": "assistant", "content": "Tortilla."},
        {"role": "user", "content": "¿Y de postre?"},
    ]
    for gen in (False, True):
        text = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        assert ours.render_chat(msgs, add_generation_prompt=gen) == text
        ids = ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == list(ids)
    assert ours.chat_template == CHATML and ours.eos_ids == (2,) and ours.pad_id == 2


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
        ({"attention_bias": True}, "attention_bias"),
        ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "model_type"),
        ({"head_dim": 32}, "head_dim"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_configs_are_refused(tmp_path, changes, needle):
    folder = make_folder(tmp_path / "m")
    _edit_config(folder, **changes)
    with pytest.raises(EnlaceError, match=needle):
        load_hf_folder(folder)


def test_missing_and_unexpected_tensors_are_listed(tmp_path):
    folder = make_folder(tmp_path / "m")
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(EnlaceError) as e:
        load_hf_folder(folder)
    assert "model.layers.1.mlp.up_proj.weight" in str(e.value) and "model.layers.1.mlp.extra.weight" in str(
        e.value
    )
    state.pop("model.layers.1.mlp.extra.weight")
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(EnlaceError, match="wrong shape"):
        load_hf_folder(folder)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_save_hf_folder_loads_in_transformers(tmp_path, qk_norm):
    from enlace.config.model import ModelConfig

    cfg = ModelConfig(
        name="ours", vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, d_model=64, seq_len=128, ffn_hidden=96,
        rope_theta=5e4, qk_norm=qk_norm,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Llama(cfg).eval()
    src = make_folder(tmp_path / "tok")  # only its tokenizer files are copied
    folder = save_hf_folder(model, tmp_path / "export", tokenizer_dir=src, eos_token_id=2)
    assert (folder / "tokenizer.json").exists()
    ids = list(range(3, 40))
    with torch.no_grad():
        ours = model(torch.tensor([ids])).logits[0]
        back = load_hf_folder(folder)(torch.tensor([ids])).logits[0]
    assert torch.equal(ours, back)
    assert (ours - hf_logits(folder, ids)).abs().max().item() < 1e-4


def test_unpermute_inverts_llamacpp_qk_permutation():
    torch.manual_seed(0)
    n_head, n_kv, hd, d = 6, 2, 8, 48
    q, k = torch.randn(n_head * hd, d), torch.randn(n_kv * hd, d)
    pq, pk = llamacpp_permute(q, n_head, n_head), llamacpp_permute(k, n_head, n_kv)
    assert not torch.equal(pq, q)
    assert torch.equal(unpermute_qk(pq, n_head), q)
    assert torch.equal(unpermute_qk(pk, n_kv), k)
    assert torch.equal(permute_qk(q, n_head), pq) and torch.equal(
        permute_qk(k, n_kv), pk
    )  # the GGUF export's
    # Head h's rows stay within head h; within it, row 2i holds half 0 row i and row 2i+1 half 1 row i.
    assert torch.equal(pq[1], q[hd // 2]) and torch.equal(pq[hd], q[hd])
