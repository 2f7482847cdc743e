"""Two pretraining runs on the same minimal pairs, item by item: is their accuracy gap more than the items' noise?

    python -m bench.pairs_paired RUN_A RUN_B [--out FILE.json]

Each run's newest checkpoint is scored as the ablation table scores a run (`enlace.ablate.runner.native_scorer`:
ENLACE's decoder in fp32, the run's tokenizer) on the 289 pairs of `assets/bench_es`. Both models answer the same
items, so the comparison is paired: only the items where exactly one of them is right (the discordant pairs)
carry information, and McNemar's exact test asks whether their split is more lopsided than a fair coin's. The
per-phenomenon accuracies show where a gap comes from. Needs the runs' tokenizer (`data/tokenizer`).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

from enlace import paths
from enlace.ablate.runner import native_scorer
from enlace.eval.bench_bases import PAIR_FILES, choice_scores, read_items
from enlace.io import atomic_write_json


def correct_items(run_dir: Path) -> dict[str, list[bool]]:
    """Per pair file, whether the run's model gives the good sentence the higher likelihood, item by item."""
    scratch = Path(tempfile.mkdtemp(prefix="pairs-"))
    try:
        model, tok = native_scorer(run_dir, scratch / "tokenizer")
        sets = read_items(paths.BENCH_ES, None)
        out = {}
        for name in PAIR_FILES:
            scores = choice_scores(model, tok, [(c, ch) for c, ch, _ in sets[name]])
            out[name.removeprefix("pares_")] = [s[0] >= s[1] for s in scores]  # a tie: bench_bases' argmax
        return out
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def mcnemar_exact(a_only: int, b_only: int) -> float:
    """Two-sided exact McNemar p-value: the discordant items' split against Binomial(n, 1/2)."""
    n = a_only + b_only
    if n == 0:
        return 1.0
    k = min(a_only, b_only)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def compare(a: dict[str, list[bool]], b: dict[str, list[bool]]) -> dict[str, Any]:
    flat_a = [x for k in a for x in a[k]]
    flat_b = [x for k in a for x in b[k]]
    a_only = sum(x and not y for x, y in zip(flat_a, flat_b, strict=True))
    b_only = sum(y and not x for x, y in zip(flat_a, flat_b, strict=True))
    return {
        "items": len(flat_a),
        "a_acc": round(sum(flat_a) / len(flat_a), 4),
        "b_acc": round(sum(flat_b) / len(flat_b), 4),
        "a_only": a_only,
        "b_only": b_only,
        "mcnemar_p": round(mcnemar_exact(a_only, b_only), 4),
        "by_phenomenon": {
            k: {"n": len(a[k]), "a": round(sum(a[k]) / len(a[k]), 3), "b": round(sum(b[k]) / len(b[k]), 3)}
            for k in a
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pairs_paired", description=__doc__.split("\n\n")[0])
    p.add_argument("run_a", type=Path)
    p.add_argument("run_b", type=Path)
    p.add_argument("--out", type=Path, default=None, help="write the comparison here as JSON")
    args = p.parse_args(argv)
    result = {"a": str(args.run_a), "b": str(args.run_b)}
    result |= compare(correct_items(args.run_a), correct_items(args.run_b))
    print(json.dumps(result, indent=2))
    if args.out is not None:
        atomic_write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
