"""LoRA step (forward, backward, AdamW on the adapters): ENLACE vs transformers + PEFT, SmolLM2-135M.

Rank 8 on q_proj and v_proj, batch 1, sequences of 128 and 256 tokens cut from the Spanish instruction
set with assistant-only labels. ENLACE trains as `enlace finetune` does on a CPU with native bf16: the frozen
base's linear weights stored in bf16 (lora.cast_frozen_base), the step under bf16 autocast, adapters and
AdamW in fp32 (on a CPU without native bf16, as `enlace finetune` does there: fp32 throughout, goal parity with
PEFT fp32). The peers: PEFT in its default fp32, and PEFT under the same bf16 autocast (fp32 base).
All see the same tokens and labels; ENLACE skips the LM head and its softmax at unlabelled positions and
never touches frozen weights' gradients. Goals: >= 1.3x PEFT fp32 and >= 1.0x PEFT bf16 autocast.
The process has `enlace finetune`'s CPU allocator setting (enlace.runtime.keep_freed_memory), which applies
to the whole process: the peers get it too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from bench.common import alternate, default_precision, format_row, goal_row, line, summary, write_result
from enlace.config.hardware import HardwareConfig
from enlace.finetune.data import build_dataset, dolly_messages, read_conversations
from enlace.finetune.loss import assistant_loss_sum
from enlace.hf.folder import load_hf_folder
from enlace.hf.gguf_import import DEFAULT_OUT, import_smollm2
from enlace.hf.tokenizer import HFTokenizer
from enlace.lora import cast_frozen_base, inject_lora, lora_parameters
from enlace.runtime import autocast, keep_freed_memory

SEQS = (128, 256)
# `enlace finetune`'s precision on this CPU (cpu-auto): bf16 base and autocast where bf16 is native, else fp32.
PRECISION = os.environ.get("BENCH_PRECISIONS", default_precision()).split(",")[0]
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


def hw(precision: str) -> HardwareConfig:
    return HardwareConfig(name=f"bench-{precision}", device="cpu", dtype=precision)


def ours_step(folder: Path, ids, labels, precision: str = "bf16"):
    model = load_hf_folder(folder)
    torch.manual_seed(0)
    inject_lora(model, ["q_proj", "v_proj"], rank=8, alpha=16)
    if precision == "bf16":
        cast_frozen_base(model)  # as enlace.finetune.train does under a bf16 profile
    model.train()
    params = [p for _, p in lora_parameters(model)]
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step():
        with autocast(hw(precision)):
            s, n = assistant_loss_sum(model, ids, labels)
        (s / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def peft_step(folder: Path, ids, labels, precision: str = "fp32"):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    model = get_peft_model(
        hf, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    )
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step():
        with autocast(hw(precision)):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main(argv: list[str] | None = None) -> int:
    rounds = int((argv or sys.argv[1:] or [os.environ.get("BENCH_ROUNDS", "6")])[0])
    keep_freed_memory()  # as setup_runtime does for a CPU run
    folder = import_smollm2(DEFAULT_OUT)
    tok = HFTokenizer(folder)
    results, rows = {}, []
    for T in SEQS:
        ids, labels = sequence(tok, T)
        n_lab = int((labels[:, 1:] != -100).sum())
        ours = f"enlace {PRECISION}"
        contenders = {
            ours: ours_step(folder, ids, labels, PRECISION),
            "peft fp32": peft_step(folder, ids, labels, "fp32"),
        }
        if PRECISION == "bf16":
            contenders["peft bf16 autocast"] = peft_step(folder, ids, labels, "bf16")
        times = alternate(contenders, rounds, warmup=1)
        stats = {k: summary(v) for k, v in times.items()}
        results[f"seq{T}"] = {"stats": stats, "labelled_tokens": n_lab}
        # fp32 against fp32 (the fp32 kind): the same arithmetic, so the goal is parity, not bf16's 1.3x.
        goals = {"peft fp32": 1.3 if PRECISION == "bf16" else 1.0, "peft bf16 autocast": 1.0}
        for peer in (p for p in goals if p in stats):
            print(line(f"lora step seq {T} ({n_lab} labelled)", stats[ours], stats[peer], peer), flush=True)
            ratio = stats[peer]["median_s"] / stats[ours]["median_s"]
            rows.append(
                goal_row(
                    f"lora step seq {T}", f"{ours} base", f"transformers+{peer}", ratio, ">=", goals[peer]
                )
            )
    path = write_result(
        "lora",
        {
            "rank": 8,
            "targets": ["q_proj", "v_proj"],
            "batch": 1,
            "rounds": rounds,
            "results": results,
            "rows": rows,
        },
    )
    print(f"wrote {path}")
    for r in rows:
        print(format_row(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
