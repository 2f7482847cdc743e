"""Data-budget preflight: does the training corpus hold enough tokens for the steps the config plans?

planned = train.max_steps x train.global_batch_size x model.seq_len. Available training tokens come from,
in order of trust: the shard manifest (exact), the corpus manifest (exact bytes for the byte loader; for
sentencepiece, characters / chars-per-token of the tokenizer report, else a Spanish default), or the data
config's `estimated_tokens`. Past data.max_epochs passes over the data, the run stops before it starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import paths
from ..errors import DataError

# Spanish text with a sentencepiece vocabulary of 8k-32k: about 4 characters per token (measured on the
# es-debian corpus: 16.3 M characters, about 4 M tokens at 8k; see the offline-resources notes).
DEFAULT_CHARS_PER_TOKEN = 4.0
KEYS = (
    "train.max_steps, train.global_batch_size or model.seq_len, a larger data config (or a source's max_files), "
    "or data.max_epochs"
)


@dataclass
class Budget:
    planned: int
    available: int | None
    where: str  # what `available` was read from
    exact: bool
    max_epochs: float

    @property
    def epochs(self) -> float | None:
        return self.planned / self.available if self.available else None

    def line(self) -> str:
        if self.available is None:
            return (
                f"data budget: {self.planned:,} tokens planned; the data size is unknown until {self.where}"
            )
        approx = "" if self.exact else "about "
        return (
            f"data budget: {self.planned:,} tokens planned, {approx}{self.available:,} training tokens in "
            f"{self.where}: {self.epochs:.2f} epochs (limit data.max_epochs {self.max_epochs:g})"
        )


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def available_tokens(
    cfg: Any, shards: Path = paths.SHARDS, corpus: Path = paths.CORPUS, tokenizer: Path = paths.TOKENIZER
) -> tuple[int | None, str, bool]:
    """(training tokens or None, where the number comes from, whether it is exact)."""
    cm = _json(corpus / "manifest.json")
    foreign = cm is not None and cm.get("name", cfg.data.name) != cfg.data.name
    if foreign:
        # data/ holds the corpus and shards another data config built: they say nothing about this one.
        cm = None
    if cfg.train.loader == "bytes":
        if cm is not None:
            return int(cm["splits"]["train"]["bytes"]), f"{corpus}/manifest.json", True
        train = corpus / "train.jsonl"
        if train.exists():  # no manifest (a hand-made corpus): the file size bounds the text bytes
            return train.stat().st_size, str(train), False
        return None, f"`enlace fetch` builds {corpus}", False
    sm = None if foreign else _json(shards / "manifest.json")
    if sm is not None:
        return int(sm["splits"]["train"]["tokens"]), f"{shards}/manifest.json", True
    if cm is not None:
        report = _json(tokenizer / "report.json") or {}
        cpt = (report.get("val") or {}).get("chars_per_token") or DEFAULT_CHARS_PER_TOKEN
        est = int(cm["splits"]["train"]["chars"] / cpt)
        return est, f"{corpus} (estimated at {cpt:.2f} chars/token)", False
    if cfg.data.estimated_tokens:
        # The config's own estimate (its comments say how it was made); exact numbers replace it once built.
        where = f"data config {cfg.data.name} (its estimated_tokens, an estimate until `enlace fetch` runs)"
        return cfg.data.estimated_tokens, where, False
    return None, f"`enlace fetch` builds {corpus}", False


def check_budget(cfg: Any, require_data: bool = False, **where: Path) -> Budget:
    """The budget; raises DataError when training would pass over the data more than data.max_epochs times,
    or (require_data, at a training start) when the data it needs is missing."""
    t, m = cfg.train, cfg.model
    planned = t.max_steps * t.global_batch_size * m.seq_len
    available, src, exact = available_tokens(cfg, **where)
    budget = Budget(planned, available, src, exact, cfg.data.max_epochs)
    if require_data and not exact:
        what = "corpus" if t.loader == "bytes" else "shards"
        build = "enlace fetch" if t.loader == "bytes" else "enlace fetch, enlace tokenize, enlace shard"
        folder = (
            where.get("corpus", paths.CORPUS) if t.loader == "bytes" else where.get("shards", paths.SHARDS)
        )
        if not (t.loader == "bytes" and available is not None):
            raise DataError(f"data budget: no {what} in {folder}; build them first ({build}, or dvc repro)")
    if budget.epochs is not None and budget.epochs > cfg.data.max_epochs:
        raise DataError(
            f"data budget: train.max_steps {t.max_steps} x train.global_batch_size {t.global_batch_size} x "
            f"model.seq_len {m.seq_len} = {planned:,} tokens, but {src} holds "
            f"{'' if exact else 'about '}{available:,} training tokens: {budget.epochs:.1f} epochs, more than "
            f"data.max_epochs {cfg.data.max_epochs:g}; change {KEYS}"
        )
    return budget
