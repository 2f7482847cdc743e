"""`enlace serve`: the OpenAI-compatible server and its chat page."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

# Defaults, written out here so that `enlace --help` imports neither torch nor FastAPI.
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080
DEFAULT_QUEUE = 16
DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_MAX_TOKENS = 2048, 512


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


def _serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from .api import Limits, create_app
    from .engine import Engine
    from .loader import load_served

    for flag, value, least in (("--slots", args.slots, 1), ("--queue", args.queue, 0),
                               ("--max-prompt-tokens", args.max_prompt_tokens, 1),
                               ("--max-tokens", args.max_tokens, 1), ("--port", args.port, 0)):  # fmt: skip
        _positive(flag, value, least)
    api_key = args.api_key or os.environ.get("ENLACE_API_KEY") or None
    served = load_served(
        args.model, args.adapter, _default_assistant(args), args.weights, args.device, args.name
    )
    slots = args.slots
    engine = Engine(served, slots=slots, queue=args.queue)
    limits = Limits(max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens)
    app = create_app(engine, limits, api_key=api_key)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    shown = "[::1]" if args.host == "::1" else args.host
    print(
        f"serving {served.name} ({served.source}; {served.weights} weights, context {served.context}, "
        f"{slots} slot(s), queue {args.queue}{', API key required' if api_key else ''})\n"
        f"chat page: http://{shown}:{args.port}/   API: http://{shown}:{args.port}/v1",
        flush=True,
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5)
    finally:
        engine.close()
    return 0


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
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
    p.add_argument("--name", default=None, help="the model id clients use (default: from the folder names)")
    p.add_argument(
        "--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST}: this machine only)"
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")
    p.add_argument(
        "--api-key", default=None,
        help="require Authorization: Bearer KEY on /v1/ (default: $ENLACE_API_KEY if set, else no key)",
    )  # fmt: skip
    p.add_argument("--slots", type=int, default=1, help="generations at a time (default 1)")
    p.add_argument(
        "--queue", type=int, default=DEFAULT_QUEUE,
        help=f"requests that may wait for a slot; beyond that a request gets 429 at once (default {DEFAULT_QUEUE})",
    )  # fmt: skip
    p.add_argument(
        "--weights", default="auto", choices=("auto", "fp32", "bf16", "int8"),
        help="decode weights (auto: bf16 on a CPU with native bf16, else fp32; int8: weight-only)",
    )  # fmt: skip
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--max-prompt-tokens", dest="max_prompt_tokens", type=int, default=DEFAULT_MAX_PROMPT_TOKENS,
        help=f"longest prompt accepted, in tokens (default {DEFAULT_MAX_PROMPT_TOKENS}, at most the context less one)",
    )  # fmt: skip
    p.add_argument(
        "--max-tokens", dest="max_tokens", type=int, default=DEFAULT_MAX_TOKENS,
        help=f"most new tokens per request, and the default when a request names none (default {DEFAULT_MAX_TOKENS})",
    )  # fmt: skip
    p.set_defaults(handler=_serve)
