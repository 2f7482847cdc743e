"""Checkpoint save and load: ENLACE's atomic, checksummed checkpoint vs a bare safetensors save/load.

Same tensors on both sides: tiny-50m's weights and its AdamW moments after one step. ENLACE's save also
hashes every file, fsyncs files and folder, renames the folder into place and writes the COMPLETE marker;
its load verifies every checksum. The bare side writes and reads the same safetensors files, nothing more.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from bench.common import alternate, goal_row, line, summary, write_result
from enlace.config import load_config
from enlace.model import Llama
from enlace.train.checkpoint import load_checkpoint, save_checkpoint
from enlace.train.optim import build_optimizer
from enlace.train.step import model_tensors, optimizer_tensors


def state(model_name: str) -> dict[str, dict[str, torch.Tensor]]:
    cfg = load_config("params.yaml", layers=("model", "train"), select={"model": model_name})
    torch.manual_seed(0)
    model = Llama(cfg.model)
    opt = build_optimizer(model, cfg.train.optimizer)
    x = torch.randint(0, cfg.model.vocab_size, (1, 33))
    model(x[:, :-1], targets=x[:, 1:]).loss.backward()
    opt.step()
    flat, _ = optimizer_tensors(opt)
    return {"model": model_tensors(model), "optimizer": flat}


def main() -> int:
    rounds = int(os.environ.get("BENCH_ROUNDS", 5))
    tensors = state(os.environ.get("BENCH_CKPT_MODEL", "tiny-50m"))
    nbytes = sum(t.numel() * t.element_size() for g in tensors.values() for t in g.values())
    root = Path(tempfile.mkdtemp(prefix="enlace-bench-ckpt-", dir=os.environ.get("BENCH_TMP")))
    step = iter(range(1, 10**6))
    try:

        def ours_save() -> None:
            save_checkpoint(root / "ours", next(step), tensors, {"bench": True}, keep_last=1)

        def bare_save() -> None:
            (root / "bare").mkdir(exist_ok=True)
            for group, ts in tensors.items():
                save_file(ts, str(root / "bare" / f"{group}.safetensors"))

        save = {
            k: summary(v)
            for k, v in alternate({"enlace": ours_save, "safetensors": bare_save}, rounds).items()
        }
        ours_dir = sorted((root / "ours").glob("step-*"))[-1]

        def ours_load() -> None:
            load_checkpoint(ours_dir)

        def bare_load() -> None:
            for group in tensors:
                load_file(str(root / "bare" / f"{group}.safetensors"))

        load = {
            k: summary(v)
            for k, v in alternate({"enlace": ours_load, "safetensors": bare_load}, rounds).items()
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"checkpoint of {nbytes / 2**20:.0f} MiB (weights + AdamW moments)")
    print(line("load", load["enlace"], load["safetensors"], "safetensors"))
    ratio = save["enlace"]["median_s"] / save["safetensors"]["median_s"]
    row = goal_row("checkpoint save, enlace time / bare time", "enlace atomic, checksummed", "bare safetensors save",
                   ratio, "<=", 1.3, note=f"{nbytes / 2**20:.0f} MiB, weights + AdamW moments")  # fmt: skip
    write_result("checkpoint", {"bytes": nbytes, "save": save, "load": load, "rows": [row]})
    print(
        line("save", save["enlace"], save["safetensors"], "safetensors")
        + f"; enlace/bare = {ratio:.2f}x (goal <= 1.3x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
