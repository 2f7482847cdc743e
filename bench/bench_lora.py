"""LoRA step (forward, backward, AdamW on the adapters): ENLACE vs transformers + PEFT, SmolLM2-135M.

Rank 8 on q_proj and v_proj, batch 1, sequences of 128 and 256 tokens cut from the Spanish instruction
set with assistant-only labels, fp32 on CPU. Both sides see the same tokens and labels; ENLACE skips the
LM head and its softmax at unlabelled positions and never touches frozen weights' gradients.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from bench.common import alternate, line, summary, write_result
from enlace.finetune.data import build_dataset, dolly_messages, read_conversations
from enlace.finetune.lora import inject_lora, lora_parameters
from enlace.finetune.loss import assistant_loss_sum
from enlace.hf.folder import load_hf_folder
from enlace.hf.gguf_import import DEFAULT_OUT, import_smollm2
from enlace.hf.tokenizer import HFTokenizer

SEQS = (128, 256)
DATA = Path("assets/instruct/es_familia_train.jsonl")


def sequence(tok: HFTokenizer, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens of consecutive rendered examples (labels on their answers), as a fine-tuning batch of 1."""
    if DATA.exists():
        convs = read_conversations(DATA, "dolly", limit=20)
    else:
        convs = [
            dolly_messages({"instruction": "¿Qué cenamos?", "response": "Tortilla de patatas. " * 20})
        ] * 5
    ds = build_dataset(tok, convs, 10_000)
    ids = [t for e in ds.examples for t in e.input_ids][:T]
    labels = [t for e in ds.examples for t in e.labels][:T]
    return torch.tensor([ids]), torch.tensor([labels])


def ours_step(folder: Path, ids, labels):
    model = load_hf_folder(folder)
    torch.manual_seed(0)
    inject_lora(model, ["q_proj", "v_proj"], rank=8, alpha=16)
    model.train()
    params = [p for _, p in lora_parameters(model)]
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step():
        s, n = assistant_loss_sum(model, ids, labels)
        (s / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def peft_step(folder: Path, ids, labels):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    model = get_peft_model(
        hf, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    )
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step():
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main(argv: list[str] | None = None) -> int:
    rounds = int((argv or sys.argv[1:] or ["6"])[0])
    folder = import_smollm2(DEFAULT_OUT)
    tok = HFTokenizer(folder)
    results, lines = {}, []
    for T in SEQS:
        ids, labels = sequence(tok, T)
        n_lab = int((labels[:, 1:] != -100).sum())
        times = alternate(
            {"enlace": ours_step(folder, ids, labels), "peft": peft_step(folder, ids, labels)},
            rounds,
            warmup=2,
        )
        ours, peer = summary(times["enlace"]), summary(times["peft"])
        results[f"seq{T}"] = {
            "enlace": ours,
            "peft": peer,
            "ratio": peer["median_s"] / ours["median_s"],
            "labelled_tokens": n_lab,
        }
        lines.append(line(f"lora step seq {T} ({n_lab} labelled)", ours, peer, "transformers+peft"))
        print(lines[-1], flush=True)
    ratios = [results[k]["ratio"] for k in results]
    path = write_result(
        "bench_lora",
        {"rank": 8, "targets": ["q_proj", "v_proj"], "batch": 1, "rounds": rounds, "results": results},
    )
    print(f"wrote {path}")
    print(" | ".join(lines) + f" | ratio (peer/ours) min {min(ratios):.2f}x, goal >= 1.3x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
