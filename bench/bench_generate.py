"""Greedy generation of 64 new tokens with a KV cache: ENLACE vs transformers `generate`, SmolLM2-135M fp32.

Same chat-formatted Spanish prompt on both sides, no early stop (eos ignored), so both produce exactly 64
tokens; the generated ids are compared, since greedy decoding of the same weights must agree.
"""

from __future__ import annotations

import sys

import torch

from bench.common import alternate, line, summary, write_result
from enlace.generate import generate
from enlace.hf.gguf_import import DEFAULT_OUT, import_smollm2
from enlace.hf.load import load_for_generation

NEW = 64
PROMPT = "Escribe una receta sencilla de tortilla de patatas para una cena en familia."


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM

    rounds = int((argv or sys.argv[1:] or ["5"])[0])
    folder = import_smollm2(DEFAULT_OUT)
    model, tok = load_for_generation(folder)
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # No stop token on either side; min_new_tokens would instead mask eos in the logits and change the argmax.
    hf.generation_config.eos_token_id = None
    x = torch.tensor([ids])
    out: dict[str, list[int]] = {}

    def ours():
        out["enlace"] = list(generate(model, ids, NEW))

    def peer():
        with torch.inference_mode():
            y = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                do_sample=False,
                pad_token_id=tok.pad_id,
            )
        out["transformers"] = y[0, len(ids) :].tolist()

    times = alternate({"enlace": ours, "transformers": peer}, rounds, warmup=1)
    same = sum(a == b for a, b in zip(out["enlace"], out["transformers"], strict=True))
    o, p = summary(times["enlace"]), summary(times["transformers"])
    path = write_result(
        "bench_generate",
        {"new_tokens": NEW, "prompt_tokens": len(ids), "rounds": rounds, "enlace": o, "transformers": p,
         "ratio": p["median_s"] / o["median_s"], "tokens_per_s": NEW / o["median_s"], "same_tokens": same},
    )  # fmt: skip
    print(f"wrote {path}; greedy tokens identical: {same}/{NEW}")
    print(
        line(f"greedy {NEW} new tokens", o, p, "transformers")
        + f" ({NEW / o['median_s']:.1f} tok/s), goal >= 1.5x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
