"""Run the data stages on datatrove's executors: the same pipeline code on one machine or a cluster.

A stage is a list of datatrove pipeline steps and a task count. `run_stages` runs them in order with
`LocalPipelineExecutor` (tasks x workers on this machine), or submits them, chained by `depends`, to
`SlurmPipelineExecutor` or `RayPipelineExecutor`. Our steps split their work by file or by fixed-size unit
(never by task), so the outputs do not depend on the task count.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.data import ExecutorConfig
from ..errors import DataError


@dataclass
class Stage:
    name: str
    pipeline: list[Any]
    tasks: int = 1  # 1 for the stages that must see the whole stream in order


def _local(stage: Stage, cfg: ExecutorConfig, logs: Path) -> Any:
    from datatrove.executor import LocalPipelineExecutor

    workers = cfg.workers or min(stage.tasks, os.cpu_count() or 1)
    # skip_completed=False: resuming is done per file by our steps, which know when an input changed;
    # datatrove's per-task completion markers would skip a task whose inputs are new.
    return LocalPipelineExecutor(
        pipeline=stage.pipeline,
        tasks=stage.tasks,
        workers=min(workers, stage.tasks),
        logging_dir=str(logs / stage.name),
        skip_completed=False,
        start_method="fork",
    )


def _cluster(stage: Stage, cfg: ExecutorConfig, logs: Path, depends: Any) -> Any:
    if cfg.kind == "slurm":
        from datatrove.executor import SlurmPipelineExecutor

        opts: dict[str, Any] = {"time": "24:00:00", "partition": "default", **cfg.slurm}
        return SlurmPipelineExecutor(
            pipeline=stage.pipeline,
            tasks=stage.tasks,
            job_name=f"enlace-{stage.name}",
            logging_dir=str(logs / stage.name),
            depends=depends,
            skip_completed=False,
            **opts,
        )
    from datatrove.executor import RayPipelineExecutor

    return RayPipelineExecutor(
        pipeline=stage.pipeline,
        tasks=stage.tasks,
        logging_dir=str(logs / stage.name),
        depends=depends,
        skip_completed=False,
    )


def run_stages(stages: list[Stage], cfg: ExecutorConfig, logs: Path) -> bool:
    """Run the stages in order. True when they have finished on return (local, Ray); False when they were
    submitted to Slurm and finish later."""
    logs = Path(logs)
    if cfg.kind == "local":
        shutil.rmtree(logs, ignore_errors=True)  # task logs of a previous run would read as this run's
        for stage in stages:
            _local(stage, cfg, logs).run()
        return True
    # datatrove's Ray executor imports without ray and fails at run() with a traceback.
    if cfg.kind == "ray" and importlib.util.find_spec("ray") is None:
        raise DataError("data.executor.kind ray needs the ray package (pip install ray)")
    # Runs the last stage, which first runs the one it depends on, and so on back to the first. Slurm's
    # run() submits the chained jobs and returns; Ray's waits for every task.
    cluster_executors(stages, cfg, logs)[-1].run()
    return cfg.kind == "ray"


def cluster_executors(stages: list[Stage], cfg: ExecutorConfig, logs: Path) -> list[Any]:
    """One Slurm or Ray executor per stage, each depending on the one before (nothing is submitted)."""
    out: list[Any] = []
    for stage in stages:
        out.append(_cluster(stage, cfg, Path(logs), out[-1] if out else None))
    return out
