"""Where a served token's time goes: `enlace serve` sampled by py-spy under streamed requests, beside
in-process `generate` on the same model, weights and prompt.

`python -m bench.profile_serve FOLDER [WEIGHTS] [NEW] [STREAMS]` (defaults: fp32, 64 new tokens, 1 then
STREAMS=3 concurrent streams). py-spy (requirements-dev.txt) samples every thread of the process 250 times a
second; each sample is put in one bucket by the frames on its stack (the first rule that matches, below), and
the buckets are given as a share of the busy samples and as milliseconds per generated token. Absolute
figures carry whatever else the machine was doing; the shares are what the profile is for.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from bench.common import cpu_description

RATE = 250  # samples per second
PROMPT = "Escribe una receta sencilla de tortilla de patatas para una cena en familia."
# (bucket, substrings of a frame; any of them puts a sample in the bucket), the first match wins.
BUCKETS = [
    ("start-up: imports and model load", ("_find_and_load", "load_model (", "load_served (")),
    ("forward: linear layers", ("Linear.forward (", "PackedLinear", "Int8Linear")),
    (
        "forward: attention (SDPA, KV cache, RoPE)",
        ("Attention.forward (", "apply_rope (", "rotate_half (", "rope_cos_sin ("),
    ),
    ("forward: RMSNorm", ("RMSNorm.forward (",)),
    ("forward: rest of the model", ("enlace/model.py",)),
    ("sampling and repetition guard", ("sample_next", "RepeatGuard", "_sample")),
    ("detokenization", ("enlace/hf/tokenizer.py", "enlace/load/run.py", "enlace/text.py")),
    ("stop strings", ("feed (enlace/serve/engine.py",)),
    ("hand-off to the event loop", ("emit (enlace/serve/engine.py", "call_soon_threadsafe", "_publish")),
    ("SSE chunk: JSON and pydantic", ("_sse (", "chunks.text", "text (enlace/serve/handlers.py", "pydantic")),
    ("event loop: HTTP and asyncio", ("uvicorn", "starlette", "asyncio", "h11", "httptools")),
    ("generate loop and other Python", ("enlace/generate.py", "enlace/serve/engine.py")),
]


# Innermost frames of a thread that waits (a queue, a lock, epoll) though py-spy took it for busy.
IDLE = (
    "_worker (concurrent/futures/thread.py:81)",
    "select (selectors.py",
    "wait (threading.py",
    "get (queue.py",
)


def bucket_of(stack: str) -> str:
    if any(stack.rsplit(";", 1)[-1].startswith(m) for m in IDLE):
        return "(idle: a wait py-spy counts as busy)"
    for name, marks in BUCKETS:
        if any(m in stack for m in marks):
            return name
    return "other"


def read_profile(path: Path) -> tuple[Counter, Counter]:
    """py-spy's raw (collapsed) output: 'frame;frame;... count' per line -> samples per bucket, and per
    (bucket, innermost frame)."""
    out: Counter = Counter()
    leaves: Counter = Counter()
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stack = stack.replace(str(Path.cwd()) + "/src/", "")
            name = bucket_of(stack)
            out[name] += int(count)
            leaves[name, stack.split(";")[-1]] += int(count)
    return out, leaves


def spy(cmd: list[str], out: Path) -> subprocess.Popen:
    spy_cmd = [
        "py-spy",
        "record",
        "--format",
        "raw",
        "-r",
        str(RATE),
        "--threads",
        "-o",
        str(out),
        "--",
        *cmd,
    ]
    return subprocess.Popen(spy_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stream_one(port: int, new: int, results: list) -> None:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": new, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    chunks = 0
    for raw in resp:
        if raw.startswith(b"data: {"):
            chunks += 1
    conn.close()
    results.append(chunks)


def served(folder: str, weights: str, new: int, streams: int, out: Path) -> int:
    """Requests one at a time, then `streams` at once; the tokens generated in all."""
    from tests.helpers import free_port  # noqa: PLC0415 (the tests' helper, not the package's)

    port = free_port()
    cmd = [sys.executable, "-m", "enlace.cli", "serve", "--model", folder, "--weights", weights,
           "--port", str(port), "--max-tokens", str(new), "--slots", str(streams)]  # fmt: skip
    proc = spy(cmd, out)
    _wait(port)
    results: list = []
    for _ in range(3):
        stream_one(port, new, results)
    threads = [threading.Thread(target=stream_one, args=(port, new, results)) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    child = int(
        subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()[0]
    )
    os.kill(child, signal.SIGINT)
    proc.wait(60)
    return (3 + streams) * new


def _wait(port: int) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the server did not come up")


IN_PROCESS = """
import sys, torch
from enlace.generate import generate
from enlace.load import load_model
loaded = load_model(sys.argv[1], weights=sys.argv[2])
ids = loaded.chat_template([{"role": "user", "content": sys.argv[4]}])
dec = loaded.stream(ids)
for _ in range(3):
    for t in generate(loaded.model, ids, int(sys.argv[3]), temperature=0.0):
        dec.push(t)
"""


def in_process(folder: str, weights: str, new: int, out: Path) -> int:
    proc = spy([sys.executable, "-c", IN_PROCESS, folder, weights, str(new), PROMPT], out)
    proc.wait()
    return 3 * new


def report(name: str, profile: tuple[Counter, Counter], tokens: int) -> None:
    counts, leaves = profile
    busy = sum(n for b, n in counts.items() if not b.startswith(("(", "start-up")))
    print(f"\n{name}: {busy} busy samples after start-up, {tokens} tokens "
          f"({busy / RATE * 1000 / tokens:.1f} ms busy/token); shares of those")  # fmt: skip
    for bucket, n in counts.most_common():
        print(f"  {bucket:34s} {100 * n / busy:5.1f}%  {n / RATE * 1000 / tokens:6.2f} ms/token")
        top = sorted(((c, leaf) for (b, leaf), c in leaves.items() if b == bucket), reverse=True)[:3]
        for c, leaf in top:
            print(f"      {100 * c / busy:5.1f}%  {leaf[:110]}")


def main(argv: list[str]) -> int:
    folder = argv[0]
    weights = argv[1] if len(argv) > 1 else "fp32"
    new = int(argv[2]) if len(argv) > 2 else 64
    streams = int(argv[3]) if len(argv) > 3 else 3
    print(f"cpu: {cpu_description()}; {os.cpu_count()} cores; {weights}; {new} new tokens a request")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(os.environ.get("PROFILE_DIR", tmp))
        n = in_process(folder, weights, new, out / "generate.txt")
        report("in-process generate (includes the model load)", read_profile(out / "generate.txt"), n)
        n = served(folder, weights, new, streams, out / "serve.txt")
        report(f"enlace serve, 3 streams one at a time then {streams} at once (includes the load)",
               read_profile(out / "serve.txt"), n)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
