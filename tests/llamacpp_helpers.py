"""What llama.cpp makes of a GGUF that ENLACE wrote, compared with ENLACE itself (no tests here).

llama.cpp comes from scripts/llama_cpp_build.py: built once per machine into a cache outside the repository, in a
venv of its own, so every llama.cpp call is a subprocess (scripts/llama_cpp_worker.py) of that venv's python.
The session fixture `llama_cpp` (conftest.py) builds it when the first test that requests it runs (minutes,
once per machine) and marks those tests `llamacpp`; if the build fails, they fail saying why. Nothing is
skipped.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from enlace.generate import generate
from enlace.hf.sp_convert import CHAT_MARKERS
from enlace.hf.tokenizer import HFTokenizer
from enlace.model import Llama
from enlace.scoring.score import evaluate, sliding_windows
from enlace.scoring.token_bytes import TokenBytes

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "scripts" / "llama_cpp_worker.py"

PROMPTS = [
    "El niño de la casa mira una puerta",
    "¿Qué hora es? La ciudad antigua",
    "Son las 10:45 del 3 de mayo y el perro",
]
TEXT = (
    "El camino del pueblo lleva una mesa verde que está en el jardín. ¡Qué bien! "
    "La ventana de la ciudad abre una puerta antigua que está en el río.\n\n"
    "Son las 10:45 del 3 de mayo de 2024. El barco de la montaña cuenta una casa tranquila; "
    "el pingüino, señor, recuerda el árbol."
)
CHATS = [
    [{"role": "user", "content": "¿Qué hacemos hoy en la ciudad?"}],
    [
        {"role": "system", "content": "Eres un asistente que responde en español."},
        {"role": "user", "content": "Dime una palabra con ñ."},
        {"role": "assistant", "content": "Año."},
        {"role": "user", "content": "¿Y otra con ü? 🙂"},
    ],
]
LOGIT_TOL = 5e-3  # fp32 in both, summed in other orders: what rounding alone can move a logit


def llama_python() -> Path:
    """The llama.cpp venv's python; the test must request the `llama_cpp` fixture, which builds it."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "llama_cpp_build.py"), "--check"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if proc.returncode:
        pytest.fail(
            f"{proc.stderr.strip()}: request the `llama_cpp` fixture (tests/conftest.py), which builds it"
        )
    return Path(proc.stdout.strip().splitlines()[-1])


def random_adapter(base: Path, out: Path, targets: list[str], scale: float) -> Path:
    """A rank-4 LoRA adapter on base with random non-zero B (a trained-looking adapter: B starts at 0)."""
    from enlace.hf.folder import load_hf_folder
    from enlace.lora import inject_lora, save_adapter

    model = load_hf_folder(base)
    inject_lora(model, targets, rank=4, alpha=8)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    save_adapter(model, out, str(base))
    return out


@dataclass
class LlamaCppRun:
    result: dict[str, Any]
    out: Path

    def array(self, name: str) -> np.ndarray:
        return np.load(self.out / f"{name}.npy")


def run_llama_cpp(gguf: Path, work: Path, **request: Any) -> LlamaCppRun:
    work.mkdir(parents=True, exist_ok=True)
    (work / "request.json").write_text(json.dumps({"gguf": str(gguf), **request}, ensure_ascii=False))
    proc = subprocess.run(
        [str(llama_python()), str(WORKER), str(work / "request.json"), str(work)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"llama.cpp worker failed on {gguf}:\n{proc.stderr[-3000:]}"
    return LlamaCppRun(json.loads((work / "result.json").read_text(encoding="utf-8")), work)


@dataclass
class Divergence:
    prompt: int
    step: int
    ours: int
    theirs: int
    logit_diff: float  # max |ours - llama.cpp| over the vocabulary at that step
    gap: float  # llama.cpp's logit of its pick minus that of ours: a near tie


@dataclass
class RoundTrip:
    """What one GGUF measured against ENLACE."""

    greedy_equal: list[int] = field(default_factory=list)  # tokens equal before any divergence, per prompt
    divergences: list[Divergence] = field(default_factory=list)
    max_logit_diff: float = 0.0  # over every greedy step before a divergence
    bpb_enlace: float = 0.0
    bpb_llama_cpp: float = 0.0
    tokens_scored: int = 0
    bytes_scored: int = 0


def step_logits(model: Llama, prompt: list[int], new: list[int]) -> np.ndarray:
    """[len(new), vocab]: the logits each new token was chosen from (row j predicts new[j])."""
    with torch.no_grad():
        out = model(torch.tensor([prompt + new[:-1]])).logits[0, len(prompt) - 1 :]
    return out.float().numpy()


def check_round_trip(
    model: Llama,
    tok: HFTokenizer,
    counter: TokenBytes,
    gguf: Path,
    work: Path,
    new_tokens: int = 32,
    exact: bool = True,
    logit_tol: float = LOGIT_TOL,
    known_warnings: tuple[str, ...] = (),
) -> RoundTrip:
    """Every check of issue 29 on one file; returns the measurements (asserts on failure).

    exact=False (f16/bf16/q8_0 files): rounded weights, so greedy tokens are not compared; bits per byte
    still within 1% of the fp32 model's. logit_tol: how far the two logits may be apart (Gemma's GELU runs
    through a half-precision table in llama.cpp: see tests/test_llama_cpp.py). known_warnings: regular
    expressions of load warnings that llama.cpp prints for the upstream file of the same model too."""
    model = model.float().eval()
    prompts = [tok.encode(p) for p in PROMPTS]
    score = tok.encode(TEXT)
    assert len(score) <= model.cfg.seq_len, (len(score), model.cfg.seq_len)
    # llama.cpp pads its context to a multiple of 256 and warns when that exceeds the trained one.
    n_ctx = min(model.cfg.seq_len, 1024)
    assert n_ctx % 256 == 0, f"test model's seq_len {model.cfg.seq_len}: use a multiple of 256"
    run = run_llama_cpp(
        gguf, work, n_ctx=n_ctx, threads=2, prompts=prompts if exact else [], new_tokens=new_tokens,
        texts=[*PROMPTS, TEXT], score=score, chat=CHATS,
    )  # fmt: skip
    r = run.result
    spm = (tok.folder / "tokenizer.model").exists()  # our sentencepiece vocabulary ("llama" in GGUF)
    # Loads cleanly: no warning or error from llama.cpp while loading or running this file, beyond those it
    # prints for the model's upstream file as well.
    unknown = [w for w in r["load_warnings"] if not any(re.fullmatch(k, w) for k in known_warnings)]
    assert unknown == [] and r["later_warnings"] == [], unknown + r["later_warnings"]
    assert r["n_vocab"] == model.cfg.vocab_size
    # llama.cpp reads our tokenizer fields into the same tokenizer: the same ids for every text.
    assert r["tokenized"] == [*prompts, score], "llama.cpp tokenizes differently from ENLACE"
    rt = RoundTrip()
    # Greedy decoding: equal tokens; at a divergence, the two logits there are a rounding-level tie.
    for i, prompt in enumerate(prompts if exact else []):
        ours = list(generate(model, prompt, new_tokens))
        theirs = r["greedy"][i]
        logits = run.array(f"greedy_{i}")
        k = next((j for j, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), len(ours))
        rt.greedy_equal.append(k)
        # ENLACE's logits at every step up to and including the divergence, in one forward pass.
        mine = step_logits(model, prompt, ours[: min(k + 1, len(ours))])
        diffs = np.abs(mine - logits[: len(mine)]).max(axis=1)
        if k:
            rt.max_logit_diff = max(rt.max_logit_diff, float(diffs[:k].max()))
        if k < len(ours):
            d = Divergence(i, k, ours[k], theirs[k], float(diffs[k]),
                           float(logits[k][theirs[k]] - logits[k][ours[k]]))  # fmt: skip
            assert d.logit_diff < logit_tol and 0 <= d.gap < 2 * logit_tol, d
            rt.divergences.append(d)
    assert rt.max_logit_diff < logit_tol, rt.max_logit_diff
    # Perplexity: llama.cpp's next-token log-probabilities, in bits per byte of the same text.
    windows = sliding_windows(score, len(score) - 1, len(score) - 1, counter)
    ref = evaluate(model, windows, batch_size=1)
    logits = torch.from_numpy(run.array("score"))[:-1].double()
    nats = -torch.log_softmax(logits, -1).gather(1, torch.tensor(score[1:])[:, None]).sum().item()
    rt.bpb_enlace, rt.bpb_llama_cpp = float(ref["bpb"]), nats / math.log(2) / windows.bytes
    rt.tokens_scored, rt.bytes_scored = windows.tokens, windows.bytes
    assert abs(rt.bpb_llama_cpp / rt.bpb_enlace - 1) < 0.01, (rt.bpb_llama_cpp, rt.bpb_enlace)
    # The chat template travels in the file and llama.cpp applies it: the same prompt text and tokens.
    for msgs, chat in zip(CHATS, r["chat"], strict=True):
        assert chat["template"] == tok.chat_template and chat["format"] == "chat_template.default"
        text = tok.render_chat(msgs, add_generation_prompt=True)
        assert chat["text"] == text
        if not spm:
            assert chat["ids"] == tok.apply_chat_template(msgs, add_generation_prompt=True)
            continue
        # A sentencepiece vocabulary: llama.cpp puts the dummy-prefix space before the text after every
        # special token (the Llama 2 "legacy" rule), where sentencepiece, and so ENLACE, puts one before
        # the whole text only. That, and nothing else, may differ: docs/llama-cpp.md.
        assert chat["ids"] != tok.apply_chat_template(msgs, add_generation_prompt=True)
        assert tok.decode(chat["ids"]) == space_after_specials(text, tok), tok.decode(chat["ids"])
    return rt


def space_after_specials(text: str, tok: HFTokenizer) -> str:
    """The text as llama.cpp's sentencepiece tokenizer sees it: a space before every run of plain text
    that starts the text or follows a special token."""
    specials = [*(t.content for t in tok.tok.get_added_tokens_decoder().values()), *CHAT_MARKERS]
    parts = re.split("(" + "|".join(map(re.escape, specials)) + ")", text)
    out, after_special = [], True
    for part in parts:
        if not part:
            continue
        is_special = part in specials
        out.append(part if is_special or not after_special else " " + part)
        after_special = is_special
    return "".join(out).removeprefix(" ")  # decoding drops the leading dummy-prefix space
