"""Decode speed of the served model: `enlace serve` through its HTTP API against transformers `generate`.

SmolLM2-135M-Instruct, batch 1, greedy, the same chat-formatted Spanish prompt, no early stop (the server's
ignore_eos, transformers without an eos id), at the precision `enlace serve` picks by default (bf16 on a CPU
with native bf16, else fp32) on both sides; with bf16, transformers' default fp32 too. The server is a real
`enlace serve` process; each request streams its answer as server-sent events and the client reads every
event, so the figure carries the HTTP, JSON and detokenising costs a user pays.

Decode rate = (N - 1) / (time for N new tokens - time for 1 new token), N = 128: the prompt's prefill and the
request's fixed costs cancel out, on both sides alike. Interleaved rounds, medians. Goal: served >= 1.5x
transformers at the same precision.
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from bench.common import alternate, format_row, goal_row, machine, wait_until_serving, write_result
from enlace.generate import resolve_decode_weights
from enlace.hf.gguf_import import DEFAULT_OUT, import_smollm2
from enlace.hf.tokenizer import HFTokenizer

NEW = 128
PROMPT = "Escribe una receta sencilla de tortilla de patatas para una cena en familia."


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return machine()["cpu"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServedModel:
    """A real `enlace serve` child process and a streamed greedy request against it."""

    def __init__(self, folder: Path, weights: str):
        self.port = free_port()
        cmd = [sys.executable, "-m", "enlace.cli", "serve", "--model", str(folder), "--weights", weights,
               "--port", str(self.port), "--max-tokens", str(NEW)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wait_until_serving(
            self.proc, self.port, "/health", 300,
            lambda: f"enlace serve exited with {self.proc.returncode}: {self.proc.stderr.read()}",
        )  # fmt: skip
        self.timings: list[dict] = []

    def stream(self, n: int) -> int:
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": n, "stream": True,
                "temperature": 0, "top_p": 1, "repetition_penalty": 1, "no_repeat_ngram": 0, "ignore_eos": True}  # fmt: skip
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        usage = None
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
                if n == NEW:
                    self.timings.append(chunk["timings"])
        conn.close()
        assert usage and usage["completion_tokens"] == n, usage
        return n

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def decode_rate(long: list[float], short: list[float]) -> float:
    return (NEW - 1) / (statistics.median(long) - statistics.median(short))


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM

    rounds = int((argv or sys.argv[1:] or [os.environ.get("BENCH_ROUNDS", "5")])[0])
    folder = import_smollm2(DEFAULT_OUT)
    weights = resolve_decode_weights("auto")
    tok = HFTokenizer(folder)
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    x = torch.tensor([ids])
    peers = {"bf16": torch.bfloat16, "fp32": torch.float32} if weights == "bf16" else {"fp32": torch.float32}
    hf = {}
    for name, dtype in peers.items():
        m = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        m.generation_config.eos_token_id = None  # no stop token: exactly n new tokens
        hf[name] = m

    def peer(name: str, n: int):
        def run():
            with torch.inference_mode():
                y = hf[name].generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=tok.pad_id)  # fmt: skip
            assert y.shape[1] == len(ids) + n

        return run

    server = ServedModel(folder, weights)
    try:
        contenders = {f"served {weights} {n}": (lambda n=n: server.stream(n)) for n in (NEW, 1)}
        for name in hf:
            contenders |= {f"transformers {name} {n}": peer(name, n) for n in (NEW, 1)}
        times = alternate(contenders, rounds, warmup=1)
    finally:
        server.stop()
    rates = {
        who: decode_rate(times[f"{who} {NEW}"], times[f"{who} 1"])
        for who in [f"served {weights}", *(f"transformers {n}" for n in hf)]
    }
    inside = statistics.median(t["decode_tokens_per_s"] for t in server.timings)
    cpu = cpu_model()
    print(
        f"CPU: {cpu}, {torch.get_num_threads()} threads; served weights {weights}; {len(ids)} prompt tokens"
    )
    for who, r in rates.items():
        print(f"{who}: {r:.1f} decode tokens/s (median of {rounds}, {NEW} vs 1 new tokens)")
    print(f"served, measured inside the server (no HTTP): {inside:.1f} decode tokens/s")
    ours = f"served {weights}"
    rows = [
        goal_row("decode tokens/s, served over HTTP (batch 1)", f"enlace serve {weights}", f"transformers {weights}",
                 rates[ours] / rates[f"transformers {weights}"], ">=", 1.5,
                 note=f"{rates[ours]:.1f} vs {rates[f'transformers {weights}']:.1f} tokens/s on {cpu}"),
    ]  # fmt: skip
    if weights == "bf16":
        rows.append(goal_row("decode tokens/s, served over HTTP (batch 1)", "enlace serve bf16", "transformers fp32",
                             rates[ours] / rates["transformers fp32"], ">=", 1.5))  # fmt: skip
    path = write_result(
        "serve",
        {"new_tokens": NEW, "prompt_tokens": len(ids), "rounds": rounds, "weights": weights, "cpu_model": cpu,
         "decode_tokens_per_s": rates, "served_inside_tokens_per_s": inside,
         "seconds": {k: v for k, v in times.items()}, "rows": rows},
    )  # fmt: skip
    print(f"wrote {path}")
    for r in rows:
        print(format_row(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
