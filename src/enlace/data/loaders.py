"""Batch loaders: `ByteLoader` (raw corpus bytes, smoke stage) and `ShardLoader` (token shards).

`get_batch(step, micro_step)` is a pure function of (seed, step, micro_step, rank, world_size): the global
batch's window offsets come from PCG64([seed, step]), and rank r at micro-step m takes rows
(r * accum + m) * micro_batch_size onwards. One process with accum 2 therefore sees exactly the rows that two
ranks with accum 1 see, and a resumed run sees the batches it would have seen.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import paths
from ..errors import DataError
from ..io import iter_jsonl, sha256_file
from ..scoring.token_bytes import TokenBytes

if TYPE_CHECKING:
    from ..scoring.score import Windows


class _Tokens:
    """Several 1-D arrays seen as one: windows may cross a shard boundary."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = [p for p in parts if p.size]
        self.starts = np.cumsum([0] + [p.size for p in self.parts])
        self.size = int(self.starts[-1])

    def window(self, start: int, length: int) -> np.ndarray:
        if len(self.parts) == 1:
            return self.parts[0][start : start + length]
        i = int(np.searchsorted(self.starts, start, side="right") - 1)
        off = start - int(self.starts[i])
        piece = self.parts[i][off : off + length]
        if piece.size == length:
            return piece
        rest = [piece]
        got = piece.size
        while got < length:
            i += 1
            take = self.parts[i][: length - got]
            rest.append(take)
            got += take.size
        return np.concatenate(rest)


class _Loader:
    kind = "base"

    def __init__(
        self,
        path_or_dir: str | Path,
        split: str,
        seq_len: int,
        micro_batch_size: int,
        global_batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ):
        if split not in ("train", "val"):
            raise DataError(f"split must be 'train' or 'val', got {split!r}")
        if global_batch_size % (micro_batch_size * world_size):
            raise DataError(
                f"global_batch_size {global_batch_size} is not a multiple of micro_batch_size {micro_batch_size} "
                f"x world_size {world_size}"
            )
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside world_size {world_size}")
        self.root = Path(path_or_dir)
        self.split, self.seq_len = split, seq_len
        self.micro_batch_size, self.global_batch_size = micro_batch_size, global_batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.accum = global_batch_size // (micro_batch_size * world_size)
        self._data: dict[str, _Tokens] = {}

    # Subclasses: the tokens of a split, and the fingerprint of the whole data set.
    def _open(self, split: str) -> _Tokens:
        raise NotImplementedError

    @property
    def fingerprint(self) -> str:
        raise NotImplementedError

    def token_bytes(self) -> TokenBytes:
        """UTF-8 bytes per token id: the denominator of bits per byte."""
        raise NotImplementedError

    def tokens(self, split: str | None = None) -> _Tokens:
        split = split or self.split
        if split not in self._data:
            data = self._open(split)
            if data.size < self.seq_len + 1:
                raise DataError(
                    f"{self.root}: the {split} split has {data.size} tokens, fewer than seq_len + 1 = {self.seq_len + 1}"
                )
            self._data[split] = data
        return self._data[split]

    def __len__(self) -> int:
        return self.tokens().size

    def _rows(self, data: _Tokens, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        block = np.stack([data.window(int(s), self.seq_len + 1) for s in starts]).astype(np.int64)
        t = torch.from_numpy(block)
        return t[:, :-1], t[:, 1:]

    def offsets(self, step: int) -> np.ndarray:
        """The global batch's window starts for `step` (the same on every rank)."""
        data = self.tokens()
        rng = np.random.Generator(np.random.PCG64([self.seed, step]))
        return rng.integers(0, data.size - self.seq_len, size=self.global_batch_size)

    def get_batch(self, step: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= micro_step < self.accum:
            raise DataError(
                f"micro_step {micro_step} is outside 0..{self.accum - 1} (grad accumulation steps)"
            )
        first = (self.rank * self.accum + micro_step) * self.micro_batch_size
        starts = self.offsets(step)[first : first + self.micro_batch_size]
        return self._rows(self.tokens(), starts)

    def val_windows(self, n: int) -> Windows:
        """n windows of seq_len targets spread evenly over the whole val split (all of it when n covers
        it), with the UTF-8 bytes their targets stand for. The same for every rank and every call."""
        from ..scoring.score import spread_windows

        data = self.tokens("val")
        return spread_windows(data, self.seq_len, n, self.token_bytes())

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "fingerprint": self.fingerprint,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "micro_batch_size": self.micro_batch_size,
            "global_batch_size": self.global_batch_size,
            "world_size": self.world_size,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Resuming on other data or another batch geometry would silently change the run: refuse."""
        mine = self.state_dict()
        diffs = [f"{k}: checkpoint {d.get(k)!r}, now {v!r}" for k, v in mine.items() if d.get(k) != v]
        if diffs:
            raise DataError(f"{self.root}: the data loader differs from the checkpoint's: {'; '.join(diffs)}")


class ByteLoader(_Loader):
    """UTF-8 bytes of a corpus split's documents joined with blank lines; vocab 256."""

    kind = "bytes"

    def _manifest_bytes(self) -> bytes | None:
        m = self.root / "manifest.json"
        return m.read_bytes() if m.exists() else None

    @property
    def fingerprint(self) -> str:
        if not hasattr(self, "_fp"):
            blob = self._manifest_bytes()
            if blob is None:
                h = hashlib.sha256()
                for split in ("train", "val"):
                    p = self.root / f"{split}.jsonl"
                    h.update(sha256_file(p).encode() if p.exists() else b"-")
                self._fp = h.hexdigest()
            else:
                self._fp = hashlib.sha256(blob).hexdigest()
        return self._fp

    def token_bytes(self) -> TokenBytes:
        return TokenBytes.raw_bytes()

    def _open(self, split: str) -> _Tokens:
        src = self.root / f"{split}.jsonl"
        if not src.exists():
            raise DataError(f"{src}: not found; run `enlace fetch` first")
        # Held in memory (the default corpus is 18 MB): a cache file next to the corpus would modify the
        # fetch stage's DVC output and make every `dvc repro` re-run the pipeline from the start.
        texts = []
        for lineno, row in iter_jsonl(src):
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise DataError(
                    f"{src}:{lineno}: not a corpus line (expected an object with a 'text' string)"
                )
            texts.append(row["text"])
        data = np.frombuffer("\n\n".join(texts).encode("utf-8"), dtype=np.uint8)
        return _Tokens([data] if data.size else [])


class ShardLoader(_Loader):
    """Token shards from `enlace shard`, memory-mapped; every shard is checked against the manifest."""

    kind = "shards"

    def __init__(self, *args: Any, verify: bool = True, **kw: Any):
        super().__init__(*args, **kw)
        self.verify = verify
        path = self.root / "manifest.json"
        if not path.exists():
            raise DataError(f"{path}: not found; the shards are missing or incomplete (run `enlace shard`)")
        self._manifest_blob = path.read_bytes()
        try:
            self.manifest = json.loads(self._manifest_blob)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON: {e}") from None
        self.dtype = np.dtype(self.manifest["dtype"])
        self.vocab_size = int(self.manifest["vocab_size"])

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self._manifest_blob).hexdigest()

    def token_bytes(self) -> TokenBytes:
        """From the tokenizer that encoded the shards (data/tokenizer beside data/shards), checked by sha256."""
        path = self.root.parent / "tokenizer" / "tokenizer.model"
        if not path.exists():
            raise DataError(f"{path}: not found; bits per byte needs the tokenizer of {self.root}")
        expected = self.manifest.get("tokenizer_sha256")
        if expected and sha256_file(path) != expected:
            raise DataError(
                f"{path}: not the tokenizer that encoded {self.root} (sha256 differs from the manifest)"
            )
        return TokenBytes.sentencepiece(path)

    def _open(self, split: str) -> _Tokens:
        parts = []
        for shard in self.manifest["splits"][split]["shards"]:
            p = self.root / shard["file"]
            if not p.exists():
                raise DataError(f"{p}: shard listed in the manifest is missing")
            expected = shard["tokens"] * self.dtype.itemsize
            actual = p.stat().st_size
            if actual != expected:
                raise DataError(
                    f"{p}: shard size is {actual} bytes, expected {expected} ({shard['tokens']} tokens); truncated or altered"
                )
            if self.verify:
                digest = sha256_file(p)
                if digest != shard["sha256"]:
                    raise DataError(
                        f"{p}: shard checksum mismatch: expected sha256 {shard['sha256']}, got {digest}"
                    )
            parts.append(np.memmap(p, dtype=self.dtype, mode="r"))
        return _Tokens(parts)


def make_loader(cfg: Any, split: str, rank: int = 0, world_size: int | None = None) -> _Loader:
    """The loader cfg.train.loader names: "bytes" over data/corpus, "shards" over data/shards."""
    t = cfg.train
    cls = ByteLoader if t.loader == "bytes" else ShardLoader
    root = paths.CORPUS if t.loader == "bytes" else paths.SHARDS
    return cls(
        root,
        split,
        cfg.model.seq_len,
        t.micro_batch_size,
        t.global_batch_size,
        t.seed,
        rank,
        world_size if world_size is not None else t.world_size,
    )
