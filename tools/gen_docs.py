"""Generate the reference pages of the docs site from the code itself.

    python tools/gen_docs.py           # write docs/reference/config.md and docs/reference/cli.md
    python tools/gen_docs.py --check   # exit 1, naming the stale pages, when they differ from the code

The configuration reference walks every pydantic model in `enlace.config` (each layer, then the models nested
in it) and reads each field's explanation from the `#` comments beside it in the source, so whatever fields
exist are listed, commented or not (tools/docgen/config_ref.py, comments.py). The CLI reference walks the
argparse parser that `enlace` itself builds (tools/docgen/cli_ref.py). `make docs` runs this before
`mkdocs build`; `tests/test_docs.py` fails when the committed pages are stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # a script beside its package, not an installed one

from docgen.cli_ref import cli_reference  # noqa: E402
from docgen.config_ref import config_reference  # noqa: E402

from enlace.io import atomic_write_text  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG_PAGE = Path("docs/reference/config.md")
CLI_PAGE = Path("docs/reference/cli.md")
REGENERATE = "python tools/gen_docs.py (or make docs)"


def pages() -> dict[Path, str]:
    return {CONFIG_PAGE: config_reference(), CLI_PAGE: cli_reference()}


def stale(root: Path = ROOT) -> list[Path]:
    """The reference pages whose committed text differs from what the code generates now."""
    out = []
    for rel, text in pages().items():
        path = root / rel
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            out.append(rel)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 when a page is stale")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale()
        for rel in bad:
            print(f"error: {rel} is stale; regenerate it with {REGENERATE}", file=sys.stderr)
        return 1 if bad else 0
    for rel, text in pages().items():
        path = ROOT / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            atomic_write_text(path, text)
            print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
