"""Manifests: every artifact ENLACE writes is checked on load, a changed byte is refused naming the file.

Tiny models only (tests/helpers.make_folder: a 2-layer Llama of 64 wide), so each test takes seconds.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_folder

from enlace.cli import main
from enlace.errors import EnlaceError, WeightsError
from enlace.hf.folder import INDEX, load_hf_folder, save_hf_folder, write_model_manifest
from enlace.hf.gguf_export import export_folder_gguf
from enlace.hf.gguf_import import import_gguf
from enlace.hf.tokenizer import HFTokenizer
from enlace.lora import ADAPTER_WEIGHTS, AdapterError, inject_lora, load_adapter, save_adapter
from enlace.manifest import MANIFEST, ManifestError, sidecar, verify_manifest

ROOT = Path(__file__).resolve().parents[1]
CORRUPT = r"adapter_model\.safetensors: sha256 does not match manifest\.json \(file changed or corrupt\)"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A model folder ENLACE wrote (so it has a manifest), with the test tokenizer."""
    src = make_folder(tmp_path_factory.mktemp("src") / "m")
    return save_hf_folder(load_hf_folder(src), tmp_path_factory.mktemp("base") / "m", src, 1, 2, 2)


def adapter(base: Path, out: Path, fill: float | None = None) -> Path:
    model = load_hf_folder(base)
    inject_lora(model, ["q_proj", "v_proj"], rank=4, alpha=8)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        if fill is not None:
            model.model.layers[1].self_attn.v_proj.lora_B.weight[3, 1] = fill
    return save_adapter(model, out, str(base), {"config_hash": "0123456789abcdef"})


def flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_adapter_folder_is_written_whole_with_its_manifest(base, tmp_path):
    ad = adapter(base, tmp_path / "ad")
    doc = json.loads((ad / MANIFEST).read_text())
    assert sorted(doc["files"]) == ["adapter_config.json", ADAPTER_WEIGHTS]
    assert doc["kind"] == "lora-adapter" and doc["provenance"]["config_hash"] == "0123456789abcdef"
    assert (
        doc["provenance"]["base_fingerprint"]
        == json.loads((base / MANIFEST).read_text())["provenance"]["fingerprint"]
    )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_corrupt_adapter_is_refused_by_export_chat_and_serve(base, tmp_path, capsys):
    ad = adapter(base, tmp_path / "ad")
    flip_middle_byte(ad / ADAPTER_WEIGHTS)
    out = tmp_path / "merged"
    assert main(["export", "--model", str(base), "--adapter", str(ad), "--out", str(out)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {ad / ADAPTER_WEIGHTS}: sha256 does not match") and not out.exists()

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run(
        [sys.executable, "-m", "enlace.cli", "chat", "--model", str(base), "--adapter", str(ad)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert str(ad / ADAPTER_WEIGHTS) in one_error_line(r.stderr)

    from enlace.serve.loader import load_served

    with pytest.raises(ManifestError, match=CORRUPT):
        load_served(str(base), str(ad), default=lambda: (base, ad), weights="fp32")


def test_non_finite_adapter_is_refused_naming_the_tensor(base, tmp_path):
    ad = adapter(base, tmp_path / "ad", fill=float("nan"))
    with pytest.raises(
        AdapterError, match=r"tensor .*layers\.1\.self_attn\.v_proj\.lora_B\.weight has non-finite"
    ):
        load_adapter(load_hf_folder(base), ad, str(base))


def test_changed_shard_and_escaping_shard_names_are_refused(tmp_path):
    folder = make_folder(tmp_path / "sharded", shard=True)
    write_model_manifest(folder, "hf-model")
    index = json.loads((folder / INDEX).read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    flip_middle_byte(folder / shard)
    with pytest.raises(ManifestError, match=rf"{shard}: sha256 does not match manifest\.json"):
        load_hf_folder(folder)
    for bad in ("../outside.safetensors", "/etc/passwd"):
        key = next(iter(index["weight_map"]))
        (folder / INDEX).write_text(json.dumps({**index, "weight_map": {**index["weight_map"], key: bad}}))
        with pytest.raises(WeightsError, match=rf"shard name '{bad}' leaves the folder"):
            load_hf_folder(folder)


def test_changed_tokenizer_files_are_refused(base, tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(base, folder)
    flip_middle_byte(folder / "tokenizer.json")
    with pytest.raises(ManifestError, match=r"tokenizer\.json: sha256 does not match manifest\.json"):
        HFTokenizer(folder)
    # The run's own tokenizer folder (data/tokenizer): checked before sentencepiece reads it.
    from enlace.manifest import write_manifest
    from enlace.text import SentencePieceCodec

    run_tok = tmp_path / "tokenizer"
    run_tok.mkdir()
    (run_tok / "tokenizer.model").write_bytes(b"sentencepiece model bytes")
    write_manifest(run_tok, "tokenizer", {"config_hash": "feedc0de"})
    flip_middle_byte(run_tok / "tokenizer.model")
    with pytest.raises(ManifestError, match=r"tokenizer\.model: sha256 does not match"):
        SentencePieceCodec(run_tok / "tokenizer.model")


def test_truncated_gguf_is_refused_and_export_json_checked(base, tmp_path, capsys):
    gguf = export_folder_gguf(base, tmp_path / "m-f32.gguf", "f32")
    doc = json.loads(sidecar(gguf).read_text())
    assert doc["kind"] == "gguf" and doc["provenance"]["source_fingerprint"]
    assert import_gguf(gguf, tmp_path / "back").is_dir()  # checked, then read
    assert main(["verify", str(gguf)]) == 0
    assert "ok: " in capsys.readouterr().out
    data = gguf.read_bytes()
    gguf.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ManifestError, match=r"m-f32\.gguf: size \d+ does not match .*truncated"):
        import_gguf(gguf, tmp_path / "again")
    assert main(["verify", str(gguf)]) == 2
    assert "m-f32.gguf: size" in one_error_line(capsys.readouterr().err)


def test_verify_prints_provenance_and_flags_added_weights(base, tmp_path, capsys):
    ad = adapter(base, tmp_path / "ad")
    assert main(["verify", str(ad)]) == 0
    out = capsys.readouterr().out
    fingerprint = json.loads((base / MANIFEST).read_text())["provenance"]["fingerprint"]
    assert f"ok: {ad}: lora-adapter" in out and f"base_fingerprint: {fingerprint}" in out
    assert "config_hash: 0123456789abcdef" in out and "files checked (size and sha256): 2" in out
    (ad / "README.md").write_text("notes")  # an extra file that no loader reads is fine
    assert main(["verify", str(ad)]) == 0
    capsys.readouterr()
    (ad / "extra.safetensors").write_bytes(b"x")  # an extra weight file is not
    assert main(["verify", str(ad)]) == 2
    assert "extra.safetensors: not listed in manifest.json" in one_error_line(capsys.readouterr().err)


def test_legacy_folder_warns_once_then_verify_write_adopts_it(tmp_path, caplog, capsys):
    legacy = make_folder(tmp_path / "legacy")  # written by transformers: no manifest
    caplog.set_level(logging.WARNING, logger="enlace.manifest")
    load_hf_folder(legacy)
    HFTokenizer(legacy)
    warned = [r.getMessage() for r in caplog.records if r.name == "enlace.manifest"]
    assert len(warned) == 1 and "no manifest" in warned[0] and "--write" in warned[0]
    assert "\n" not in warned[0]
    assert main(["verify", str(legacy)]) == 2
    assert "no manifest" in one_error_line(capsys.readouterr().err)
    assert main(["verify", str(legacy), "--write"]) == 0
    out = capsys.readouterr().out
    assert f"adopted {legacy}" in out and "hf-model" in out and "fingerprint: " in out
    assert verify_manifest(legacy)["kind"] == "hf-model"
    flip_middle_byte(legacy / "model.safetensors")
    with pytest.raises(EnlaceError, match=r"model\.safetensors: sha256 does not match"):
        load_hf_folder(legacy)


def test_manifest_names_that_leave_the_folder_are_refused(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    entry = {"size": 2, "sha256": "0" * 64}
    (folder / MANIFEST).write_text(json.dumps({"kind": "x", "files": {"../config.json": entry}}))
    with pytest.raises(ManifestError, match=r"file name '\.\./config\.json' leaves the folder"):
        verify_manifest(folder)
