"""LoRA: exact start, frozen base, merge/unmerge, and PEFT interoperability in both directions."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_folder
from safetensors.torch import load_file, save_file

from enlace.errors import EnlaceError
from enlace.hf.folder import load_hf_folder
from enlace.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LoraLinear,
    inject_lora,
    load_adapter,
    lora_parameters,
    merge_and_unload,
    save_adapter,
    set_merged,
)

IDS = torch.tensor([list(range(3, 60))])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("lora") / "base")


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


def randomise_b(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_untrained_adapter_reproduces_base_and_only_lora_trains(folder):
    model = load_hf_folder(folder)
    base = logits(model)
    wrapped = inject_lora(model, ["q_proj", "v_proj", "down_proj"], rank=4, alpha=8, dropout=0.1)
    assert len(wrapped) == 6 and all(isinstance(m, LoraLinear) for m in wrapped.values())
    model.eval()
    assert torch.equal(logits(model), base)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in lora_parameters(model)} and len(trainable) == 12
    a = wrapped["model.layers.0.self_attn.q_proj"].lora_A.weight
    bound = 1 / a.shape[1] ** 0.5  # kaiming-uniform with a=sqrt(5), as PEFT
    assert a.abs().max() <= bound and a.abs().max() > 0.5 * bound and a.dtype == torch.float32
    model.train()
    model(IDS).logits.sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)
    assert wrapped["model.layers.0.self_attn.q_proj"].lora_A.weight.grad is not None


def test_merge_unmerge_and_unload(folder):
    model = load_hf_folder(folder)
    inject_lora(model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 4, 8)
    randomise_b(model)
    w0 = model.model.layers[1].mlp.up_proj.base.weight.clone()
    out = logits(model)
    set_merged(model, True)
    assert not torch.equal(model.model.layers[1].mlp.up_proj.base.weight, w0)
    assert (logits(model) - out).abs().max() < 1e-5
    set_merged(model, False)
    assert (model.model.layers[1].mlp.up_proj.base.weight - w0).abs().max() < 1e-6
    plain = merge_and_unload(model)
    assert isinstance(plain.model.layers[1].mlp.up_proj, torch.nn.Linear)
    assert (logits(plain) - out).abs().max() < 1e-5


def test_our_adapter_loads_in_peft_with_same_logits(folder, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = load_hf_folder(folder)
    inject_lora(model, ["q_proj", "v_proj", "gate_proj"], rank=4, alpha=16)
    randomise_b(model)
    save_adapter(model, tmp_path / "adapter", str(folder))
    keys = set(load_file(str(tmp_path / "adapter" / ADAPTER_WEIGHTS)))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in keys) and len(keys) == 12
    cfg = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 16 and cfg["bias"] == "none"
    assert cfg["task_type"] == "CAUSAL_LM" and cfg["fan_in_fan_out"] is False
    assert cfg["target_modules"] == ["gate_proj", "q_proj", "v_proj"]

    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), tmp_path / "adapter"
    ).eval()
    with torch.no_grad():
        ref = peft(IDS).logits
    assert (logits(model) - ref).abs().max() < 1e-4
    assert (logits(load_hf_folder(folder)) - ref).abs().max() > 1e-3  # the adapter does change the model


def test_peft_adapter_loads_in_ours_with_same_logits(folder, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    peft = get_peft_model(
        hf,
        LoraConfig(r=8, lora_alpha=32, target_modules=["k_proj", "o_proj", "up_proj"], task_type="CAUSAL_LM"),
    )
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    peft.save_pretrained(tmp_path / "peft")
    peft.eval()
    with torch.no_grad():
        ref = peft(IDS).logits
    model = load_hf_folder(folder)
    wrapped = load_adapter(model, tmp_path / "peft", str(folder))
    assert len(wrapped) == 6
    assert (logits(model.eval()) - ref).abs().max() < 1e-4


def test_wrong_rank_target_or_base_is_refused(folder, tmp_path):
    model = load_hf_folder(folder)
    inject_lora(model, ["q_proj", "v_proj"], rank=4, alpha=8)
    save_adapter(model, tmp_path / "a", str(folder))
    cfg_path = tmp_path / "a" / ADAPTER_CONFIG
    good = json.loads(cfg_path.read_text())

    cfg_path.write_text(json.dumps({**good, "r": 8}))
    with pytest.raises(EnlaceError, match=r"adapter_config\.json: size .* does not match manifest\.json"):
        load_adapter(load_hf_folder(folder), tmp_path / "a")
    # The checks behind the manifest's, on a folder without one (as PEFT writes them).
    (tmp_path / "a" / "manifest.json").unlink()
    with pytest.raises(EnlaceError, match="wrong shape.*lora_A"):
        load_adapter(load_hf_folder(folder), tmp_path / "a")

    cfg_path.write_text(json.dumps({**good, "target_modules": ["q_proj", "k_proj", "v_proj"]}))
    with pytest.raises(EnlaceError, match=r"4 missing \(e\.g\. .*layers\.0\.self_attn\.k_proj\.lora_A"):
        load_adapter(load_hf_folder(folder), tmp_path / "a")

    cfg_path.write_text(json.dumps({**good, "target_modules": ["q_proj"]}))
    with pytest.raises(EnlaceError, match=r"unexpected \(e\.g\. .*v_proj"):
        load_adapter(load_hf_folder(folder), tmp_path / "a")

    cfg_path.write_text(json.dumps(good))
    with pytest.raises(EnlaceError, match="trained on"):
        load_adapter(load_hf_folder(folder), tmp_path / "a", base_model="models/another-model")
    other = make_folder(tmp_path / "base", hidden_size=32, intermediate_size=64)  # same name, other weights
    with pytest.raises(EnlaceError, match="weights differ"):
        load_adapter(load_hf_folder(other), tmp_path / "a", base_model=str(other))

    tensors = load_file(str(tmp_path / "a" / ADAPTER_WEIGHTS))
    tensors.pop("base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight")
    save_file(tensors, str(tmp_path / "a" / ADAPTER_WEIGHTS))
    fresh = load_hf_folder(folder)
    with pytest.raises(
        EnlaceError,
        match=r"1 missing \(e\.g\. base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight\)",
    ):
        load_adapter(fresh, tmp_path / "a")
    assert not any(isinstance(m, LoraLinear) for m in fresh.modules())  # a failed load leaves no adapters
