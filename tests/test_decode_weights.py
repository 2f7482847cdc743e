"""Decode weights: bf16 (prepacked) and int8 weight-only models give the fp32 model's outputs within their
precision, decode the same way, and `auto` follows the CPU's native bf16. bf16 needs oneDNN's bf16 ISA
(AVX-512 BW/VL/DQ or AVX-NE-CONVERT): where this CPU lacks it, the tests check the one-line refusal
instead, and the refusal is also checked everywhere with an AVX2-only CPU's flags passed in."""

import pytest
import torch
import torch.nn.functional as F

from enlace import runtime
from enlace.config.model import ModelConfig
from enlace.errors import HardwareError
from enlace.generate import Int8Linear, PackedLinear, decode_weights, generate, resolve_decode_weights
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
def test_packed_linear_equals_a_bf16_linear():
    if not BF16_HERE:  # this CPU's path: refused up front, with the instruction sets it lacks
        with pytest.raises(HardwareError, match=REFUSED):
            decode_weights(model(), "bf16")
        return
    lin = torch.nn.Linear(64, 96, bias=False)
    x = torch.randn(5, 3, 64).bfloat16()
    assert torch.equal(PackedLinear(lin)(x), F.linear(x, lin.weight.bfloat16()))


@needs_onednn
def test_bf16_decode_is_refused_on_an_avx2_cpu_and_allowed_with_avx512():
    m = model()
    with pytest.raises(HardwareError, match=REFUSED + r" this CPU lacks \(/proc/cpuinfo\); use"):
        decode_weights(m, "bf16", flags=AVX2_CPU)
    assert next(m.parameters()).dtype == torch.float32  # refused before touching the model
    assert resolve_decode_weights("bf16", flags=AVX512_BF16_CPU) == "bf16"
    assert resolve_decode_weights("bf16", flags=AVX2_CPU | {"avx_ne_convert"}) == "bf16"
    # int8 and fp32 run on both kinds; off CPU bf16 is a plain cast, not oneDNN's.
    assert resolve_decode_weights("int8", flags=AVX2_CPU) == "int8"
    assert resolve_decode_weights("bf16", device="cuda", flags=AVX2_CPU) == "bf16"


def test_int8_linear_is_close_to_fp32():
    lin = torch.nn.Linear(64, 96, bias=False)
    x = torch.randn(7, 64)
    ref = lin(x)
    err = (Int8Linear(lin)(x).float() - ref).norm() / ref.norm()
    assert err < 0.02


@pytest.mark.parametrize("weights,tol", [("bf16", 0.03), ("int8", 0.05)])
def test_decode_weights_keep_the_logits(weights, tol):
    if weights == "bf16" and not BF16_HERE:
        with pytest.raises(HardwareError, match=REFUSED):
            decode_weights(model(), weights)
        return
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
