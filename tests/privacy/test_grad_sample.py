"""Per-sample gradients of the book-keeping engine against a naive per-example loop."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp.privacy.clipping import clip_factors
from lightning_dp.privacy.grad_sample import GradSampleEngine, PerSampleGradientError, choose_layer_strategy


def naive_per_sample(model, loss_fn, x, y):
    """Reference: one backward per example, returning flat per-sample gradients (B, P)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(loss_fn(model(x[i : i + 1]), y[i : i + 1]), params, allow_unused=True)
        rows.append(torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                               for g, p in zip(grads, params)]))
    return torch.stack(rows)


def engine_result(model, loss_fn, x, y, c, **engine_kwargs):
    engine = GradSampleEngine(model, **engine_kwargs)
    with engine.record():
        loss_fn(model(x), y).backward()
    engine.check_parameter_gradients()
    norms = engine.per_sample_norms()
    factors = clip_factors(norms, c)
    sums = engine.clipped_sum(factors)
    engine.remove()
    order = {id(p): i for i, p in enumerate(engine.parameters)}
    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.cat([sums[order[id(p)]].reshape(-1) for p in params])
    return norms, flat


class Residual(nn.Module):
    """Uses one Linear twice (weight sharing by calls) and an in-place ReLU."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.shared = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = F.relu(self.inp(x), inplace=True)
        h = self.shared(h).relu_()
        h = self.ln(self.shared(h) + h)
        return self.out(h)


class TextNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 5, padding_idx=0)
        self.conv = nn.Conv1d(5, 4, 3, padding=1, padding_mode="circular")
        self.gn = nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4 * 7, 3)

    def forward(self, ids):
        h = self.emb(ids).transpose(1, 2)
        h = torch.tanh(self.gn(self.conv(h)))
        return self.fc(h.flatten(1))


def mnist_cnn():
    return nn.Sequential(
        nn.Conv2d(1, 16, 8, stride=2, padding=3), nn.Tanh(), nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, stride=2), nn.Tanh(), nn.MaxPool2d(2, 1),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, 10))


CASES = {
    "mlp": (lambda: nn.Sequential(nn.Linear(5, 7), nn.ReLU(inplace=True), nn.Linear(7, 3)),
            lambda g: torch.randn(9, 5, generator=g), lambda g: torch.randint(0, 3, (9,), generator=g)),
    "mnist_cnn": (mnist_cnn, lambda g: torch.randn(6, 1, 28, 28, generator=g),
                  lambda g: torch.randint(0, 10, (6,), generator=g)),
    "conv_same_reflect": (lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding="same", padding_mode="reflect", dilation=2),
                                                nn.Flatten(), nn.Linear(3 * 36, 2)),
                          lambda g: torch.randn(5, 2, 6, 6, generator=g), lambda g: torch.randint(0, 2, (5,), generator=g)),
    "residual_shared_layernorm": (Residual, lambda g: torch.randn(7, 6, generator=g),
                                  lambda g: torch.randint(0, 3, (7,), generator=g)),
    "text_embedding_conv1d_groupnorm": (TextNet, lambda g: torch.randint(0, 11, (6, 7), generator=g),
                                        lambda g: torch.randint(0, 3, (6,), generator=g)),
    "conv3d_grouped_conv1d": (lambda: nn.Sequential(nn.Conv3d(2, 4, 2, padding=1, groups=2), nn.Flatten(2),
                                                    nn.Conv1d(4, 2, 3, stride=2, groups=2), nn.Flatten(),
                                                    nn.Linear(2 * 31, 2)),
                              lambda g: torch.randn(4, 2, 3, 3, 3, generator=g),
                              lambda g: torch.randint(0, 2, (4,), generator=g)),
    "sequence_linear": (lambda: nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Flatten(), nn.Linear(30, 2)),
                        lambda g: torch.randn(8, 5, 4, generator=g), lambda g: torch.randint(0, 2, (8,), generator=g)),
}


def prepared(case, seed):
    """A float64 model and batch of ``case`` with the naive per-sample gradients (B, P)."""
    make, make_x, make_y = CASES[case]
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(0)
    model = make().double()
    x, y = make_x(g), make_y(g)
    if x.is_floating_point():
        x = x.double()
    ref = naive_per_sample(model, F.cross_entropy, x, y)
    model.zero_grad(set_to_none=True)
    return model, x, y, ref


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("c", [1e-3, 0.5, 1e6])
def test_norms_and_clipped_sum_match_naive_loop(case, c):
    model, x, y, ref = prepared(case, seed=1)
    norms, flat = engine_result(model, F.cross_entropy, x, y, c)
    torch.testing.assert_close(norms, ref.norm(dim=1), rtol=1e-9, atol=1e-12)
    factors = clip_factors(ref.norm(dim=1), c)
    torch.testing.assert_close(flat, (factors[:, None] * ref).sum(0), rtol=1e-9, atol=1e-12)
    # every clipped per-sample contribution has norm <= C
    assert torch.all((factors * ref.norm(dim=1)) <= c)
    # the engine restored requires_grad on every parameter
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("case", ["mnist_cnn", "conv_same_reflect", "text_embedding_conv1d_groupnorm"])
def test_ghost_norm_path_matches_naive_loop(case):
    """instantiate_limit=0 forces the unfold + ghost-norm path for every conv and linear layer."""
    model, x, y, ref = prepared(case, seed=2)
    norms, flat = engine_result(model, F.cross_entropy, x, y, 0.3, instantiate_limit=0)
    torch.testing.assert_close(norms, ref.norm(dim=1), rtol=1e-9, atol=1e-12)
    factors = clip_factors(ref.norm(dim=1), 0.3)
    torch.testing.assert_close(flat, (factors[:, None] * ref).sum(0), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("positions,d_in,d_out,expected", [(1, 512, 32, "ghost"), (25, 256, 32, "instantiate"),
                                                             (196, 64, 16, "instantiate"), (64, 4096, 4096, "ghost")])
def test_strategy_cost_model(positions, d_in, d_out, expected):
    assert choose_layer_strategy(256, positions, d_in, d_out) == expected


def test_ghost_and_instantiate_agree_for_sequences():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4)).double()
    x = torch.randn(5, 6, 3, dtype=torch.float64)
    results = []
    for limit in (0, 2**40):  # limit 0 forces the ghost norm
        engine = GradSampleEngine(model, instantiate_limit=limit)
        with engine.record():
            model(x).square().mean(dim=(1, 2)).mean().backward()
        n = engine.per_sample_norms()
        results.append((n, engine.clipped_sum(clip_factors(n, 0.1))))
        engine.remove()
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b)


def test_empty_batch_gives_zero_sums():
    model = nn.Sequential(nn.Linear(3, 2))
    engine = GradSampleEngine(model)
    with engine.record():
        F.cross_entropy(model(torch.zeros(0, 3)), torch.zeros(0, dtype=torch.long)).backward()
    norms = engine.per_sample_norms()
    assert norms.shape == (0,)
    assert all(torch.count_nonzero(s) == 0 for s in engine.clipped_sum(clip_factors(norms, 1.0)))


def test_no_trainable_parameters_is_an_error():
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(PerSampleGradientError, match="no trainable parameters"):
        GradSampleEngine(model)


def test_tied_weights_are_refused():
    a = nn.Linear(3, 3)
    b = nn.Linear(3, 3)
    b.weight = a.weight
    with pytest.raises(PerSampleGradientError, match="tied"):
        GradSampleEngine(nn.Sequential(a, b))


def test_parameter_used_outside_its_module_is_detected():
    class Leaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 2)

        def forward(self, x):
            h = self.a(x)
            return self.b(h) + F.linear(h, self.b.weight, self.b.bias)  # b used outside b.forward

    model = Leaky()
    engine = GradSampleEngine(model)
    with engine.record():
        model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(PerSampleGradientError, match="outside the forward"):
        engine.check_parameter_gradients()


def test_hooks_are_inert_when_not_recording():
    model = nn.Sequential(nn.Linear(3, 2))
    engine = GradSampleEngine(model)
    model(torch.randn(4, 3)).sum().backward()
    assert model[0].weight.grad is not None
    assert not engine.layers[0].calls
    engine.remove()
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks
