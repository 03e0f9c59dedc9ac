"""The engine's per-user gradients (issue 51, ULS): ``group_norms`` and the clipped sum that follows equal the naive
per-user MEAN gradients computed by per-example autograd, for every contribution form (factored linear and
convolution weights, embedding rows, dense norm-layer gradients, tied weights, LoRA adapters), and a user whose
example is dropped for a non-finite gradient keeps the others'."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_dp.privacy.grad_sample import GradSampleEngine
from tests.helpers import probe


class Mixed(nn.Module):
    """Embedding, Conv1d, LayerNorm, Linear, and an output layer tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 6)
        self.conv = nn.Conv1d(6, 6, 3, padding=1)
        self.norm = nn.LayerNorm(6)
        self.lin = nn.Linear(6, 6)
        self.out = nn.Linear(6, 20, bias=False)
        self.out.weight = self.emb.weight  # tied, through a module (as GPT-2's output layer)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(self.emb(tokens).transpose(1, 2))).transpose(1, 2)
        h = torch.tanh(self.lin(self.norm(h))).mean(1)
        return self.out(h)


def _naive(model: nn.Module, loss_of, inputs: torch.Tensor, sizes: list[int], factors: torch.Tensor):
    per = []
    for i in range(inputs.shape[0]):
        model.zero_grad()
        loss_of(model, inputs[i:i + 1]).backward()
        per.append({id(p): p.grad.detach().clone() for p in model.parameters() if p.requires_grad})
    norms, total, start = [], {k: torch.zeros_like(v) for k, v in per[0].items()}, 0
    for g, n in enumerate(sizes):
        mean = {k: sum(per[i][k] for i in range(start, start + n)) / n for k in per[0]}
        norms.append(math.sqrt(sum(float((t ** 2).sum()) for t in mean.values())))
        for k, t in mean.items():
            total[k] += factors[g] * t
        start += n
    return torch.tensor(norms), total


def _engine(model: nn.Module, loss_of, inputs: torch.Tensor, sizes: list[int], factors: torch.Tensor):
    engine = GradSampleEngine(model)
    probe(engine, model, inputs)
    engine.start(batch_size=inputs.shape[0])
    model.zero_grad()
    loss_of(model, inputs).backward()
    engine.stop()
    engine.check_parameter_gradients()
    engine.per_sample_norms()
    norms = engine.group_norms(sizes)
    summed = dict(zip(map(id, engine.parameters), engine.clipped_sum(factors)))
    engine.remove()
    return norms, summed


def _check(model, loss_of, inputs, sizes):
    factors = torch.linspace(0.3, 1.7, len(sizes))
    want_norms, want_sum = _naive(model, loss_of, inputs, sizes, factors)
    norms, summed = _engine(model, loss_of, inputs, sizes, factors)
    assert torch.allclose(norms.double(), want_norms.double(), rtol=1e-5, atol=1e-6)
    for key, value in want_sum.items():
        assert torch.allclose(summed[key], value, rtol=1e-5, atol=1e-6)


def _cross_entropy(model, tokens):
    return nn.functional.cross_entropy(model(tokens), tokens[:, 0])


@pytest.mark.parametrize("sizes", [[3, 1, 2, 1], [1] * 7, [7]])
def test_group_norms_equal_naive_per_user_means(sizes):
    torch.manual_seed(0)
    _check(Mixed(), _cross_entropy, torch.randint(0, 20, (7, 5)), sizes)


def test_group_norms_of_lora_adapters():
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    from lightning_dp.models import GPT2, LoRA

    torch.manual_seed(0)
    net = LoRA(GPT2(vocab_size=23, max_positions=16, embed_dim=16, num_layers=2, num_heads=2, dropout=0.0), rank=4,
               target_modules=["c_attn", "c_proj", "c_fc"])
    with torch.no_grad():  # peft starts B at zero: move it so that every adapter has a gradient
        for name, p in net.named_parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)

    def loss_of(model, tokens):
        logits = model(tokens)
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1),
                                           reduction="none").view(tokens.shape[0], -1).mean(1).mean()

    _check(net, loss_of, torch.randint(0, 23, (5, 6)), [2, 3])


def test_a_dropped_example_leaves_its_users_other_records():
    """An example whose gradient is not finite is dropped (its contribution 0) before the grouping: its user's mean
    is the others' sum over the user's record count, and no norm is inf or nan."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    x = torch.randn(4, 4)
    x[1] = math.inf

    def loss_of(m, inputs):
        return m(inputs).square().sum(1).mean()

    engine = GradSampleEngine(model)
    probe(engine, model, torch.randn(4, 4))
    engine.start(batch_size=4)
    loss_of(model, x).backward()
    engine.stop()
    per_example = engine.per_sample_norms()
    assert engine.dropped == 1 and math.isinf(per_example[1])
    norms = engine.group_norms([2, 2])
    assert torch.isfinite(norms).all()
    alone, _ = _naive(model, loss_of, x[[0, 2, 3]], [1, 2], torch.ones(2))  # example 0; examples 2 and 3
    want = torch.stack([alone[0] / 2, alone[1]])  # user 0: (g_0 + 0) / 2, its dropped record counted as zero
    assert torch.allclose(norms, want.to(norms.dtype), rtol=1e-5)
