"""Test support: a tiny in-memory byte loader with the real loaders' API, tiny configs, and a subprocess
entry point (`python -m enlace.train.testing`) so tests can kill a training process mid-run.

Not used by any stage; it lets the trainer's tests run without a corpus and in a second or two.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

from ..config.resolve import LAYERS, Config, _set_dotted
from ..errors import DataError, EnlaceError

WORDS = (
    "el la de que y en un una los las por con para se no es su al lo como más pero sus le ya o este "
    "sí porque esta entre cuando muy sin sobre también me hasta hay donde quien desde todo nos durante "
    "casa ciudad río sol mar tiempo día noche agua tierra vida mundo hombre mujer niño libro camino"
).split()


def synthetic_text(n_bytes: int = 60_000, seed: int = 0) -> bytes:
    """Pseudo-Spanish with repeated structure, so a tiny model's loss visibly falls."""
    g = torch.Generator().manual_seed(seed)
    out: list[str] = []
    size = 0
    while size < n_bytes:
        k = int(torch.randint(4, 12, (1,), generator=g))
        idx = torch.randint(0, len(WORDS), (k,), generator=g).tolist()
        sentence = " ".join(WORDS[i] for i in idx).capitalize() + ". "
        out.append(sentence)
        size += len(sentence.encode())
    return "".join(out).encode()[:n_bytes]


class SyntheticLoader:
    """Random windows of a byte string; batch rows are a pure function of (seed, step, row)."""

    def __init__(
        self,
        data: bytes,
        split: str,
        seq_len: int,
        micro_batch_size: int,
        global_batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ):
        cut = int(len(data) * 0.9)
        self.data = torch.tensor(list(data[:cut] if split == "train" else data[cut:]), dtype=torch.long)
        self.split, self.seq_len, self.seed = split, seq_len, seed
        self.micro, self.global_batch = micro_batch_size, global_batch_size
        self.rank, self.world_size = rank, world_size
        self.accum = global_batch_size // (micro_batch_size * world_size)
        self.fingerprint = hashlib.sha256(bytes(data)).hexdigest()[:16]

    def _rows(self, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = offsets[:, None] + torch.arange(self.seq_len + 1)[None, :]
        w = self.data[idx]
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def get_batch(self, step: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        offsets = torch.randint(0, len(self.data) - self.seq_len - 1, (self.global_batch,), generator=g)
        start = (self.rank * self.accum + micro_step) * self.micro
        return self._rows(offsets[start : start + self.micro])

    def val_windows(self, n: int):
        from ..eval.score import spread_windows
        from ..eval.token_bytes import TokenBytes

        return spread_windows(self.data.numpy(), self.seq_len, n, TokenBytes.raw_bytes())

    def state_dict(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "split": self.split,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d != self.state_dict():
            raise DataError(f"loader state mismatch: checkpoint has {d}, loader is {self.state_dict()}")


TINY = {
    "hardware": {"name": "cpu", "device": "cpu", "dtype": "fp32", "num_threads": 1, "deterministic": True},
    "model": {
        "name": "tiny",
        "vocab_size": 256,
        "n_layer": 2,
        "n_head": 4,
        "n_kv_head": 2,
        "d_model": 32,
        "seq_len": 32,
        "ffn_multiple_of": 16,
        "qk_norm": True,
        "z_loss_weight": 1e-4,
    },
    "train": {
        "name": "tiny",
        "loader": "bytes",
        "max_steps": 8,
        "micro_batch_size": 4,
        "grad_accum_steps": 2,
        "global_batch_size": 8,
        "optimizer": {"lr": 3e-3, "weight_decay": 0.1},
        "schedule": {"warmup_steps": 2, "decay_steps": 3, "decay_shape": "1-sqrt"},
        "checkpoint": {"every": 2, "keep_last": 3},
        "log_every": 1,
        "eval_every": 0,
        "eval_batches": 2,
    },
    "data": {"name": "synthetic", "sources": []},
}


def tiny_dict(overrides: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    d = json.loads(json.dumps(TINY))
    for key, value in (overrides or {}).items():
        section, rest = key.split(".", 1)
        _set_dotted(d[section], rest, value)
    return d


def config_from_dict(d: dict[str, dict[str, Any]]) -> Config:
    return Config(layers={k: LAYERS[k].model_validate(v) for k, v in d.items()}, provenance={}, files={})


def tiny_config(overrides: dict[str, Any] | None = None) -> Config:
    """The tiny test config with dotted overrides, e.g. {"train.max_steps": 12}."""
    return config_from_dict(tiny_dict(overrides))


def loaders_for(cfg: Config, rank: int = 0, world_size: int = 1, text: bytes | None = None):
    t = cfg.train
    data = text if text is not None else synthetic_text()
    args = (cfg.model.seq_len, t.micro_batch_size, t.global_batch_size, t.seed, rank, world_size)
    return SyntheticLoader(data, "train", *args), SyntheticLoader(data, "val", *args)


def main(argv: list[str] | None = None) -> int:
    """Train a tiny config in this process: `python -m enlace.train.testing CONFIG.json RUN_DIR`."""
    import os

    from .dist import cleanup, init_distributed
    from .trainer import train

    p = argparse.ArgumentParser()
    p.add_argument("config", type=Path)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--stop-after", type=int, default=None)
    a = p.parse_args(argv)
    cfg = config_from_dict(json.loads(a.config.read_text()))
    try:
        info = init_distributed(cfg.hardware.device, cfg.train.world_size)
        rank, world = info.rank, info.world_size
        tr, va = loaders_for(cfg, rank, world)
        result = train(cfg, a.run_dir, loader=tr, val_loader=va, stop_after=a.stop_after, progress=False)
    except EnlaceError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"step": result.step, "interrupted": result.interrupted}), flush=True)
    cleanup(info)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())


def write_config(d: dict[str, dict[str, Any]], path: Path) -> Path:
    path.write_text(json.dumps(d), encoding="utf-8")
    return path


def spawn_trainer(
    config_json: Path,
    run_dir: Path,
    env: dict[str, str] | None = None,
    stop_after: int | None = None,
    nproc: int = 1,
    port: int | None = None,
):
    """Start `python -m enlace.train.testing` (under torchrun when nproc > 1) as a subprocess."""
    import os
    import subprocess

    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={port}", "-m"]
    else:
        cmd += ["-m"]
    cmd += ["enlace.train.testing", str(config_json), str(run_dir)]
    if stop_after is not None:
        cmd += ["--stop-after", str(stop_after)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkpoint_digests(ckpt: Path) -> dict[str, str]:
    from .checkpoint import sha256_file

    return {p.name: sha256_file(p) for p in sorted(Path(ckpt).iterdir()) if p.is_file()}


def logged_losses(run_dir: Path) -> list[tuple[int, float]]:
    from .metrics import read_jsonl

    return [(r["step"], r["loss"]) for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "loss" in r]
