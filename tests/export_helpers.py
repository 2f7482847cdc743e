"""Builders for the export tests (no tests here): a tiny Spanish corpus, tokenizer, shards and a trained run,
made through the real CLI in a temporary project folder."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from enlace.cli import main

ROOT = Path(__file__).resolve().parents[1]
NOUNS = (
    "casa perro ciudad río montaña libro mesa camino puerta ventana pueblo barco jardín árbol niño".split()
)
VERBS = "mira tiene busca encuentra lleva cuenta abre cierra recuerda construye pinta vende".split()
ADJ = "grande pequeña antigua nueva roja verde tranquila oscura alegre lejana española".split()
EXTRA = ["¿Qué hora es?", "¡Qué bien!", "Son las 10:45 del 3 de mayo de 2024.", "Año, señor, pingüino."]
VOCAB = 600
TINY = [
    "--set", "model.d_model=32", "--set", "model.n_layer=2", "--set", "model.n_head=4",
    "--set", "model.n_kv_head=2", "--set", "model.seq_len=64", "--set", f"model.vocab_size={VOCAB}",
    "--set", "model.ffn_multiple_of=16", "--set", "hardware.num_threads=1",
    "--set", "train.max_steps=6", "--set", "train.checkpoint.every=6",
    "--set", "train.schedule.warmup_steps=2", "--set", "train.schedule.decay_steps=2",
    "--set", "train.micro_batch_size=4", "--set", "train.global_batch_size=4",
    "--set", "train.eval_batches=1", "--set", "train.eval_every=0",
]  # fmt: skip


def spanish_doc(rng: random.Random) -> str:
    paras = []
    for _ in range(rng.randint(2, 4)):
        s = [
            f"El {rng.choice(NOUNS)} de la {rng.choice(NOUNS)} {rng.choice(VERBS)} una {rng.choice(NOUNS)} "
            f"{rng.choice(ADJ)} que está en el {rng.choice(NOUNS)}."
            for _ in range(rng.randint(2, 5))
        ]
        s.append(rng.choice(EXTRA))
        paras.append(" ".join(s))
    return "\n\n".join(paras)


def make_project(folder: Path, qk_norm: bool = True, tied: bool = True, seed: int = 0) -> Path:
    """params, configs and a corpus in `folder`; then tokenize, shard and a 6-step pretrain run there.

    The caller must chdir into folder first (the stages use paths relative to the project root).
    """
    shutil.copy(ROOT / "params.yaml", folder / "params.yaml")
    shutil.copytree(ROOT / "configs", folder / "configs")
    corpus = folder / "data" / "corpus"
    corpus.mkdir(parents=True)
    rng = random.Random(seed)
    docs = [spanish_doc(rng) for _ in range(160)]
    for split, part in (("train", docs[:-16]), ("val", docs[-16:])):
        (corpus / f"{split}.jsonl").write_text(
            "".join(json.dumps({"source": "gen", "text": d}, ensure_ascii=False) + "\n" for d in part),
            encoding="utf-8",
        )
    data = ["--set", f"data.tokenizer.vocab_size={VOCAB}", "--set", "data.tokenizer.num_threads=1"]
    data += ["--set", f"model.vocab_size={VOCAB}"]
    assert main(["tokenize", *data]) == 0
    assert main(["shard", *data, "--set", "data.shard.num_workers=1"]) == 0
    model = [
        "--set",
        f"model.qk_norm={str(qk_norm).lower()}",
        "--set",
        f"model.tie_embeddings={str(tied).lower()}",
    ]
    assert main(["pretrain", "--no-progress", "--run-dir", "runs/pretrain", *TINY, *model, *data]) == 0
    return folder


def chat_rows(n: int) -> list[dict]:
    """Dolly-format instruction rows (the finetune stage's default format)."""
    answers = ["Vamos al parque y luego cenamos.", "Leemos un cuento.", "Hacemos una tortilla."]
    return [
        {
            "instruction": f"¿Qué hacemos el día {i}?",
            "context": "",
            "response": answers[i % 3],
            "category": "f",
        }
        for i in range(n)
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path
