"""Per-sample gradients summed from terms that cancel (docs/per_sample_gradients.md, "Floating point").

A review found that an example whose positions' terms cancel (two positions with one huge input and opposite output
gradients: a per-position regression with targets +-L) escaped clipping wherever its gradient was summed from
factors: the Gram form's float32 norm rounded to 0 for a gradient of 2e4 C, and the weighted sum carried it
unclipped. Each test adds such an example to a batch and compares the clipped sums of the two neighbouring batches
(same seeds): they must differ by at most C. Before Contribution.margin they differed by up to 2e6 C."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dp.privacy import GradSampleEngine, clip_factors
from lightning_dp.privacy.grad_sample.contributions import CANCELLATION_RATIO, Factored, choose_layer_strategy

B, T, D = 8, 2, 64


def linear_batch(scale: float, label: float, attacker: bool):
    """A Linear(64, 64) on (B, T, 64) with a squared loss per position; the attacker (example 0) has two equal
    inputs of norm ``scale`` and targets the layer's output ``+- label`` (plus 1 on the second)."""
    torch.manual_seed(0)
    layer = nn.Linear(D, D, bias=False)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g)
    u, v = torch.randn(D, generator=g), torch.randn(D, generator=g)
    u, v = u / u.norm(), v / v.norm()
    if attacker:
        x[0, 0] = x[0, 1] = scale * u
        base = layer(scale * u).detach()
        y[0, 0], y[0, 1] = base + label * v, base - label * v + v
    else:
        x, y = x[1:], y[1:]
    return layer, x, y


def clipped(layer: nn.Module, x, y, clip: float = 1.0, **engine_kwargs):
    """The engine's norms and clipped sum for the squared loss of ``layer`` on ``(x, y)``."""
    engine = GradSampleEngine(layer, **engine_kwargs)
    engine.probe(lambda n: ((layer(x[:n]) - y[:n]) ** 2).sum((1, 2)).mean())
    with engine.record(batch_size=x.shape[0]):
        ((layer(x) - y) ** 2).sum((1, 2)).mean().backward()
    norms = engine.per_sample_norms()
    total = engine.clipped_sum(clip_factors(norms, clip))[0]
    engine.remove()
    return norms, total


def true_norm(layer: nn.Linear, x, y) -> float:
    """Example 0's gradient norm in float64: its own loss's (the engine's per-sample gradients)."""
    w = layer.weight.detach().double()
    g = 2 * (x[0].double() @ w.T - y[0].double())
    return float((g.T @ x[0].double()).norm())


@pytest.mark.parametrize("path", ["ghost", "released"])
@pytest.mark.parametrize("scale, label", [(1e4, 1e5), (1e5, 1e6)])
def test_cancelling_positions_move_the_clipped_sum_by_at_most_c(path, scale, label):
    """The Gram (ghost) norm, and an instantiated gradient released before the sum (keep_limit=0: the sum from the
    factors): the example's norm is at least its true one and the neighbours' sums differ by at most C."""
    kwargs = {"instantiate_limit": 0} if path == "ghost" else {"keep_limit": 0}
    assert choose_layer_strategy(B, T, D, D) == "ghost"  # the default path: ghost; "released" forces instantiation
    if path == "released":
        kwargs["instantiate_limit"] = 2**40
    layer, x, y = linear_batch(scale, label, attacker=True)
    with pytest.MonkeyPatch.context() as patch:
        if path == "released":  # this layer's factors are smaller than its gradients only past a threshold: force it
            patch.setattr(Factored, "_strategy", lambda self: "instantiate")
        norms, with_it = clipped(layer, x, y, **kwargs)
        _, without = clipped(*linear_batch(scale, label, attacker=False)[:1], x[1:], y[1:], **kwargs)
    assert float(norms[0]) >= true_norm(layer, x, y)
    assert float((with_it - without).double().norm()) <= 1.0 + 1e-6


def test_an_embeddings_cancelling_positions_move_the_clipped_sum_by_at_most_c():
    """One token at two positions with opposite output gradients (OneHotFactored): the neighbours' sums differ by
    at most C (before: 9 C, the norm rounded to 0)."""
    def batch(label: float, attacker: bool):
        torch.manual_seed(0)
        emb = nn.Embedding(10, 8)
        g = torch.Generator().manual_seed(1)
        ids, y = torch.randint(0, 10, (9, 3), generator=g), torch.randn(9, 3, 8, generator=g)
        v = torch.randn(8, generator=g)
        v = v / v.norm()
        if attacker:
            ids[0] = torch.tensor([3, 3, 5])
            base = emb.weight[3].detach()
            y[0, 0], y[0, 1] = base + label * v, base - label * v + v
        else:
            ids, y = ids[1:], y[1:]
        return emb, ids, y

    for label in (1e6, 1e9):
        _, with_it = clipped(*batch(label, True))
        _, without = clipped(*batch(label, False))
        assert float((with_it - without).double().norm()) <= 1.0 + 1e-6


def test_the_margin_is_added_only_where_terms_cancel_and_bounds_the_norm_from_above():
    """An honest batch's ghost norms are the float64 per-example norms (no margin: its examples' terms are below
    CANCELLATION_RATIO times their norms); the cancelling example's norm is above its true norm by at most its
    margin's order (sum over 2 positions' terms, float32 rounding of a product over B T rows)."""
    layer, x, y = linear_batch(1e3, 1e3, attacker=False)
    norms, _ = clipped(layer, x, y, instantiate_limit=0)
    w = layer.weight.detach().double()
    g = 2 * (x.double() @ w.T - y.double())
    exact = torch.einsum("btp,btd->bpd", g, x.double()).flatten(1).norm(dim=1)
    sizes = (g.norm(dim=2) * x.double().norm(dim=2)).sum(1)
    assert bool((sizes < CANCELLATION_RATIO * exact).all())
    torch.testing.assert_close(norms.double(), exact, rtol=1e-6, atol=0.0)
    layer, x, y = linear_batch(1e4, 1e5, attacker=True)
    norms, _ = clipped(layer, x, y, instantiate_limit=0)
    truth = true_norm(layer, x, y)
    w = layer.weight.detach().double()
    g0 = 2 * (x[0].double() @ w.T - y[0].double())
    size = float((g0.norm(dim=1) * x[0].double().norm(dim=1)).sum())
    assert size > 1e3 * truth  # cancelling terms
    gamma = x.shape[0] * T * 2.0**-24 / (1 - x.shape[0] * T * 2.0**-24)
    assert truth <= float(norms[0]) <= truth + 1.01 * gamma * size + 1e-3 * truth
