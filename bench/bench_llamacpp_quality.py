"""What each weight precision costs in quality, ENLACE against llama.cpp on ENLACE's own GGUF exports.

SmolLM2-135M-Instruct (the offline default base), bits per byte on the Spanish prose yardstick
(assets/eval/prosa-es.txt), the same non-overlapping windows of 512 tokens and the same byte count on both
sides (ENLACE's scorer: enlace.scoring.score). ENLACE scores its decode weights fp32, bf16 and int8
(`enlace generate --weights`); llama.cpp (the pinned build of scripts/llama_cpp_build.py) scores the F32, F16 and
BF16 files that `enlace export --gguf` writes, and Q8_0 and Q4_K_M made from the F32 file by llama.cpp's own
quantizer (ENLACE writes no quantized GGUF). llama.cpp runs with an f32 KV cache, so its F32 row is the same
model as ENLACE fp32, and differs only by rounding.

Goals: llama.cpp's F32 within 0.1% of ENLACE fp32 (the export is the model), and ENLACE's int8 costing no more
than 1% over fp32 (llama.cpp's Q8_0 cost is printed beside it).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import format_row, goal_row, write_result
from enlace.generate import decode_weights
from enlace.hf.folder import load_hf_folder
from enlace.hf.gguf_export import export_folder_gguf
from enlace.hf.gguf_import import DEFAULT_OUT, import_smollm2
from enlace.hf.tokenizer import HFTokenizer
from enlace.scoring.score import evaluate, sliding_windows
from enlace.scoring.token_bytes import TokenBytes

ROOT = Path(__file__).resolve().parents[1]
PROSE = ROOT / "assets" / "eval" / "prosa-es.txt"
WORKER = ROOT / "scripts" / "llama_cpp_worker.py"
WINDOW = 512
QUANTS = {"Q8_0": 7, "Q4_K_M": 15}  # llama.cpp's LLAMA_FTYPE values


@torch.inference_mode()
def window_nats(model, windows) -> float:
    """Summed cross-entropy of the scored targets, from the logits of the model as it decodes (packed
    bf16 and int8 layers have no .weight for the fused training loss that `evaluate` uses)."""
    nats = 0.0
    for x, y in zip(windows.x, windows.y, strict=True):
        logits = model(x[None]).logits[0].float()
        nats += torch.nn.functional.cross_entropy(logits, y, ignore_index=-100, reduction="sum").item()
    return nats


def llama_python() -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "llama_cpp_build.py")],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        raise SystemExit(f"llama.cpp is not available: {proc.stderr.strip()[-1500:]}")
    return proc.stdout.strip().splitlines()[-1]


def llama_cpp_nats(py: str, gguf: Path, windows, work: Path) -> float:
    rows = [[x.tolist(), y.tolist()] for x, y in zip(windows.x, windows.y, strict=True)]
    req = work / "request.json"
    req.write_text(json.dumps({"gguf": str(gguf), "n_ctx": WINDOW, "threads": 2, "windows": rows}))
    subprocess.run([py, str(WORKER), str(req), str(work)], check=True, capture_output=True)
    return sum(json.loads((work / "result.json").read_text())["window_nats"])


def main() -> int:
    folder = import_smollm2(DEFAULT_OUT)
    tok = HFTokenizer(folder)
    windows = sliding_windows(
        tok.encode(PROSE.read_text(encoding="utf-8")),
        WINDOW,
        WINDOW,
        TokenBytes.hugging_face(folder / "tokenizer.json"),
    )
    bpb: dict[str, float] = {}
    seconds: dict[str, float] = {}
    scorer = float(evaluate(load_hf_folder(folder), windows, batch_size=4)["bpb"])
    for w in ("fp32", "bf16", "int8"):
        t0 = time.perf_counter()
        model = decode_weights(load_hf_folder(folder), w)
        bpb[f"enlace {w}"] = window_nats(model, windows) / math.log(2) / windows.bytes
        if w == "fp32":  # the same figure as ENLACE's scorer (which needs trainable, unpacked weights)
            assert abs(bpb["enlace fp32"] / scorer - 1) < 1e-5, (bpb["enlace fp32"], scorer)
        seconds[f"enlace {w}"] = time.perf_counter() - t0
        print(f"enlace {w}: {bpb[f'enlace {w}']:.5f} bpb", flush=True)
    py = llama_python()
    with tempfile.TemporaryDirectory(prefix="enlace-gguf-") as tmp:
        files = {
            t.upper(): export_folder_gguf(folder, Path(tmp) / f"m-{t}.gguf", t)
            for t in ("f32", "f16", "bf16")
        }
        for name, ftype in QUANTS.items():
            files[name] = Path(tmp) / f"m-{name}.gguf"
            subprocess.run([py, str(WORKER), "quantize", str(files["F32"]), str(files[name]), str(ftype)],
                           check=True, capture_output=True)  # fmt: skip
        sizes = {name: f.stat().st_size for name, f in files.items()}
        for name, f in files.items():
            t0 = time.perf_counter()
            nats = llama_cpp_nats(py, f, windows, Path(tmp))
            bpb[f"llama.cpp {name}"] = nats / math.log(2) / windows.bytes
            seconds[f"llama.cpp {name}"] = time.perf_counter() - t0
            print(
                f"llama.cpp {name}: {bpb[f'llama.cpp {name}']:.5f} bpb ({sizes[name] / 2**20:.0f} MiB)",
                flush=True,
            )
    ref = bpb["enlace fp32"]
    cost = {k: 100 * (v / ref - 1) for k, v in bpb.items()}
    print(f"\n{'weights':<20} {'bpb':>8} {'vs enlace fp32':>15}")
    for k, v in bpb.items():
        print(f"{k:<20} {v:>8.5f} {cost[k]:>+14.3f}%")
    rows = [
        goal_row("GGUF F32 bpb, |llama.cpp - enlace|", "llama.cpp F32 (enlace export)", "enlace fp32",
                 abs(cost["llama.cpp F32"]), "<=", 0.1, "%"),
        goal_row("int8 weights bpb cost over fp32", "enlace int8", "llama.cpp Q8_0",
                 cost["enlace int8"], "<=", 1.0, "%",
                 note=f"llama.cpp Q8_0 {cost['llama.cpp Q8_0']:+.3f}%, Q4_K_M {cost['llama.cpp Q4_K_M']:+.3f}%"),
    ]  # fmt: skip
    for r in rows:
        print(format_row(r))
    write_result("llamacpp_quality", {
        "model": "SmolLM2-135M-Instruct", "text": str(PROSE.relative_to(ROOT)), "window": WINDOW,
        "tokens": windows.tokens, "bytes": windows.bytes, "bpb": bpb, "cost_pct": cost, "seconds": seconds,
        "rows": rows,
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
