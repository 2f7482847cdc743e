"""Data stages at scale: fetch -> extract/clean -> dedup/split -> tokenizer -> shard on a synthetic corpus.

Generates Spanish-like parquet files (random documents over a Spanish vocabulary with its function words, so
the cleaning keeps them and dedup finds nothing), serves them from a local Hugging Face stand-in
(tests/hub_server.py) and runs the real pipeline in a child process per task count, sampling the resident
memory of the whole process tree. A benchmark, not a test:

    python -m bench.bench_data --mib 256 --tasks 1 2

Prints MB/s of input text and the peak memory of the process tree per stage (PSS: shared pages split among
the processes that share them, so forked tasks are not counted twice; the RSS sum is kept beside it), and
whether the
corpus and shards are identical across task counts; writes bench/results/data-<MiB>mib.json. The goal (issue 13):
peak under 2 GiB for a 10 GiB corpus, i.e. a peak that does not grow with the corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_SENTENCES = 100_000  # tokenizer sample: ~50 MiB of these ~0.5 KB lines
FUNCTION = "de la que el en y los del se las por un para con una su al lo como más pero sus le ya".split()
CONTENT = (
    "casa ciudad río montaña libro mesa camino puerta ventana pueblo barco jardín árbol historia tiempo "
    "mundo gobierno año día vida parte forma caso país lugar agua tierra noche mujer hombre niño trabajo "
    "grande pequeña antigua nueva roja verde tranquila oscura alegre lejana mira tiene busca encuentra "
    "lleva cuenta abre cierra recuerda construye pinta vende escribe canta habla vive sale llega"
).split()


def make_parquet(folder: Path, mib: int, file_mib: int = 64, seed: int = 0) -> int:
    """Write ~mib MiB of text as parquet files of ~file_mib MiB of text each. Returns the text bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    # 20,000 pseudo-words from Spanish syllables with Zipf-like frequencies, plus the function words the
    # language filter counts (about a third of the running words, as in real Spanish prose).
    syll = [
        c + v
        for c in ("", "b", "c", "d", "f", "g", "l", "m", "n", "p", "r", "s", "t", "ch", "ll")
        for v in "aeiou"
    ]
    pseudo = sorted({"".join(rng.choice(syll, rng.integers(2, 5))) for _ in range(30000)})[:20000]
    vocab = np.array(FUNCTION + CONTENT + pseudo)
    weights = np.concatenate(
        [np.full(len(FUNCTION), 0.35 / len(FUNCTION)), 0.65 / np.arange(2, len(CONTENT) + len(pseudo) + 2)]
    )
    weights[len(FUNCTION) :] *= 0.65 / weights[len(FUNCTION) :].sum()
    weights /= weights.sum()
    suffixes = [""] * 8 + ["s", "es", "ado", "ción", "mente", "ista"]
    words, cdf = vocab.tolist(), np.cumsum(weights)
    total, i = 0, 0
    folder.mkdir(parents=True, exist_ok=True)
    while total < mib << 20:
        texts: list[str] = []
        size = 0
        while size < file_mib << 20 and total + size < mib << 20:
            # A batch of 500 documents of 3-7 paragraphs of 40-119 words, all words drawn at once.
            paras = rng.integers(3, 8, size=500)
            lengths = rng.integers(40, 120, size=int(paras.sum()))
            n = int(lengths.sum())
            idx = np.minimum(np.searchsorted(cdf, rng.random(n) * cdf[-1]), len(words) - 1).tolist()
            suf = rng.integers(0, len(suffixes), size=n).tolist()
            drawn = [words[a] + suffixes[b] for a, b in zip(idx, suf, strict=True)]
            ends = np.cumsum(lengths).tolist()
            para_text = [
                " ".join(drawn[e - k : e]).capitalize() + "."
                for e, k in zip(ends, lengths.tolist(), strict=True)
            ]
            at = 0
            for k in paras.tolist():
                doc = "\n\n".join(para_text[at : at + k])
                at += k
                texts.append(doc)
                size += len(doc.encode())
                if size >= file_mib << 20 or total + size >= mib << 20:
                    break
        pq.write_table(
            pa.table({"id": [str(j) for j in range(len(texts))], "text": texts}), folder / f"{i:03d}.parquet"
        )
        total += size
        i += 1
    return total


def child(work: Path, endpoint: str, tasks: int, text_bytes: int) -> None:
    """The pipeline, stage by stage, timed (runs in its own process so its memory can be measured)."""
    from enlace.config.data import DataConfig, TokenizerConfig
    from enlace.data.corpus import corpus_stages, work_items
    from enlace.data.engine import run_stages
    from enlace.data.pipeline_steps import raise_recorded_errors
    from enlace.data.shard import build_shards
    from enlace.data.sources import Lock, fetch_source
    from enlace.data.tokenize import build_tokenizer
    from enlace.io import sha256_file

    data = DataConfig.model_validate(
        {
            "name": "bench",
            "val_fraction": 0.01,
            "cleaning": {"min_doc_chars": 200},
            "executor": {"tasks": tasks, "workers": tasks},
            "sources": [
                {
                    "name": "synth",
                    "kind": "hf",
                    "repo": "bench/es",
                    "files": ["data/*.parquet"],
                    "endpoint": endpoint,
                    "extractor": "parquet",
                }
            ],
        }
    )
    raw, out = work / f"raw{tasks}", work / f"corpus{tasks}"
    import resource

    times: dict[str, float] = {}
    # The child's own peak so far (MiB) after each stage; tasks run in other processes (the parent samples
    # the whole tree, per stage, through the stage file).
    rss: dict[str, float] = {}
    stage_file = work / f"stage{tasks}"

    def start(stage: str) -> float:
        stage_file.write_text(stage)
        return time.perf_counter()

    def mark(stage: str, t: float) -> None:
        times[stage] = time.perf_counter() - t
        rss[stage] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    t = start("fetch")
    lock = Lock.load(work / f"lock{tasks}.json")
    roots = {"synth": fetch_source(data.sources[0], raw, lock)}
    lock.save()
    mark("fetch", t)
    items = work_items(data, roots)
    extract, rest = corpus_stages(data, items, raw / ".work", out, "bench")
    t = start("extract+clean")
    run_stages(extract, data.executor, work / "logs" / "extract")
    raise_recorded_errors(raw / ".work")
    mark("extract+clean", t)
    for stage in rest:  # exact dedup, MinHash signatures, buckets, cluster, split+write
        t = start(stage.name)
        run_stages([stage], data.executor, work / "logs" / stage.name)
        raise_recorded_errors(raw / ".work")
        mark(stage.name, t)
    t = start("tokenizer")
    # A fixed thread count: the tokenizer is trained once, not per task, and its threads change the model.
    # The sample (input_sentence_size sentences, ~0.5 KB each here) bounds its memory, not the corpus.
    tok = TokenizerConfig(type="bpe", vocab_size=8192, input_sentence_size=SAMPLE_SENTENCES, num_threads=2)
    build_tokenizer(tok, out, work / f"tok{tasks}")
    mark("tokenizer", t)
    t = start("shard")
    m = build_shards(out, work / f"tok{tasks}", work / f"shards{tasks}", "uint16", 8192, 1 << 24, tasks=tasks)
    mark("shard", t)
    # Hashed in chunks, under a stage of its own: reading the corpus whole to hash it once made the "shard"
    # peak of a 10 GiB run 11 GB, the size of train.jsonl, while the stage itself stayed flat.
    start("check")
    manifest_sha = sha256_file(work / f"shards{tasks}" / "manifest.json")
    corpus_sha = sha256_file(out / "train.jsonl")
    print(
        json.dumps(
            {
                "seconds": times,
                "self_peak_rss_mib_after": rss,
                "mb_per_s": {k: text_bytes / 1e6 / v for k, v in times.items()},
                "tokens": m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"],
                "corpus_train_sha256": corpus_sha,
                "shard_manifest_sha256": manifest_sha,
            }
        )
    )


def tree_memory(pid: int) -> tuple[int, int]:
    """(sum of RSS, sum of PSS) over the process tree. Task processes are forked, so their RSS counts the
    pages they share with the parent once per process; PSS splits each shared page among its sharers, so
    its sum is the physical memory the tree holds."""
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    rss = pss = 0
    for q in procs:
        try:
            full = q.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss += full.rss
        pss += full.pss
    return rss, pss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256, help="MiB of synthetic text")
    ap.add_argument("--file-mib", type=int, default=64, help="MiB of text per parquet file")
    ap.add_argument("--tasks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--child", nargs=4, metavar=("WORK", "ENDPOINT", "TASKS", "BYTES"))
    args = ap.parse_args()
    if args.child:
        work, endpoint, tasks, nbytes = args.child
        child(Path(work), endpoint, int(tasks), int(nbytes))
        return
    sys.path.insert(0, str(ROOT / "tests"))
    from hub_server import serve_hub

    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp, serve_hub() as hub:
        work = Path(tmp)
        t = time.perf_counter()
        text_bytes = make_parquet(work / "src", args.mib, args.file_mib)
        files = {f"data/{p.name}": p.read_bytes() for p in sorted((work / "src").glob("*.parquet"))}
        hub.publish("bench/es", files)
        print(
            f"generated {text_bytes / 2**20:.0f} MiB of text in {len(files)} parquet files "
            f"({sum(map(len, files.values())) / 2**20:.0f} MiB) in {time.perf_counter() - t:.0f} s"
        )
        env = dict(os.environ, ENLACE_NO_PROGRESS="1", OMP_WAIT_POLICY="PASSIVE")
        for tasks in args.tasks:
            cmd = [
                sys.executable,
                "-m",
                "bench.bench_data",
                "--child",
                str(work),
                hub.url,
                str(tasks),
                str(text_bytes),
            ]
            errlog = open(work / f"child{tasks}.log", "w")  # noqa: SIM115 - closed after the wait
            p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=errlog, text=True)
            peak = {"rss": 0, "pss": 0}
            stage_peak: dict[str, dict[str, int]] = {}
            stage_file = work / f"stage{tasks}"
            while p.poll() is None:
                now = dict(zip(("rss", "pss"), tree_memory(p.pid), strict=True))
                try:
                    stage = stage_file.read_text()
                except OSError:
                    stage = "start"
                at = stage_peak.setdefault(stage, {"rss": 0, "pss": 0})
                for k, v in now.items():
                    peak[k] = max(peak[k], v)
                    at[k] = max(at[k], v)
                time.sleep(0.2)
            out = p.stdout.read() if p.stdout else ""
            errlog.close()
            if p.returncode != 0:
                tail = (work / f"child{tasks}.log").read_text()[-3000:]
                raise SystemExit(f"bench child with {tasks} tasks failed ({p.returncode}):\n{tail}")
            r = json.loads(out.strip().splitlines()[-1])
            r["peak_pss_mib"] = peak["pss"] / 2**20
            r["peak_rss_sum_mib"] = peak["rss"] / 2**20
            r["stage_peak_pss_mib"] = {k: v["pss"] / 2**20 for k, v in stage_peak.items()}
            r["stage_peak_rss_sum_mib"] = {k: v["rss"] / 2**20 for k, v in stage_peak.items()}
            results[f"tasks_{tasks}"] = r
            rates = ", ".join(
                f"{k} {v:.1f} MB/s {r['stage_peak_pss_mib'].get(k, 0):.0f} MiB"
                for k, v in r["mb_per_s"].items()
            )
            print(
                f"{tasks} task(s): {rates}; peak memory {peak['pss'] / 2**20:.0f} MiB PSS "
                f"({peak['rss'] / 2**20:.0f} MiB summing RSS, which counts forked pages once per process)",
                flush=True,
            )
    shas = {r["corpus_train_sha256"] + r["shard_manifest_sha256"] for r in results.values()}
    print(f"corpus and shard manifest identical across task counts: {len(shas) == 1}")
    summary = {"text_mib": text_bytes / 2**20, "cores": os.cpu_count(), "results": results}
    out = ROOT / "bench" / "results" / f"data-{args.mib}mib.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
