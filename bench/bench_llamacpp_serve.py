"""Serving speed: `enlace serve` against llama.cpp's server (llama-cpp-python's) on the same weights.

SmolLM2-135M-Instruct by default, or any folder ENLACE exports (`--model`, with `--adapter` a LoRA adapter
merged first: the Gemma 3 assistant). ENLACE serves the Hugging Face folder with `--weights W`; llama.cpp serves the GGUF
that `enlace export --gguf` writes from that folder, at the matching precision: fp32 against F32, bf16
against BF16, and ENLACE's weight-only int8 against llama.cpp's Q8_0 (quantized from the F32 file by llama.cpp
itself). Both servers are real child processes on 2 threads; the client streams over HTTP (/v1/completions,
greedy, no early stop: ENLACE's ignore_eos, llama.cpp's logit_bias on the eos id) and measures:

- decode tokens/s at batch 1: (N - 1) / (arrival of the last token - arrival of the first), N = 64;
- time to first token for a 500-token prompt (a prefix of the prose yardstick);
- total tokens/s of 4 concurrent streams of N tokens (ENLACE with --slots 4; llama-cpp-python's server
  serves one request at a time, so its streams queue: --interrupt_requests False, as by default a new
  request cuts the running one short);
- resident memory: the server process's peak (VmHWM) after all of it.

Both servers of a pair run side by side and take turns request by request, the order flipping every round,
so a machine whose speed drifts over minutes (a shared VM's can halve and recover) slows both alike. Both
run with OpenMP's default wait policy and OMP_NUM_THREADS=2, as a user would start them.

Every prompt starts with a request number, so neither server can reuse a cached prefix (llama-cpp-python
keeps the last prompt's KV cache and reuses a common prefix; `enlace serve` has no prompt cache).
Ratios are ENLACE over llama.cpp for rates, llama.cpp over ENLACE for times and memory (> 1: ENLACE better).
Goal (issue 29): decode at least 1.0x llama.cpp at the same precision.

    python -m bench.bench_llamacpp_serve [ROUNDS] [PAIRS of fp32,bf16,int8,q4] [--model DIR [--adapter DIR]]   e.g. `1 fp32`
    python -m bench.bench_llamacpp_serve 3 fp32,bf16 --model models/gemma3-270m --adapter runs/assistant/adapter

With --model the result goes to bench/results/llamacpp_serve_<folder name>.json, beside SmolLM2's.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.bench_serve import cpu_model, free_port
from bench.common import format_row, goal_row, wait_until_serving, write_result
from enlace.export import export_merged
from enlace.hf.gguf_export import export_folder_gguf
from enlace.hf.gguf_import import DEFAULT_OUT, import_smollm2
from enlace.hf.tokenizer import HFTokenizer

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "scripts" / "llama_cpp_worker.py"
PROSE = ROOT / "assets" / "eval" / "prosa-es.txt"
NEW = 64
LONG_PROMPT = 500
STREAMS = 4
THREADS = 2
# pair -> (enlace serve --weights, the llama.cpp file). The last pair sets ENLACE's smallest weights against
# llama.cpp's usual 4-bit file: not the same precision, what a user choosing a small server compares.
PAIRS = {
    "fp32": ("fp32", "F32"),
    "bf16": ("bf16", "BF16"),
    "int8": ("int8", "Q8_0"),
    "q4": ("int8", "Q4_K_M"),
}
QUANTS = {"Q8_0": 7, "Q4_K_M": 15}  # llama.cpp's LLAMA_FTYPE values
SHORT = "Escribe una receta sencilla de tortilla de patatas para una cena en familia."


def llama_python() -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "llama_cpp_build.py")], capture_output=True, text=True
    )
    if proc.returncode:
        raise SystemExit(f"llama.cpp is not available: {proc.stderr.strip()[-1500:]}")
    return proc.stdout.strip().splitlines()[-1]


class Server:
    """A server child process, ready when /v1/models answers; `extra` is merged into every request body."""

    def __init__(self, cmd: list[str], port: int, extra: dict, env: dict | None = None):
        self.port, self.extra, self.cmd = port, extra, cmd
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        wait_until_serving(self.proc, port, "/v1/models", 600, self._died)

    def _died(self) -> str:
        self.log.seek(0)
        return f"{self.cmd[:4]} exited with {self.proc.returncode}: {self.log.read()[-2000:]}"

    def stream(self, prompt: str, n: int) -> list[float]:
        """Arrival times (perf_counter) of the streamed chunks that carry text, request sent at [0]."""
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "top_p": 1, "stream": True, **self.extra}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()[:500]
        times = [t0]
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            choices = json.loads(line[5:]).get("choices") or []
            if choices and choices[0].get("text"):
                times.append(time.perf_counter())
        conn.close()
        return times

    def peak_rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def decode_rate(server: Server, prompt: str) -> float:
    t = server.stream(prompt, NEW)
    # Exactly NEW tokens (no early stop); a text chunk may hold back a partial character, so the rate is
    # tokens after the first over the time from the first chunk to the last.
    assert len(t) - 1 >= NEW // 2, f"{len(t) - 1} text chunks for {NEW} tokens: did it stop early?"
    return (NEW - 1) / (t[-1] - t[1])


def first_token_s(server: Server, prompt: str) -> float:
    t = server.stream(prompt, 2)
    return t[1] - t[0]


def streams_rate(server: Server, prompts: list[str]) -> float:
    results: list[list[float]] = []
    threads = [threading.Thread(target=lambda p=p: results.append(server.stream(p, NEW))) for p in prompts]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    assert all(len(r) - 1 >= NEW // 2 for r in results), [len(r) - 1 for r in results]  # none cut short
    return len(prompts) * NEW / wall


def measure_pair(servers: dict[str, Server], long_prompt: str, rounds: int, counter: list[int]):
    """Medians per server of each figure, the two servers taking turns request by request.

    The servers run side by side (only one is ever busy), and the order flips every round (A B, then B A):
    a machine whose speed drifts over minutes, as a shared VM's does, slows both alike instead of
    whichever happened to run second.
    """

    def numbered(text: str) -> str:
        counter[0] += 1
        return f"Petición {counter[0]}. {text}"

    samples = {who: {"decode": [], "ttft": [], "total": []} for who in servers}
    for r in range(rounds):
        order = list(servers.items())
        for key in ("decode", "ttft", "total"):
            for who, server in order if r % 2 == 0 else order[::-1]:
                if key == "decode":
                    samples[who][key].append(decode_rate(server, numbered(SHORT)))
                elif key == "ttft":
                    samples[who][key].append(first_token_s(server, numbered(long_prompt)))
                else:
                    samples[who][key].append(streams_rate(server, [numbered(SHORT) for _ in range(STREAMS)]))
    return {
        who: {"decode_tokens_per_s": statistics.median(s["decode"]), "ttft_s": statistics.median(s["ttft"]),
              "total_tokens_per_s": statistics.median(s["total"]),
              "peak_rss_mib": servers[who].peak_rss_mib(), "decode_samples": s["decode"]}
        for who, s in samples.items()
    }  # fmt: skip


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.bench_llamacpp_serve")
    p.add_argument("rounds", nargs="?", type=int, default=int(os.environ.get("BENCH_ROUNDS", "3")))
    p.add_argument("pairs", nargs="?", default=",".join(PAIRS), help=f"comma-separated, of {list(PAIRS)}")
    p.add_argument("--model", default=None, help="a Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--adapter", default=None, help="with --model: a LoRA adapter, merged before both serve it"
    )
    args = p.parse_args(argv)
    if args.adapter and not args.model:
        p.error("--adapter needs --model (the base it was trained on)")
    return args


def stop_bias(tok: HFTokenizer) -> dict[str, float]:
    """llama.cpp's logit_bias that keeps it from stopping: every id that ends ENLACE's answers, and "</s>",
    which llama.cpp makes an end of generation wherever a vocabulary has it (Gemma's is an HTML tag)."""
    ids = [*tok.eos_ids, tok.token_id("</s>")]
    return {str(i): -1e9 for i in dict.fromkeys(ids) if i is not None}


def start_enlace(folder: Path, weights: str, env: dict) -> Server:
    port = free_port()
    return Server(
        [sys.executable, "-m", "enlace.cli", "serve", "--model", str(folder), "--weights", weights,
         "--port", str(port), "--slots", str(STREAMS), "--max-tokens", str(NEW)],
        port, {"ignore_eos": True}, env,
    )  # fmt: skip


def start_llama_cpp(py: str, gguf: Path, tok: HFTokenizer, env: dict) -> Server:
    port = free_port()
    return Server(
        [py, "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads", str(THREADS),
         "--n_threads_batch", str(THREADS), "--n_ctx", "1024", "--interrupt_requests", "False",
         "--host", "127.0.0.1", "--port", str(port)],
        port, {"logit_bias": stop_bias(tok)}, env,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse(argv if argv is not None else sys.argv[1:])
    rounds, pairs = args.rounds, args.pairs.split(",")
    py = llama_python()
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    results: dict[str, dict[str, dict[str, float]]] = {}
    counter = [0]
    with tempfile.TemporaryDirectory(prefix="enlace-serve-gguf-") as tmp:
        if args.adapter:  # both servers get the same merged weights
            folder = Path(export_merged(Path(args.model), Path(args.adapter), Path(tmp) / "merged")["folder"])
        else:
            folder = Path(args.model) if args.model else import_smollm2(DEFAULT_OUT)
        name = (
            Path(args.model).name + (" + LoRA" if args.adapter else "")
            if args.model
            else "SmolLM2-135M-Instruct"
        )
        tok = HFTokenizer(folder)
        long_prompt = tok.decode(
            tok.encode(PROSE.read_text(encoding="utf-8"), add_special_tokens=False)[:LONG_PROMPT]
        )
        f32 = export_folder_gguf(folder, Path(tmp) / "m-f32.gguf", "f32")
        for pair in pairs:
            weights, kind = PAIRS[pair]
            gguf = f32 if kind == "F32" else Path(tmp) / f"m-{kind}.gguf"
            if kind == "BF16":
                export_folder_gguf(folder, gguf, "bf16")
            elif kind in QUANTS:
                subprocess.run(
                    [py, str(WORKER), "quantize", str(f32), str(gguf), str(QUANTS[kind])],
                    check=True,
                    capture_output=True,
                )
            servers = {}
            try:  # both up before the first request, so neither one's start-up lands in the other's figures
                servers[f"enlace {weights}"] = start_enlace(folder, weights, env)
                servers[f"llama.cpp {kind}"] = start_llama_cpp(py, gguf, tok, env)
                results[pair] = measure_pair(servers, long_prompt, rounds, counter)
            finally:
                for server in servers.values():
                    server.stop()
            print(f"{pair}: {results[pair]}", flush=True)
    cpu = cpu_model()
    print(f"\nCPU: {cpu}; {THREADS} threads each; torch {torch.__version__}; {name}")
    head = f"{'server':<16} {'decode tok/s':>12} {'TTFT 500 (s)':>12} {'4 streams tok/s':>15} {'peak RSS MiB':>12}"
    print(head)
    for who, r in ((who, r) for pair in results.values() for who, r in pair.items()):
        print(f"{who:<16} {r['decode_tokens_per_s']:>12.1f} {r['ttft_s']:>12.3f} {r['total_tokens_per_s']:>15.1f} "
              f"{r['peak_rss_mib']:>12.0f}")  # fmt: skip
    rows, ratios = [], {}
    for pair in pairs:
        weights, kind = PAIRS[pair]
        a, b = results[pair][f"enlace {weights}"], results[pair][f"llama.cpp {kind}"]
        ratios[pair] = {
            "decode": a["decode_tokens_per_s"] / b["decode_tokens_per_s"],
            "ttft": b["ttft_s"] / a["ttft_s"],
            "streams": a["total_tokens_per_s"] / b["total_tokens_per_s"],
            "rss": b["peak_rss_mib"] / a["peak_rss_mib"],
        }
        r = ratios[pair]
        print(f"ratios {weights} vs {kind} (>1: enlace better): decode {r['decode']:.2f}x, "
              f"TTFT {r['ttft']:.2f}x, 4 streams {r['streams']:.2f}x, memory {r['rss']:.2f}x")  # fmt: skip
        rows.append(goal_row("decode tokens/s, served (batch 1)", f"enlace serve {weights}",
                             f"llama.cpp server {kind}", r["decode"], ">=", 1.0,
                             note=f"TTFT(500) {r['ttft']:.2f}x, 4 streams {r['streams']:.2f}x, memory "
                                  f"{r['rss']:.2f}x; {name}; {cpu}"))  # fmt: skip
    key = f"llamacpp_serve_{Path(args.model).name}" if args.model else "llamacpp_serve"
    write_result(key, {"model": name, "cpu_model": cpu, "threads": THREADS, "new_tokens": NEW, "rounds": rounds,
                                    "long_prompt_tokens": LONG_PROMPT, "results": results, "ratios": ratios,
                                    "rows": rows})  # fmt: skip
    for r in rows:
        print(format_row(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
