"""`enlace export`: a trained run as a Hugging Face folder and GGUF, checked against transformers, PEFT,
and our own GGUF importer (llama.cpp: tests/test_llama_cpp.py). One tiny run is trained once for the module."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from export_helpers import ROOT, TINY, chat_rows, make_project, write_jsonl, write_tie_model

from enlace.cli import main
from enlace.config.model import ModelConfig
from enlace.errors import GGUFExportError, UnsupportedModelError
from enlace.export import sentencepiece_bundle, write_folder
from enlace.generate import generate
from enlace.hf import sp_convert
from enlace.hf.folder import load_hf_folder, read_state, write_model_manifest
from enlace.hf.gguf_export import export_folder_gguf
from enlace.hf.gguf_import import import_gguf
from enlace.load import load_trained_model
from enlace.model import Llama

PROMPT = "¿Qué hora es? El niño de la casa"


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("proj")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        make_project(root)
        assert main(["export", "--gguf", "--gguf-type", "f32"]) == 0
        yield root
    finally:
        os.chdir(cwd)


@pytest.fixture
def in_project(project, monkeypatch):
    monkeypatch.chdir(project)
    return project


def hf_load(folder, caplog, **kw):
    """transformers' model and the loading report; fails on any warning it logs."""
    from transformers import AutoModelForCausalLM

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="transformers"):
        model, info = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, output_loading_info=True, **kw
        )
    assert not any(r.levelno >= logging.WARNING for r in caplog.records), [r.message for r in caplog.records]
    return model.eval(), info


def ours_ids(project):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(project / "runs/export/hf")
    return tok(PROMPT)["input_ids"]


def test_export_loads_in_transformers_without_warnings_and_matches(in_project, caplog):
    folder = in_project / "runs/export/hf"
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert "tokenizer_config.json" in names
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["tie_word_embeddings"] is True
    hf, info = hf_load(folder, caplog)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"))
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # still tied
    ours, _, _ = load_trained_model(in_project / "runs/pretrain")
    ids = ours_ids(in_project)
    with torch.no_grad():
        diff = (hf(torch.tensor([ids])).logits - ours(torch.tensor([ids])).logits).abs().max().item()
    assert diff < 1e-4
    # Greedy decoding: identical tokens.
    mine = list(generate(ours, ids, 12))
    theirs = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert theirs[0, len(ids) :].tolist()[: len(mine)] == mine


def test_export_and_tokenizer_carry_manifests_enlace_verify_reads(in_project, capsys):
    """The export names its run (config hash, checkpoint) and its GGUF's sha256 in export.json is compared."""
    assert main(["verify", "runs/export/hf"]) == 0
    out = capsys.readouterr().out
    assert "ok: runs/export/hf: hf-model" in out and "config_hash: " in out and "checkpoint: " in out
    assert "hf-f32.gguf: sha256 matches runs/export/hf/export.json" in out
    assert main(["verify", "runs/export/hf-f32.gguf"]) == 0 and "gguf" in capsys.readouterr().out
    assert main(["verify", "data/tokenizer"]) == 0
    out = capsys.readouterr().out
    assert "ok: data/tokenizer: tokenizer" in out and "tokenizer.model" in out and "report.json" in out


def test_tokenizer_json_ids_equal_sentencepiece_on_val_and_edge_cases(in_project):
    import sentencepiece as spm
    from transformers import AutoTokenizer

    sp = spm.SentencePieceProcessor(model_file=str(in_project / "data/tokenizer/tokenizer.model"))
    tok = AutoTokenizer.from_pretrained(in_project / "runs/export/hf")
    val = [json.loads(x)["text"] for x in (in_project / "data/corpus/val.jsonl").read_text().splitlines()]
    for text in [*sp_convert.EDGE_CASES, *val]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == text
        assert tok(text)["input_ids"] == [sp.eos_id(), *ids]  # the document separator first, as in training
    for piece in ("<|im_start|>", "<|im_end|>"):
        assert tok.convert_tokens_to_ids(piece) == sp.piece_to_id(piece)
    assert (tok.bos_token_id, tok.eos_token_id) == (sp.eos_id(), sp.eos_id())
    assert (tok.pad_token_id, tok.unk_token_id) == (sp.pad_id(), sp.unk_id())
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hola"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "</s><|im_start|>user\nhola<|im_end|>\n<|im_start|>assistant\n"


def test_unigram_converts_and_unsupported_settings_are_refused(tmp_path):
    import random

    import sentencepiece as spm
    from export_helpers import spanish_doc

    rng = random.Random(1)
    lines = [line for _ in range(60) for line in spanish_doc(rng).split("\n") if line]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(tmp_path / "u"), model_type="unigram",
        vocab_size=340, byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"], split_digits=True, minloglevel=2,
    )  # fmt: skip
    model = tmp_path / "u.model"
    assert sp_convert.convert(model, lines[:50], tmp_path / "tokenizer.json")["type"] == "unigram"
    m = sp_convert.read_model(model)
    m.normalizer["name"] = "nmt_nfkc"
    m.normalizer["remove_extra_whitespaces"] = 1
    with pytest.raises(sp_convert.TokenizerConversionError, match="normalization 'nmt_nfkc'.*remove_extra"):
        sp_convert.build_from(m, "x.model")


def test_unigram_float32_tie_is_refused_with_the_reason(tmp_path):
    """sentencepiece's unigram picks other pieces for the same word deep into a long document (float32 path
    scores): the conversion check finds it and refuses, saying why and what to use instead."""
    import sentencepiece as spm

    model = write_tie_model(tmp_path / "tie.model")
    sp = spm.SentencePieceProcessor(model_file=str(model))
    tok = sp_convert.build(model)
    long = "c " * 40_000 + "ab"
    assert sp.encode("ab", out_type=str) == ["▁a", "b"] and sp.encode(long, out_type=str)[-2:] == ["▁", "ab"]
    sp_convert.verify(model, tok, ["ab", "c ab"])
    with pytest.raises(sp_convert.TokenizerConversionError, match="float32.*tokenizer.type: bpe"):
        sp_convert.convert(model, [long], tmp_path / "tokenizer.json")
    assert not (tmp_path / "tokenizer.json").exists()


def test_llama_variant_untied_loads_in_transformers(in_project, tmp_path, caplog):
    cfg = ModelConfig(
        name="t", vocab_size=600, n_layer=2, n_head=4, n_kv_head=2, d_model=32, seq_len=64, ffn_multiple_of=16,
        tie_embeddings=False, qk_norm=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Llama(cfg).eval()
    bundle = sentencepiece_bundle(in_project / "data/tokenizer", cfg.seq_len, [])
    bundle.extra_files.append(in_project / "data/tokenizer/tokenizer.model")
    write_folder(model, bundle, tmp_path / "llama")
    assert json.loads((tmp_path / "llama/config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    hf, info = hf_load(tmp_path / "llama", caplog)
    ids = torch.tensor([ours_ids(in_project)])
    with torch.no_grad():
        assert (hf(ids).logits - model(ids).logits).abs().max() < 1e-4
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)
    # GGUF of the llama architecture: q/k rows permuted the llama.cpp way; transformers undoes it.
    export_folder_gguf(tmp_path / "llama", tmp_path / "llama.gguf", "f32")
    g, _ = hf_load(tmp_path, caplog, gguf_file="llama.gguf")
    with torch.no_grad():
        assert (g(ids).logits - model(ids).logits).abs().max() < 1e-4
    back = read_state(import_gguf(tmp_path / "llama.gguf", tmp_path / "back"))
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_squared_relu_exports_for_transformers_and_other_switches_are_refused(in_project, tmp_path, caplog):
    cfg = ModelConfig(
        name="t", vocab_size=600, n_layer=2, n_head=4, n_kv_head=2, d_model=32, seq_len=64, ffn_multiple_of=16,
        qk_norm=False, mlp_act="relu2",
    )  # fmt: skip
    torch.manual_seed(0)
    model = Llama(cfg).eval()
    bundle = sentencepiece_bundle(in_project / "data/tokenizer", cfg.seq_len, [])
    write_folder(model, bundle, tmp_path / "relu2")
    assert json.loads((tmp_path / "relu2/config.json").read_text())["hidden_act"] == "relu2"
    hf, _ = hf_load(tmp_path / "relu2", caplog)
    ids = torch.tensor([ours_ids(in_project)])
    with torch.no_grad():
        assert (hf(ids).logits - model(ids).logits).abs().max() < 1e-4
    assert load_hf_folder(tmp_path / "relu2").cfg.mlp_act == "relu2"
    with pytest.raises(GGUFExportError, match="mlp_act relu2"):
        export_folder_gguf(tmp_path / "relu2", tmp_path / "relu2.gguf", "f32")
    for switch in ({"value_embeds": True}, {"logit_softcap": 30.0}):
        with pytest.raises(UnsupportedModelError, match=next(iter(switch))):
            write_folder(Llama(cfg.model_copy(update=switch)), bundle, tmp_path / "foreign")
    assert not (tmp_path / "foreign").exists()


def test_byte_level_smoke_model_exports(in_project, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = ["--model", "smoke", "--train", "smoke", *TINY, "--set", "model.vocab_size=256"]
    args += ["--set", "train.grad_accum_steps=1"]
    assert main(["pretrain", "--no-progress", "--run-dir", str(tmp_path / "b"), *args]) == 0
    assert main(["export", "--run-dir", str(tmp_path / "b"), "--out", str(tmp_path / "bh"), "--gguf"]) == 0
    tok = AutoTokenizer.from_pretrained(tmp_path / "bh")
    text = "¿Año? 🙂"
    assert tok(text)["input_ids"] == list(text.encode()) and tok.decode(list(text.encode())) == text
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "bh", dtype=torch.float32).eval()
    ours, _, _ = load_trained_model(tmp_path / "b")
    ids = torch.tensor([list(text.encode())])
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids).logits).abs().max() < 1e-4
    assert import_gguf(tmp_path / "bh-f16.gguf", tmp_path / "bg").is_dir()


@pytest.mark.parametrize("ftype", ["f32", "f16"])
def test_gguf_round_trip_and_transformers(in_project, tmp_path, ftype, caplog):
    folder = in_project / "runs/export/hf"
    path = export_folder_gguf(folder, tmp_path / f"m-{ftype}.gguf", ftype)
    ref = load_hf_folder(folder)
    if ftype == "f16":  # what the file holds: matrices rounded to f16, norms kept f32
        with torch.no_grad():
            for p in ref.parameters():
                if p.dim() > 1:
                    p.copy_(p.half().float())
    back = import_gguf(path, tmp_path / "back")
    state = read_state(back)
    assert all(torch.equal(state[k], v) for k, v in ref.state_dict().items() if k != "lm_head.weight")
    ids = ours_ids(in_project)
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(back / "tokenizer.json")).encode(PROMPT).ids == ids
    # transformers' GGUF reader does not map qwen3.attention.key_length (llama.cpp reads it) and falls back
    # to Qwen3's default head_dim of 128, so it is passed explicitly.
    g, _ = hf_load(tmp_path, caplog, gguf_file=path.name, head_dim=ref.cfg.head_dim)
    with torch.no_grad():
        assert (g(torch.tensor([ids])).logits - ref(torch.tensor([ids])).logits).abs().max() < 1e-4


def test_finetune_on_export_then_peft_and_merged_export(in_project, tmp_path, caplog):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = in_project / "runs/export/hf"
    train = write_jsonl(tmp_path / "train.jsonl", chat_rows(8))
    val = write_jsonl(tmp_path / "val.jsonl", chat_rows(10)[8:])
    args = ["finetune", "--model", str(folder), "--data", str(train), "--val-data", str(val), "--steps", "3"]
    args += ["--batch", "2", "--max-len", "64", "--rank", "4", "--out", str(tmp_path / "ft"), "--quiet"]
    args += [
        "--set",
        "finetune.schedule.warmup_steps=1",
        "--set",
        "finetune.optimizer.lr=0.05",
        "--targets",
        "q_proj,v_proj,up_proj",
    ]
    assert main(args) == 0
    adapter = tmp_path / "ft" / "adapter"
    ids = torch.tensor([ours_ids(in_project)])
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    emb = base.model.embed_tokens.weight.detach().clone()
    peft = PeftModel.from_pretrained(base, adapter).eval()
    from enlace.load import load_model

    mine = load_model(folder, adapter).model
    with torch.no_grad():
        ref = peft(ids).logits
        assert (mine(ids).logits - ref).abs().max() < 1e-4
    merged_ref = peft.merge_and_unload().eval()
    out = tmp_path / "merged"
    assert (
        main(["export", "--model", str(folder), "--adapter", str(adapter), "--out", str(out), "--gguf"]) == 0
    )
    hf, info = hf_load(out, caplog)
    with torch.no_grad():
        assert (hf(ids).logits - merged_ref(ids).logits).abs().max() < 1e-4
        assert (hf(ids).logits - base_logits(folder, ids)).abs().max() > 1e-4  # the adapter did something
    assert (
        torch.equal(hf.model.embed_tokens.weight, emb)
        and hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    )
    g = import_gguf(tmp_path / "merged-f16.gguf", tmp_path / "mg")
    assert load_hf_folder(g).cfg.tie_embeddings


def base_logits(folder, ids):
    with torch.no_grad():
        return load_hf_folder(folder)(ids).logits


def test_export_refusals(in_project, tmp_path, capsys):
    assert main(["export", "--run-dir", str(tmp_path / "nope")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main(["export", "--model", str(in_project / "runs/export/hf")]) == 2
    assert "go together" in capsys.readouterr().err
    (tmp_path / "f").write_text("x")
    assert main(["export", "--out", str(tmp_path / "f")]) == 2
    assert main(["export", "--gguf-type", "q4"]) == 2


def test_benchmark_items_are_well_formed():
    from enlace.eval.bench_es import SUBTASKS

    root = Path(__file__).resolve().parents[1] / "assets" / "bench_es"
    pairs = [
        json.loads(x) for s in SUBTASKS for x in (root / f"pares_{s[10:]}.jsonl").read_text().splitlines()
    ]
    conts = [json.loads(x) for x in (root / "continuaciones.jsonl").read_text().splitlines()]
    assert len(pairs) + len(conts) >= 400 and len({p["good"] for p in pairs}) == len(pairs)
    for p in pairs:
        assert p["prefix"] and p["good_rest"] != p["bad_rest"]
        assert f"{p['prefix']} {p['good_rest']}" == p["good"] and f"{p['prefix']} {p['bad_rest']}" == p["bad"]
    assert all(len(set(c["choices"])) == 4 and 0 <= c["label"] < 4 for c in conts)


def test_bench_es_runs_offline_with_no_network(in_project, tmp_path, monkeypatch):
    """Any connection to a non-loopback address fails the run; it must not need one."""
    import socket

    from enlace.eval.bench_es import OFFLINE

    attempts = []
    real_connect = socket.socket.connect

    def guarded(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if (
            isinstance(host, str)
            and host not in ("127.0.0.1", "::1", "localhost")
            and not host.startswith("/")
        ):
            attempts.append(address)
            raise OSError(f"network disabled in this test: {address}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    for k in OFFLINE:
        monkeypatch.delenv(k, raising=False)
    shutil.copytree(Path(__file__).resolve().parents[1] / "assets", in_project / "assets", dirs_exist_ok=True)
    out = tmp_path / "bench.json"
    assert main(["bench-es", str(in_project / "runs/export/hf"), "--out", str(out), "--limit", "3"]) == 0
    assert attempts == [] and all(os.environ[k] == "1" for k in OFFLINE)
    r = json.loads(out.read_text())["tasks"]
    assert r["enlace_es_continuaciones"]["n"] == 3 and 0 <= r["enlace_es_pares"]["acc"] <= 1
    assert r["enlace_es_pares"]["acc_stderr"] is not None


# ---- hostile inputs around Hugging Face folders, GGUF files and adapters (issue 12) ----------------------


def test_cli_refusals_name_the_bad_path(in_project, tmp_path, capsys):
    folder = in_project / "runs/export/hf"
    assert main(["generate", "--model", str(folder), "--raw", "", "--max-new-tokens", "4"]) == 0
    capsys.readouterr()
    for args, needle in (
        (["generate", "--model", str(tmp_path / "missing"), "hola"], "no such folder"),
        (["finetune", "--model", str(tmp_path / "missing"), "--quiet"], "no such folder"),
        (
            ["import-gguf", "--gguf", str(folder / "config.json"), "--out", str(tmp_path / "o")],
            "not a GGUF file",
        ),
        (
            ["import-gguf", "--gguf", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "o")],
            "no such file",
        ),
    ):
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((in_project / "runs/export/hf-f32.gguf").read_bytes()[:200])
    assert main(["import-gguf", "--gguf", str(cut), "--out", str(tmp_path / "o")]) == 2
    assert "unreadable GGUF" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_adapter_follows_base_content_not_its_path(in_project, tmp_path):
    from safetensors.torch import load_file, save_file

    from enlace.lora import ADAPTER_CONFIG, AdapterError, inject_lora, load_adapter, save_adapter
    from enlace.manifest import ManifestError

    folder = in_project / "runs/export/hf"
    model = load_hf_folder(folder)
    inject_lora(model, ["q_proj", "v_proj"], rank=4, alpha=8)
    save_adapter(model, tmp_path / "ad", str(folder))
    copy = tmp_path / "a-copy-named-otherwise"
    shutil.copytree(folder, copy)
    assert len(load_adapter(load_hf_folder(copy), tmp_path / "ad", str(copy))) == 4
    state = load_file(str(copy / "model.safetensors"))
    state["model.norm.weight"] = state["model.norm.weight"] * 2
    save_file(state, str(copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ManifestError, match=r"model\.safetensors: sha256 does not match manifest\.json"):
        load_hf_folder(copy)
    write_model_manifest(copy, "hf-model")  # now another model, under the same name
    with pytest.raises(AdapterError, match="weights differ"):
        load_adapter(load_hf_folder(copy), tmp_path / "ad", str(copy))
    # Shape mismatches: one short line, every tensor in the file it names.
    cfg = json.loads((tmp_path / "ad" / ADAPTER_CONFIG).read_text())
    (tmp_path / "ad" / "manifest.json").unlink()  # a hand-edited adapter, as PEFT writes them: no manifest
    (tmp_path / "ad" / ADAPTER_CONFIG).write_text(json.dumps({**cfg, "r": 8}))
    with pytest.raises(AdapterError) as e:
        load_adapter(load_hf_folder(folder), tmp_path / "ad", str(folder))
    msg = str(e.value)
    assert "8 wrong shape" in msg and len(msg) < 600 and "\n" not in msg
    listed = Path(msg.rsplit("full list in ", 1)[1]).read_text().splitlines()
    assert len(listed) == 8 and all(line.startswith("wrong shape: ") for line in listed)


def test_merged_export_of_a_byte_level_bpe_base_as_gguf(tmp_path, caplog):
    """A GPT-2-style folder (as SmolLM2's) merged with an adapter: equal to PEFT's merge, and its GGUF
    (llama architecture, q/k permuted, "gpt2" vocabulary, llama.cpp's "gpt-2" pre-tokenizer: it refuses the
    file for "gpt2") reads back with the same tensors and tokenizer."""
    from gguf import GGUFReader
    from helpers import SENTENCES, make_folder
    from peft import PeftModel
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from enlace.lora import inject_lora, save_adapter

    base = make_folder(tmp_path / "base")
    model = load_hf_folder(base)
    inject_lora(model, ["q_proj", "k_proj", "down_proj"], rank=4, alpha=8)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    save_adapter(model, tmp_path / "ad", str(base))
    out = tmp_path / "merged"
    assert (
        main(["export", "--model", str(base), "--adapter", str(tmp_path / "ad"), "--out", str(out), "--gguf"])
        == 0
    )
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    ids = torch.tensor([tok.encode(" ".join(SENTENCES)).ids])
    ref = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), tmp_path / "ad"
    )
    ref = ref.merge_and_unload().eval()
    hf, _ = hf_load(out, caplog)
    with torch.no_grad():
        assert (hf(ids).logits - ref(ids).logits).abs().max() < 1e-4
    fields = GGUFReader(tmp_path / "merged-f16.gguf").fields
    assert fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    back = import_gguf(tmp_path / "merged-f16.gguf", tmp_path / "back")
    assert (
        Tokenizer.from_file(str(back / "tokenizer.json")).encode(SENTENCES[1]).ids
        == tok.encode(SENTENCES[1]).ids
    )
    merged = read_state(out)
    state = read_state(back)
    assert all(torch.equal(state[k], v.half().float() if v.dim() > 1 else v) for k, v in merged.items())


def test_ablation_scores_the_choices_as_bench_es_does(in_project, monkeypatch):
    """The ablation table's minimal-pair and continuation columns are `make bench-es`'s scores of the run's
    export; the scratch export is removed again."""
    from enlace.ablate.runner import choices
    from enlace.config import load_config
    from enlace.eval.bench_bases import Entry, bench_one

    items = in_project / "assets" / "bench_es"  # another test of the module may have put them there
    if not items.exists():
        items.parent.mkdir(exist_ok=True)
        items.symlink_to(ROOT / "assets" / "bench_es")
    got = choices(Path("runs/pretrain"), load_config("params.yaml"))
    assert not Path("runs/pretrain/hf").exists()
    row = bench_one(Entry("run", Path("runs/export/hf")), "Hola.", Path("assets/bench_es"), None, 64)
    assert got == {"pairs_acc": row["pairs_acc"], "continuations_acc": row["continuations_acc"]}
    assert 0 < got["pairs_acc"] < 1 and 0 < got["continuations_acc"] < 1
    # The path for a run no exported architecture has (value embeddings): ENLACE's own decoder and the same
    # tokenizer give the same answers as the export through transformers.
    from enlace.ablate.runner import native_scorer
    from enlace.eval.bench_bases import choice_metrics

    scratch = in_project / "native-scorer"
    m = choice_metrics(*native_scorer(Path("runs/pretrain"), scratch), items)
    assert {k: m[k] for k in got} == got
    # bench/pairs_paired.py's item-by-item answers add up to the same accuracy; McNemar's exact test.
    monkeypatch.syspath_prepend(str(ROOT))  # bench/ is a package at the repository's root
    from bench.pairs_paired import compare, correct_items, mcnemar_exact

    answers = correct_items(Path("runs/pretrain"))
    assert (
        compare(answers, answers)["a_acc"] == got["pairs_acc"]
        and compare(answers, answers)["mcnemar_p"] == 1.0
    )
    assert mcnemar_exact(0, 5) == 0.0625 and mcnemar_exact(3, 3) == 1.0 and mcnemar_exact(2, 12) < 0.05
