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
    "--set", "train.micro_batch_size=4", "--set", "train.grad_accum_steps=1", "--set", "train.global_batch_size=4",
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


def make_project(
    folder: Path, qk_norm: bool = True, tied: bool = True, seed: int = 0, train: tuple[str, ...] = ()
) -> Path:
    """params, configs and a corpus in `folder`; then tokenize, shard and a 6-step pretrain run there
    (`train`: more `--set` arguments for the pretrain run, after TINY's).

    The caller must chdir into folder first (the stages use paths relative to the project root).
    """
    shutil.copy(ROOT / "params.yaml", folder / "params.yaml")
    shutil.copytree(ROOT / "configs", folder / "configs")
    src = folder / "corpus-src"
    src.mkdir()
    rng = random.Random(seed)
    for i in range(160):
        (src / f"doc{i:03d}.txt").write_text(spanish_doc(rng), encoding="utf-8")
    layer = {
        "name": "tiny", "val_fraction": 0.1, "cleaning": {"min_doc_chars": 100},
        "sources": [{"name": "gen", "kind": "local", "path": "corpus-src"}],
        "tokenizer": {"type": "bpe", "vocab_size": VOCAB, "num_threads": 1},
        "shard": {"tokens_per_shard": 20000, "num_workers": 1},
    }  # fmt: skip
    (folder / "configs" / "data" / "tiny.yaml").write_text(json.dumps(layer), encoding="utf-8")
    data = ["--data", "tiny"]
    assert main(["fetch", *data]) == 0
    assert main(["tokenize", *data]) == 0
    data += ["--set", f"model.vocab_size={VOCAB}"]  # shard checks the model's vocabulary too
    assert main(["shard", *data]) == 0
    model = [
        "--set",
        f"model.qk_norm={str(qk_norm).lower()}",
        "--set",
        f"model.tie_embeddings={str(tied).lower()}",
    ]
    assert (
        main(["pretrain", "--no-progress", "--run-dir", "runs/pretrain", *TINY, *train, *model, *data]) == 0
    )
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


def _varint(n: int) -> bytes:
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def write_tie_model(path: Path) -> Path:
    """A hand-built sentencepiece unigram model in which "▁ab" has two segmentations 5e-5 apart.

    ["▁a", "b"] scores -6.0 and ["▁", "ab"] -6.00005: exact sums pick the first, but sentencepiece adds a
    document's scores in float32, and after some 10^5 of accumulated score the 5e-5 is lost and it picks the
    second. The protobuf is written by hand (field numbers of sentencepiece_model.proto).
    """
    import struct

    def field(num: int, wire: int, payload: bytes) -> bytes:
        head = _varint(num << 3 | wire)
        return head + (_varint(len(payload)) + payload if wire == 2 else payload)

    def piece(text: str, score: float, kind: int) -> bytes:
        body = field(1, 2, text.encode()) + field(2, 5, struct.pack("<f", score)) + field(3, 0, _varint(kind))
        return field(1, 2, body)

    pieces = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)] + [
        (f"<0x{i:02X}>", 0.0, 6) for i in range(256)
    ]
    pieces += [("▁", -1.0, 1), ("a", -4.0, 1), ("b", -3.0, 1), ("ab", -5.00005, 1), ("▁a", -3.0, 1)]
    pieces += [("▁c", -3.0, 1), ("c", -4.0, 1)]
    trainer = field(3, 0, _varint(1)) + field(4, 0, _varint(len(pieces))) + field(35, 0, _varint(1))
    normalizer = (
        field(1, 2, b"identity") + field(3, 0, _varint(1)) + field(4, 0, _varint(0)) + field(5, 0, _varint(1))
    )
    blob = b"".join(piece(*p) for p in pieces) + field(2, 2, trainer) + field(3, 2, normalizer)
    path.write_bytes(blob)
    return path
