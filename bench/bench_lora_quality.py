"""Quality of LoRA with a bf16 base: the default fine-tune (configs/finetune) trained under the `cpu` profile
(fp32 everywhere) and under `cpu-bf16` (frozen base in bf16, bf16 autocast, adapters and AdamW fp32).

Same data, steps and seed; each adapter's held-out assistant loss is then measured the same way, in fp32 on
the fp32 base (enlace.finetune.evaluate.heldout_loss), so the figure isolates the training precision.
Goal: within 1%. BENCH_LORA_STEPS shortens both runs alike (warmup scaled in proportion).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from bench.common import cpu_tag, default_precision, format_row, goal_row, write_result
from enlace.config import load_config
from enlace.finetune.data import load_dataset
from enlace.finetune.evaluate import heldout_loss
from enlace.finetune.train import finetune
from enlace.hf.folder import load_hf_folder
from enlace.hf.tokenizer import HFTokenizer
from enlace.lora import load_adapter

PROFILES = {"fp32": "cpu", "bf16": "cpu-bf16"}


def main() -> int:
    if default_precision() != "bf16" and os.environ.get("BENCH_PRECISIONS") is None:
        # bf16 would be emulated here (hours, and not what the default run trains in): nothing to compare.
        print(f"skipped: the bf16-vs-fp32 comparison needs native bf16, which {cpu_tag()} lacks; "
              "BENCH_PRECISIONS=bf16 forces it", flush=True)  # fmt: skip
        write_result("lora_quality", {"skipped": "no native bf16", "rows": []})
        return 0
    steps = os.environ.get("BENCH_LORA_STEPS")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="enlace-bench-lora-q-") as tmp:
        for precision, profile in PROFILES.items():
            overrides = [f"finetune.out={tmp}/{precision}"]
            if steps:
                base = load_config("params.yaml", layers=("finetune",)).finetune
                warm = max(1, round(base.schedule.warmup_steps * int(steps) / base.max_steps))
                overrides += [f"finetune.max_steps={steps}", f"finetune.schedule.warmup_steps={warm}"]
            cfg = load_config(
                "params.yaml",
                layers=("hardware", "finetune"),
                select={"hardware": profile},
                overrides=overrides,
            )
            t0 = time.perf_counter()
            run = finetune(cfg.finetune, cfg.hardware, fresh=True, progress=False)
            if run.interrupted:
                return run.exit_code
            ft = cfg.finetune
            tok = HFTokenizer(Path(ft.base_model))
            val = load_dataset(tok, Path(ft.val_data), ft.format, ft.max_len, None, ft.system_prompt)
            model = load_hf_folder(Path(ft.base_model))
            load_adapter(model, Path(ft.out) / "adapter", ft.base_model)
            loss = heldout_loss(model, val, tok.pad_id)
            results[precision] = {"profile": profile, "steps": ft.max_steps, "train_loss": run.final["loss"],
                                  "heldout_loss": loss, "seconds": time.perf_counter() - t0}  # fmt: skip
            print(
                f"{precision} ({profile}): {ft.max_steps} steps, held-out assistant loss {loss:.4f}",
                flush=True,
            )
    gap = results["bf16"]["heldout_loss"] / results["fp32"]["heldout_loss"] - 1
    row = goal_row("LoRA held-out assistant loss, bf16 base vs fp32 (|gap|)", "enlace bf16 base", "enlace fp32",
                   abs(gap) * 100, "<=", 1.0, "%",
                   f"{results['bf16']['heldout_loss']:.4f} vs {results['fp32']['heldout_loss']:.4f} "
                   f"after {results['fp32']['steps']} steps")  # fmt: skip
    path = write_result("lora_quality", {"results": results, "relative_gap": gap, "rows": [row]})
    print(f"wrote {path}")
    print(format_row(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
