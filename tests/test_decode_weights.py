"""Decode weights: bf16 (prepacked) and int8 weight-only models give the fp32 model's outputs within their
precision, decode the same way, and `auto` follows the CPU's native bf16."""

import pytest
import torch
import torch.nn.functional as F

from enlace import runtime
from enlace.config.model import ModelConfig
from enlace.generate import Int8Linear, PackedLinear, decode_weights, generate, resolve_decode_weights
from enlace.model import Llama

CFG = ModelConfig(name="t", vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, d_model=64, seq_len=64)


def model() -> Llama:
    torch.manual_seed(0)
    return Llama(CFG).eval()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_packed_linear_equals_a_bf16_linear():
    lin = torch.nn.Linear(64, 96, bias=False)
    x = torch.randn(5, 3, 64).bfloat16()
    assert torch.equal(PackedLinear(lin)(x), F.linear(x, lin.weight.bfloat16()))


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
    assert low.lm_head.__class__ is (PackedLinear if weights == "bf16" else Int8Linear)
    assert next(low.parameters()).dtype == torch.bfloat16  # norms, embedding: the KV cache follows
    assert (a - b).norm() / a.norm() < tol
    # Generation runs on the converted model and is deterministic.
    ids = [1, 2, 3, 4]
    assert list(generate(low, ids, 8)) == list(generate(low, ids, 8))


def test_auto_follows_native_bf16(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert resolve_decode_weights("auto") == "bf16"
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"avx2"}))
    assert resolve_decode_weights("auto") == "fp32"
    m = model()
    assert decode_weights(m, "auto") is m and next(m.parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match="choose from"):
        resolve_decode_weights("fp8")
