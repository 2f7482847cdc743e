"""Run an ablation: calibrate each variant, train it for the budget, score it, decide the second seeds.

Each run is `enlace pretrain` of the variant's config in a fresh process (worker.py), with max_steps and
the schedule fitted to the budget (fit.py). A run still going at its budget gets SIGTERM, which the
trainer answers by saving a checkpoint; the row then says so (its decay did not finish). Scoring is the
eval stage's own: validation and the prose yardstick by `score_model_dir`, as `enlace eval --model-dir`;
the minimal pairs and continuations as `make bench-es` scores them (bench_bases, on the exported run;
a variant no exported architecture has, such as value embeddings, is scored by ENLACE's own decoder in
fp32 with the same tokenizer).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import paths
from ..config import Config, load_config
from ..errors import EnlaceError, UnsupportedModelError
from ..estimate import train_flops_per_token
from ..eval.bench_bases import Entry, choice_metrics, load
from ..eval.bench_es import go_offline
from ..eval.evaluate import read_prose, score_model_dir
from ..export import export_run, run_bundle
from ..hf.arch import for_config
from ..load import load_trained_model
from ..model import Llama
from ..peak import PEAK_DTYPES, matmul_peak_gflops, mfu, peak_update
from ..runtime import CPUINFO, resolve_run, setup_runtime
from ..train.checkpoint import latest_checkpoint
from ..train.metrics import read_jsonl
from .fit import Calibration, calibration_overrides, fitted_steps, schedule_overrides, step_seconds
from .spec import BASELINE, AblationSpec

SIGTERM_GRACE_S = 300  # time a stopped run gets to write its checkpoint before SIGKILL


class AblationError(EnlaceError):
    """A variant's run failed: the message names it and its log."""


@dataclass(frozen=True)
class Selection:
    """What every run resolves its config from, as on the command line."""

    params: str
    select: dict[str, str]  # --hardware/--model/--train/--data
    overrides: list[str]  # --set: after the file's `set`, before the variant's own

    def sets(self, spec: AblationSpec, overrides: list[str]) -> list[str]:
        return [*spec.set, *self.overrides, *overrides]

    def config(self, spec: AblationSpec, overrides: list[str]) -> Config:
        return load_config(
            self.params, select=self.select, overrides=self.sets(spec, overrides), stage=spec.stage
        )

    def worker_args(self, spec: AblationSpec, overrides: list[str]) -> list[str]:
        args = ["--params", self.params]
        args += ["--stage", spec.stage] if spec.stage else []
        for layer, name in self.select.items():
            args += ["--select", f"{layer}={name}"]
        for o in self.sets(spec, overrides):
            args += ["--set", o]
        return args


def as_sets(d: dict[str, Any]) -> list[str]:
    return [f"{k}={v}" for k, v in d.items()]


def train_run(
    sel: Selection, spec: AblationSpec, overrides: list[str], run_dir: Path, limit_s: float | None
) -> tuple[float, int, bool]:
    """`enlace pretrain` in its own process; (wall seconds, exit status, whether it got SIGTERM at the limit)."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.parent / f"{run_dir.name}.log"
    cmd = [sys.executable, "-m", "enlace.ablate.worker", *sel.worker_args(spec, overrides), str(run_dir)]
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        stopped = False
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            stopped = True
            proc.send_signal(signal.SIGTERM)  # the trainer saves a checkpoint and exits 143
            try:
                proc.wait(timeout=SIGTERM_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        except BaseException:
            proc.kill()  # the harness itself was interrupted: take the run down with it
            proc.wait()
            raise
    wall = time.perf_counter() - t0
    # Stopped at the budget, a run exits 143 after saving, or dies of the signal when training had already
    # ended (in its summary or teardown): either way its last checkpoint is what it made.
    if not stopped and proc.returncode != 0:
        tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        raise AblationError(f"{run_dir.name}: exit status {proc.returncode}: {tail[0]} (log: {log})")
    return wall, proc.returncode, stopped


def calibrate(sel: Selection, spec: AblationSpec, variant: str, root: Path) -> Calibration:
    cfg = sel.config(spec, spec.variants[variant])
    over = as_sets(calibration_overrides(cfg.train, spec.calibration_steps))
    run_dir = root / ".calibrate" / variant
    wall, _, _ = train_run(sel, spec, [*spec.variants[variant], *over], run_dir, None)
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
    cal = Calibration(
        spec.calibration_steps, wall, step_seconds(read_jsonl(run_dir / "metrics.jsonl"), tokens_per_step)
    )
    shutil.rmtree(run_dir)
    return cal


def choices(run_dir: Path, cfg: Config) -> dict[str, Any]:
    """Minimal-pair and continuation accuracy (assets/bench_es) of the run's last checkpoint, scored as
    `make bench-es` scores every base: exported to a Hugging Face folder, loaded by transformers in fp32.
    A byte-level run (the smoke stage) has no token to start a text with: its columns stay empty."""
    if cfg.train.loader == "bytes":
        return {"pairs_acc": None, "continuations_acc": None}
    go_offline()
    folder = run_dir / "hf"
    try:
        for_config(cfg.model)
    except UnsupportedModelError:
        model, tok = native_scorer(run_dir, folder)
    else:
        export_run(run_dir, folder)
        model, tok = load(Entry(run_dir.name, folder))
    m = choice_metrics(model, tok, paths.BENCH_ES)
    shutil.rmtree(folder)  # the checkpoint stays; the folder is one command away
    return {"pairs_acc": m["pairs_acc"], "continuations_acc": m["continuations_acc"]}


class NativeLM:
    """ENLACE's decoder called as bench_bases calls a transformers model: logits of right-padded rows (under
    causal attention the padding after a row changes none of its own positions). Like transformers, it
    scores rows longer than the training window (RoPE's angles are computed, not looked up), where ENLACE's
    generation refuses them."""

    def __init__(self, model: Llama):
        self.model = model

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Any:
        cfg = self.model.cfg
        if input_ids.shape[1] > cfg.seq_len:
            self.model.cfg = cfg.model_copy(update={"seq_len": input_ids.shape[1]})
        try:
            return self.model(input_ids)
        finally:
            self.model.cfg = cfg


def native_scorer(run_dir: Path, folder: Path) -> tuple[NativeLM, Any]:
    """A run no exported architecture has: its checkpoint in fp32 and the tokenizer an export would carry
    (written to `folder`, read back by transformers as bench_bases reads every base's)."""
    from transformers import AutoTokenizer

    model, meta, _ = load_trained_model(run_dir)
    bundle = run_bundle(meta, model.cfg.seq_len)
    folder.mkdir(parents=True, exist_ok=True)
    bundle.tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(bundle.config), encoding="utf-8")
    return NativeLM(model.float().eval()), AutoTokenizer.from_pretrained(folder)


def score(run_dir: Path, cfg: Config, prose: str, device: torch.device) -> dict[str, Any]:
    """val_* and prose_* as `enlace eval --model-dir` computes them, the choice accuracies as `make
    bench-es` computes them, plus what the run spent."""
    m = score_model_dir(run_dir, cfg, device, prose)
    _, _, meta = latest_checkpoint(run_dir / "checkpoints")
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    speeds = [r["tokens_per_s"] for r in records[1:]]  # the first interval includes start-up
    return {
        "steps": meta["step"],
        "tokens": meta["counters"]["tokens"],
        "skipped": meta["counters"]["skipped"],
        "val_bpb": m["val_bpb"],
        "prose_bpb": m["prose_bpb"],
        **choices(run_dir, cfg),
        "tokens_per_s": round(statistics.median(speeds), 1) if speeds else None,
    }


def run_mfu(run: dict[str, Any], cfg: Config, peak: dict[str, Any] | None) -> float | None:
    """Model FLOPs (estimate.train_flops_per_token: 6N + attention, what the bench uses) per second over the
    matmul peak of the run's precision. Optimizer work (Muon's Newton-Schulz) is not model FLOPs: it shows
    as a lower MFU."""
    if peak is None or not run["tokens_per_s"]:
        return None
    flops_per_token = train_flops_per_token(cfg.model, cfg.model.seq_len)
    return round(mfu(run["tokens_per_s"], flops_per_token, peak["gflops"]), 4)


def cpu_model() -> str:
    try:
        lines = CPUINFO.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        lines = []
    named = (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    return next(named, platform.processor() or platform.machine())


def machine(dtype: str) -> dict[str, Any]:
    """What the table was measured on: CPU model, the ISA torch dispatches, precision, threads, load."""
    return {
        "cpu": cpu_model(),
        "isa": torch.backends.cpu.get_cpu_capability(),
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "load_average_1min": round(os.getloadavg()[0], 2),
    }


def measure_peak(dtype: str, device: torch.device) -> dict[str, Any] | None:
    """The CPU's matmul peak of the runs' precision (peak.py); None on a GPU, whose runs show no MFU."""
    return matmul_peak_gflops(dtype) if device.type == "cpu" and dtype in PEAK_DTYPES else None


def close_to_baseline(prose_bpb: dict[str, float], below: float) -> list[str]:
    """The variants whose first-seed prose bits per byte is within `below` (relative) of the baseline's:
    they, and the baseline, run the other seeds too."""
    base = prose_bpb[BASELINE]
    return [v for v, b in prose_bpb.items() if v != BASELINE and abs(b / base - 1) < below]


def log_line(text: str) -> None:
    print(text, flush=True)  # progress of a long command, also when its output goes to a file


def run_ablation(
    spec: AblationSpec, sel: Selection, root: Path, command: str, log=log_line
) -> dict[str, Any]:
    # Resolved as each run resolves it: cpu-auto's dtype (and the CPU kind's recipe) on this machine.
    base_cfg = resolve_run(sel.config(spec, spec.variants[BASELINE])).cfg
    device = setup_runtime(base_cfg.hardware)
    prose = read_prose(Path(base_cfg.eval.prose))
    dtype = base_cfg.hardware.dtype
    peak = measure_peak(dtype, device)
    started = machine(dtype)

    cals = {v: calibrate(sel, spec, v, root) for v in spec.variants}
    for v, c in cals.items():
        log(f"{v}: {c.step_s:.3f} s/step after {c.overhead_s:.0f} s of start-up (calibration)")
    # Every variant must fit before any trains: a budget too small for one fails now, not an hour in.
    planned = {v: fitted_steps(spec.budget_s, c, spec.fill) for v, c in cals.items()}
    runs: list[dict[str, Any]] = []

    def run(variant: str, seed: int) -> dict[str, Any]:
        cfg0 = sel.config(spec, spec.variants[variant])
        steps = planned[variant]
        fitted = {**schedule_overrides(cfg0.train, steps), "train.seed": seed}
        overrides = [*spec.variants[variant], *as_sets(fitted)]
        cfg = sel.config(spec, overrides)
        run_dir = root / f"{variant}-s{seed}"
        wall, _, _ = train_run(sel, spec, overrides, run_dir, spec.budget_s)
        r = {"variant": variant, "seed": seed, "planned_steps": steps, "wall_s": round(wall, 1)}
        r |= {"overrides": overrides, **score(run_dir, cfg, prose, device)}
        r["stopped_at_budget"] = r["steps"] < steps  # its decay did not finish
        r["mfu"] = run_mfu(r, cfg, peak)
        log(
            f"{variant} seed {seed}: {r['steps']}/{steps} steps in {wall:.0f} s, prose {r['prose_bpb']:.4f} "
            f"val {r['val_bpb']:.4f} bits/byte"
            + (" (stopped at the budget)" if r["stopped_at_budget"] else "")
        )
        runs.append(r)
        return r

    first = {v: run(v, spec.seeds[0]) for v in spec.variants}
    close = close_to_baseline({v: r["prose_bpb"] for v, r in first.items()}, spec.second_seed_below)
    if close:
        for seed in spec.seeds[1:]:
            for v in [BASELINE, *close]:
                run(v, seed)
    if peak is not None:
        peak = peak_update(peak, measure_peak(dtype, device))
        for r in runs:
            r["mfu"] = run_mfu(r, sel.config(spec, r["overrides"]), peak)
    return {
        "name": spec.name,
        "command": command,
        "budget_s": spec.budget_s,
        "machine": started | {"load_average_1min_end": round(os.getloadavg()[0], 2)},
        "peak": peak,
        "calibration": {
            v: {"step_s": round(c.step_s, 4), "overhead_s": round(c.overhead_s, 1)} for v, c in cals.items()
        },
        "spec": spec.model_dump(mode="json"),
        "runs": runs,
    }
