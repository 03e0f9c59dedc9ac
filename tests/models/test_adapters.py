"""LoRA adapters (issue 25, item 3): only the adapters train, their per-sample gradients are exact (the layer matrix
case hf_gpt2_lora in tests/privacy/test_layer_matrix.py), and DP-SGD's per-sample state grows with the adapters,
not with the frozen base model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("peft")
pytest.importorskip("transformers")

from lightning_dp.callbacks import DPSGD  # noqa: E402
from lightning_dp.models import GPT2, CausalLanguageModel, LoRA  # noqa: E402
from lightning_dp.models.language import load_weights  # noqa: E402
from lightning_dp.privacy.grad_sample import GradSampleEngine  # noqa: E402
from tests.helpers import ACCELERATORS, DEVICE, DeviceProbe, trainer  # noqa: E402


def _gpt2(vocab=23, **kw):
    torch.manual_seed(0)
    return GPT2(vocab_size=vocab, max_positions=16, embed_dim=16, num_layers=2, num_heads=2, dropout=0.0, **kw)


def test_only_the_adapters_are_trainable_and_start_as_the_base_model():
    base = _gpt2()
    ids = torch.randint(0, 23, (3, 10))
    before = base(ids).detach()
    net = LoRA(base, rank=4, target_modules=["c_attn", "c_proj", "c_fc"])
    trainable = [n for n, p in net.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 2 * 4  # (A, B) x 2 blocks x (c_attn, attn.c_proj, c_fc, mlp.c_proj)
    torch.testing.assert_close(net(ids), before)  # B starts at zero
    assert net.adapter_parameters() == sum(p.numel() for n, p in net.named_parameters() if "lora_" in n)


def test_target_modules_default_and_errors():
    assert LoRA(_gpt2()).target_modules == ["c_attn"]  # peft's default for GPT-2
    with pytest.raises(ValueError, match=r"target_modules \['nope'\] match no module"):
        LoRA(_gpt2(), target_modules=["nope"])
    with pytest.raises(ValueError, match="target_modules=None needs a transformers model"):
        LoRA(nn.Sequential(nn.Linear(2, 2)))
    for kwargs, match in ((dict(rank=0), "rank"), (dict(alpha=0), "alpha"), (dict(dropout=1.0), "dropout")):
        with pytest.raises(ValueError, match=match):
            LoRA(_gpt2(), **kwargs)


def _engine_state_bytes(model, ids):
    engine = GradSampleEngine(model)
    engine.probe(lambda n: model(ids[:n]).float().mean())
    with engine.record(batch_size=len(ids)):
        model(ids).float().mean().backward()
    engine.per_sample_norms()
    contributions = engine._contributions
    seen = {}
    for parts in contributions.values():
        for c in parts:
            for t in vars(c).values():
                if isinstance(t, torch.Tensor):
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    names = [layer.name for layer in engine.layers]
    engine.remove()
    return sum(seen.values()), names


def test_per_sample_state_grows_with_the_adapters_not_with_the_base_model():
    """The engine hooks only the adapters; a base model with a 100x larger (frozen) vocabulary table leaves the
    per-sample state unchanged, and doubling the rank grows it."""
    ids = torch.randint(0, 23, (8, 12))
    small, names = _engine_state_bytes(LoRA(_gpt2(23), rank=4, target_modules=["c_attn", "c_fc"]), ids)
    large, _ = _engine_state_bytes(LoRA(_gpt2(2300), rank=4, target_modules=["c_attn", "c_fc"]), ids)
    wider, _ = _engine_state_bytes(LoRA(_gpt2(23), rank=8, target_modules=["c_attn", "c_fc"]), ids)
    assert all("lora_A" in n or "lora_B" in n for n in names) and len(names) == 8
    assert large == small  # the frozen wte/lm_head grew 100x: no per-sample state for it
    assert wider > small


def _data(n=48, t=12, vocab=23):
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader(torch.randint(0, vocab, (n, t), generator=g), batch_size=8)


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("extra", [{}, {"precision": "bf16-mixed", "accumulate_grad_batches": 2}])
def test_dp_sgd_trains_only_the_adapters(extra, accelerator):
    net = LoRA(_gpt2(), rank=4, target_modules=["c_attn", "c_proj", "c_fc"])
    model = CausalLanguageModel(net, lr=0.05, optimizer="sgd")
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=0, max_physical_batch_size=5)
    probe = DeviceProbe()
    t = trainer(max_steps=3, callbacks=[dp, probe], accelerator=accelerator, **extra)
    t.fit(model, train_dataloaders=_data())
    assert t.global_step == dp._released == 3 and probe.devices == {DEVICE[accelerator]}
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    assert any(not torch.equal(p, adapters[n]) for n, p in model.named_parameters() if n in adapters)


def test_load_weights_from_a_lightning_checkpoint_and_refuse_another_size(tmp_path):
    model = CausalLanguageModel(_gpt2(), lr=0.01)
    t = trainer(max_steps=1)
    t.fit(model, train_dataloaders=_data())
    path = tmp_path / "base.ckpt"
    t.save_checkpoint(path)
    loaded = _gpt2(checkpoint=str(path))
    for a, b in zip(loaded.state_dict().values(), model.network.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="does not fit GPT2.*other shapes"):
        _gpt2(vocab=30, checkpoint=str(path))
    with pytest.raises(FileNotFoundError, match="no such file"):
        _gpt2(checkpoint=str(tmp_path / "missing.ckpt"))


def test_user_level_dp_sgd_trains_only_the_adapters_per_user():
    """Issue 51: LoRA under user sampling (each user's mean adapter gradient clipped as one) and under ELS."""

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(1)
            self.ids = torch.randint(0, 23, (40, 8), generator=g)
            self.user_ids = [i // 4 for i in range(40)]  # 10 users of 4 sequences

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return self.ids[i]

    for kwargs in ({"sampling": "user"}, {}):
        net = LoRA(_gpt2(), rank=4, target_modules=["c_attn", "c_fc"])
        model = CausalLanguageModel(net, lr=0.05, optimizer="sgd")
        frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        dp = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=0, privacy_unit="user", max_examples_per_user=3,
                   accountant_kwargs={"value_discretization_interval": 1e-3}, **kwargs)
        t = trainer(max_steps=3, callbacks=[dp], precision="bf16-mixed")
        t.fit(model, train_dataloaders=torch.utils.data.DataLoader(Tokens(), batch_size=4))
        assert t.global_step == 3 and dp.accountant.privacy_unit == "user"
        assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
