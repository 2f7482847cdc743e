"""ENLACE's CPU decode kernels (enlace.kernels): their products, their determinism, the build cache and the
decode path that uses them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gemma_helpers import GEMMA3_SWITCHES

from enlace import generate as generate_module
from enlace import kernels
from enlace.config.model import ModelConfig
from enlace.generate import Int8Linear, KernelLinear, decode_weights, generate
from enlace.model import KVCache, Llama, SlotCache

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernels are built on Linux")

CFG = ModelConfig(name="t", vocab_size=300, n_layer=2, n_head=6, n_kv_head=2, d_model=72, seq_len=64)


@pytest.fixture(scope="module", autouse=True)
def built():
    # make test's machines have a C++ compiler (torch.compile needs one too): a failed build is a failure.
    assert kernels.available(), f"ENLACE's kernels did not build: {kernels.why_unavailable()}"


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
# 16: the AVX2 loop only; 37: a tail too; 57 and 121: on an AVX-512 CPU, its loop (32 floats, 64 int8 a
# step), then the AVX2 one, then a tail; 200: most of it in the widest loop.
@pytest.mark.parametrize("width", [16, 37, 57, 121, 200])
def test_products_match_torch(rows, width):
    g = torch.Generator().manual_seed(rows * 1000 + width)
    x, w = torch.randn(rows, width, generator=g), torch.randn(130, width, generator=g)
    ref = x.double() @ w.double().T
    got = torch.ops.enlace.linear_f32(x, w)
    assert got.shape == (rows, 130) and got.dtype == torch.float32
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5)
    wb = w.bfloat16()  # bf16 weights are widened exactly: the reference is the same product in float64
    got = torch.ops.enlace.linear_bf16(x, wb)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), x.double() @ wb.double().T, rtol=1e-5, atol=1e-5)
    codes = torch.randint(-127, 128, (130, width), dtype=torch.int8, generator=g)
    scales = torch.rand(130, generator=g)
    assert torch.equal(torch.ops.enlace.linear_i8(x, codes, scales), int16_reference(x, codes, scales))


def int16_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What linear_i8 promises, step by step in torch: each activation row as int16 with its own scale
    (round half to even), the integer dot products exactly, then float32 scaling in the kernel's order."""
    amax = x.abs().amax(dim=1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros_like(amax))
    q = torch.round(x * inv).clamp(-32767, 32767).double()
    total = (q @ codes.double().T).float()  # exact in float64 (far below 2^53), then rounded once
    return total * (amax / 32767.0) * scales


def test_int8_products_stay_near_the_float_ones():
    # int16 activations cost at most half a step of 1/32767 of a row's largest value per element.
    g = torch.Generator().manual_seed(7)
    x, codes = (
        torch.randn(4, 640, generator=g),
        torch.randint(-127, 128, (300, 640), dtype=torch.int8, generator=g),
    )
    scales = torch.rand(300, generator=g)
    exact = (x.double() @ codes.double().T) * scales.double()
    bound = (
        codes.double().abs().sum(1) * scales.double() * (x.abs().amax(1, keepdim=True).double() / 65534)
        + 1e-4
    )
    assert ((torch.ops.enlace.linear_i8(x, codes, scales).double() - exact).abs() <= bound).all()


def test_int8_products_of_long_rows_are_summed_in_chunks_without_overflow():
    # Past 4,096 columns a 32-bit lane could overflow: the kernel sums chunks into 64-bit totals.
    x = torch.full((1, 9000), 3.0)
    x[0, 0] = 3.0  # every activation is the row's largest: each becomes 32767
    codes = torch.full((2, 9000), 127, dtype=torch.int8)
    codes[1] = -127
    got = torch.ops.enlace.linear_i8(x, codes, torch.ones(2))
    assert torch.equal(got, int16_reference(x, codes, torch.ones(2)))
    assert got[0, 0].item() == pytest.approx(3.0 * 127 * 9000, rel=1e-6) and got[0, 1] == -got[0, 0]


def test_a_nan_activation_reaches_an_int8_product():
    x = torch.randn(2, 64)
    x[1, 5] = float("nan")
    y = torch.ops.enlace.linear_i8(x, torch.ones(8, 64, dtype=torch.int8), torch.ones(8))
    assert y[1].isnan().all() and not y[0].isnan().any()


def test_leading_dimensions_and_dtype_are_kept():
    x = torch.randn(2, 1, 40, dtype=torch.bfloat16)
    y = torch.ops.enlace.linear_f32(x, torch.randn(24, 40))
    assert y.shape == (2, 1, 24) and y.dtype == torch.bfloat16


def test_a_row_sum_does_not_depend_on_the_thread_count():
    x, w = torch.randn(4, 333), torch.randn(5000, 333)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.enlace.linear_f32(x, w)
        torch.set_num_threads(max(2, before))
        many = torch.ops.enlace.linear_f32(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


def test_bad_operands_are_refused_by_name():
    with pytest.raises(RuntimeError, match="at most 8 activation rows"):
        torch.ops.enlace.linear_f32(torch.randn(9, 16), torch.randn(4, 16))
    with pytest.raises(RuntimeError, match="activations of width 15 for a weight of width 16"):
        torch.ops.enlace.linear_f32(torch.randn(1, 15), torch.randn(4, 16))
    with pytest.raises(
        RuntimeError, match="linear_bf16: the weight must be a contiguous 2-D bfloat16 tensor"
    ):
        torch.ops.enlace.linear_bf16(torch.randn(1, 16), torch.randn(4, 16))
    with pytest.raises(RuntimeError, match="one float32 scale per output row"):
        torch.ops.enlace.linear_i8(torch.randn(1, 16), torch.zeros(4, 16, dtype=torch.int8), torch.ones(3))


def test_decode_layers_use_the_kernels_and_keep_the_logits():
    torch.manual_seed(0)
    ref = Llama(CFG).eval()
    fast = decode_weights(_same(ref), "fp32")
    assert isinstance(fast.lm_head, KernelLinear)
    assert fast.lm_head.weight is fast.model.embed_tokens.weight  # the tied head is not copied
    # q, k and v stay three weights (read in one pass by the layer kernel): no stacked copy is made.
    assert fast.model.layers[0].self_attn.qkv is None
    assert isinstance(fast.model.layers[0].self_attn.q_proj, KernelLinear)
    torch_path = decode_weights(_same(ref), "fp32", kernel_choice="torch")
    assert type(torch_path.lm_head) is torch.nn.Linear
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    # Greedy decoding through the kernels gives torch's sequence.
    assert list(generate(fast, ids, 12)) == list(generate(torch_path, ids, 12))
    # One decode step through the kernels (after a prefill) gives the plain forward pass's logits.
    nxt = 7
    with torch.no_grad():
        want = ref(torch.tensor([[*ids, nxt]])).logits[0, -1]
        cache = KVCache.empty(CFG, 1, 16, torch.device("cpu"), torch.float32)
        fast(torch.tensor([ids]), cache=cache)
        got = fast(torch.tensor([[nxt]]), cache=cache).logits[0, -1]
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def _same(model: Llama) -> Llama:
    copy = Llama(model.cfg).eval()
    copy.load_state_dict(model.state_dict())
    return copy


def test_int8_decoding_on_fp32_activations_matches_torchs_int8_kernel(monkeypatch):
    lin = torch.nn.Linear(96, 150, bias=False)
    mine, theirs = Int8Linear(lin, torch.float32, kernel=True), Int8Linear(lin, torch.float32, kernel=False)
    x = torch.randn(1, 1, 96)
    assert torch.allclose(mine(x), theirs(x), rtol=1e-4, atol=1e-4)
    # A prompt's rows: the weight dequantised a block at a time (here 32 rows of 96, so five blocks) for
    # torch's fp32 GEMM; the product of the dequantised matrix either way.
    monkeypatch.setattr(generate_module, "PREFILL_BLOCK", 32 * 96)
    prefill = torch.randn(1, 20, 96)
    want = prefill @ mine.dequantized().T
    assert torch.allclose(mine(prefill), want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(theirs(prefill), want, rtol=1e-4, atol=1e-4)


def _run(code: str, cache: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "XDG_CACHE_HOME": str(cache), **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=300)


def test_a_damaged_library_is_rebuilt_not_loaded(tmp_path):
    code = "from enlace import kernels; assert kernels.available(), kernels.why_unavailable(); print(kernels.library())"
    first = _run(code, tmp_path)
    assert first.returncode == 0, first.stderr
    library = Path(first.stdout.split()[-1])
    assert library.is_relative_to(tmp_path / "enlace" / "kernels")
    data = bytearray(library.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: the manifest's sha256 no longer matches
    library.write_bytes(bytes(data))
    second = _run(code, tmp_path)
    assert second.returncode == 0, second.stderr
    assert "rebuilding" in second.stderr
    assert library.read_bytes() != bytes(data)


def test_switched_off_decoding_keeps_torchs_kernels(tmp_path):
    code = (
        "from enlace import kernels; from enlace.generate import decode_weights; from enlace.model import Llama;"
        "from enlace.config.model import ModelConfig;"
        "m = decode_weights(Llama(ModelConfig(name='t', vocab_size=64, d_model=32, n_layer=1, n_head=2,"
        " n_kv_head=2, seq_len=16)), 'fp32');"
        "print(kernels.available(), kernels.why_unavailable(), type(m.lm_head).__name__)"
    )
    done = _run(code, tmp_path, ENLACE_KERNELS="0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "ENLACE_KERNELS=0", "Linear"]
    assert not (tmp_path / "enlace" / "kernels").exists()  # nothing was built


GEMMA_LIKE = ModelConfig(
    name="g", vocab_size=300, n_layer=4, n_head=4, n_kv_head=2, d_model=64, attn_head_dim=32, ffn_hidden=128,
    seq_len=64, norm_eps=1e-6, query_pre_attn_scalar=24, sliding_window=6, global_every=2,
    rope_local_theta=10_000.0, tie_embeddings=True, **GEMMA3_SWITCHES,
)  # fmt: skip


def _decoder(cfg: ModelConfig, weights: str) -> Llama:
    torch.manual_seed(1)
    model = Llama(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)  # norms away from their identity: each one is exercised
    # "enlace": int8 and bf16 through ENLACE's kernels on every CPU kind (with "auto" a CPU with native bf16
    # decodes them with torch's and oneDNN's).
    return decode_weights(model, weights, kernel_choice="enlace")


@pytest.mark.parametrize("weights", ["fp32", "int8", "bf16"])
@pytest.mark.parametrize("cfg", [CFG, GEMMA_LIKE], ids=["llama", "gemma3"])
def test_the_layer_loop_in_one_call_equals_the_layers_in_python(cfg, weights):
    model = _decoder(cfg, weights)
    fast = model.layers_step
    assert fast is not None
    prompt, steps = torch.tensor([list(range(10, 19))]), [5, 17, 230, 9, 44, 3]  # past the window of 6
    logits = {}
    with torch.no_grad():
        for name, layers_step in (("one call", fast), ("python", None)):
            model.layers_step = layers_step
            cache = KVCache.empty(cfg, 1, 32, torch.device("cpu"), torch.float32)
            model(prompt, cache=cache)
            logits[name] = torch.stack([model(torch.tensor([[t]]), cache=cache).logits[0, -1] for t in steps])
    assert torch.allclose(logits["one call"], logits["python"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cfg", [CFG, GEMMA_LIKE], ids=["llama", "gemma3"])
def test_slot_rows_at_their_own_positions_equal_the_layers_in_python(cfg):
    model = _decoder(cfg, "fp32")
    fast = model.layers_step
    lengths = [3, 11, 7]
    out = {}
    with torch.no_grad():
        for name, layers_step in (("one call", fast), ("python", None)):
            model.layers_step = layers_step
            slots = SlotCache(KVCache.empty(cfg, 4, 32, torch.device("cpu"), torch.float32), list(lengths))
            for i, n in enumerate(lengths):  # each row prefilled alone, as the server does
                row = slots.cache.row(i)
                model(torch.tensor([list(range(20 + i, 20 + i + n))]), cache=row)
            out[name] = model(torch.tensor([[4], [8], [15]]), cache=slots).logits[:, -1]
    assert torch.allclose(out["one call"], out["python"], atol=1e-4, rtol=1e-4)


def test_a_position_outside_the_cache_is_refused_and_changes_nothing():
    model = _decoder(CFG, "fp32")
    cache = KVCache.empty(CFG, 1, 8, torch.device("cpu"), torch.float32)
    x = torch.randn(1, CFG.d_model)
    before = x.clone()
    with pytest.raises(RuntimeError, match="position 8 is outside the cache"):
        model.layers_step(x, torch.tensor([8]), cache.k, cache.v)
    assert torch.equal(x, before) and all(not k.any() for k in cache.k)


def test_a_failed_build_is_said_once_and_leaves_torchs_kernels(tmp_path):
    # A compiler that fails (here one that fails on every source) must not leave a half-built library
    # behind, nor stop decoding: torch's kernels take over, and why is one line.
    fails = tmp_path / "cxx"
    fails.write_text("#!/bin/sh\necho 'error: this compiler refuses everything' >&2\nexit 1\n")
    fails.chmod(0o755)
    code = "from enlace import kernels; print(kernels.available()); print(kernels.why_unavailable())"
    done = _run(code, tmp_path, CXX=str(fails))
    assert done.returncode == 0, done.stderr
    available, why = done.stdout.strip().splitlines()
    assert available == "False"
    assert why == f"{fails} failed on the kernels' sources: error: this compiler refuses everything"
    built = tmp_path / "enlace" / "kernels"
    assert not any(p.name.endswith(".so") for p in built.rglob("*"))
