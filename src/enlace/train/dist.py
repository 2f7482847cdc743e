"""torchrun / DDP helpers. Without WORLD_SIZE > 1 in the environment everything is a single-process no-op."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_rank() -> int:
    """This process's rank as torchrun set it, before the process group is joined (0 when alone)."""
    return int(os.environ.get("RANK", "0")) if env_world_size() > 1 else 0


def init_distributed(device_type: str, planned_world_size: int) -> DistInfo:
    """Join the process group torchrun set up; refuse a world size the config did not plan for."""
    world = env_world_size()
    if world != planned_world_size:
        raise ConfigError(
            "train config",
            "train.world_size",
            f"the config plans for {planned_world_size} process(es) but WORLD_SIZE is {world}; "
            f"set train.world_size={world} (and grad_accum_steps so the global batch still adds up) "
            f"or launch {planned_world_size} process(es)",
        )
    if world == 1:
        return DistInfo()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world)


def cleanup(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def gather_objects(info: DistInfo, obj: Any) -> list[Any]:
    """Every rank's obj, in rank order, on every rank (small JSON-able objects such as RNG states)."""
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def mean_across(info: DistInfo, t: torch.Tensor) -> torch.Tensor:
    if not info.enabled:
        return t
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / info.world_size


def any_across(info: DistInfo, flag: bool, device: torch.device) -> bool:
    """True on every rank if it is true on any: ranks must agree on when to stop, or they deadlock."""
    if not info.enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)
