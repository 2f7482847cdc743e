"""Gemma 3's switches of our decoder, at tiny size, against transformers' Gemma3ForCausalLM.

Random weights, random norms (so (1 + weight) is tested), head_dim stated apart from d_model / n_head, a
sliding window shorter than the sequence, two RoPE bases and a layer pattern with both kinds of layer.
"""

from __future__ import annotations

import pytest
import torch

from enlace.config.model import ModelConfig
from enlace.generate import generate
from enlace.hf.arch import for_config, from_hf_config, to_hf_config
from enlace.hf.folder import build_model, load_hf_folder, save_hf_folder
from enlace.model import KVCache, Llama, closed_form_num_parameters

WINDOW = 5


def tiny_hf(seed: int = 0, **kw):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    args = dict(
        vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=7, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
        query_pre_attn_scalar=24, sliding_window=WINDOW,
        layer_types=["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(7)],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
    )  # fmt: skip
    args.update(kw)
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**args)).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)  # offsets from 1: the (1 + weight) scale is exercised
    return model


def ours_from(hf_model, sdpa_backend: str = "auto") -> Llama:
    cfg = from_hf_config(hf_model.config.to_dict(), "tiny gemma3", name="tiny-gemma3")
    model = build_model(cfg, dict(hf_model.state_dict()), "tiny gemma3")
    model.model.layers.apply(lambda m: setattr(m, "sdpa_backend", sdpa_backend))
    return model.eval()


@pytest.fixture(scope="module")
def pair():
    hf = tiny_hf()
    return hf, ours_from(hf)


def test_config_maps_gemma3_switches(pair):
    hf, ours = pair
    cfg = ours.cfg
    assert cfg.head_dim == 16 != cfg.d_model // cfg.n_head
    assert (cfg.sliding_window, cfg.global_every, cfg.rope_theta, cfg.rope_local_theta) == (
        WINDOW, 3, 1_000_000.0, 10_000.0,
    )  # fmt: skip
    assert [cfg.is_local(i) for i in range(7)] == [t == "sliding_attention" for t in hf.config.layer_types]
    assert cfg.sandwich_norm and cfg.norm_unit_offset and cfg.embed_scale and cfg.qk_norm
    assert ours.num_parameters() == closed_form_num_parameters(cfg) == hf.num_parameters()
    back = from_hf_config(to_hf_config(cfg), "round trip", name=cfg.name)
    assert back == cfg


@pytest.mark.parametrize("backend", ["auto", "math"])
def test_logits_equal_transformers(pair, backend):
    """Sequence longer than the window: the local layers' mask matters (both attention paths)."""
    hf, _ = pair
    ours = ours_from(hf, backend)
    ids = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_window_changes_logits(pair):
    """A test that could not fail if the window were ignored would prove nothing: with the window opened
    to the whole sequence, the logits after position WINDOW move and only those."""
    hf, ours = pair
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(2))
    wide = ours_from(tiny_hf(sliding_window=64))
    with torch.no_grad():
        a, b = ours(ids).logits, wide(ids).logits
    torch.testing.assert_close(a[:, :WINDOW], b[:, :WINDOW], rtol=1e-5, atol=1e-5)
    assert (a[:, WINDOW:] - b[:, WINDOW:]).abs().amax() > 1e-3


def test_kv_cache_matches_full_forward(pair):
    """Prefill a chunk, then one token at a time and a multi-token chunk, past the window."""
    _, ours = pair
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = ours(ids).logits
        cache = KVCache.empty(ours.cfg, 1, 20, torch.device("cpu"), torch.float32)
        parts = [ours(ids[:, :7], cache=cache).logits]
        for t in range(7, 12):
            parts.append(ours(ids[:, t : t + 1], cache=cache).logits)
        parts.append(ours(ids[:, 12:], cache=cache).logits)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


def test_greedy_generate_equals_transformers(pair):
    hf, ours = pair
    prompt = [1, 5, 9, 33, 4]
    with torch.no_grad():
        want = hf.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    got = list(generate(ours, prompt, 24))
    assert got == want


def test_save_and_load_folder_round_trip(pair, tmp_path):
    """Our folder writer produces a Gemma 3 folder transformers loads to the same logits."""
    from transformers import AutoModelForCausalLM

    hf, ours = pair
    save_hf_folder(ours, tmp_path, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(load_hf_folder(tmp_path)(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_defaults_are_llama():
    """Every Gemma switch off by default: a plain config builds the modules (and names) it always did."""
    cfg = ModelConfig(name="t", vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, seq_len=16)
    names = list(Llama(cfg).state_dict())
    assert not any("feedforward" in n for n in names)
    assert all(m.window is None and m.scale is None for m in Llama(cfg).modules() if hasattr(m, "window"))


def test_lora_merged_export_keeps_gemma_and_its_licence(tmp_path):
    """A LoRA adapter on a Gemma base merges into a folder transformers loads to our merged logits, and
    the base's licence files travel with the derived weights."""
    from helpers import write_tokenizer
    from transformers import AutoModelForCausalLM

    from enlace.export import export_merged
    from enlace.lora import ALL_TARGETS, inject_lora, lora_modules, save_adapter

    base = tmp_path / "base"
    vocab = write_tokenizer(base)
    ours = ours_from(tiny_hf(vocab_size=vocab))
    for name, text in (("LICENSE.md", "Gemma Terms of Use\n"), ("GEMMA_TERMS.html", "<p>terms</p>\n")):
        (base / name).write_text(text, encoding="utf-8")  # before the folder's manifest, which lists them
    save_hf_folder(ours, base, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    inject_lora(ours, ALL_TARGETS, rank=4, alpha=8.0)
    torch.manual_seed(5)
    with torch.no_grad():
        for m in lora_modules(ours).values():
            m.lora_B.weight.normal_(0, 0.05)  # a trained-looking adapter: B starts at zero
    save_adapter(ours, tmp_path / "adapter", str(base))
    ids = torch.randint(0, vocab, (1, 14), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = ours.eval()(ids).logits
    export_merged(base, tmp_path / "adapter", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, want, rtol=1e-4, atol=1e-4)
    for name in ("LICENSE.md", "GEMMA_TERMS.html"):
        assert (tmp_path / "merged" / name).read_bytes() == (base / name).read_bytes()


def test_gguf_export_refuses_an_attention_scale_llama_cpp_cannot_state(pair, tmp_path):
    """llama.cpp's gemma3 hard-codes 1/sqrt(head_dim); this model's query_pre_attn_scalar is 24, head_dim 16.
    (GGUF export of Gemma 3 itself: tests/test_llama_cpp.py.)"""
    from enlace.hf.gguf_export import GGUFExportError, write_gguf

    assert for_config(pair[1].cfg).name == "gemma3"
    n = pair[1].cfg.vocab_size
    vocab = {"model": "llama", "pre": "default", "tokens": [f"t{i}" for i in range(n)], "types": [1] * n,
             "scores": [0.0] * n, "add_space_prefix": False}  # fmt: skip
    with pytest.raises(GGUFExportError, match=r"query_pre_attn_scalar 24.*1/sqrt\(16\)"):
        write_gguf(pair[1], tmp_path / "x.gguf", vocab, {})
    assert list(tmp_path.iterdir()) == []  # no partial file left behind


def test_qwen3_is_not_mistaken_for_a_partial_gemma():
    """QK-norm alone is Qwen3 (exported as such); a Gemma switch without the others is refused by name."""
    from enlace.errors import UnsupportedModelError

    base = dict(name="t", vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, seq_len=16)
    assert to_hf_config(ModelConfig(**base, qk_norm=True))["model_type"] == "qwen3"
    assert to_hf_config(ModelConfig(**base))["model_type"] == "llama"
    with pytest.raises(UnsupportedModelError, match="only exportable all together"):
        to_hf_config(ModelConfig(**base, sandwich_norm=True))
