"""DVC experiments on the project's own pipeline: git holds the small results, DVC the heavy ones.

The end-to-end test copies dvc.yaml, .gitignore, .dvc/config and src/ into a temporary git repository,
with params.yaml selecting tiny layer files, and drives the real `dvc` and `enlace` commands.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
GIT = shutil.which("git")
pytestmark = pytest.mark.skipif(GIT is None or not (BIN / "dvc").exists(), reason="needs git and dvc")


def git_env() -> dict[str, str]:
    return {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
        "GIT_CONFIG_GLOBAL": os.devnull,
    }


def run(cwd: Path, *cmd: str, env: dict[str, str] | None = None) -> str:
    r = subprocess.run(cmd, cwd=cwd, env=env or git_env(), capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def dvc_outputs() -> list[tuple[str, bool]]:
    """(path, cached) for every out, metric and plot file that dvc.yaml declares."""
    found = []
    for stage in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].values():
        for kind in ("outs", "metrics", "plots"):
            for item in stage.get(kind, []):
                path, opts = (item, {}) if isinstance(item, str) else next(iter(item.items()))
                found.append((path, (opts or {}).get("cache", True)))
    return found


def test_git_tracks_small_results_and_ignores_cached_outputs(tmp_path):
    """`dvc exp show` and `dvc metrics diff` read cache: false files from git, so .gitignore must let
    them in; checkpoints, adapters and other run files must stay out of git."""
    run(tmp_path, "git", "init", "-q")
    shutil.copy(ROOT / ".gitignore", tmp_path / ".gitignore")

    def ignored(path: str) -> bool:
        r = subprocess.run(["git", "check-ignore", "-q", path], cwd=tmp_path, env=git_env())
        assert r.returncode in (0, 1), r
        return r.returncode == 0

    outputs = dvc_outputs()
    assert any(not cached for _, cached in outputs) and any(cached for _, cached in outputs)
    for path, cached in outputs:
        # A cached folder: a file inside it (git tracks files, not folders).
        probe = f"{path}/file.bin" if cached and "." not in Path(path).name else path
        assert ignored(probe) == cached, (
            f"{path} (cache: {cached}) is {'' if ignored(probe) else 'not '}ignored"
        )
    for path in ("dvc.lock", "params.yaml", "dvc.yaml", "configs/train/x.yaml"):
        assert not ignored(path), path
    for path in (
        "runs/pretrain/config.json",
        "runs/pretrain/previous/abc/metrics.json",
        "runs/smoke/.resume-check-x/checkpoints/step-1/model.safetensors",
        "runs/gpu-check.json",
        "data/corpus/train.jsonl",
    ):
        assert ignored(path), path


# --- end to end ------------------------------------------------------------------------------------

WORDS = (
    "el la los una casa perro ciudad río montaña libro mesa camino puerta ventana pueblo barco jardín "
    "grande pequeña antigua nueva roja verde mira tiene busca encuentra lleva abre cierra y de en con"
).split()
MODEL = {"n_layer": 1, "n_head": 2, "n_kv_head": 1, "d_model": 32, "seq_len": 32, "ffn_multiple_of": 16}
TRAIN = {
    "max_steps": 20,
    "micro_batch_size": 4,
    "global_batch_size": 4,
    "optimizer": {"lr": 0.01},
    "schedule": {"warmup_steps": 2, "decay_steps": 5},
    "checkpoint": {"every": 10},
    "log_every": 5,
    "eval_batches": 2,
}


def tiny_project(repo: Path) -> None:
    """The project's pipeline files and code, with params.yaml selecting tiny layers and a local corpus."""
    for f in ("dvc.yaml", ".gitignore", ".dvcignore", ".dvc/config", ".dvc/.gitignore"):
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / f, repo / f)
    shutil.copytree(ROOT / "src/enlace", repo / "src/enlace", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "assets", repo / "assets")
    shutil.copytree(ROOT / "configs/finetune", repo / "configs/finetune")  # dvc.yaml names its layer
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["config"].update(hardware="cpu", model="tiny", train="tiny", data="tiny")
    params["smoke"] = {"model": "smoke-tiny", "train": "smoke-tiny"}
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False, allow_unicode=True))

    def layer(rel: str, data: dict[str, Any]) -> None:
        (repo / "configs" / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / "configs" / rel).write_text(yaml.safe_dump(data, sort_keys=False))

    hw = yaml.safe_load((ROOT / "configs/hardware/cpu.yaml").read_text())
    layer("hardware/cpu.yaml", {**hw, "num_threads": 1})
    layer("data/tiny.yaml", {
        "name": "tiny", "val_fraction": 0.1, "cleaning": {"min_doc_chars": 100},
        "sources": [{"name": "gen", "kind": "local", "path": "corpus-src"}],
        "tokenizer": {"type": "bpe", "vocab_size": 320, "num_threads": 1},
        "shard": {"tokens_per_shard": 5000, "num_workers": 1},
    })  # fmt: skip
    layer("model/tiny.yaml", {"name": "tiny", "vocab_size": 320, **MODEL})
    layer("model/smoke-tiny.yaml", {"name": "smoke-tiny", "vocab_size": 256, **MODEL})
    layer("train/tiny.yaml", {"name": "tiny", **TRAIN})
    layer("train/tiny-long.yaml", {"name": "tiny-long", **TRAIN, "max_steps": 30})
    layer(
        "train/smoke-tiny.yaml", {"name": "smoke-tiny", "loader": "bytes", **TRAIN, "optimizer": {"lr": 0.02}}
    )
    rng = random.Random(0)
    src = repo / "corpus-src"
    src.mkdir()
    for i in range(60):
        paras = [" ".join(rng.choice(WORDS) for _ in range(60)) + "." for _ in range(3)]
        (src / f"doc{i:02d}.txt").write_text("\n\n".join(paras), encoding="utf-8")


def experiments(show: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """`dvc exp show --json` -> {name: {"params": ..., "metrics": ...}} for the baseline and its experiments."""
    out = {}
    for base in show:
        if base["rev"] == "workspace":
            continue
        revs = [base] + [r for exp in base.get("experiments") or [] for r in exp["revs"]]
        for r in revs:
            data = r["data"]
            out[r.get("name") or r["rev"]] = {
                "params": {f: v["data"] for f, v in (data.get("params") or {}).items()},
                "metrics": {f: v.get("data") for f, v in (data.get("metrics") or {}).items()},
            }
    return out


@pytest.mark.slow
@pytest.mark.dvc
def test_dvc_experiments_compare_runs_and_a_clone_pulls_clean(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    tiny_project(repo)
    env = {
        **git_env(),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(repo / "src"),  # the stages run the copied code, which dvc.yaml hashes
        "DVC_NO_ANALYTICS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
    }

    def sh(*cmd: str, cwd: Path = repo) -> str:
        return run(cwd, *cmd, env=env)

    sh("git", "init", "-q")
    # What `dvc remote add -d store DIR` writes (one dvc process less): a default remote in a folder.
    config = (repo / ".dvc/config").read_text()
    assert "[core]\n" in config
    config = config.replace("[core]\n", "[core]\n    remote = store\n", 1)
    (repo / ".dvc/config").write_text(config + f"['remote \"store\"']\n    url = {tmp_path / 'remote'}\n")
    sh("dvc", "repro", "pretrain")
    # The baseline commit: dvc.lock and the small results go to git, checkpoints and data do not.
    sh("git", "add", "-A")
    tracked = set(sh("git", "diff", "--cached", "--name-only").split())
    assert {
        "dvc.lock",
        "runs/pretrain/metrics.json",
        "runs/pretrain/curves.csv",
        "runs/smoke/metrics.json",
    } <= tracked
    assert not [p for p in tracked if p.startswith("data/") or "/checkpoints/" in p], tracked
    sh("git", "commit", "-qm", "baseline")
    sh("dvc", "push", "-q")

    # A new clone plus `dvc pull` is up to date: nothing would re-run.
    sh("git", "clone", "-q", str(repo), str(tmp_path / "clone"), cwd=tmp_path)
    sh("dvc", "pull", "--with-deps", "pretrain", cwd=tmp_path / "clone")
    status = sh("dvc", "status", "pretrain", "--json", cwd=tmp_path / "clone")
    assert json.loads(status) == {}, status

    # One experiment, both kinds of -S: switch a params.yaml selector to another layer file, and set a key
    # inside that file (30 steps there, 40 once the key is applied).
    sh("dvc", "exp", "run", "pretrain", "-n", "longer", "-S", "config.train=tiny-long",
       "-S", "configs/train/tiny-long.yaml:max_steps=40")  # fmt: skip
    exps = experiments(json.loads(sh("dvc", "exp", "show", "--json")))
    assert len(exps) == 2 and "longer" in exps, list(exps)
    base = next(k for k in exps if k != "longer")
    steps = {k: exps[k]["metrics"]["runs/pretrain/metrics.json"]["steps"] for k in exps}
    assert steps == {base: 20, "longer": 40}, steps
    assert exps[base]["params"]["params.yaml"]["config"]["train"] == "tiny"
    assert exps["longer"]["params"]["params.yaml"]["config"]["train"] == "tiny-long"
    assert exps["longer"]["params"]["configs/train/tiny-long.yaml"]["max_steps"] == 40
    assert exps[base]["metrics"]["runs/smoke/metrics.json"]["steps"] == 20  # git-tracked, so not "!"

    # The workspace holds the last experiment: metrics and plots diff against the baseline commit.
    diff = json.loads(sh("dvc", "metrics", "diff", "HEAD", "--json"))["runs/pretrain/metrics.json"]
    assert diff["steps"] == {"old": 20, "new": 40, "diff": 20}
    assert diff["final_train_loss"]["old"] != diff["final_train_loss"]["new"]
    plots = json.loads(sh("dvc", "plots", "diff", "HEAD", "--json"))["data"]["runs/pretrain/curves.csv"]
    points = plots[0]["content"]["data"]["values"]
    assert {p["rev"] for p in points} == {"HEAD", "workspace"}
    assert max(int(p["step"]) for p in points if p["rev"] == "workspace") == 40
