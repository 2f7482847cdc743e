"""A few minutes on a CUDA machine that say whether this stack works on its GPU.

    python -m enlace.gpu_check --out runs/gpu-check.json      (make gpu-check)

Checks, each recorded in the JSON even when it fails:
- which scaled_dot_product_attention backends run tiny-50m's shapes (causal, GQA) and which one PyTorch picks;
- fp16 + GradScaler training of tiny-50m on one repeated batch: finite losses that fall (it memorises);
- bf16 training the same way where the GPU has native bf16 (compute capability >= 8.0);
- the same through torch.compile (what `compile: true` profiles run; Triton needs a C compiler at run time);
- tokens/s and MFU against a measured dense-matmul peak;
- torch.cuda.max_memory_allocated against the memory preflight's estimate;
- resume exactness: the trainer itself stopped after k steps and resumed writes the same checkpoint files
  as a straight run of 2k steps.
Training goes through the trainer's own step and checkpoint code (enlace.train.step, enlace.train.checkpoint).
Without a CUDA device it prints why it skipped and exits 0, so `make gpu-check` is safe anywhere.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# cuBLAS reads this when its handle is created: it must be set before the first CUDA call for
# deterministic matmuls in the resume check.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

from .config.hardware import HardwareConfig  # noqa: E402
from .config.model import ModelConfig  # noqa: E402
from .config.train import OptimizerConfig  # noqa: E402
from .estimate import train_flops_per_token  # noqa: E402
from .model import Llama, closed_form_num_parameters  # noqa: E402
from .peak import matmul_peak_gflops, mfu, sync  # noqa: E402
from .scoring.score import Windows  # noqa: E402
from .train.optim import build_optimizer  # noqa: E402
from .train.step import StepSettings, TrainState, make_scaler, train_step  # noqa: E402
from .train.trainer import lm_forward  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")


def _backend_enum(name: str):
    from torch.nn.attention import SDPBackend

    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]


def sdpa_context(backend: str | None):
    """Pin SDPA to one backend; None lets PyTorch choose."""
    import contextlib

    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel([_backend_enum(backend)])


def probe_sdpa(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seq_len: int) -> dict[str, Any]:
    """Run forward+backward of causal GQA attention with the model's shapes under each backend."""
    import torch.nn.functional as F

    shape_q = (1, cfg.n_head, seq_len, cfg.head_dim)
    shape_kv = (1, cfg.n_kv_head, seq_len, cfg.head_dim)
    q = torch.randn(shape_q, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(shape_kv, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(shape_kv, device=device, dtype=dtype, requires_grad=True)
    gqa = cfg.n_kv_head != cfg.n_head
    runs: dict[str, Any] = {}
    for name in SDPA_BACKENDS:
        try:
            with sdpa_context(name):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
                y.float().sum().backward()
            sync(device)
            runs[name] = {"ok": True}
        except Exception as e:  # a backend without a kernel raises RuntimeError; record why
            runs[name] = {"ok": False, "error": str(e).splitlines()[0][:300]}
    chosen = None
    try:
        # What 'auto' dispatches to for these inputs (private API, so guarded).
        from torch.nn.attention import SDPBackend

        choice = torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=gqa)
        chosen = SDPBackend(choice).name
    except Exception as e:
        chosen = f"unknown ({type(e).__name__})"
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "seq_len": seq_len,
        "backends": runs,
        "auto_picks": chosen,
    }


def _batch(cfg: ModelConfig, batch: int, seq_len: int, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=g).to(device)


class Stepper:
    """The trainer's own step (enlace.train.step.train_step) on a model, AdamW and GradScaler (fp16)."""

    def __init__(
        self,
        cfg: ModelConfig,
        device: torch.device,
        dtype: str,
        backend: str | None,
        lr: float = 1e-3,
        seed: int = 0,
        compile: bool = False,
    ):
        torch.manual_seed(seed)
        self.hw = HardwareConfig(
            name=f"gpu-check-{dtype}",
            device=device.type,
            dtype=dtype,
            loss_scaler=dtype == "fp16",
            sdpa_backend=backend or "auto",
        )
        model = Llama(cfg).to(device)
        opt = build_optimizer(model, OptimizerConfig(lr=lr, betas=(0.9, 0.95), weight_decay=0.1), device.type)
        self.state = TrainState(model, opt, make_scaler(device, self.hw), device)
        # What the trainer calls: the model itself, or its torch.compile wrapper (hardware.compile).
        self.call = torch.compile(model) if compile else model
        self.settings = StepSettings(accum=1, grad_clip=1.0, hardware=self.hw)
        self.lr = lr

    @property
    def model(self) -> Llama:
        return self.state.model

    @property
    def scaler(self) -> torch.amp.GradScaler:
        return self.state.scaler

    def step(self, tokens: torch.Tensor) -> float:
        batch = (tokens[:, :-1], tokens[:, 1:])
        forward = functools.partial(lm_forward, accum=1)
        out, _ = train_step(self.state, self.call, batch, lambda: batch, forward, self.lr, self.settings)
        return out.loss


def train_check(
    cfg: ModelConfig,
    device: torch.device,
    dtype: str,
    backend: str | None,
    steps: int,
    batch: int,
    seq_len: int,
    estimate: Callable[[int, int], int] | None = None,
    compile: bool = False,
) -> dict[str, Any]:
    """Train on one repeated batch: losses must be finite and fall; also speed and peak memory.
    compile: through torch.compile, as profiles with hardware.compile train (needs Triton and a C compiler)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    st = Stepper(cfg, device, dtype, backend, compile=compile)
    tokens = _batch(cfg, batch, seq_len, seed=1, device=device)
    losses: list[float] = []
    warmup = min(3, max(steps - 1, 0))
    t0 = time.perf_counter()
    for i in range(steps):
        if i == warmup:
            sync(device)
            t0 = time.perf_counter()
        losses.append(st.step(tokens))
    sync(device)
    elapsed = time.perf_counter() - t0
    timed = steps - warmup
    res: dict[str, Any] = {
        "dtype": dtype,
        "sdpa_backend": backend or "auto",
        "batch": batch,
        "seq_len": seq_len,
        "steps": steps,
        "losses": [round(x, 4) for x in losses],
        "finite": all(math.isfinite(x) for x in losses),
        "falling": len(losses) > 1 and losses[-1] < 0.9 * losses[0],
        "tokens_per_s": batch * seq_len * timed / elapsed if timed else None,
    }
    if dtype == "fp16":
        res["final_loss_scale"] = st.scaler.get_scale()
    if device.type == "cuda":
        res["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
        if estimate is not None:
            res["estimated_peak"] = estimate(batch, seq_len)
            res["estimate_over_measured"] = res["estimated_peak"] / res["max_memory_allocated"]
    res["ok"] = res["finite"] and res["falling"]
    return res


class RandomTokens:
    """Seeded random token windows with the trainer's loader API: the resume check needs no corpus."""

    def __init__(self, vocab: int, seq_len: int, batch: int, seed: int = 0):
        self.vocab, self.seq_len, self.batch, self.seed = vocab, seq_len, batch, seed
        self.fingerprint = f"random-tokens-{vocab}-{seed}"

    def _rows(self, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(key)
        t = torch.randint(0, self.vocab, (self.batch, self.seq_len + 1), generator=g)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def get_batch(self, step: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rows(self.seed * 1_000_003 + step)

    def val_windows(self, n: int) -> Windows:
        g = torch.Generator().manual_seed(-1)
        t = torch.randint(0, self.vocab, (n, self.seq_len + 1), generator=g)
        return Windows(t[:, :-1].contiguous(), t[:, 1:].contiguous(), bytes=n * self.seq_len)  # no text

    def state_dict(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        pass  # the batches are a pure function of the step


def resume_check(
    cfg: ModelConfig, device: torch.device, dtype: str, backend: str | None, k: int, batch: int, seq_len: int
) -> dict[str, Any]:
    """The trainer itself (enlace.train.trainer.train) on this device: a run stopped after k steps and resumed
    must write the same final checkpoint, byte for byte, as a run of 2k steps without a stop."""
    from .config.resolve import build_config
    from .train.checkpoint import list_checkpoints
    from .train.trainer import train

    hw = HardwareConfig(
        name=f"gpu-check-{dtype}",
        device=device.type,
        dtype=dtype,
        loss_scaler=dtype == "fp16",
        sdpa_backend=backend or "auto",
        deterministic=True,
    )
    t = {
        "name": "gpu-check", "max_steps": 2 * k, "micro_batch_size": batch, "global_batch_size": batch,
        "optimizer": {"lr": 1e-3}, "schedule": {"warmup_steps": 1, "decay_steps": k},
        "checkpoint": {"every": k, "keep_last": 2}, "log_every": 1, "eval_batches": 1,
    }  # fmt: skip
    run_cfg = build_config(
        {
            "hardware": hw,
            "model": cfg.model_copy(update={"seq_len": seq_len}),
            "train": t,
            "data": {"name": "random-tokens", "sources": []},
        }
    )
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            finals = []
            for run, stops in (("straight", [None]), ("resumed", [k, None])):
                for stop in stops:
                    data = RandomTokens(cfg.vocab_size, seq_len, batch)
                    train(
                        run_cfg,
                        Path(tmp) / run,
                        loader=data,
                        val_loader=data,
                        stop_after=stop,
                        progress=False,
                    )
                finals.append(list_checkpoints(Path(tmp) / run / "checkpoints")[-1])
            a, b = finals
            differing = [f.name for f in sorted(a.iterdir()) if f.read_bytes() != (b / f.name).read_bytes()]
        return {
            "ok": not differing,
            "steps": 2 * k,
            "resumed_at": k,
            "differing_files": differing,
            "dtype": dtype,
        }
    finally:
        torch.use_deterministic_algorithms(previous)


def _guard(results: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    """Run one check; an exception is a failed check with its message, never the end of the others."""
    t0 = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as e:
        results[name] = {
            "ok": False,
            "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
        }
    results[name]["seconds"] = round(time.perf_counter() - t0, 1)


def _profile(name: str) -> HardwareConfig:
    import yaml

    return HardwareConfig.model_validate(
        yaml.safe_load((ROOT / "configs" / "hardware" / f"{name}.yaml").read_text())
    )


def _device_report(device: torch.device, cfg: ModelConfig, seq_len: int) -> dict[str, Any]:
    """The GPU, the software and the model checked: the report's head."""
    props = torch.cuda.get_device_properties(device)
    cc = (props.major, props.minor)
    return {
        "device": {
            "name": props.name,
            "compute_capability": list(cc),
            "memory_gib": round(props.total_memory / 2**30, 2),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            # torch.cuda.is_bf16_supported() is True on Turing too (emulated): decide by compute capability
            "native_bf16": cc >= (8, 0),
        },
        "model": cfg.name,
        "parameters": closed_form_num_parameters(cfg),
        "flops_formula": (train_flops_per_token.__doc__ or "").splitlines()[0],
        "flops_per_token": train_flops_per_token(cfg, seq_len),
    }


def _train_checks(
    checks: dict[str, Any],
    cfg: ModelConfig,
    device: torch.device,
    args: argparse.Namespace,
    seq_len: int,
    works: list[str],
) -> None:
    """Training in fp16 (the rtx2060 profile), bf16 (rtx5090's) where native, and compiled."""
    from .estimate import estimate_training_memory

    cc = torch.cuda.get_device_capability(device)
    native_bf16 = cc >= (8, 0)

    def pick(preferred: str) -> str | None:
        # The profile's backend if it runs these shapes; otherwise let PyTorch choose and say so.
        return preferred if preferred in works else None

    def estimator(profile: HardwareConfig) -> Callable[[int, int], int]:
        return lambda b, t: estimate_training_memory(cfg, profile, b, t).peak

    def train(dtype: str, profile: HardwareConfig) -> dict[str, Any]:
        backend = pick(profile.sdpa_backend)
        return train_check(cfg, device, dtype, backend, args.steps, args.batch, seq_len, estimator(profile))

    p2060 = _profile("rtx2060")
    p2060 = p2060.model_copy(update={"sdpa_backend": pick(p2060.sdpa_backend) or "auto"})
    _guard(checks, "train_fp16", lambda: train("fp16", p2060))
    if native_bf16:
        p5090 = _profile("rtx5090").model_copy(update={"min_compute_capability": list(cc)})
        _guard(checks, "train_bf16", lambda: train("bf16", p5090))
    else:
        checks["train_bf16"] = {"ok": None, "skipped": f"sm_{cc[0]}{cc[1]} has no native bf16 (needs sm_80+)"}
    compiled_dtype = "bf16" if native_bf16 else "fp16"
    _guard(
        checks,
        "train_compiled",
        lambda: train_check(cfg, device, compiled_dtype, None, args.steps, args.batch, seq_len, compile=True),
    )


def run_checks(args: argparse.Namespace) -> dict[str, Any]:
    """The checks one after another, each guarded: the report's order."""
    import yaml

    device = torch.device("cuda", 0)
    cfg = ModelConfig.model_validate(
        yaml.safe_load((ROOT / "configs" / "model" / f"{args.model}.yaml").read_text())
    )
    seq_len = args.seq_len or cfg.seq_len
    out = _device_report(device, cfg, seq_len)
    native_bf16 = out["device"]["native_bf16"]
    checks: dict[str, Any] = {}
    half = torch.bfloat16 if native_bf16 else torch.float16
    _guard(checks, "sdpa", lambda: {**probe_sdpa(cfg, device, half, seq_len), "ok": True})
    works = [n for n, r in checks["sdpa"].get("backends", {}).items() if r.get("ok")]
    peaks: dict[str, float] = {}
    _guard(checks, "matmul_peak", lambda: _peaks(device, native_bf16, peaks))
    _train_checks(checks, cfg, device, args, seq_len, works)
    for name in ("train_fp16", "train_bf16"):
        r = checks.get(name, {})
        dt = "fp16" if name == "train_fp16" else "bf16"
        if r.get("tokens_per_s") and peaks.get(dt):
            r["peak_flops"] = peaks[dt] * 1e9
            r["mfu"] = round(mfu(r["tokens_per_s"], out["flops_per_token"], peaks[dt]), 4)
    resume_dtype = "bf16" if native_bf16 else "fp16"
    _guard(
        checks,
        "resume_exact",
        lambda: resume_check(cfg, device, resume_dtype, "math", args.resume_steps, 1, min(seq_len, 512)),
    )
    out["checks"] = checks
    out["ok"] = all(c.get("ok") is not False for c in checks.values())
    return out


def _peaks(device: torch.device, native_bf16: bool, peaks: dict[str, float]) -> dict[str, Any]:
    """The matmul peak (GFLOP/s) of each half precision the GPU runs natively: MFU's denominators."""
    for precision in ("fp16", "bf16") if native_bf16 else ("fp16",):
        peaks[precision] = matmul_peak_gflops(precision, repeats=1, device=device)["gflops"]
    return {"ok": True, **{f"{k}_tflops": round(v / 1e3, 1) for k, v in peaks.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m enlace.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/gpu-check.json", help="where to write the results (JSON)")
    p.add_argument("--model", default="tiny-50m", help="model config name (configs/model/NAME.yaml)")
    p.add_argument("--steps", type=int, default=30, help="training steps per precision")
    p.add_argument("--batch", type=int, default=1, help="micro-batch (1 fits tiny-50m at 2048 on 6 GB)")
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's seq_len")
    p.add_argument("--resume-steps", type=int, default=5, help="k in the resume check (k saved, k replayed)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            f"gpu-check skipped: no CUDA device (torch {torch.__version__}, built for "
            f"{torch.version.cuda or 'CPU only'}); nothing written. Run it on the GPU machine, e.g. in `make docker-2060`'s image."
        )
        return 0
    results = run_checks(args)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    for name, r in results["checks"].items():
        state = {True: "ok", False: "FAILED", None: "skipped"}[r.get("ok")]
        extra = {
            k: r[k]
            for k in ("tokens_per_s", "mfu", "estimate_over_measured", "auto_picks", "error")
            if k in r
        }
        print(f"{name:>14}: {state} {json.dumps(extra, default=str)}")
    print(f"results: {path}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
