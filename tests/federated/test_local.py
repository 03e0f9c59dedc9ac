"""Vectorized client computations against per-client loops."""

import pytest
import torch
from torch import nn

from lightning_dp.federated import FlatParams, choose_hypotheses, client_losses, local_sgd, local_sgd_loop
from lightning_dp.federated.local import client_outputs_and_losses, masked_loss, predictions


def padded_clients(sizes, d=3, classes=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    nmax = max(sizes)
    x = torch.randn(len(sizes), nmax, d, generator=g, dtype=torch.float64)
    if classes:
        y = torch.randint(0, classes, (len(sizes), nmax), generator=g)
    else:
        y = torch.randn(len(sizes), nmax, generator=g, dtype=torch.float64)
    mask = torch.arange(nmax).unsqueeze(0) < torch.tensor(sizes).unsqueeze(1)
    return x, y, mask


MODELS = {
    "rmse": lambda: nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 1)).double(),
    "cross_entropy": lambda: nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).double(),
    "binary_cross_entropy": lambda: nn.Sequential(nn.Linear(3, 1), nn.Flatten(0)).double(),
    "rmse_classes": lambda: nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).double(),
}
CLASSES = {"rmse": None, "cross_entropy": 4, "binary_cross_entropy": 2, "rmse_classes": 4}


@pytest.mark.parametrize("loss", ["rmse", "cross_entropy", "binary_cross_entropy", "rmse_classes"])
@pytest.mark.parametrize("epochs,batch_size", [(1, 4), (3, 2), (2, 50)])
def test_vectorized_local_sgd_equals_per_client_loop(loss, epochs, batch_size):
    """Unequal client sizes (1 to 13 examples): a client with fewer batches must stop, not train on padding."""
    torch.manual_seed(0)
    model = MODELS[loss]()
    spec = FlatParams.of(model)
    sizes = [1, 5, 13, 7, 2]
    x, y, mask = padded_clients(sizes, classes=CLASSES[loss])
    # padding is garbage on purpose: it must never influence the result
    x = torch.where(mask.unsqueeze(-1), x, torch.full_like(x, 1e6))
    start = spec.flatten(model).unsqueeze(0).repeat(len(sizes), 1) + 0.01 * torch.randn(len(sizes), spec.numel,
                                                                                       dtype=torch.float64)
    kwargs = dict(epochs=epochs, lr=0.05, batch_size=batch_size, loss=loss.removesuffix("_classes"))
    fast = local_sgd(model, spec, start, x, y, mask, generator=torch.Generator().manual_seed(3), **kwargs)
    slow = local_sgd_loop(model, spec, start, x, y, mask, generator=torch.Generator().manual_seed(3), **kwargs)
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(fast, start)



def test_per_client_generators_make_a_client_independent_of_its_batch_companions():
    """With one generator per client, training clients {0..4} together equals training {0, 1} and {2, 3, 4}
    apart (other padding lengths): what lets the module shard a round's clients across processes."""
    torch.manual_seed(0)
    model = MODELS["rmse"]()
    spec = FlatParams.of(model)
    sizes = [6, 2, 13, 7, 3]
    x, y, mask = padded_clients(sizes)
    start = spec.flatten(model).unsqueeze(0).repeat(len(sizes), 1)

    def gens(ids):
        return [torch.Generator().manual_seed(100 + i) for i in ids]

    kwargs = dict(epochs=2, lr=0.05, batch_size=3, loss="rmse")
    together = local_sgd(model, spec, start, x, y, mask, generator=gens(range(5)), **kwargs)
    a = local_sgd(model, spec, start[:2], x[:2, :6], y[:2, :6], mask[:2, :6], generator=gens([0, 1]), **kwargs)
    b = local_sgd(model, spec, start[2:], x[2:], y[2:], mask[2:], generator=gens([2, 3, 4]), **kwargs)
    torch.testing.assert_close(together, torch.cat([a, b]), rtol=1e-12, atol=1e-12)
    loop = local_sgd_loop(model, spec, start, x, y, mask, generator=gens(range(5)), **kwargs)
    torch.testing.assert_close(together, loop, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="one per client"):
        local_sgd(model, spec, start, x, y, mask, generator=gens([0]), **kwargs)
    # the module's form: a key function reading rows of one table per epoch by client index
    tables = [torch.rand(5, 13, generator=torch.Generator().manual_seed(e)) for e in range(2)]

    def keys(ids, width):
        return lambda epoch: tables[epoch][ids, :width]

    together = local_sgd(model, spec, start, x, y, mask, generator=keys([0, 1, 2, 3, 4], 13), **kwargs)
    a = local_sgd(model, spec, start[:2], x[:2, :6], y[:2, :6], mask[:2, :6], generator=keys([0, 1], 6), **kwargs)
    b = local_sgd(model, spec, start[2:], x[2:], y[2:], mask[2:], generator=keys([2, 3, 4], 13), **kwargs)
    torch.testing.assert_close(together, torch.cat([a, b]), rtol=1e-12, atol=1e-12)
    loop = local_sgd_loop(model, spec, start, x, y, mask, generator=keys([0, 1, 2, 3, 4], 13), **kwargs)
    torch.testing.assert_close(together, loop, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="one key per"):
        local_sgd(model, spec, start, x, y, mask, generator=keys([0, 1], 13), **kwargs)

def test_client_losses_and_choice_match_loop():
    torch.manual_seed(1)
    model = MODELS["rmse"]()
    spec = FlatParams.of(model)
    x, y, mask = padded_clients([4, 9, 2])
    hyps = torch.randn(3, spec.numel, dtype=torch.float64)
    got = client_losses(model, spec, hyps, x, y, mask, "rmse")
    assert got.shape == (3, 3)
    for c in range(3):
        for j in range(3):
            m = mask[c]
            out = torch.func.functional_call(model, spec.unflatten(hyps[j]), (x[c, m],))
            ref = (out.squeeze(-1) - y[c, m]).square().mean().sqrt()
            torch.testing.assert_close(got[c, j], ref)
    assert torch.equal(choose_hypotheses(got), got.argmin(1))


def test_flat_params_round_trip():
    model = MODELS["cross_entropy"]()
    spec = FlatParams.of(model)
    flat = spec.flatten(model)
    assert flat.numel() == spec.numel == sum(p.numel() for p in model.parameters())
    for name, t in spec.unflatten(flat).items():
        assert torch.equal(t, model.get_parameter(name))
    assert spec.sizes == [15, 5, 20, 4]


def test_masked_loss_of_exact_fit_has_zero_gradient():
    theta = torch.zeros(2, requires_grad=True)
    loss = masked_loss(torch.zeros(3, 1) + theta.sum(), torch.zeros(3), torch.ones(3, dtype=torch.bool), "rmse")
    loss.backward()
    assert loss.item() == 0 and torch.all(theta.grad == 0)


def test_bad_arguments():
    model = MODELS["rmse"]()
    spec = FlatParams.of(model)
    x, y, mask = padded_clients([2])
    with pytest.raises(ValueError, match="loss='mse'"):
        local_sgd(model, spec, spec.flatten(model)[None], x, y, mask, epochs=1, lr=0.1, batch_size=1, loss="mse")
    with pytest.raises(ValueError, match="no trainable parameters"):
        FlatParams.of(nn.Linear(2, 2).requires_grad_(False))


def test_losses_against_naive_formulas():
    """Each loss equals its formula computed by hand on the masked-in examples."""
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([True, True, False, True, True])
    logits = torch.randn(5, 4, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 3, 1, 2, 3])
    kept = mask.nonzero().squeeze(1).tolist()
    brier = sum(sum((torch.softmax(logits[i], 0)[c].item() - (c == labels[i].item())) ** 2 for c in range(4))
                for i in kept) / len(kept)
    assert masked_loss(logits, labels, mask, "rmse").item() == pytest.approx(brier ** 0.5, rel=1e-12)
    ce = sum(-torch.log_softmax(logits[i], 0)[labels[i]].item() for i in kept) / len(kept)
    assert masked_loss(logits, labels, mask, "cross_entropy").item() == pytest.approx(ce, rel=1e-12)
    z = logits[:, 0]
    bits = torch.tensor([1, 0, 1, 1, 0])
    bce = sum(-(b * torch.log(torch.sigmoid(z[i])) + (1 - b) * torch.log(1 - torch.sigmoid(z[i]))).item()
              for i, b in ((i, bits[i].item()) for i in kept)) / len(kept)
    assert masked_loss(z, bits, mask, "binary_cross_entropy").item() == pytest.approx(bce, rel=1e-10)
    assert masked_loss(z[:, None], bits, mask, "binary_cross_entropy").item() == pytest.approx(bce, rel=1e-10)


def test_predictions_and_client_outputs_and_losses():
    assert predictions(torch.tensor([-0.5, 0.0, 2.0]), "binary_cross_entropy").tolist() == [0, 1, 1]
    scores = torch.tensor([[0.1, 0.9], [2.0, -1.0]])
    assert predictions(scores, "cross_entropy").tolist() == [1, 0]
    assert predictions(scores, "rmse").tolist() == [1, 0]
    with pytest.raises(ValueError, match="regression"):
        predictions(torch.zeros(3), "rmse")
    torch.manual_seed(0)
    model = MODELS["cross_entropy"]()
    spec = FlatParams.of(model)
    x, y, mask = padded_clients([3, 2], classes=4)
    hyps = torch.randn(3, spec.numel, dtype=torch.float64)
    out, losses = client_outputs_and_losses(model, spec, hyps, x, y, mask, "cross_entropy")
    assert out.shape == (2, 3, 3, 4) and losses.shape == (2, 3)
    torch.testing.assert_close(losses, client_losses(model, spec, hyps, x, y, mask, "cross_entropy"))
    for c in range(2):
        for j in range(3):
            ref = torch.func.functional_call(model, spec.unflatten(hyps[j]), (x[c],))
            torch.testing.assert_close(out[c, j], ref)
            torch.testing.assert_close(losses[c, j], masked_loss(ref, y[c], mask[c], "cross_entropy"))


def test_the_loop_forward_equals_the_vmap_forward():
    from lightning_dp.federated.local import FlatParams, client_outputs_and_losses

    net = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 4))
    spec = FlatParams.of(net)
    g = torch.Generator().manual_seed(0)
    hyps = torch.randn(2, spec.numel, generator=g) * 0.1
    x, y = torch.randn(3, 5, 1, 6, 6, generator=g), torch.randint(0, 4, (3, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    out_v, loss_v = client_outputs_and_losses(net, spec, hyps, x, y, mask, "cross_entropy")
    out_l, loss_l = client_outputs_and_losses(net, spec, hyps, x, y, mask, "cross_entropy", engine="loop")
    assert out_l.shape == out_v.shape == (3, 2, 5, 4)
    assert torch.allclose(out_l, out_v, atol=1e-6) and torch.allclose(loss_l, loss_v, atol=1e-6)


def test_the_loop_trains_image_models_channels_last_to_the_same_values():
    """The loop engine runs convolutional models channels-last on CPU (faster pooling): the same trained models as
    vmap's (float64, unequal clients), the template untouched."""
    from lightning_dp.federated.local import _fast_layout

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1), nn.Flatten(),
                        nn.Linear(3 * 3 * 3, 4)).double()
    spec = FlatParams.of(net)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 9, 2, 6, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (4, 9), generator=g)
    mask = torch.arange(9).unsqueeze(0) < torch.tensor([9, 1, 4, 6]).unsqueeze(1)
    assert _fast_layout(net, x) == torch.channels_last and _fast_layout(net, x[:, :, 0, 0]) is None
    start = spec.flatten(net).repeat(4, 1)
    kwargs = dict(epochs=2, lr=0.3, batch_size=4, loss="cross_entropy")
    looped = local_sgd_loop(net, spec, start, x, y, mask, generator=torch.Generator().manual_seed(2), **kwargs)
    vectorized = local_sgd(net, spec, start, x, y, mask, generator=torch.Generator().manual_seed(2), **kwargs)
    torch.testing.assert_close(looped, vectorized, rtol=1e-10, atol=1e-12)
    assert not torch.equal(looped, start)
    assert net[0].weight.is_contiguous()  # the caller's model keeps its layout


class _ViewNet(nn.Module):
    """Flattens with view, which channels-last convolution outputs cannot serve."""

    def __init__(self):
        super().__init__()
        self.c, self.p, self.f = nn.Conv2d(3, 4, 3), nn.MaxPool2d(2), nn.Linear(36, 5)

    def forward(self, x):
        return self.f(self.p(self.c(x)).view(-1, 36))


class _NCHWOrder(nn.Module):
    """Reads the activations' memory in order, as a custom operator might: channels-last would change its values."""

    def __init__(self):
        super().__init__()
        self.c, self.f = nn.Conv2d(2, 3, 3, padding=1), nn.Linear(3 * 4 * 4, 2)

    def forward(self, x):
        h = self.c(x)
        flat = torch.as_strided(h, (h.shape[0], h[0].numel()), (h[0].numel(), 1))  # storage order
        return self.f(flat)


@pytest.mark.parametrize("make,shape", [(_ViewNet, (3, 8, 8)), (_NCHWOrder, (2, 4, 4)),
                                        (lambda: nn.Sequential(nn.Conv3d(1, 2, 1), nn.Flatten(1, 2), nn.Conv2d(4, 2, 1),
                                                               nn.Flatten(), nn.Linear(2 * 3 * 3, 2)), (1, 2, 3, 3))])
def test_the_loop_keeps_nchw_where_the_forward_depends_on_it(make, shape):
    """A view after a convolution, a forward that reads memory order, 3-d weights: trained NCHW, as written."""
    from lightning_dp.federated.local import _fast_layout

    torch.manual_seed(0)
    net = make()
    spec = FlatParams.of(net)
    x = torch.randn(2, 5, *shape)
    y = torch.randint(0, 2, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.bool)
    start = spec.flatten(net).repeat(2, 1)
    assert _fast_layout(net, x, spec, start) is None
    out = local_sgd_loop(net, spec, start, x, y, mask, epochs=1, lr=0.1, batch_size=2, loss="cross_entropy",
                         generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(out).all() and not torch.equal(out, start)


@pytest.mark.parametrize("entries", [2**22, 10])
def test_norms_and_clipped_sum_in_one_pass_equal_the_two_functions(entries, monkeypatch):
    """delta_norms_and_sum (the server's partial sum of a block, issue 53) is delta_norms then clipped_delta_sum bit
    for bit, in one block and in several (blocks of 2 rows)."""
    from lightning_dp.federated import local
    from lightning_dp.privacy.clipping import clip_factors

    plain = local.row_blocks
    monkeypatch.setattr(local, "row_blocks", lambda rows: plain(rows, entries))
    g = torch.Generator().manual_seed(0)
    rows, origin = torch.randn(9, 5, generator=g), torch.randn(5, generator=g)
    norms, total = local.delta_norms_and_sum(rows, origin, lambda n: clip_factors(n, 1.5))
    expected_norms = local.delta_norms(rows, origin)
    assert torch.equal(norms, expected_norms)
    assert torch.equal(total, local.clipped_delta_sum(rows, origin, clip_factors(expected_norms, 1.5)))
    assert len(local.row_blocks(rows)) == (1 if entries > 45 else 5)
    norms, total = local.delta_norms_and_sum(rows[:0], origin, lambda n: clip_factors(n, 1.5))
    assert norms.shape == (0,) and torch.equal(total, torch.zeros(5))
