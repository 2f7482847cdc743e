"""LoRA with a bf16 base: frozen linear weights in bf16, everything trained (adapters, AdamW state), the norms
and the tied embedding in fp32; a step under bf16 autocast gives the fp32 step's loss within bf16 rounding."""

import torch

from enlace.config.hardware import HardwareConfig
from enlace.config.model import ModelConfig
from enlace.finetune.loss import assistant_loss_sum
from enlace.lora import cast_frozen_base, inject_lora, lora_parameters
from enlace.model import Llama
from enlace.runtime import autocast

CFG = ModelConfig(name="t", vocab_size=128, n_layer=2, n_head=4, n_kv_head=2, d_model=64, seq_len=32)
BF16 = HardwareConfig(name="cpu-bf16", device="cpu", dtype="bf16")


def lora_model(bf16_base: bool) -> Llama:
    torch.manual_seed(0)
    model = Llama(CFG)
    inject_lora(model, ["q_proj", "v_proj", "gate_proj"], rank=4, alpha=8)
    if bf16_base:
        assert cast_frozen_base(model) > 0
    return model


def step(model: Llama, hw: HardwareConfig | None) -> tuple[float, torch.optim.AdamW]:
    torch.manual_seed(1)
    ids = torch.randint(0, CFG.vocab_size, (2, 24))
    labels = ids.clone()
    labels[:, :8] = -100  # prompt tokens carry no label
    opt = torch.optim.AdamW([p for _, p in lora_parameters(model)], lr=1e-2)
    with autocast(hw) if hw else torch.autocast("cpu", enabled=False):
        s, n = assistant_loss_sum(model, ids, labels)
    (s / n).backward()
    opt.step()
    return float((s / n).detach()), opt


def test_frozen_base_is_bf16_and_everything_trained_is_fp32():
    model = lora_model(bf16_base=True)
    for name, p in model.named_parameters():
        trained = ".lora_A." in name or ".lora_B." in name
        frozen_linear = p.dim() == 2 and not trained and "embed_tokens" not in name
        assert p.dtype == (torch.bfloat16 if frozen_linear else torch.float32), name
        assert p.requires_grad == trained, name
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie survives, in fp32
    loss, opt = step(model, BF16)
    for _, p in lora_parameters(model):
        assert p.grad is not None and p.grad.dtype == torch.float32
        assert all(v.dtype == torch.float32 for k, v in opt.state[p].items() if k != "step")
    ref, _ = step(lora_model(bf16_base=False), None)
    assert abs(loss - ref) / ref < 1e-2
