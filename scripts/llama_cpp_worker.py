"""Runs inside llama.cpp's own venv (scripts/llama_cpp_build.py), never the project's: what llama.cpp makes of a GGUF.

    <llama venv python> scripts/llama_cpp_worker.py REQUEST.json OUT_DIR
    <llama venv python> scripts/llama_cpp_worker.py quantize IN.gguf OUT.gguf FTYPE

REQUEST: {"gguf": path, "n_ctx": int, "prompts": [[ids]], "new_tokens": int, "texts": [str],
          "score": [ids], "chat": [messages], "windows": [[x, y]]}. Writes OUT_DIR/result.json and, as .npy beside it, the logits
llama.cpp computed: score.npy [len(score), vocab] for the scored text (one window, logits_all), and
greedy_<i>.npy [new_tokens, vocab], the logits each greedy step chose from.

Only numpy and llama_cpp are importable here.
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import llama_chat_format

WARN, ERROR, CONT = 3, 4, 5  # ggml_log_level in this llama.cpp (llama-cpp-python's comment is older)
records: list[tuple[int, str]] = []


@llama_cpp.llama_log_callback
def _log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    msg = text.decode("utf-8", "replace")
    if level == CONT and records:
        records[-1] = (records[-1][0], records[-1][1] + msg)
    else:
        records.append((level, msg))


def greedy(llm: llama_cpp.Llama, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """argmax decoding straight on llama.cpp's logits, one token at a time (no sampler in between)."""
    llm.reset()
    llm.eval(prompt)
    tokens, logits = [], []
    for _ in range(n):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        logits.append(row)
        tokens.append(int(row.argmax()))
        llm.eval([tokens[-1]])
    return tokens, np.stack(logits)


def window_nats(llm: llama_cpp.Llama, x: list[int], y: list[int]) -> float:
    """-sum log p(y[i] | x[:i+1]) over the targets that are not -100 (context only)."""
    llm.reset()
    llm.eval(x)
    logits = np.array(llm.scores[: len(x)], dtype=np.float64)
    keep = np.array([t != -100 for t in y])
    rows, targets = logits[keep], np.array(y)[keep]
    top = rows.max(axis=1, keepdims=True)
    logz = np.log(np.exp(rows - top).sum(axis=1)) + top[:, 0]
    return float((logz - rows[np.arange(len(targets)), targets]).sum())


def quantize(src: str, dst: str, ftype: int) -> None:
    """llama.cpp's own quantizer (llama-quantize), e.g. ftype 7 = Q8_0, 15 = Q4_K_M."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize {src} -> {dst} (ftype {ftype}) failed")


def chat_prompt(llm: llama_cpp.Llama, messages: list[dict]) -> dict:
    """The chat prompt as llama-cpp-python's server builds it from the file's tokenizer.chat_template."""
    template = llm.metadata.get("tokenizer.chat_template")
    if template is None:
        return {"template": None}
    bos, eos = llm.token_bos(), llm.token_eos()
    formatter = llama_chat_format.Jinja2ChatFormatter(
        template=template,
        eos_token=llm._model.token_get_text(eos) if eos != -1 else "",
        bos_token=llm._model.token_get_text(bos) if bos != -1 else "",
        stop_token_ids=[eos],
    )
    result = formatter(messages=messages)
    ids = llm.tokenize(result.prompt.encode("utf-8"), add_bos=not result.added_special, special=True)
    return {"template": template, "format": llm.chat_format, "text": result.prompt, "ids": ids}


def main(request_path: str, out_dir: str) -> int:
    req = json.loads(Path(request_path).read_text(encoding="utf-8"))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    llama_cpp.llama_log_set(_log, ctypes.c_void_p(0))
    llm = llama_cpp.Llama(
        req["gguf"], n_ctx=req["n_ctx"], n_batch=req["n_ctx"], n_threads=req.get("threads", 1),
        logits_all=True, verbose=False, seed=0,
        # fp32 end to end, as ENLACE's reference: llama.cpp's KV cache is f16 unless told otherwise.
        type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
        # llama-server's default for sliding-window models (Gemma 3). The library's default, a full-size
        # SWA cache, makes llama.cpp warn on every load, whatever the file.
        swa_full=False,
    )  # fmt: skip
    loaded = [t.strip() for level, t in records if level in (WARN, ERROR)]
    result: dict = {
        "load_warnings": loaded,
        "architecture": llm.metadata.get("general.architecture"),
        "n_vocab": llm.n_vocab(),
        "tokenized": [llm.tokenize(t.encode("utf-8"), add_bos=True, special=False) for t in req.get("texts", [])],
        "greedy": [],
        "chat": [chat_prompt(llm, m) for m in req.get("chat", [])],
    }  # fmt: skip
    for i, prompt in enumerate(req.get("prompts", [])):
        tokens, logits = greedy(llm, prompt, req["new_tokens"])
        result["greedy"].append(tokens)
        np.save(out / f"greedy_{i}.npy", logits)
    # Windows of a long text (bench): summed nats of the scored targets, computed here, as the full
    # logits of a window ([T, vocab]) are too big to hand back.
    result["window_nats"] = [window_nats(llm, x, y) for x, y in req.get("windows", [])]
    if req.get("score"):
        llm.reset()
        llm.eval(req["score"])
        np.save(out / "score.npy", np.array(llm.scores[: len(req["score"])], dtype=np.float32))
    result["later_warnings"] = [t.strip() for level, t in records if level in (WARN, ERROR)][len(loaded) :]
    (out / "result.json").write_text(json.dumps(result, ensure_ascii=False), encoding="utf-8")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["quantize"]:
        quantize(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        sys.exit(0)
    sys.exit(main(*sys.argv[1:3]))
