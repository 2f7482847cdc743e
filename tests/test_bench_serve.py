"""`make bench`'s serving table end to end on a tiny model: `enlace serve` and llama.cpp's own `llama-server`
built for this CPU (the `llama_cpp_native` fixture builds it once per machine, and marks the test `llamacpp`)
both serve the same weights at fp32/F32 and int8/Q8_0, a few tokens each. It checks that both answered every
kind of request and the table's shape, not speed: timings on a shared test machine mean nothing."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_folder

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ("decode_tokens_per_s", "ttft_s", "total_tokens_per_s", "peak_rss_mib")

pytestmark = [pytest.mark.usefixtures("llama_cpp_native"), pytest.mark.timeout(3600)]


def test_serving_table_compares_enlace_serve_with_llama_server(tmp_path):
    folder = make_folder(tmp_path / "tiny")
    out = tmp_path / "bench"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    cmd = [sys.executable, "-m", "bench.bench_llamacpp_serve", "--model", str(folder), "--precisions",
           "fp32,int8-torch", "--tokens", "12", "--prompt-tokens", "24", "--rounds", "1", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    data = json.loads((out / "serve.json").read_text())
    assert list(data["results"]) == ["tiny"]
    tables = data["results"]["tiny"]
    assert list(tables) == ["fp32", "int8-torch"]
    expected = {"fp32": ("fp32", "F32"), "int8-torch": ("int8, torch's kernels", "Q8_0")}
    for precision, (ours, theirs) in expected.items():
        rows = tables[precision]
        assert list(rows) == ["enlace serve", "llama.cpp native"]
        assert [rows[w]["weights"] for w in rows] == [ours, theirs]
        for who, f in rows.items():  # every figure measured: each server answered each kind of request
            assert all(math.isfinite(f[k]) and f[k] > 0 for k in FIGURES), (precision, who, f)
            assert len(f["decode_samples"]) == 1
        assert rows["llama.cpp native"]["ratios"] == {k: 1.0 for k in FIGURES}
        assert rows["enlace serve"]["ratios"]["decode_tokens_per_s"] == pytest.approx(
            rows["enlace serve"]["decode_tokens_per_s"] / rows["llama.cpp native"]["decode_tokens_per_s"]
        )
    assert data["isa_flags"] and data["cpu_model"] and data["tokens"] == 12 and data["prompt_tokens"] == 24
    assert len(data["rows"]) == 2 * len(FIGURES)  # the four goals of issue 39, per precision

    md = (out / "serve.md").read_text()
    assert f"CPU: {data['cpu_model']}; ISA flags: {' '.join(data['isa_flags'])}" in md
    sections = [line for line in md.splitlines() if line.startswith("## ")]
    assert sections == [
        "## tiny, fp32 (enlace fp32 against llama.cpp F32)",
        "## tiny, int8-torch (enlace int8 against llama.cpp Q8_0)",
    ]
    body = [line for line in md.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(body) == 2 * 3  # per precision: a header and one row per server
    assert sum("llama-server -np 4" in line for line in body) == 2
    assert md in proc.stdout  # the table is printed too


def test_a_cpu_with_native_bf16_measures_both_kernel_paths(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # bench/ is a package at the repository's root
    from bench.bench_llamacpp_serve import default_precisions

    assert default_precisions(native_bf16=True, own_kernels=True) == [
        "fp32", "bf16", "int8", "bf16-torch", "int8-torch"
    ]  # fmt: skip
    assert default_precisions(native_bf16=False, own_kernels=True) == ["fp32", "bf16", "int8"]
    assert default_precisions(native_bf16=False, own_kernels=False) == ["fp32", "int8"]
