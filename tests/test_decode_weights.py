"""Decode weights: bf16 (prepacked) and int8 weight-only models give the fp32 model's outputs within their
precision, decode the same way, and `auto` follows the CPU's native bf16. bf16 needs oneDNN's bf16 ISA
(AVX-512 BW/VL/DQ or AVX-NE-CONVERT): where this CPU lacks it, bf16 weights decode through ENLACE's
kernels (Bf16Linear, the rest fp32), and without those the one-line refusal is checked."""

import pytest
import torch
import torch.nn.functional as F

from enlace import kernels, runtime
from enlace.config.model import ModelConfig
from enlace.errors import HardwareError
from enlace.generate import (
    Bf16Embedding,
    Bf16Linear,
    Int8Linear,
    PackedLinear,
    decode_weights,
    generate,
    resolve_decode_weights,
)
from enlace.model import Llama

CFG = ModelConfig(name="t", vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, d_model=64, seq_len=64)

# /proc/cpuinfo flags of the two CPU kinds this project runs on (abridged to what the checks read).
AVX2_CPU = frozenset({"sse2", "avx", "avx2", "fma"})
AVX512_BF16_CPU = AVX2_CPU | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
# Can this machine's oneDNN run bf16 kernels? Where not, the bf16 tests check the refusal instead.
BF16_HERE = runtime.onednn_bf16_missing() is None
REFUSED = (
    "decode weights bf16: oneDNN's bf16 kernels need avx512bw, avx512vl, avx512dq or avx_ne_convert, which"
)
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


def model() -> Llama:
    torch.manual_seed(0)
    return Llama(CFG).eval()


@needs_onednn
@pytest.mark.skipif(not BF16_HERE, reason="oneDNN has no bf16 kernels on this CPU (Bf16Linear's tests run)")
def test_packed_linear_equals_a_bf16_linear():
    lin = torch.nn.Linear(64, 96, bias=False)
    x = torch.randn(5, 3, 64).bfloat16()
    assert torch.equal(PackedLinear(lin)(x), F.linear(x, lin.weight.bfloat16()))


@needs_onednn
def test_bf16_on_an_avx2_cpu_takes_enlaces_kernels_and_is_refused_without_them(monkeypatch):
    # With the kernels (built on every machine make test runs on): the linear weights alone in bf16, one
    # copy of the tied head, the rest fp32, and the same logits as fp32 weights rounded to bf16.
    assert kernels.available()
    m = decode_weights(model(), "bf16", flags=AVX2_CPU)
    assert isinstance(m.lm_head, Bf16Linear) and isinstance(m.model.embed_tokens, Bf16Embedding)
    assert m.layers_step is not None and next(m.parameters()).dtype == torch.float32
    rounded = model()
    with torch.no_grad():
        for p in rounded.parameters():
            if p.dim() == 2:
                p.copy_(p.bfloat16().float())
    ids = [1, 2, 3, 4]
    assert list(generate(m, ids, 8)) == list(generate(rounded, ids, 8))
    # Without them (no compiler, or ENLACE_KERNELS=0): refused up front, saying what is missing.
    monkeypatch.setitem(kernels._state, "ok", False)
    monkeypatch.setitem(kernels._state, "why", "no C++ compiler")
    m = model()
    with pytest.raises(
        HardwareError, match=REFUSED + r" this CPU lacks \(/proc/cpuinfo\), and ENLACE's kernels"
    ):
        decode_weights(m, "bf16", flags=AVX2_CPU)
    assert next(m.parameters()).dtype == torch.float32  # refused before touching the model
    assert resolve_decode_weights("bf16", flags=AVX512_BF16_CPU) == "bf16"
    assert resolve_decode_weights("bf16", flags=AVX2_CPU | {"avx_ne_convert"}) == "bf16"
    # int8 and fp32 run on both kinds; off CPU bf16 is a plain cast, not oneDNN's.
    assert resolve_decode_weights("int8", flags=AVX2_CPU) == "int8"
    assert resolve_decode_weights("bf16", device="cuda", flags=AVX2_CPU) == "bf16"


@needs_onednn
def test_a_cpu_with_native_bf16_decodes_on_enlaces_kernels_unless_torchs_are_asked_for(monkeypatch):
    # On a bf16 kind `auto` takes the layer loop on bf16 (and int8) weights as on an AVX2 CPU, its prefills on
    # oneDNN's bf16 GEMM; `--kernels torch` packs bf16 for oneDNN, so both paths can be measured there.
    assert kernels.available()
    auto = decode_weights(model(), "bf16", flags=AVX512_BF16_CPU)
    asked = decode_weights(model(), "bf16", flags=AVX512_BF16_CPU, kernel_choice="enlace")
    # Prefills take oneDNN's bf16 GEMM only where PyTorch also dispatches AVX-512 (not on an AVX2 machine
    # handed these flags, nor under ATEN_CPU_CAPABILITY=avx2).
    native_here = runtime.cpu_bf16_native(AVX512_BF16_CPU) is not None
    for m in (auto, asked):
        assert isinstance(m.lm_head, Bf16Linear) and m.layers_step is not None
        assert m.lm_head.bf16_prefill == native_here
    ids = [5, 6, 7]
    assert list(generate(auto, ids, 8)) == list(generate(asked, ids, 8))
    int8 = decode_weights(model(), "int8", flags=AVX512_BF16_CPU)
    assert isinstance(int8.lm_head, Int8Linear) and int8.lm_head.kernel and int8.layers_step is not None
    assert next(int8.parameters()).dtype == torch.float32
    if BF16_HERE:
        torch_path = decode_weights(model(), "bf16", flags=AVX512_BF16_CPU, kernel_choice="torch")
        assert isinstance(torch_path.lm_head, PackedLinear) and torch_path.layers_step is None
    # On an AVX2 CPU the prefill stays fp32: bf16 GEMMs would be emulated there.
    assert not decode_weights(model(), "bf16", flags=AVX2_CPU).lm_head.bf16_prefill
    # torch's own kernels cannot decode bf16 where oneDNN has none; without ENLACE's, "enlace" is refused.
    with pytest.raises(HardwareError, match="kernel_choice 'torch'"):
        decode_weights(model(), "bf16", flags=AVX2_CPU, kernel_choice="torch")
    monkeypatch.setitem(kernels._state, "ok", False)
    monkeypatch.setitem(kernels._state, "why", "no C++ compiler")
    with pytest.raises(HardwareError, match=r"--kernels enlace on cpu: .*\(no C\+\+ compiler\)"):
        decode_weights(model(), "int8", flags=AVX2_CPU, kernel_choice="enlace")


@needs_onednn
def test_a_prefill_on_native_bf16_is_onednns_bf16_product_and_a_decode_step_is_unchanged():
    lin = torch.nn.Linear(64, 96, bias=False)
    many, one = torch.randn(2, 9, 64), torch.randn(1, 1, 64)
    w = lin.weight.detach()
    for plain, native, dense in (
        (Bf16Linear(lin), Bf16Linear(lin, bf16_prefill=True), w.bfloat16()),
        (
            Int8Linear(lin, torch.float32, kernel=True),
            Int8Linear(lin, torch.float32, kernel=True, bf16_prefill=True),
            None,
        ),
    ):
        dense = native.dequantized().bfloat16() if dense is None else dense
        with torch.no_grad():
            assert torch.equal(native(many), F.linear(many.bfloat16(), dense).float())
            assert native(many).dtype == torch.float32
            assert torch.equal(native(one), plain(one))  # one row: ENLACE's kernel either way


def test_int8_linear_is_close_to_fp32():
    lin = torch.nn.Linear(64, 96, bias=False)
    x = torch.randn(7, 64)
    ref = lin(x)
    err = (Int8Linear(lin)(x).float() - ref).norm() / ref.norm()
    assert err < 0.02


@pytest.mark.parametrize("weights,tol", [("bf16", 0.03), ("int8", 0.05)])
def test_decode_weights_keep_the_logits(weights, tol):
    ref, low = model(), decode_weights(model(), weights)
    x = torch.randint(0, CFG.vocab_size, (1, 20))
    with torch.no_grad():
        a, b = ref(x).logits, low(x).logits.float()
    bf16_class = Bf16Linear if kernels.available() else PackedLinear
    assert low.lm_head.__class__ is (bf16_class if weights == "bf16" else Int8Linear)
    # Norms, embedding and so the KV cache: fp32 where ENLACE's kernels are built (their products take fp32
    # activations), else bf16 with torch's kernels.
    fp32_rest = kernels.available()
    assert next(low.parameters()).dtype == (torch.float32 if fp32_rest else torch.bfloat16)
    assert (a - b).norm() / a.norm() < tol
    # Generation runs on the converted model and is deterministic.
    ids = [1, 2, 3, 4]
    assert list(generate(low, ids, 8)) == list(generate(low, ids, 8))


def test_auto_follows_native_bf16():
    assert runtime.cpu_bf16_native(AVX512_BF16_CPU, "AVX512") == "avx512_bf16"
    # Native bf16 needs the flag and PyTorch dispatching AVX-512 kernels (ATEN_CPU_CAPABILITY=avx2 caps it).
    assert runtime.cpu_bf16_native(AVX512_BF16_CPU, "AVX2") is None
    assert runtime.cpu_bf16_native(AVX2_CPU, "AVX2") is None
    assert resolve_decode_weights("auto", flags=AVX2_CPU) == "fp32"
    m = model()
    assert decode_weights(m, "auto", flags=AVX2_CPU) is m and next(m.parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match="choose from"):
        resolve_decode_weights("fp8")


def test_a_tied_int8_model_keeps_one_copy_of_its_embedding():
    low = decode_weights(model(), "int8")
    assert CFG.tie_embeddings
    held = {id(t): t for t in [*low.parameters(), *low.buffers()]}.values()
    embed = CFG.vocab_size * CFG.d_model
    assert sum(t.numel() for t in held if t.dim() == 2 and t.numel() == embed) == embed  # the int8 head only
    x = torch.randint(0, CFG.vocab_size, (1, 5))
    ref = model().model.embed_tokens(x)
    got = low.model.embed_tokens(x).float()
    assert (got - ref).norm() / ref.norm() < 0.02


# ---- an int8 output head on an fp32 model (--head int8): Gemma 3's 262k-row head ----


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory):
    from gemma_helpers import tiny_gemma_folder

    return tiny_gemma_folder(tmp_path_factory.mktemp("head") / "gemma")


def test_an_int8_head_keeps_gemmas_logits_in_one_copy(gemma_folder):
    from enlace.hf.folder import load_hf_folder
    from enlace.load import load_model

    ref = load_hf_folder(gemma_folder).eval()
    loaded = load_model(gemma_folder, weights="fp32", head="int8")
    low, cfg = loaded.model, ref.cfg
    assert loaded.weights == "fp32 (int8 head)" and isinstance(low.lm_head, Int8Linear) and cfg.tie_embeddings
    assert next(low.parameters()).dtype == torch.float32  # the rest, and so the KV cache, stay fp32
    held = {id(t): t for t in [*low.parameters(), *low.buffers()]}.values()
    table = [t for t in held if t.dim() == 2 and t.shape == (cfg.vocab_size, cfg.d_model)]
    assert [t.dtype for t in table] == [torch.int8]  # one copy, int8: no fp32 embedding left
    torch.manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        emb_ref, emb = ref.model.embed_tokens(x), low.model.embed_tokens(x)
        a, b = ref(x).logits, low(x).logits
    assert emb.dtype == torch.float32 and (emb - emb_ref).norm() / emb_ref.norm() < 0.01
    assert b.dtype == torch.float32 and (a - b).norm() / a.norm() < 0.03  # a bounded error
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9  # the likeliest token mostly the same
    # A loss over the int8 head scores what decoding computes (its dequantised rows, not its int8 codes).
    y = torch.randint(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        ce = low(x, targets=y).ce
    assert ce.item() == pytest.approx(F.cross_entropy(b.flatten(0, 1), y.flatten()).item(), abs=1e-4)
    assert list(generate(low, [2, 5, 9], 6)) == list(generate(low, [2, 5, 9], 6))


def test_an_int8_head_is_refused_off_cpu_and_unknown_heads_are_named(gemma_folder):
    from enlace.errors import EnlaceError
    from enlace.load import load_model

    with pytest.raises(EnlaceError, match="--head int8 on cuda: the int8 kernel is torch's CPU one"):
        load_model(gemma_folder, weights="bf16", device="cuda", head="int8")
    with pytest.raises(EnlaceError, match="--head int4: choose from same, int8"):
        load_model(gemma_folder, weights="fp32", head="int4")


def test_the_head_benchmark_gives_bits_per_byte_both_ways(gemma_folder, tmp_path):
    """`python -m bench.bench_head_int8` on the tiny Gemma: what it reports, and a small cost."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from gemma_helpers import TEXTS

    root = Path(__file__).resolve().parents[1]
    text = tmp_path / "prosa.txt"
    text.write_text(" ".join(TEXTS[:6]), encoding="utf-8")
    cmd = [
        sys.executable,
        "-m",
        "bench.bench_head_int8",
        str(gemma_folder),
        "--prose",
        str(text),
        "--context",
        "64",
    ]
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["prose_bytes"] == len(text.read_bytes()) and r["positions_compared"] > 0 and r["context"] == 64
    assert r["fp32_bpb"] > 0 and abs(r["bpb_change_percent"]) < 2
    assert r["logits_relative_error"] < 0.03 and r["argmax_agreement"] >= 0.9
