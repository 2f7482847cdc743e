"""What the assistant knows when it need not phrase it: the judge's fact questions as multiple choice.

    python tools/knowledge_probe.py                                   # the in-context Gemma (the preamble)
    python tools/knowledge_probe.py --adapter runs/assistant-preamble-mid/adapter

For each fact question of `assets/eval/preguntas-juez.jsonl`, the prompt is the assistant's own (the preamble
and the question, ending at "ENLACE:"), and each candidate answer, the key and every key competing with it
(the question's `wrong` list; for a capital, every other capital), is scored as the continuation
" <candidate>." by the sum of its tokens' log-probabilities. The question counts as known when the key scores
highest. Free generation must find the answer among every word, so this is an upper bound of sorts on what
the judge's "correct" can reach with this base, not a score of the served assistant. Chance is the mean of
1 / (number of candidates). One forward pass per candidate, fp32: about 10 min on 2 Zen 4 cores.
"""

from __future__ import annotations

import argparse
import sys

import torch

from enlace.finetune.judge import read_questions
from enlace.load import load_model


def candidate_scores(loaded, prompt: list[int], candidates: list[str]) -> list[float]:
    """Sum of log-probabilities of " <candidate>." after the prompt, one forward pass each."""
    tok, scores = loaded.tokenizer, []
    for cand in candidates:
        ids = tok.encode(f" {cand}.")
        ids = ids[1:] if ids and ids[0] == tok.bos_id else ids  # a continuation takes no start token
        with torch.no_grad():
            logits = loaded.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        logp = torch.log_softmax(logits.float(), dim=-1)
        scores.append(float(logp.gather(1, torch.tensor(ids)[:, None]).sum()))
    return scores


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--assistant", default="configs/assistant/gemma3-preamble.yaml", help="a preamble spec")
    p.add_argument("--adapter", default=None, help="a LoRA adapter trained in the spec's format")
    p.add_argument("--questions", default="assets/eval/preguntas-juez.jsonl")
    args = p.parse_args(argv)
    loaded = load_model(args.assistant, adapter=args.adapter)
    loaded.model.eval()
    known: dict[str, list[int]] = {}
    chance: dict[str, float] = {}
    for q in read_questions(args.questions, None):
        if q.kind != "fact":
            continue
        candidates = [q.answer, *(c for c in q.competitors if c != q.answer)]
        scores = candidate_scores(
            loaded, loaded.chat_template([{"role": "user", "content": q.question}]), candidates
        )
        best = max(range(len(candidates)), key=scores.__getitem__)
        known.setdefault(q.split, []).append(int(best == 0))
        chance[q.split] = chance.get(q.split, 0.0) + 1 / len(candidates)
        mark = "known" if best == 0 else "not  "
        print(
            f"{q.id} {q.split:4} {mark} picked {candidates[best]!r} (key {q.answer!r}, {len(candidates)} candidates)"
        )
    for split, hits in known.items():
        print(
            f"{split}: key ranked first for {sum(hits)} of {len(hits)} fact questions (chance {chance[split]:.1f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
