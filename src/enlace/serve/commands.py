"""`enlace serve`: the OpenAI-compatible server and its chat page."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

# Defaults, written out here so that `enlace --help` imports neither torch nor FastAPI.
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080
DEFAULT_QUEUE = 16
DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_MAX_TOKENS = 2048, 512
DEFAULT_PROMPT_CACHE = 2048  # = engine.PROMPT_CACHE
DEFAULT_BODY_TIMEOUT, DEFAULT_QUEUE_TIMEOUT = 10.0, 60.0
# Connections and requests uvicorn takes at once beyond the slots and the queue (keep-alive clients, /health,
# the page, refusals); past them it answers 503 without calling the app.
SPARE_CONNECTIONS = 32


def _default_assistant(args: argparse.Namespace):
    """The default pipeline's assistant: the finetune layer's base model and its run's adapter."""

    def find() -> tuple[Path, Path]:
        from ..finetune.commands import load_finetune_cfg

        cfg = load_finetune_cfg(args)
        return Path(cfg.finetune.base_model), Path(cfg.finetune.out) / "adapter"

    return find


def _positive(flag: str, value: int, least: int = 1) -> None:
    from ..errors import EnlaceError

    if value < least:
        raise EnlaceError(f"{flag} {value}: must be at least {least}")


def _api_key(args: argparse.Namespace) -> str | None:
    """The key, checked before the model loads: an address other machines reach needs one, or a stated
    --no-api-key."""
    from ..errors import EnlaceError
    from .guard import is_loopback

    if args.no_api_key and args.api_key:
        raise EnlaceError("--api-key and --no-api-key: pass one of them")
    api_key = None if args.no_api_key else args.api_key or os.environ.get("ENLACE_API_KEY") or None
    if api_key is None and not args.no_api_key and not is_loopback(args.host):
        raise EnlaceError(
            f"--host {args.host}: other machines can reach this address; pass --api-key KEY (or set "
            "ENLACE_API_KEY), or --no-api-key to serve without one"
        )
    for origin in args.cors_origin:
        if not origin.startswith(("http://", "https://")) or origin.count("/") != 2:
            raise EnlaceError(f"--cors-origin {origin}: expected an origin, e.g. http://localhost:3000")
    for flag, seconds in (("--body-timeout", args.body_timeout), ("--queue-timeout", args.queue_timeout)):
        if not seconds > 0:
            raise EnlaceError(f"{flag} {seconds}: must be above 0 seconds")
    return api_key


def _setup_runtime(device: str) -> None:
    """As a training run sets its runtime up: the CPU allocator keeps freed memory (each decode step frees
    and reallocates the same activations), PyTorch's threads (one per core, used by the one compute thread
    alone). Determinism stays off: a served answer promises no bit-exact rerun across machines."""
    from ..config.hardware import HardwareConfig
    from ..runtime import setup_runtime

    kind = "cuda" if device.startswith("cuda") else "cpu"
    setup_runtime(HardwareConfig(name="serve", device=kind, deterministic=False))


def _serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from .api import Limits, create_app
    from .engine import Engine
    from .loader import load_served
    from .prefix import prompt_cache_words

    for flag, value, least in (("--slots", args.slots, 1), ("--queue", args.queue, 0),
                               ("--max-prompt-tokens", args.max_prompt_tokens, 1),
                               ("--max-tokens", args.max_tokens, 1), ("--port", args.port, 0),
                               ("--prompt-cache", args.prompt_cache, 0)):  # fmt: skip
        _positive(flag, value, least)
    api_key = _api_key(args)
    _setup_runtime(args.device)
    served = load_served(
        args.model,
        args.adapter,
        _default_assistant(args),
        args.weights,
        args.device,
        args.name,
        args.head,
        args.kernels,
        args.adapter_scale,
    )
    slots = args.slots
    engine = Engine(served, slots=slots, queue=args.queue, prompt_cache=args.prompt_cache)
    limits = Limits(max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
                    body_timeout=args.body_timeout, queue_timeout=args.queue_timeout)  # fmt: skip
    app = create_app(engine, limits, api_key=api_key, host=args.host, cors_origins=tuple(args.cors_origin))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    shown = "[::1]" if args.host == "::1" else args.host
    print(
        f"serving {served.name} ({served.source}; {served.weights} weights, context {served.context}, "
        f"{slots} slot(s), queue {args.queue}, {prompt_cache_words(served.model, args.prompt_cache)}"
        f"{', API key required' if api_key else ''})\n"
        f"chat page: http://{shown}:{args.port}/   API: http://{shown}:{args.port}/v1",
        flush=True,
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5,
                    limit_concurrency=slots + args.queue + SPARE_CONNECTIONS)  # fmt: skip
    finally:
        engine.close()
    return 0


ADAPTER_SCALE_HELP = (
    "the adapter's delta times S before it is merged (default 1: as trained; 0: the base), as llama.cpp's "
    "--lora-scaled; the model id gets @S"
)


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    from ..choices import HEAD_HELP, KERNELS_HELP, DecodeKernels, HeadWeights, values
    from ..finetune.commands import _common as finetune_common

    p = sub.add_parser(
        "serve",
        parents=[finetune_common()],
        help="serve a model over an OpenAI-compatible HTTP API, with a chat page at /",
        description="Serve one model over OpenAI's chat and completion endpoints (streaming too), with a chat "
        "page at /. Without --model: the fine-tuned assistant of the default pipeline (the finetune layer's "
        "base model with runs/finetune/adapter).",
    )
    p.add_argument(
        "--model", default=None,
        help="a Hugging Face folder (e.g. models/smollm2-135m-instruct), a LoRA run folder (runs/finetune), "
        "a pretraining run folder (runs/pretrain) or a .gguf file",
    )  # fmt: skip
    p.add_argument("--adapter", default=None, help="a LoRA adapter folder for --model (PEFT layout)")
    p.add_argument("--adapter-scale", type=float, default=1.0, metavar="S", help=ADAPTER_SCALE_HELP)
    p.add_argument("--name", default=None, help="the model id clients use (default: from the folder names)")
    p.add_argument(
        "--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST}: this machine only)"
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")
    p.add_argument(
        "--api-key", default=None,
        help="require Authorization: Bearer KEY on /v1/ and for /health's details (default: $ENLACE_API_KEY "
        "if set, else no key; an address other than loopback needs a key or --no-api-key)",
    )  # fmt: skip
    p.add_argument(
        "--no-api-key", dest="no_api_key", action="store_true",
        help="serve an address other than loopback without a key (anyone who reaches it may use it)",
    )  # fmt: skip
    p.add_argument(
        "--cors-origin", dest="cors_origin", action="append", default=[], metavar="ORIGIN",
        help="a web origin (e.g. http://localhost:3000) whose pages may call the API from a browser; repeat "
        "for more (default: only the server's own page)",
    )  # fmt: skip
    p.add_argument("--slots", type=int, default=1, help="generations at a time (default 1)")
    p.add_argument(
        "--queue", type=int, default=DEFAULT_QUEUE,
        help=f"requests that may wait for a slot; beyond that a request gets 429 at once (default {DEFAULT_QUEUE})",
    )  # fmt: skip
    p.add_argument(
        "--queue-timeout", dest="queue_timeout", type=float, default=DEFAULT_QUEUE_TIMEOUT,
        help=f"seconds a request may wait for a slot before a 503 (default {DEFAULT_QUEUE_TIMEOUT:g})",
    )  # fmt: skip
    p.add_argument(
        "--body-timeout", dest="body_timeout", type=float, default=DEFAULT_BODY_TIMEOUT,
        help=f"seconds to receive a request's body before a 408 (default {DEFAULT_BODY_TIMEOUT:g})",
    )  # fmt: skip
    p.add_argument(
        "--weights", default="auto", choices=("auto", "fp32", "bf16", "int8"),
        help="decode weights (auto: bf16 on a CPU with native bf16, else fp32; int8: weight-only)",
    )  # fmt: skip
    p.add_argument(
        "--head",
        default="same",
        choices=values(HeadWeights),
        help=HEAD_HELP,
    )
    p.add_argument("--kernels", default="auto", choices=values(DecodeKernels), help=KERNELS_HELP)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--max-prompt-tokens", dest="max_prompt_tokens", type=int, default=DEFAULT_MAX_PROMPT_TOKENS,
        help=f"longest prompt accepted, in tokens (default {DEFAULT_MAX_PROMPT_TOKENS}, at most the context less one)",
    )  # fmt: skip
    p.add_argument(
        "--max-tokens", dest="max_tokens", type=int, default=DEFAULT_MAX_TOKENS,
        help=f"most new tokens per request, and the default when a request names none (default {DEFAULT_MAX_TOKENS})",
    )  # fmt: skip
    p.add_argument(
        "--prompt-cache", dest="prompt_cache", type=int, default=DEFAULT_PROMPT_CACHE, metavar="TOKENS",
        help="positions of prompt KV kept for reuse: a prompt that starts with tokens already computed (the "
        f"preamble, a conversation's earlier turns) prefills only the rest (default {DEFAULT_PROMPT_CACHE}; 0: off)",
    )  # fmt: skip
    p.set_defaults(handler=_serve)
