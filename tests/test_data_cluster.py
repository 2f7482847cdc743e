"""The cluster executors build the same pipeline objects as the local one. Slurm runs through datatrove's
real SlurmPipelineExecutor (sbatch script, pickled executor, launch_pickled_pipeline per array task) with
stand-ins for sbatch and srun (tests/fake_slurm) that run each job on this machine as it is submitted."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
from test_data_pipeline import data_config, make_text_source

from enlace.data.corpus import build_corpus
from enlace.errors import DataError

FAKE_SLURM = Path(__file__).resolve().parent / "fake_slurm"
SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.mark.slow  # over 15 s on 2 busy cores (pytest --durations)
def test_slurm_executor_gives_the_local_corpus(tmp_path, monkeypatch):
    src = make_text_source(tmp_path / "src", 24, seed=3)
    sources = [{"name": "gen", "kind": "local", "path": str(src)}]
    # Near-dedup off: its 16 extra jobs (one Python start each) would only repeat the local path's steps.
    cleaning = {"min_doc_chars": 100, "near_dedup": False}
    local = data_config(sources, cleaning=cleaning)
    build_corpus(local, "h", tmp_path / "raw1", tmp_path / "c1", None, workers=2, tasks=2)
    logs = tmp_path / "slurm-logs"
    slurm = data_config(
        sources,
        cleaning=cleaning,
        executor={"kind": "slurm", "tasks": 2, "logging_dir": str(logs), "slurm": {"partition": "p"}},
    )
    # The jobs run `launch_pickled_pipeline` (datatrove's, beside this python) and unpickle our steps.
    monkeypatch.setenv(
        "PATH", f"{FAKE_SLURM}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    )
    monkeypatch.setenv("PYTHONPATH", f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    assert build_corpus(slurm, "h", tmp_path / "raw2", tmp_path / "c2", None) == {}  # submitted, not run here
    for name in ("train.jsonl", "val.jsonl", "manifest.json"):
        assert (tmp_path / "c1" / name).read_bytes() == (tmp_path / "c2" / name).read_bytes()
    script = (logs / "fetch" / "extract" / "launch_script.slurm").read_text()
    assert "#SBATCH --array=0-1" in script and "#SBATCH --partition=p" in script
    assert (logs / "fetch" / "split" / "launch_script.slurm").exists()


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="ray is installed")
def test_ray_without_ray_is_a_one_line_error(tmp_path):
    src = make_text_source(tmp_path / "src", 4)
    data = data_config(
        [{"name": "gen", "kind": "local", "path": str(src)}],
        executor={"kind": "ray", "logging_dir": str(tmp_path / "logs")},
    )
    with pytest.raises(DataError, match="data.executor.kind ray needs the ray package"):
        build_corpus(data, "h", tmp_path / "raw", tmp_path / "c", None)


def test_ray_executors_chain_our_stages(tmp_path):
    """datatrove builds Ray executors without ray installed: each stage's executor holds our steps and
    depends on the previous stage (run() would need ray and a cluster)."""
    from datatrove.executor import RayPipelineExecutor

    from enlace.data.corpus import corpus_stages, work_items
    from enlace.data.engine import cluster_executors
    from enlace.data.pipeline_steps import ExtractClean, Finalize, MinhashFiles

    src = make_text_source(tmp_path / "src", 4)
    data = data_config(
        [{"name": "gen", "kind": "local", "path": str(src)}], executor={"kind": "ray", "tasks": 3}
    )
    items = work_items(data, {"gen": src})
    extract, rest = corpus_stages(data, items, tmp_path / "work", tmp_path / "out", "h")
    executors = cluster_executors(extract + rest, data.executor, tmp_path / "logs")
    assert all(isinstance(e, RayPipelineExecutor) for e in executors)
    assert [e.depends for e in executors] == [None, *executors[:-1]]
    assert [e.tasks for e in executors] == [3, 1, 3, 14, 1, 1]
    steps = [type(step) for e in executors for step in e.pipeline]
    assert ExtractClean in steps and MinhashFiles in steps and Finalize in steps


def test_ray_executor_gives_the_local_corpus_and_shards(tmp_path, monkeypatch):
    """datatrove's RayPipelineExecutor on a local Ray instance (2 CPUs): the same corpus and shards, byte for
    byte, as the local executor. Runs where ray is installed (`pip install ray`)."""
    ray = pytest.importorskip("ray")
    from enlace.config.data import ExecutorConfig, TokenizerConfig
    from enlace.data.shard import build_shards
    from enlace.data.tokenize import build_tokenizer

    src = make_text_source(tmp_path / "src", 24, seed=5)
    sources = [{"name": "gen", "kind": "local", "path": str(src)}]
    local = data_config(sources)
    build_corpus(local, "h", tmp_path / "raw1", tmp_path / "c1", None, workers=2, tasks=2)
    build_tokenizer(
        TokenizerConfig(type="bpe", vocab_size=300, num_threads=1), tmp_path / "c1", tmp_path / "tok"
    )
    build_shards(tmp_path / "c1", tmp_path / "tok", tmp_path / "s1", "uint16", 300, 4000, tasks=2)
    # The Ray workers unpickle our steps: they import enlace from the source tree.
    monkeypatch.setenv("PYTHONPATH", f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        executor = {"kind": "ray", "tasks": 2, "logging_dir": str(tmp_path / "logs")}
        ray_cfg = data_config(sources, executor=executor)
        # Ray's run() blocks until the chained stages are done: the corpus is complete on return.
        build_corpus(ray_cfg, "h", tmp_path / "raw2", tmp_path / "c2", None)
        for name in ("train.jsonl", "val.jsonl", "manifest.json"):
            assert (tmp_path / "c1" / name).read_bytes() == (tmp_path / "c2" / name).read_bytes()
        manifest = build_shards(
            tmp_path / "c2",
            tmp_path / "tok",
            tmp_path / "s2",
            "uint16",
            300,
            4000,
            executor=ExecutorConfig.model_validate(executor),
        )
        assert manifest, "the Ray encoding finished inside run(): the shards are assembled in the same call"
    finally:
        ray.shutdown()
    files = sorted(p.name for p in (tmp_path / "s1").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "s2").iterdir())
    for name in files:
        assert (tmp_path / "s1" / name).read_bytes() == (tmp_path / "s2" / name).read_bytes()
