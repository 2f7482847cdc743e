"""`enlace finetune-eval`: held-out assistant-only loss without and with the adapter, sample answers with
automatic checks (loops, distinct-2, language) on both, and answers to questions the instruction set never
saw, each judged in Spanish, on topic and free of loops (enlace.finetune.judge)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

from ..config.finetune import FinetuneConfig
from ..config.hardware import HardwareConfig
from ..errors import EnlaceError
from ..hf.tokenizer import HFTokenizer
from ..io import atomic_write_json
from ..load import add_adapter, load_model
from ..lora import set_merged
from ..model import IGNORE_INDEX
from ..runtime import setup_runtime
from .data import Dataset, collate, load_dataset
from .judge import interleave, read_questions
from .loss import assistant_loss_sum
from .text_checks import Reply, answer_checks

# Goals from the finetune issue: no looping answer, held-out loss at least 20% below the base model's.
GOAL_LOSS_REDUCTION = 0.20


@torch.no_grad()
def heldout_loss(model, data: Dataset, pad_id: int, batch: int = 4) -> float:
    """Mean cross-entropy per assistant token (every token weighs the same)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(data.examples), batch):
        b = collate(data.examples[i : i + batch], pad_id)
        s, n = assistant_loss_sum(model, b["input_ids"], b["labels"])
        total, count = total + float(s), count + n
    return total / max(count, 1)


def answer(model, tok: HFTokenizer, prompt: str, cfg: FinetuneConfig) -> Reply:
    from ..generate import generate

    msgs = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []) + [
        {"role": "user", "content": prompt}
    ]
    g = cfg.generation
    ids = list(
        generate(
            model,
            tok.apply_chat_template(msgs, add_generation_prompt=True),
            g.max_new_tokens,
            temperature=g.temperature,
            top_k=g.top_k,
            top_p=g.top_p,
            repetition_penalty=g.repetition_penalty,
            no_repeat_ngram=g.no_repeat_ngram,
            seed=g.seed,
            eos_ids=tok.eos_ids,
        )
    )
    ended = bool(ids) and ids[-1] in tok.eos_ids
    return Reply(tok.decode(ids, skip_special_tokens=True).strip(), len(ids), ended)


def judge_questions(model, tok: HFTokenizer, questions: list, cfg: FinetuneConfig, who: str) -> dict:
    """Every held-out question answered with each of the layer's decodings and judged
    (enlace.finetune.assistant.judge_assistant)."""
    from .assistant import from_loaded, judge_assistant

    a = from_loaded(who, model, tok, system=cfg.system_prompt)
    sampler = {k: v for k, v in cfg.generation.model_dump().items() if k not in ("max_new_tokens", "seed")}
    return judge_assistant(a, questions, cfg.judge_decodings, sampler, cfg.generation.max_new_tokens)


def answer_budget_warning(val: Dataset, max_new_tokens: int) -> str | None:
    """A warning when the generation budget is shorter than the held-out answers (in the base's tokens): the
    model then cannot finish an answer of the length it was taught, and every such answer is cut."""
    lengths = [sum(1 for x in e.labels if x != IGNORE_INDEX) for e in val.examples]
    longer = sum(n > max_new_tokens for n in lengths)
    if not longer:
        return None
    return (
        f"warning: generation.max_new_tokens={max_new_tokens} is below {longer} of the {len(lengths)} held-out "
        f"answers (the longest is {max(lengths)} tokens with its end marker): such answers are cut, not ended"
    )


def judged_rows(questions: list, after: dict | None, before: dict | None) -> tuple[list, dict, dict]:
    """Per question, the first decoding's answers and verdicts (the adapter's, and the base's when judged);
    the first decoding's flat rates per model; and each decoding's summary per model."""
    if after is None:
        return [], {}, {}
    first = next(iter(after["decodings"]))
    runs = {"finetuned": after} | ({"base": before} if before else {})
    judged = {
        who: r["decodings"][first]["rates"]
        | {"ended_rate": r["decodings"][first]["summary"]["ended"]["rate"]}
        for who, r in runs.items()
    }
    by_decoding = {who: {d: x["summary"] for d, x in r["decodings"].items()} for who, r in runs.items()}
    keep = ("spanish", "on_topic", "loops", "keywords_found", "correct", "key_found", "competing_found", "ok")
    verdicts = []
    for i, q in enumerate(questions):
        a = after["decodings"][first]["answers"][i]
        row = {"question": q.question, "topic": q.topic, "kind": q.kind, "keywords": list(q.keywords),
               "finetuned": a["answer"], "verdict": {k: a[k] for k in keep if k in a}, "tokens": a["tokens"],
               "ended": a["ended"]}  # fmt: skip
        if before:
            b = before["decodings"][first]["answers"][i]
            row.update(base=b["answer"], base_verdict={k: b[k] for k in keep if k in b}, base_tokens=b["tokens"],
                       base_ended=b["ended"])  # fmt: skip
        verdicts.append(row)
    return verdicts, judged, by_decoding


def loss_fields(before: float, after: float) -> dict:
    reduction = (before - after) / before if before > 0 else 0.0
    return {
        "loss_before": round(before, 5),
        "loss_after": round(after, 5),
        "ppl_before": round(math.exp(before), 3),
        "ppl_after": round(math.exp(after), 3),
        "improvement": round(before - after, 5),
        "loss_reduction": round(reduction, 4),
    }


def preamble_eval(cfg: FinetuneConfig, adapter: Path) -> dict:
    """A layer trained in a preamble's format (finetune.preamble): its held-out loss, every example rendered
    as serving renders it (the preamble in the prompt, the loss on the answer and its end), without and with
    the adapter. Its answers are `enlace judge`'s, through the spec, which this names."""
    from .train import training_preamble

    spec = training_preamble(cfg)
    base = load_model(cfg.base_model, flag="finetune.base_model")
    tok = base.hf_tokenizer("finetune-eval")
    val = load_dataset(tok, Path(cfg.val_data), cfg.format, cfg.max_len, None, cfg.system_prompt, spec)
    before = heldout_loss(base.model, val, tok.pad_id)
    add_adapter(base.model, adapter, cfg.base_model, merge=False)  # unmerged, as it trained
    after = heldout_loss(base.model, val, tok.pad_id)
    result = {
        "base_model": cfg.base_model, "adapter": str(adapter), "preamble": cfg.preamble,
        "val_data": cfg.val_data, "val": val.report(), **loss_fields(before, after), "answers": [],
        "judge_with": f"enlace judge --assistant {cfg.preamble} --adapter {adapter}",
    }  # fmt: skip
    atomic_write_json(Path(cfg.out) / "eval.json", result)
    return result


def finetune_eval(cfg: FinetuneConfig, hw: HardwareConfig, adapter: Path | None = None) -> dict:
    setup_runtime(hw)
    if cfg.method == "full":
        raise EnlaceError(
            f"finetune-eval: {cfg.name} is a full fine-tune (no adapter); judge it with "
            f"`enlace judge --assistant {Path(cfg.out) / 'assistant.yaml'}` or `--model {Path(cfg.out) / 'model'}`"
        )
    adapter = Path(adapter or Path(cfg.out) / "adapter")
    if not (adapter / "adapter_config.json").exists():
        raise EnlaceError(f"{adapter}: no adapter; run `enlace finetune` first")
    if cfg.preamble is not None:  # answers in the chat template would not be what is served
        return preamble_eval(cfg, adapter)
    split = None if cfg.questions_split == "all" else cfg.questions_split
    questions = read_questions(Path(cfg.questions), split) if cfg.questions else []  # a bad file fails first
    if cfg.questions_limit:
        questions = interleave(questions)[: cfg.questions_limit]
    base = load_model(cfg.base_model, flag="finetune.base_model")
    model, tok = base.model, base.hf_tokenizer("finetune-eval")
    val = load_dataset(tok, Path(cfg.val_data), cfg.format, cfg.max_len, None, cfg.system_prompt)
    warning = answer_budget_warning(val, cfg.generation.max_new_tokens)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    before = heldout_loss(model, val, tok.pad_id)
    answers_before = [answer(model, tok, p, cfg).text for p in cfg.eval_prompts]
    judged_before = (
        judge_questions(model, tok, questions, cfg, "base") if cfg.judge_base and questions else None
    )
    add_adapter(model, adapter, cfg.base_model, merge=False)  # the held-out loss first, as trained
    after = heldout_loss(model, val, tok.pad_id)
    set_merged(model, True)  # same outputs, one matmul per projection while generating
    answers_after = [answer(model, tok, p, cfg).text for p in cfg.eval_prompts]
    judged_after = judge_questions(model, tok, questions, cfg, "finetuned") if questions else None
    fields = loss_fields(before, after)
    checks = {"base": answer_checks(answers_before), "finetuned": answer_checks(answers_after)}
    verdicts, judged, by_decoding = judged_rows(questions, judged_after, judged_before)
    result = {
        "base_model": cfg.base_model,
        "adapter": str(adapter),
        "val_data": cfg.val_data,
        "val": val.report(),
        **fields,
        # Flat copies of the adapter's checks, so `dvc metrics show` and `enlace report` list them.
        "looping": checks["finetuned"]["looping"],
        "distinct_2": checks["finetuned"]["distinct_2"],
        "spanish": checks["finetuned"]["spanish"],
        "goals_met": checks["finetuned"]["looping"] == 0 and fields["loss_reduction"] >= GOAL_LOSS_REDUCTION,
        "checks": checks,
        "generation": cfg.generation.model_dump(),
        "answers": [
            {"prompt": p, "base": a, "finetuned": b}
            for p, a, b in zip(cfg.eval_prompts, answers_before, answers_after, strict=True)
        ],
    }
    if questions:
        # The judge's rates on unseen questions, flat for `dvc metrics show`, then per question.
        result.update({f"new_questions_{k}": v for k, v in judged["finetuned"].items()})
        result.update({"questions_file": cfg.questions, "judge": judged, "questions": verdicts})
        result.update({"questions_split": cfg.questions_split, "judge_decodings": by_decoding})
    atomic_write_json(Path(cfg.out) / "eval.json", result)
    return result
