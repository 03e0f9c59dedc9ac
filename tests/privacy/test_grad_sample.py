"""Per-sample gradients of the book-keeping engine against a naive per-example loop."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp.privacy.clipping import clip_factors
from lightning_dp.privacy.grad_sample import GradSampleEngine, PerSampleGradientError, choose_layer_strategy
from lightning_dp.privacy.grad_sample.contributions import term_floor
from tests.helpers import probe


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
    probe(engine, model, x)
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


def assert_matches_naive(norms, flat, ref, c):
    """The engine's norms and clipped sum at ``c`` against the naive per-example gradients ``ref`` (1e-9); returns
    the naive clip factors."""
    torch.testing.assert_close(norms, ref.norm(dim=1), rtol=1e-9, atol=1e-12)
    factors = clip_factors(ref.norm(dim=1), c)
    torch.testing.assert_close(flat, (factors[:, None] * ref).sum(0), rtol=1e-9, atol=1e-12)
    return factors


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
    # 8 and more input channels per group (the grouped convolution backward at 64 positions and more: see
    # test_wide_convolutions_through_the_grouped_backward)
    "wide_convs_grouped_backward": (
        lambda: nn.Sequential(nn.Conv1d(8, 16, 3, padding=2, dilation=2, padding_mode="circular"), nn.Unflatten(1, (4, 4)),
                              nn.Conv2d(4, 16, 1), nn.Conv2d(16, 16, 3, stride=2, padding=1, groups=2), nn.Tanh(),
                              nn.Conv2d(16, 8, 2, padding="same", padding_mode="reflect", bias=False),
                              nn.Unflatten(1, (8, 1)), nn.Conv3d(8, 4, (1, 2, 2)), nn.Flatten(), nn.Linear(4, 3)),
        lambda g: torch.randn(5, 8, 4, generator=g), lambda g: torch.randint(0, 3, (5,), generator=g)),
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


@pytest.mark.usefixtures("exact_norms")
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("c", [1e-3, 0.5, 1e6])
def test_norms_and_clipped_sum_match_naive_loop(case, c):
    model, x, y, ref = prepared(case, seed=1)
    norms, flat = engine_result(model, F.cross_entropy, x, y, c)
    factors = assert_matches_naive(norms, flat, ref, c)
    # every clipped per-sample contribution has norm <= C
    assert torch.all((factors * ref.norm(dim=1)) <= c)
    # the engine restored requires_grad on every parameter
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("c", [1e-3, 0.5])
def test_wide_convolutions_through_the_grouped_backward(monkeypatch, c):
    """Convolutions with 8 and more input channels per group (circular padding and dilation, groups, reflect 'same'
    padding, 3-D) take their per-sample gradients from one grouped convolution backward: exact against the loop."""
    import lightning_dp.privacy.grad_sample.rules.conv as conv

    monkeypatch.setattr(conv, "GROUPED_BACKWARD_MIN_POSITIONS", 1)  # the test's layers have 1 to 4 positions
    calls = []
    grouped = conv._grouped_conv_grads
    monkeypatch.setattr(conv, "_grouped_conv_grads", lambda *a: calls.append(1) or grouped(*a))
    model, x, y, ref = prepared("wide_convs_grouped_backward", seed=1)
    norms, flat = engine_result(model, F.cross_entropy, x, y, c)
    assert len(calls) == 4
    assert_matches_naive(norms, flat, ref, c)


@pytest.mark.usefixtures("exact_norms")
@pytest.mark.parametrize("case", ["mnist_cnn", "conv_same_reflect", "text_embedding_conv1d_groupnorm"])
def test_ghost_norm_path_matches_naive_loop(case):
    """instantiate_limit=0 forces the unfold + ghost-norm path for every conv and linear layer."""
    model, x, y, ref = prepared(case, seed=2)
    norms, flat = engine_result(model, F.cross_entropy, x, y, 0.3, instantiate_limit=0)
    assert_matches_naive(norms, flat, ref, 0.3)


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
        probe(engine, model, x)
        with engine.record():
            model(x).square().mean(dim=(1, 2)).mean().backward()
        n = engine.per_sample_norms()
        results.append((n, engine.clipped_sum(clip_factors(n, 0.1))))
        engine.remove()
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b)


def test_instantiated_gradients_larger_than_their_factors_are_kept_within_the_keep_limit(monkeypatch):
    """Per-sample gradients instantiated for the norms and larger than their factors (a 64 x 64 weight seen at 16
    positions) are kept for the clipped sum while the step's keep_limit has room, and released beyond it (the sum
    then recomputed from the factors); every limit gives the same norms and sums, equal to the naive loop."""
    from lightning_dp.privacy.grad_sample.contributions import term_floor, Factored

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)).double()
    x = torch.randn(5, 16, 64, dtype=torch.float64)
    each = 5 * 64 * 64 * 8  # one layer's (B, 64, 64) float64 per-sample gradients
    kept_after: dict[int, list[bool]] = {}
    summed = []
    original = Factored.weighted_sum

    def spy(self, factors):
        kept_after.setdefault(limit, []).append(self._dense is not None)
        return original(self, factors)

    monkeypatch.setattr(Factored, "weighted_sum", spy)
    for limit in (0, each, 2 * each):
        engine = GradSampleEngine(model, keep_limit=limit)
        probe(engine, model, x)
        with engine.record():
            model(x).square().mean(dim=(1, 2)).mean().backward()
        n = engine.per_sample_norms()
        summed.append((n, engine.clipped_sum(clip_factors(n, 0.1))))
        engine.remove()
    assert kept_after == {0: [False, False], each: [True, False], 2 * each: [True, True]}
    for n, sums in summed[1:]:
        torch.testing.assert_close(n, summed[0][0])
        for a, b in zip(sums, summed[0][1]):
            torch.testing.assert_close(a, b)
    per = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        model(x[i:i + 1]).square().mean(), list(model.parameters()))]) for i in range(5)])
    torch.testing.assert_close(summed[0][0], per.norm(dim=1))
    with pytest.raises(ValueError, match="keep_limit=-1 is negative"):
        GradSampleEngine(model, keep_limit=-1)


def test_empty_batch_gives_zero_sums():
    model = nn.Sequential(nn.Linear(3, 2))
    engine = GradSampleEngine(model)
    probe(engine, model, torch.zeros(1, 3))
    with engine.record():
        F.cross_entropy(model(torch.zeros(0, 3)), torch.zeros(0, dtype=torch.long)).backward()
    norms = engine.per_sample_norms()
    assert norms.shape == (0,)
    assert all(torch.count_nonzero(s) == 0 for s in engine.clipped_sum(clip_factors(norms, 1.0)))


def test_no_trainable_parameters_is_an_error():
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(PerSampleGradientError, match="no trainable parameters"):
        GradSampleEngine(model)


@pytest.mark.parametrize("limit", [0, 2**40], ids=["ghost", "instantiated"])
def test_tied_linear_weights_include_the_cross_term(limit):
    """One weight used by two Linear layers: ||g_a + g_b||^2 needs 2 <g_a, g_b>, from the factors alone."""
    torch.manual_seed(0)
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = a.weight
    model = nn.Sequential(a, nn.Tanh(), b, nn.Flatten(), nn.Linear(12, 2)).double()
    x, y = torch.randn(6, 4, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    ref = naive_per_sample(model, F.cross_entropy, x, y)
    model.zero_grad(set_to_none=True)
    norms, flat = engine_result(model, F.cross_entropy, x, y, 0.5, instantiate_limit=limit)
    assert_matches_naive(norms, flat, ref, 0.5)


@pytest.mark.parametrize("limit", [0, 2**40], ids=["ghost", "instantiated"])
def test_tied_weights_and_biases_of_linear_layers_on_vectors(limit):
    """Linear layers on (B, d) keep their factors 2-D and share the output gradient's squared norms between the weight
    and the bias: the cross terms of a tied weight AND a tied bias still come out exact."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight, b.bias = a.weight, a.bias
    model = nn.Sequential(a, nn.Tanh(), b, nn.Tanh(), nn.Linear(4, 3)).double()
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randint(0, 3, (7,))
    ref = naive_per_sample(model, F.cross_entropy, x, y)
    model.zero_grad(set_to_none=True)
    norms, flat = engine_result(model, F.cross_entropy, x, y, 0.5, instantiate_limit=limit)
    assert_matches_naive(norms, flat, ref, 0.5)


def test_factored_on_vectors_equals_one_position_sequences():
    """A Factored contribution of (B, p) and (B, d) factors (kept 2-D) gives the norms, sums, dense gradients, cross
    terms and dropped rows of the same factors as (B, 1, p) and (B, 1, d)."""
    from lightning_dp.privacy.grad_sample.contributions import Dense, Factored

    g = torch.Generator().manual_seed(3)
    left, right = torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randn(6, 3, generator=g,
                                                                                dtype=torch.float64)
    f = torch.rand(6, generator=g, dtype=torch.float64)
    flat, seq = Factored(left, right, (5, 3)), Factored(left[:, None], right[:, None], (5, 3))
    bias = Dense(left, sq_norms=flat.left_sq_norms)
    torch.testing.assert_close(flat.sq_norms(), seq.sq_norms())
    torch.testing.assert_close(bias.sq_norms(), left.square().sum(1))
    torch.testing.assert_close(flat.weighted_sum(f), seq.weighted_sum(f))
    torch.testing.assert_close(Factored(right, left, (3, 5)).weighted_sum(f), seq.weighted_sum(f).T)
    torch.testing.assert_close(flat.dense(), seq.dense())
    torch.testing.assert_close(flat.dot(seq), seq.sq_norms())
    drop = torch.tensor([False, True, False, False, True, False])
    flat.drop(drop)
    bias.drop(drop)
    assert float(flat.sq_norms()[1]) == 0 and float(bias.sq_norms()[4]) == 0
    torch.testing.assert_close(flat.weighted_sum(f), seq.weighted_sum(f * ~drop))


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
    probe(engine, model, torch.randn(4, 3))
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


# ------------------------------------------------------------------ established batch dimensions
class SequenceFirst(nn.Module):
    """Applies its layers to (T, B, d), as sequence-first code does; here T == B == 5."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, 4)
        self.lin = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)
        self.out = nn.Linear(4, 2)

    def forward(self, ids):  # ids: (B, T)
        h = self.emb(ids.t())  # (T, B, 4)
        h = self.ln(torch.tanh(self.lin(h)))
        return self.out(h.mean(0))


class MaskedMix(nn.Module):
    """A layer with a parameter that takes a shared (T, T) mask and a per-example keyword tensor."""

    def __init__(self, d=3):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d)

    def forward(self, x, mask, *, scale):
        return (mask @ x) @ self.weight * scale[:, None, None]


class MaskedNet(nn.Module):
    def __init__(self, t=5):
        super().__init__()
        self.register_buffer("mask", torch.tril(torch.ones(t, t)))
        self.mix = MaskedMix()
        self.out = nn.Linear(3, 2)

    def forward(self, x):  # x: (B, T, 3)
        return self.out(self.mix(x, self.mask, scale=x[:, 0, 0].sigmoid()).mean(1))


class PositionalEmbedding(nn.Module):
    """nanoGPT's wpe(arange(T)): one embedding shared by every example of the batch."""

    def __init__(self, t=5):
        super().__init__()
        self.tok = nn.Embedding(9, 4)
        self.pos = nn.Embedding(t, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, ids):
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        return self.out(h.mean(1))


@pytest.mark.parametrize("make,make_x", [
    (SequenceFirst, lambda g: torch.randint(0, 9, (5, 5), generator=g)),
    (MaskedNet, lambda g: torch.randn(5, 5, 3, generator=g, dtype=torch.float64)),
], ids=["sequence_first_T_equals_B", "shared_mask_T_equals_B_and_keyword_tensor"])
def test_batch_dimension_is_established_when_other_dimensions_equal_the_batch(make, make_x):
    """T == B: reading dimension 0 as the batch would mix examples; the probe finds the real one."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = make().double()
    x, y = make_x(g), torch.randint(0, 2, (5,), generator=g)
    ref = naive_per_sample(model, F.cross_entropy, x, y)
    model.zero_grad(set_to_none=True)
    norms, flat = engine_result(model, F.cross_entropy, x, y, 0.5)
    assert_matches_naive(norms, flat, ref, 0.5)


def test_input_without_batch_dimension_is_broadcast_to_the_batch():
    """wpe(arange(T)) with T == B looked per-example by its shape; its output is expanded to the batch instead,
    so each example's gradient flows through its own slice (the probe checks that the result is unchanged)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = PositionalEmbedding().double()
    x, y = torch.randint(0, 9, (5, 5), generator=g), torch.randint(0, 2, (5,), generator=g)
    ref = naive_per_sample(model, F.cross_entropy, x, y)
    model.zero_grad(set_to_none=True)
    engine = GradSampleEngine(model)
    probe(engine, model, x)
    assert engine.layers[1].broadcast and not engine.layers[0].broadcast
    with engine.record(batch_size=5):
        F.cross_entropy(model(x), y).backward()
    norms = engine.per_sample_norms()
    torch.testing.assert_close(norms, ref.norm(dim=1), rtol=1e-9, atol=1e-12)


def test_folded_batch_and_batch_by_batch_inputs_are_refused():
    flat = nn.Linear(3, 3)
    engine = GradSampleEngine(flat)
    with pytest.raises(PerSampleGradientError, match="without a batch dimension"):
        probe(engine, lambda x: flat(x.reshape(-1, 3)), torch.randn(4, 2, 3))  # (B*T, d)
    pair = nn.Linear(1, 1)
    engine = GradSampleEngine(pair)
    with pytest.raises(PerSampleGradientError, match=r"dimensions \[0, 1\] all follow the number of examples"):
        probe(engine, lambda x: pair((x @ x.t()).unsqueeze(-1)), torch.randn(4, 3))  # (B, B, 1)


def test_steps_are_checked_against_the_probe():
    model = nn.Linear(3, 2)
    engine = GradSampleEngine(model)
    with engine.record():
        model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(PerSampleGradientError, match=r"not established: call engine.probe"):
        engine.per_sample_norms()
    probe(engine, model, torch.randn(4, 3))
    with engine.record():
        model(torch.randn(4, 2, 3)).sum().backward()  # a rank the probe did not see
    with pytest.raises(PerSampleGradientError, match="ranks"):
        engine.per_sample_norms()


@pytest.mark.parametrize("layer,x", [
    (nn.Linear(4, 3), torch.randn(6, 4)),
    (nn.Linear(4, 3), torch.randn(6, 5, 4)),
    (nn.Conv2d(2, 3, 3), torch.randn(6, 2, 5, 5)),
], ids=["linear", "linear_sequence", "conv2d"])
def test_frozen_weight_with_trainable_bias_counts_only_the_bias(layer, x):
    """BitFit: only trainable parameters enter the per-sample norm (the frozen weight used to be counted)."""
    model = nn.Sequential(layer, nn.Flatten(), nn.LazyLinear(2)).double()
    x = x.double()
    model(x)  # materialize the lazy layer
    model[0].weight.requires_grad_(False)
    model[2].requires_grad_(False)
    y = torch.randint(0, 2, (x.shape[0],))
    ref = naive_per_sample(model, F.cross_entropy, x, y)
    assert ref.shape[1] == 3  # the bias alone
    model.zero_grad(set_to_none=True)
    norms, flat = engine_result(model, F.cross_entropy, x, y, 1e6)
    torch.testing.assert_close(norms, ref.norm(dim=1), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(flat, ref.sum(0), rtol=1e-9, atol=1e-12)


def test_ghost_norm_rounding_below_zero_gives_zero_not_nan():
    """Per-sample gradients that nearly cancel: the float32 Gram sum of large terms rounds below zero."""
    torch.manual_seed(0)
    b, d, p = 64, 300, 300
    u, v = torch.randn(b, 1, d), torch.randn(b, 1, p)
    x = torch.cat([u, u + 1e-4 * torch.randn(b, 1, d)], 1)  # both positions see almost the same input ...
    go = torch.cat([v, -v], 1)  # ... with opposite output gradients: per-sample gradients of norm ~ 1e-4 * 300
    raw = (torch.bmm(x, x.transpose(1, 2)) * torch.bmm(go, go.transpose(1, 2))).sum((1, 2))
    assert (raw < 0).any()  # the unclamped ghost norm goes negative: sqrt would give NaN

    model = nn.Linear(d, p, bias=False)
    engine = GradSampleEngine(model, instantiate_limit=0)  # force the ghost norm
    engine.probe(lambda n: model(x[:n]))
    with engine.record():
        out = model(x)
        out.backward(go / b)  # recorded contribution x batch size = go
    norms = engine.per_sample_norms()
    assert torch.isfinite(norms).all() and (norms >= 0).all()
    # their terms cancel ~1,000 times: clipped as at least term_floor() of them (contributions.py), never less than
    # their own norm (~0.03)
    exact = torch.einsum("btp,btd->bpd", go.double(), x.double()).flatten(1).norm(dim=1)
    floor = term_floor(go.double().norm(dim=2) * x.double().norm(dim=2))
    torch.testing.assert_close(norms.double(), torch.maximum(exact, floor), rtol=1e-5, atol=0.0)
    assert bool((floor > 100 * exact).all())


def test_trainable_set_changes_are_seen():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    model[0].requires_grad_(False)
    engine = GradSampleEngine(model)
    assert [p for p in engine.parameters] == list(model[1].parameters()) and not engine.trainable_changed()
    model[0].weight.requires_grad_(True)
    assert engine.trainable_changed()


def test_layers_called_with_keyword_inputs():
    """fc(input=x) used to be refused as an input without a batch dimension."""
    torch.manual_seed(0)

    class Keywords(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.emb, self.out = nn.Linear(4, 4), nn.Embedding(7, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.out(input=torch.tanh(self.fc(input=x[:, :4])) + self.emb(input=x[:, 4].long()))

    model = Keywords().double()
    x = torch.cat([torch.randn(6, 4), torch.randint(0, 7, (6, 1)).float()], 1).double()
    y = torch.randint(0, 2, (6,))
    ref = naive_per_sample(model, F.cross_entropy, x, y)
    model.zero_grad(set_to_none=True)
    norms, flat = engine_result(model, F.cross_entropy, x, y, 0.5)
    torch.testing.assert_close(norms, ref.norm(dim=1), rtol=1e-9, atol=1e-12)


def test_a_step_leaves_nothing_behind():
    """Nothing of a recorded step survives clear(): a layer's output kept by its own gradient hook formed a cycle
    through autograd's C++ graph that Python's collector could not free (800 MiB per GPT-2 step)."""
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    engine = GradSampleEngine(model)
    probe(engine, model, torch.randn(4, 3))
    refs = []
    hook = model[2].register_forward_hook(lambda m, a, out: refs.append(weakref.ref(out)))
    with engine.record(batch_size=4):
        model(torch.randn(4, 3)).sum().backward()
    engine.per_sample_norms()
    engine.clear()
    hook.remove()
    gc.collect()
    assert refs and all(r() is None for r in refs)


def test_the_loss_scale_is_applied_to_norms_and_weights_not_to_the_records(monkeypatch):
    """The rules see the output gradients autograd gave (no scaled copy of each: on the MNIST CNN a fresh 3 MiB
    tensor a step); the engine multiplies the norms by |loss_scale| and the sums' weights by it, which equals scaling
    every per-sample gradient (each is linear in its output gradients): checked against the naive loop."""
    from lightning_dp.privacy.grad_sample.rules.conv import ConvRule

    model, x, y, ref = prepared("mnist_cnn", seed=3)
    first = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    engine = GradSampleEngine(model)
    probe(engine, lambda a, b: F.cross_entropy(model(a), b), x, y)
    given, seen = [], []

    def keep_output_grad(module, args, out):
        out.register_hook(lambda g: given.append(g.detach().clone()))

    first.register_forward_hook(keep_output_grad)
    original = ConvRule.contributions

    def spy(self, layer, records, batch_size):
        if layer.module is first:
            seen.extend((r.grad_outputs[0].clone(), r.scale) for r in records)
        return original(self, layer, records, batch_size)

    monkeypatch.setattr(ConvRule, "contributions", spy)
    b = len(x)
    for scale in (b, 2.5 * b):
        with engine.record(batch_size=b):
            F.cross_entropy(model(x), y).backward()
        norms = engine.per_sample_norms(loss_scale=scale)
        torch.testing.assert_close(norms, ref.norm(dim=1) * scale / b)
        flat = torch.cat([s.flatten() for s in engine.clipped_sum(torch.ones(b, dtype=norms.dtype))])
        torch.testing.assert_close(flat, ref.sum(0) * scale / b)
        engine.clear()
    assert len(given) == len(seen) == 2 and all(s == 1.0 for _, s in seen)
    for (g, _), autograd_g in zip(seen, given):
        torch.testing.assert_close(g, autograd_g, rtol=0, atol=0)  # as autograd gave it, not times the batch size
