"""Test helpers shared by the test files (no tests here).

- Training: a tiny in-memory byte loader with the real loaders' API, tiny configs, and a script entry point
  (`python tests/helpers.py CONFIG.json RUN_DIR`) so tests can kill a training process mid-run.
- Fine-tuning: a small random Llama saved by transformers, with a byte-level BPE tokenizer and a ChatML
  template, written as a Hugging Face folder; instruction rows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

from enlace.config.resolve import Config, build_config, set_dotted
from enlace.errors import DataError, EnlaceError

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
        from enlace.scoring.score import spread_windows
        from enlace.scoring.token_bytes import TokenBytes

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
        set_dotted(d[section], rest, value)
    return d


def config_from_dict(d: dict[str, dict[str, Any]]) -> Config:
    return build_config(d)


def tiny_config(overrides: dict[str, Any] | None = None) -> Config:
    """The tiny test config with dotted overrides, e.g. {"train.max_steps": 12}."""
    return config_from_dict(tiny_dict(overrides))


def loaders_for(cfg: Config, rank: int = 0, world_size: int = 1, text: bytes | None = None):
    t = cfg.train
    data = text if text is not None else synthetic_text()
    args = (cfg.model.seq_len, t.micro_batch_size, t.global_batch_size, t.seed, rank, world_size)
    return SyntheticLoader(data, "train", *args), SyntheticLoader(data, "val", *args)


def main(argv: list[str] | None = None) -> int:
    """Train a tiny config in this process: `python tests/helpers.py CONFIG.json RUN_DIR`."""
    import os

    from enlace.train.dist import cleanup, init_distributed
    from enlace.train.trainer import train

    p = argparse.ArgumentParser()
    p.add_argument("config", type=Path)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--stop-after", type=int, default=None)
    p.add_argument("--kill-during-save", type=int, default=None, metavar="STEP")
    p.add_argument("--kill-at-swap", type=int, default=None, metavar="STEP")
    p.add_argument("--sigint-during-save", type=int, default=None, metavar="STEP")
    a = p.parse_args(argv)
    cfg = config_from_dict(json.loads(a.config.read_text()))
    if a.kill_during_save is not None:
        kill_during_save(a.kill_during_save)
    if a.kill_at_swap is not None:
        kill_at_swap(a.kill_at_swap)
    if a.sigint_during_save is not None:
        sigint_during_save(a.sigint_during_save)
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


def kill_during_save(step: int) -> None:
    """SIGKILL this process once the first tensor file of step's checkpoint is written and synced."""
    import os
    import signal

    from enlace.train import checkpoint

    real = checkpoint.fsync_file

    def fsync_then_die(path: Path) -> None:
        real(path)
        if Path(path).parent.name.startswith(f".tmp-{checkpoint.step_dirname(step)}-"):
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.fsync_file = fsync_then_die


def sigint_during_save(step: int) -> None:
    """Send this process SIGINT after each tensor file of step's checkpoint: Ctrl-C pressed twice while
    that checkpoint is being written."""
    import os
    import signal

    from enlace.train import checkpoint

    real = checkpoint.fsync_file

    def fsync_then_interrupt(path: Path) -> None:
        real(path)
        if Path(path).parent.name.startswith(f".tmp-{checkpoint.step_dirname(step)}-"):
            os.kill(os.getpid(), signal.SIGINT)

    checkpoint.fsync_file = fsync_then_interrupt


def kill_at_swap(step: int) -> None:
    """SIGKILL this process when a re-save of step has moved the old copy aside and not yet renamed the new
    one in: the instant at which a delete-first re-save lost the only checkpoint."""
    import os
    import signal

    from enlace.train.checkpoint import step_dirname

    real = os.replace

    def replace_then_die(src, dst) -> None:
        real(src, dst)
        if Path(dst).name == f".old-{step_dirname(step)}":
            os.kill(os.getpid(), signal.SIGKILL)

    os.replace = replace_then_die


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
    faults: list[str] | None = None,
):
    """Start this file as a script (under torchrun when nproc > 1) in a subprocess.

    faults: e.g. ["--kill-during-save", "15"]: the fault injections main() installs in that process."""
    import os
    import subprocess

    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={port}"]
    cmd += [str(Path(__file__).resolve()), str(config_json), str(run_dir)]
    if stop_after is not None:
        cmd += ["--stop-after", str(stop_after)]
    cmd += faults or []
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkpoint_digests(ckpt: Path) -> dict[str, str]:
    from enlace.io import sha256_file

    return {p.name: sha256_file(p) for p in sorted(Path(ckpt).iterdir()) if p.is_file()}


def logged_losses(run_dir: Path) -> list[tuple[int, float]]:
    from enlace.train.metrics import read_jsonl

    return [(r["step"], r["loss"]) for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "loss" in r]


def nan_at_steps(monkeypatch: Any, steps: set[int], accum: int) -> None:
    """Make the trainer's loss NaN on those (0-based) optimizer steps of a fresh in-process run."""
    from enlace.train import trainer

    real = trainer.lm_forward
    calls = {"n": 0}

    def forward(model, batch, accum: int):
        loss, parts = real(model, batch, accum=accum)
        step = calls["n"] // accum
        calls["n"] += 1
        return (loss * float("nan") if step in steps else loss), parts

    monkeypatch.setattr(trainer, "lm_forward", forward)


# ---- fine-tuning builders ------------------------------------------------------------------------------------

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nEres un asistente útil.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "La ciudad de Buenos Aires es grande y tiene muchos barrios.",
    "Había una vez un niño que vivía cerca del mar con su abuela.",
    "¿Qué podemos cenar hoy? Tortilla de patatas, ensalada y fruta.",
    "Los niños se acuestan a las nueve y media; mañana hay colegio.",
    "El 3 de mayo de 2024 fuimos al parque con 12 amigos.",
] * 20
SENTENCES = ["Había una vez un niño.", "¿Qué cenamos hoy, mamá? ¡Tortilla!", "El 3 de mayo de 2024 llovió."]


def write_tokenizer(folder: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "chat_template": CHATML,
        "add_bos_token": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return tok.get_vocab_size()


def make_folder(
    folder: Path, kind: str = "llama", tied: bool = True, dtype=torch.float32, seed: int = 0, **kw
) -> Path:
    """A random transformers model (kind: llama or qwen3) with our test tokenizer, saved into folder."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shard = kw.pop("shard", False)
    vocab = write_tokenizer(folder)
    args = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    args.update(kw)
    torch.manual_seed(seed)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, rope_theta=20000.0, **args))
    else:
        model = LlamaForCausalLM(LlamaConfig(rope_theta=20000.0, **args))
    with torch.no_grad():  # transformers initialises norms to 1; random norms test that they are loaded
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.to(dtype).save_pretrained(folder, **({"max_shard_size": "100KB"} if shard else {}))
    return folder


def dolly_rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        rows.append(
            {
                "instruction": f"¿Qué hacemos el día {i}?",
                "context": "Somos una familia de cuatro." if i % 2 else "",
                "response": "Vamos al parque y luego cenamos tortilla de patatas."
                if i % 3
                else "Leemos un cuento.",
                "category": "familia",
            }
        )
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def llamacpp_permute(w: torch.Tensor, n_head: int, n_head_kv: int | None = None) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, written out independently."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


if __name__ == "__main__":
    sys.exit(main())
