"""DPSGD seeds each pass' backward so that every example's gradient is exact up to a power of two, whatever the
batch's size (``exact_seed``; docs/per_sample_gradients.md, "Floating point").

The attack (a review, 2026-12-07): many identical examples whose per-position terms cancel (one input at two
positions of a LayerNorm, regression targets +-L), and the same batch with one ordinary example added. Under a mean
loss every example's float32 gradient was rounded through 1 / B, the copies' rounding moved together with B, and
the clipped sums of the two neighbouring batches differed by 4.5 C (255 copies) to 24 C (1,023): a layer without a
floor of its own (norm layers, recurrent and attention biases, parametrizations, the torch.func fallback) carried
it. With the exact seed they differ by at most C."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dp.callbacks.private_step as private_step
from lightning_dp.callbacks import DPSGD
from lightning_dp.callbacks.private_step import exact_seed
from tests.helpers import trainer

D = 8


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(D)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.norm(x) - y) ** 2).sum((1, 2)).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def neighbours(copies: int, extra: bool):
    """``copies`` identical examples whose two positions' LayerNorm terms cancel 1e6 times, and one ordinary example
    if ``extra``."""
    g = torch.Generator().manual_seed(1)
    u, v = torch.randn(D, generator=g), torch.randn(D, generator=g)
    v = v / v.norm()
    n = copies + extra
    x, y = torch.zeros(n, 2, D), torch.zeros(n, 2, D)
    base = nn.functional.layer_norm(u, (D,))
    x[:copies] = u
    y[:copies, 0], y[:copies, 1] = base + 1e6 * v, base - 1e6 * v + v
    if extra:
        x[copies], y[copies] = torch.randn(2, D, generator=g), torch.randn(2, D, generator=g)
    return TensorDataset(x, y)


def clipped_sums(monkeypatch, data, **trainer_kwargs):
    """The clipped sums DPSGD's first step adds its noise to (one batch holding the whole dataset, in order)."""
    seen = []
    original = private_step.noisy_mean

    def capture(sums, **kwargs):
        seen.append(torch.cat([s.detach().reshape(-1).clone() for s in sums]))
        return original(sums, **kwargs)

    monkeypatch.setattr(private_step, "noisy_mean", capture)
    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=0, poisson_sampling=False)
    trainer(max_steps=1, callbacks=[dp], **trainer_kwargs).fit(
        Regressor(), DataLoader(data, batch_size=len(data)))
    return seen[0]


@pytest.mark.parametrize("copies", [255, 1023])
def test_identical_cancelling_examples_do_not_move_together_with_the_batch_size(monkeypatch, copies):
    with_it = clipped_sums(monkeypatch, neighbours(copies, True))
    without = clipped_sums(monkeypatch, neighbours(copies, False))
    # C, and the float32 rounding of sums of up to `copies` clipped gradients of norm C
    assert float((with_it - without).double().norm()) <= 1.0 + copies * 2.0**-23


def test_the_seed_is_exact_and_within_a_factor_two_of_the_mean():
    for examples, accumulate in [(1, 1), (7, 1), (256, 1), (257, 1), (1023, 3), (60000, 4)]:
        factor, k = exact_seed(examples, accumulate)
        n = examples * accumulate
        assert 0.5 < factor <= 1 and factor * 2.0**k == n and 2.0**k < 2 * n
        # the seed through Lightning's division and the mean: exactly 2^-k
        seed = torch.tensor(factor, dtype=torch.float32) / accumulate
        assert float(seed / examples) == math.ldexp(1.0, -k)
