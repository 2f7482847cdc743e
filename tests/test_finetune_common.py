"""Shared builders for the fine-tuning tests (no tests here): a small random Llama saved by transformers,
with a byte-level BPE tokenizer and a ChatML template, written as a Hugging Face folder."""

from __future__ import annotations

import json
from pathlib import Path

import torch

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
