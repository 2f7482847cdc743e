"""The quality cost of an int8 output head (`--head int8`) in bits per byte: Gemma 3's first.

`python -m bench.bench_head_int8 [FOLDER] [--prose TEXT] [--context N]` (defaults: models/gemma3-270m,
assets/eval/prosa-es.txt, 512 tokens a window, moved by half) scores the text with the model in fp32, then
with its head in int8 (enlace.generate.int8_head: a scale per row; a tied embedding reads the same int8
rows), through the one scoring path (`enlace.scoring.score.evaluate` over the eval stage's sliding windows;
the loss over the head's dequantised matrix: what the int8 kernel multiplies by). Bits are divided by the
text's UTF-8 bytes, as bench-bases does: every token of the text is scored once, after a start token. It also compares the two models' logits on the
last CHECK positions of the text's first window: the relative error of the logits and how often the
likeliest token is the same. It prints one JSON object and writes nothing. It takes no timings.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from enlace.config.hardware import HardwareConfig
from enlace.eval.evaluate import read_prose
from enlace.generate import int8_head
from enlace.load import load_model
from enlace.scoring.score import evaluate, precision, sliding_windows
from enlace.scoring.token_bytes import TokenBytes

CHECK = 64  # positions whose logits are compared ([CHECK, vocab] fp32: 64 MiB for Gemma's 262k)
HW = HardwareConfig(name="bench-fp32", device="cpu")  # fp32, no autocast: the head's own error only


@torch.inference_mode()
def last_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits of the last CHECK positions of ids [1, T]."""
    h = model.hidden_states(ids)[:, -CHECK:]
    return model.lm_head(h).float()[0]


def bits_per_byte(model: torch.nn.Module, ids: list[int], n_bytes: int, context: int) -> float:
    """Every token after the first scored once, in windows of `context` moved by half (the eval stage's
    sliding windows and `evaluate`), over the text's UTF-8 bytes: the tokens stand for the whole text."""
    windows = sliding_windows(ids, context, max(1, context // 2), TokenBytes.raw_bytes(model.cfg.vocab_size))
    r = evaluate(model, windows, batch_size=4, precision=lambda: precision(HW))
    return r["loss"] * r["tokens"] / math.log(2) / n_bytes


def head_int8_quality(folder: Path, text: str, context: int = 512) -> dict[str, Any]:
    """Bits per byte of `text` with the fp32 model and with its head in int8, and the logits' agreement."""
    loaded = load_model(folder, flag="FOLDER")
    tok, model = loaded.hf_tokenizer("bench_head_int8"), loaded.model
    start = tok.bos_id if tok.bos_id is not None else tok.eos_id  # the text starts a document
    ids = [start, *tok.encode(text, add_special_tokens=False)]
    context = min(context, model.cfg.seq_len)
    n_bytes = len(text.encode("utf-8"))
    first = torch.tensor([ids[:context]])
    fp32, want = bits_per_byte(model, ids, n_bytes, context), last_logits(model, first)
    int8_head(model)
    int8, got = bits_per_byte(model, ids, n_bytes, context), last_logits(model, first)
    return {
        "model": str(folder),
        "prose_bytes": n_bytes,
        "prose_tokens": len(ids) - 1,
        "context": context,
        "fp32_bpb": round(fp32, 6),
        "int8_head_bpb": round(int8, 6),
        "bpb_change": round(int8 - fp32, 6),
        "bpb_change_percent": round(100 * (int8 / fp32 - 1), 4),
        "logits_relative_error": round(float((got - want).norm() / want.norm()), 6),
        "argmax_agreement": round(float((got.argmax(-1) == want.argmax(-1)).float().mean()), 4),
        "positions_compared": int(want.shape[0]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_head_int8", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", nargs="?", default="models/gemma3-270m", help="a model folder (default Gemma 3)")
    p.add_argument("--prose", default="assets/eval/prosa-es.txt", help="the text to score")
    p.add_argument("--context", type=int, default=512, help="tokens a window (default 512)")
    args = p.parse_args(argv)
    text = read_prose(Path(args.prose), "--prose")
    print(json.dumps(head_int8_quality(Path(args.folder), text, args.context), indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
