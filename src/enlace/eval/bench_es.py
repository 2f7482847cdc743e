"""`enlace bench-es`: the project's Spanish benchmark, run by lm-evaluation-harness on a Hugging Face folder.

Items and task YAMLs live in assets/bench_es (`dataset_path: json`, loaded with lm-eval's include path).
Nothing may reach a network: the offline switches of datasets, the hub and transformers are set before
lm-eval is imported, and the data files are local. Contexts start the way the folder's tokenizer starts a
text: for our exports, with the document separator the model was trained after.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

from .. import paths
from ..errors import EnlaceError
from ..io import atomic_write_json

TASKS = ["enlace_es_pares", "enlace_es_continuaciones"]
SUBTASKS = [
    "enlace_es_genero", "enlace_es_numero", "enlace_es_ser_estar", "enlace_es_subjuntivo",
    "enlace_es_cliticos", "enlace_es_preposiciones", "enlace_es_tildes",
]  # fmt: skip
CHANCE = {"enlace_es_pares": 0.5, "enlace_es_continuaciones": 0.25, **dict.fromkeys(SUBTASKS, 0.5)}
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
NEWLINE = 10  # the byte-level model has no special tokens: its contexts start after a newline byte


def go_offline() -> None:
    os.environ.update(OFFLINE)


def task_dir(assets: Path, dest: Path) -> Path:
    """The task YAMLs with their data_files made absolute, so lm-eval finds them from any directory."""
    assets = Path(assets).resolve()
    if not (assets / "enlace_es_pares.yaml").exists():
        raise EnlaceError(f"{assets}: the benchmark's task files are missing")
    for f in assets.glob("*.yaml"):
        text = re.sub(
            r"(train: )assets/bench_es/", rf"\g<1>{assets.as_posix()}/", f.read_text(encoding="utf-8")
        )
        (dest / f.name).write_text(text, encoding="utf-8")
    return dest


def hf_folder(model_dir: Path) -> Path:
    """The Hugging Face folder lm-eval reads, told apart from the other model paths by enlace.load."""
    from ..load import locate

    ref = locate(model_dir, flag="MODEL_DIR")
    how = {
        "run": "no config.json; export a run first (`enlace export`)",
        "gguf": "a GGUF file; import it first (`enlace import-gguf --gguf FILE`)",
        "hf": "a LoRA run; merge it first (`enlace export --model BASE --adapter ADAPTER`)",
    }
    if ref.kind != "hf" or ref.adapter is not None:
        raise EnlaceError(f"MODEL_DIR {model_dir}: {how[ref.kind]}")
    return ref.path


def run_bench(
    model_dir: Path,
    out: Path | None = None,
    limit: int | None = None,
    assets: Path = paths.BENCH_ES,
    batch_size: int = 16,
) -> dict[str, Any]:
    """Accuracy and its standard error per task (and the pairs' size-weighted mean) for one model folder."""
    model_dir = hf_folder(Path(model_dir))
    go_offline()
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    args: dict[str, Any] = {"pretrained": str(model_dir), "dtype": "float32"}
    if tok("a")["input_ids"] != tok("a", add_special_tokens=False)["input_ids"]:
        # The tokenizer marks the start of a text itself (ours: the document separator): keep it, as in
        # training. Others (SmolLM2) are left alone rather than given a BOS they were not trained with.
        args["add_bos_token"] = True
    if tok.bos_token_id is None and tok.eos_token_id is None:
        args["prefix_token_id"] = NEWLINE
    with tempfile.TemporaryDirectory() as tmp:
        tm = TaskManager(include_path=str(task_dir(assets, Path(tmp))), include_defaults=False)
        res = lm_eval.simple_evaluate(
            model="hf", model_args=args, tasks=TASKS, task_manager=tm, device="cpu",
            batch_size=batch_size, limit=limit, log_samples=False,
        )  # fmt: skip
    tasks: dict[str, Any] = {}
    for name in [*TASKS, *SUBTASKS]:
        r = res["results"].get(name, {})
        if "acc,none" not in r:
            continue
        n = res.get("n-samples", {}).get(name, {}).get("effective")
        if n is None:
            n = sum(res["n-samples"][s]["effective"] for s in SUBTASKS if s in res.get("n-samples", {}))
        entry = {"acc": r["acc,none"], "acc_stderr": r.get("acc_stderr,none"), "n": n, "chance": CHANCE[name]}
        if "acc_norm,none" in r:
            entry.update(acc_norm=r["acc_norm,none"], acc_norm_stderr=r.get("acc_norm_stderr,none"))
        tasks[name] = entry
    result = {"model": str(model_dir), "lm_eval": lm_eval.__version__, "tasks": tasks}
    if out is not None:
        atomic_write_json(Path(out), result)
    return result
