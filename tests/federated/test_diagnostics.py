"""Cosine diagnostics of client updates and per-sample gradients (thesis Fig. 5.4)."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from lightning_dp.datamodules import SyntheticLinearMixtureDataModule
from lightning_dp.federated import FederatedRound
from lightning_dp.federated.diagnostics import mean_pairwise_cosine, per_sample_gradients
from lightning_dp.federated.local import FlatParams
from lightning_dp.federated.parts import LocalSGD, UniformSelection
from lightning_dp.models import LinearRegression, LogisticRegression


def test_mean_pairwise_cosine_equals_the_brute_force_mean_and_skips_zero_rows():
    v = torch.randn(7, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    brute = [float(v[i] @ v[j] / (v[i].norm() * v[j].norm())) for i in range(7) for j in range(7) if i != j]
    assert mean_pairwise_cosine(v) == pytest.approx(sum(brute) / len(brute), rel=1e-12)
    assert mean_pairwise_cosine(torch.cat([v, torch.zeros(2, 5, dtype=torch.float64)])) == pytest.approx(
        sum(brute) / len(brute), rel=1e-12)
    assert mean_pairwise_cosine(torch.ones(3, 4)) == pytest.approx(1.0)
    assert math.isnan(mean_pairwise_cosine(v[:1]))


def test_per_sample_gradients_equal_a_loop_of_autograd():
    model = LogisticRegression(in_features=12, num_classes=3)
    spec = FlatParams.of(model)
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(5, spec.numel, generator=g)
    x, y = torch.randn(5, 1, 3, 4, generator=g), torch.randint(0, 3, (5,), generator=g)
    got = per_sample_gradients(model, spec, theta, x, y, "cross_entropy")
    for i in range(5):
        t = theta[i].clone().requires_grad_(True)
        out = torch.func.functional_call(model, spec.unflatten(t), (x[i:i + 1],))
        (expected,) = torch.autograd.grad(torch.nn.functional.cross_entropy(out, y[i:i + 1]), t)
        assert torch.allclose(got[i], expected, atol=1e-6)
    shared = per_sample_gradients(model, spec, theta[0], x, y, "cross_entropy")
    assert torch.allclose(shared[2], per_sample_gradients(model, spec, theta[0:1].expand(5, -1), x, y,
                                                          "cross_entropy")[2])


def test_the_round_logs_the_cosines_of_its_updates_and_of_per_sample_gradients():
    m = FederatedRound(LinearRegression(), selection=UniformSelection(20),
                       update=LocalSGD(epochs=5, lr=0.05, batch_size=2), seed=0, diagnostics=True)
    captured = []
    original = m.update.train

    def spy(template, spec, start, *args, **kwargs):
        trained = original(template, spec, start, *args, **kwargs)
        captured.append(trained - start)
        return trained

    m.update.train = spy
    t = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  accelerator="cpu", devices=1, max_epochs=3, num_sanity_val_steps=0, limit_val_batches=0,
                  log_every_n_steps=1)
    t.fit(m, SyntheticLinearMixtureDataModule(seed=0))
    assert len(m.private_step.cosines) == 3
    assert float(t.callback_metrics["nonprivate/update_cosine"]) == pytest.approx(
        mean_pairwise_cosine(captured[-1]), rel=1e-9)
    assert -1 <= m.private_step.cosines[-1][2] <= 1


def test_diagnostics_need_nonprivate_metrics():
    with pytest.raises(ValueError, match="log_nonprivate_metrics"):
        FederatedRound(LinearRegression(), diagnostics=True, log_nonprivate_metrics=False)
