"""Layers with parametrized tensors (torch.nn.utils.parametrize): per-sample gradients of the parameters the
optimizer updates (the parametrizations' originals), exact against per-example autograd."""

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from lightning_dp.privacy.clipping import clip_factors
from lightning_dp.privacy.grad_sample import GradSampleEngine, PerSampleGradientError
from lightning_dp.privacy.grad_sample.rules.parametrized import ParametrizedRule
from tests.privacy.reference import per_example_gradients
from tests.privacy.test_grad_sample_edges import _check, _data, _refused_when_recorded

#: these tests compare the chain's per-sample gradients with autograd's: without the floors (a pull-back's floor is its
#: source's terms times a bound on J^T, which an honest example reaches where the parametrization shrinks its gradient;
#: what they are for, and what they cost honest examples: tests/privacy/test_cancellation.py)
pytestmark = pytest.mark.usefixtures("exact_norms")


class _Symmetric(nn.Module):
    def forward(self, x):
        return x.triu() + x.triu(1).transpose(-1, -2)


class _Scaled(nn.Module):
    """A parametrization with a parameter of its own (a learned scale)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.scale * x


def _symmetric_linear():
    layer = nn.Linear(5, 5)
    parametrize.register_parametrization(layer, "weight", _Symmetric())
    return layer


def _scaled_bias_linear():
    layer = nn.Linear(5, 6)
    parametrize.register_parametrization(layer, "bias", _Scaled())
    return layer


MODELS = {
    "weight_norm linear": (lambda: parametrizations.weight_norm(nn.Linear(5, 6)), (5,), 6),
    "weight_norm conv": (lambda: nn.Sequential(parametrizations.weight_norm(nn.Conv2d(2, 4, 3)), nn.Flatten()),
                         (2, 6, 6), 64),
    "orthogonal": (lambda: parametrizations.orthogonal(nn.Linear(5, 5)), (5,), 5),
    "a user's parametrization": (_symmetric_linear, (5,), 5),
    "a parametrization with a parameter": (_scaled_bias_linear, (5,), 6),
    "spectral_norm, eval": (lambda: parametrizations.spectral_norm(nn.Linear(5, 6)).eval(), (5,), 6),
}


@pytest.mark.parametrize("name", MODELS)
def test_parametrized_layers_are_exact(name):
    make, shape, width = MODELS[name]
    torch.manual_seed(0)
    layer = make()
    model = nn.Sequential(layer, nn.Tanh(), nn.Linear(width, 3))
    x, y = _data(*shape)
    _check(model, x, y, train=name != "spectral_norm, eval")
    engine = GradSampleEngine(model)
    target = next(m for m in layer.modules() if parametrize.is_parametrized(m))
    (mine,) = [found for found in engine.layers if found.module is target]
    assert isinstance(mine.rule, ParametrizedRule)
    trainable = set(mine.trainable)
    assert {n for n, p in target.named_parameters()} == trainable  # the originals, not a computed tensor
    assert any(".original" in n for n in trainable) or "parametrizations.bias.0.scale" in trainable
    engine.remove()


def test_a_frozen_original_is_left_out():
    torch.manual_seed(0)
    layer = parametrizations.weight_norm(nn.Linear(5, 6))
    layer.parametrizations.weight.original0.requires_grad_(False)  # the norm g frozen, the direction v trained
    x, y = _data(5)
    _check(nn.Sequential(layer, nn.Tanh(), nn.Linear(6, 3)), x, y)


def _randomize_power_iteration(layer):
    sn = layer.parametrizations.weight[0]
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # far from converged: every forward's iteration changes the weight it divides
        sn._u.copy_(F.normalize(torch.randn(sn._u.shape, generator=g, dtype=sn._u.dtype), dim=0))
        sn._v.copy_(F.normalize(torch.randn(sn._v.shape, generator=g, dtype=sn._v.dtype), dim=0))
    return sn


@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("calls", [1, 2])
def test_spectral_norm_in_training_replays_each_calls_own_vectors(calls, conv):
    """Each training forward moves spectral_norm's vectors one power iteration and divides by the norm they give.
    The pull-back (or replay) of each call must use that call's vectors and must not iterate again (which would
    change the model's state against a non-private run). The reference: every example alone from the vectors the
    batch's forward started with (the iteration does not depend on the input), so each call sees the same weight."""
    torch.manual_seed(0)
    layer = parametrizations.spectral_norm(nn.Conv1d(2, 2, 3, padding=1) if conv else nn.Linear(5, 5))
    head = nn.Sequential(nn.Flatten(), nn.Linear(10 if conv else 5, 3))

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer, self.head = layer, head

        def forward(self, x):
            for _ in range(calls):
                x = torch.tanh(self.layer(x))
            return self.head(x)

    model = Twice().double().train()
    x, y = _data(*((2, 5) if conv else (5,)))
    x = x.double()
    engine = GradSampleEngine(model)
    engine.probe(lambda n: F.cross_entropy(model(x[:n]), y[:n]))
    sn = _randomize_power_iteration(layer)
    start = (sn._u.clone(), sn._v.clone())
    with engine.record(batch_size=7):
        F.cross_entropy(model(x), y).backward()
    after_forward = (sn._u.clone(), sn._v.clone())
    norms = engine.per_sample_norms()
    factors = clip_factors(norms, 0.5)
    summed = engine.clipped_sum(factors)
    assert torch.equal(sn._u, after_forward[0]) and torch.equal(sn._v, after_forward[1])  # no extra iteration
    order = {id(p): i for i, p in enumerate(engine.parameters)}
    engine.remove()

    reference = copy.deepcopy(model)
    rows = []
    for i in range(7):
        ref_sn = reference.layer.parametrizations.weight[0]
        with torch.no_grad():
            ref_sn._u.copy_(start[0])
            ref_sn._v.copy_(start[1])
        params, row = per_example_gradients(reference, F.cross_entropy(reference(x[i:i + 1]), y[i:i + 1],
                                                                       reduction="none"))
        rows.append(row[0])
    ref = torch.stack(rows)
    torch.testing.assert_close(norms, ref.norm(dim=1), rtol=1e-6, atol=1e-9)
    names = dict(reference.named_parameters())
    mine = dict(model.named_parameters())
    flat = torch.cat([summed[order[id(mine[n])]].reshape(-1) for n, p in names.items() if p.requires_grad])
    torch.testing.assert_close(flat, (factors[:, None] * ref).sum(0), rtol=1e-6, atol=1e-9)


class _Counting(nn.Module):
    """A custom layer that counts its calls in a buffer (state updated in the forward)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 5))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return x @ self.weight


class _Drifting(nn.Module):
    """A parametrization whose forward moves a buffer (as spectral_norm does, but unknown to the engine)."""

    def __init__(self, out_variant=False):
        super().__init__()
        self.out_variant = out_variant
        self.register_buffer("running", torch.zeros(()))

    def forward(self, w):
        if self.training:
            with torch.no_grad():
                if self.out_variant:  # as spectral_norm's power iteration writes its vectors: torch.func lets it be
                    torch.add(self.running, 1.0, out=self.running)
                else:
                    self.running.add_(1.0)
        return w * (1.0 + 0.01 * self.running)


@pytest.mark.parametrize("make", [
    lambda: _Counting(),
    lambda: parametrize.register_parametrization(nn.Linear(5, 5), "weight", _Drifting()),
    lambda: parametrize.register_parametrization(nn.Linear(5, 5), "weight", _Drifting(out_variant=True)),
], ids=["custom layer", "parametrization", "parametrization writing with out="])
def test_a_replay_that_moves_buffers_is_refused(make):
    """The torch.func replay would run the forward's state update again: refused, by torch.func (an in-place
    update of a captured tensor) or, where torch.func lets it through (an ``out=`` write), by the check that the
    replay left every buffer as it was."""
    torch.manual_seed(0)
    model = nn.Sequential(make(), nn.Tanh(), nn.Linear(5, 3))
    x, y = _data(5)
    engine = GradSampleEngine(model)
    engine.probe(lambda n: F.cross_entropy(model(x[:n]), y[:n]))
    with engine.record(batch_size=7):
        F.cross_entropy(model(x), y).backward()
    with pytest.raises(PerSampleGradientError, match="changes its buffers|mutate a captured Tensor"):
        engine.per_sample_norms()


def test_dpsgd_trains_a_weight_normed_model():
    """Through the callback: a fit of an ordinary LightningModule with weight_norm on its first layer takes its
    steps, every gradient the optimizer uses released by DPSGD (its last line of defence checks that)."""
    from lightning_dp import DPSGD
    from tests.helpers import BlobsData, Classifier, trainer

    module = Classifier(net=nn.Sequential(parametrizations.weight_norm(nn.Linear(6, 16)), nn.Tanh(), nn.Linear(16, 3)))
    before = module.net[0].parametrizations.weight.original1.detach().clone()
    fit = trainer(max_steps=3, callbacks=[DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit.fit(module, datamodule=BlobsData())
    assert fit.global_step == 3
    assert not torch.equal(before, module.net[0].parametrizations.weight.original1)


class _Double(nn.Module):
    def forward(self, x):
        return 2 * x


class _Attention(nn.Module):
    """MultiheadAttention (whose rule claims out_proj) with out_proj's weight parametrized."""

    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)
        parametrize.register_parametrization(self.attention.out_proj, "weight", _Double())
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        out, _ = self.attention(x, x, x)
        return self.head(out.mean(1))


def test_a_parametrized_child_of_a_claiming_rule_takes_the_fallback():
    """The attention rule computes out_proj's gradients as the gradients of the weight it reads: with that weight
    parametrized they are not the original's (norms 22 % low before, found by a review). The whole attention
    module takes the exact fallback."""
    torch.manual_seed(0)
    model = _Attention()
    x, y = _data(3, 4)
    _check(model, x, y)
    engine = GradSampleEngine(model)
    assert isinstance(engine.layers[0].rule, ParametrizedRule)
    assert "out_proj.parametrizations.weight.original" in engine.layers[0].trainable
    engine.remove()


def test_inside_parametrize_cached_the_replay_computes_the_tensor_afresh():
    """The per-sample computation inside ``parametrize.cached()`` (a training step wrapped in it): the replay must
    not read the cached tensor, computed from the parameters rather than from each example's (norms 12.6 % low
    before, found by a review)."""
    torch.manual_seed(0)
    model = nn.Sequential(parametrizations.weight_norm(nn.Linear(5, 5)), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = _data(5)
    x = x.double()
    _, ref = per_example_gradients(model, F.cross_entropy(model(x), y, reduction="none"))
    engine = GradSampleEngine(model)
    engine.probe(lambda n: F.cross_entropy(model(x[:n]), y[:n]))
    with parametrize.cached():
        with engine.record(batch_size=7):
            F.cross_entropy(model(x), y).backward()
        norms = engine.per_sample_norms()
        assert parametrize._cache_enabled  # the cache is on again after the replay
    engine.remove()
    torch.testing.assert_close(norms, ref.norm(dim=1), rtol=1e-6, atol=1e-9)


class _TwoReads(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 5))

    def forward(self, x):
        return x @ self.weight.T + torch.tanh(x @ self.weight.T)  # the parametrized weight read twice


def test_spectral_norm_read_twice_in_a_forward_is_refused():
    """Each read moves spectral_norm's power iteration in training: the two reads used two weights, which the
    replay cannot tell apart (norms up to 1.4 % low before, found by a review). Refused; inside
    ``parametrize.cached()`` the weight is computed once and the forward is exact."""
    torch.manual_seed(0)
    model = nn.Sequential(parametrizations.spectral_norm(_TwoReads()), nn.Tanh(), nn.Linear(5, 3)).double().train()
    x, y = _data(5)
    x = x.double()
    engine = GradSampleEngine(model)
    engine.probe(lambda n: F.cross_entropy(model(x[:n]), y[:n]))
    with pytest.raises(PerSampleGradientError, match="read a spectral_norm-parametrized weight 2 times"):
        with engine.record(batch_size=7):
            F.cross_entropy(model(x), y).backward()
    engine.remove()
    engine = GradSampleEngine(model)
    engine.probe(lambda n: F.cross_entropy(model(x[:n]), y[:n]))
    with engine.record(batch_size=7), parametrize.cached():
        F.cross_entropy(model(x), y).backward()
    engine.per_sample_norms()
    engine.remove()


def test_a_parametrized_recurrent_layer_is_refused_before_any_data():
    lstm = nn.LSTM(4, 5, batch_first=True)
    parametrize.register_parametrization(lstm, "weight_hh_l0", _Double())
    with pytest.raises(PerSampleGradientError, match="parametrized weight \\(weight_hh_l0\\)"):
        GradSampleEngine(nn.Sequential(lstm))


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_the_deprecated_hook_based_reparametrizations_are_refused_with_the_remedy(kind):
    """torch.nn.utils.weight_norm / spectral_norm compute the weight in a forward pre-hook, outside the recorded
    forward: refused when the engine is built, naming the parametrizations' version that works; frozen, accepted."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation warning for weight_norm
        layer = getattr(torch.nn.utils, kind)(nn.Linear(5, 6))
    with pytest.raises(PerSampleGradientError, match=f"deprecated torch.nn.utils.{kind}.*parametrizations.{kind}"):
        GradSampleEngine(nn.Sequential(layer, nn.Linear(6, 3)))
    for p in layer.parameters():
        p.requires_grad_(False)
    GradSampleEngine(nn.Sequential(layer, nn.Linear(6, 3))).remove()


class _Twice(nn.Module):
    """One weight-normed linear layer called on two inputs (two records of one layer; its bias its own)."""

    def __init__(self):
        super().__init__()
        self.fc = parametrizations.weight_norm(nn.Linear(5, 6))

    def forward(self, x):
        return self.fc(x) + torch.tanh(self.fc(2 * x))


def _stacked():
    layer = parametrizations.weight_norm(nn.Linear(5, 6))
    parametrize.register_parametrization(layer, "weight", _Scaled())  # weight_norm, then a learned scale
    return layer


def _bias_only():
    layer = nn.Linear(5, 6)
    parametrize.register_parametrization(layer, "bias", _Scaled())
    layer.weight.requires_grad_(False)
    return layer


CHAINED = {
    "weight_norm, dim=1": (lambda: parametrizations.weight_norm(nn.Linear(5, 6), dim=1), (5,), 6),
    "weight_norm, the whole tensor": (lambda: parametrizations.weight_norm(nn.Linear(5, 6), dim=None), (5,), 6),
    "weight_norm on positions (B, T, d)": (
        lambda: nn.Sequential(parametrizations.weight_norm(nn.Linear(5, 6)), nn.Flatten()), (4, 5), 24),
    "weight_norm conv1d, dim=2": (lambda: nn.Sequential(parametrizations.weight_norm(nn.Conv1d(2, 3, 3), dim=2),
                                                        nn.Flatten()), (2, 8), 18),
    "weight_norm transposed conv": (lambda: nn.Sequential(parametrizations.weight_norm(nn.ConvTranspose2d(2, 3, 3,
                                                          stride=2)), nn.Flatten()), (2, 3, 3), 147),
    "spectral_norm conv, eval": (lambda: nn.Sequential(parametrizations.spectral_norm(nn.Conv2d(2, 4, 3)).eval(),
                                                       nn.Flatten()), (2, 6, 6), 64),
    "orthogonal, cayley": (lambda: parametrizations.orthogonal(nn.Linear(5, 5), orthogonal_map="cayley"), (5,), 5),
    "two parametrizations stacked": (_stacked, (5,), 6),
    "a parametrized bias, the weight frozen": (_bias_only, (5,), 6),
    "one layer called twice": (_Twice, (5,), 6),
}


@pytest.mark.parametrize("name", CHAINED)
def test_linear_and_conv_layers_are_chained_through_their_parametrizations(name, monkeypatch):
    """A parametrized linear layer or convolution takes its own rule's per-sample gradients of the tensor it reads,
    pulled back through the parametrizations, not the replay of the fallback (which would fail here): exact against
    per-example autograd, with no warning (torch's "performance drop" of a batched weight_norm backward included)."""
    from lightning_dp.privacy.grad_sample.rules import functorch

    def no_replay(*args, **kwargs):
        raise AssertionError("the fallback replayed a layer that its rule chains")

    monkeypatch.setattr(functorch, "per_example_grads", no_replay)
    make, shape, width = CHAINED[name]
    torch.manual_seed(0)
    model = nn.Sequential(make(), nn.Tanh(), nn.Linear(width, 3))
    x, y = _data(*shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check(model, x, y, train="eval" not in name)  # spectral_norm in training: the test above
    engine = GradSampleEngine(model)
    rules = [layer.rule for layer in engine.layers if isinstance(layer.rule, ParametrizedRule)]
    assert rules and all(rule.inner is not None for rule in rules)
    engine.remove()


def test_what_the_chain_cannot_take_falls_back_exactly(monkeypatch):
    """A parametrized layer of a type with no chained rule (a LayerNorm) takes the exact fallback; a linear layer is
    chained whatever the engine's instantiate_limit (its rule's ghost norms, or instantiated gradients, pulled back)."""
    from lightning_dp.privacy.grad_sample.rules import functorch

    replayed = []
    original = functorch.per_example_grads
    monkeypatch.setattr(functorch, "per_example_grads",
                        lambda layer, *a, **k: (replayed.append(layer.name), original(layer, *a, **k))[1])
    torch.manual_seed(0)
    norm = nn.LayerNorm(6)
    parametrize.register_parametrization(norm, "weight", _Scaled())
    model = nn.Sequential(parametrizations.weight_norm(nn.Linear(5, 6)), norm, nn.Tanh(), nn.Linear(6, 3)).double()
    x, y = _data(5)
    x = x.double()
    params, ref = per_example_gradients(model, F.cross_entropy(model(x), y, reduction="none"))
    for limit in (2**30, 8):
        replayed.clear()
        engine = GradSampleEngine(model, instantiate_limit=limit)
        engine.probe(lambda n: F.cross_entropy(model(x[:n]), y[:n]))
        with engine.record(batch_size=7):
            F.cross_entropy(model(x), y).backward()
        norms = engine.per_sample_norms()
        engine.clear()
        engine.remove()
        torch.testing.assert_close(norms, ref.norm(dim=1), rtol=1e-6, atol=1e-9)
        assert sorted(set(replayed)) == ["1"]


class _Closed(nn.Module):
    """Every closed-form pull-back: weight_norm and spectral_norm (eval) on a linear layer of vectors (the factored
    statistics) and on convolutions (the instantiated ones), beside a plain bias."""

    def __init__(self):
        super().__init__()
        self.conv_wn = parametrizations.weight_norm(nn.Conv1d(2, 3, 3, padding=1))
        self.conv_sn = parametrizations.spectral_norm(nn.Conv1d(3, 3, 3, padding=1))
        self.fc_wn = parametrizations.weight_norm(nn.Linear(15, 6))
        self.fc_sn = parametrizations.spectral_norm(nn.Linear(6, 3))

    def forward(self, x):
        h = torch.tanh(self.conv_sn(torch.tanh(self.conv_wn(x))))
        return self.fc_sn(torch.tanh(self.fc_wn(h.flatten(1))))


def _closed_model():
    torch.manual_seed(0)
    model = _Closed().double().eval()
    for sn in _spectral(model):
        _randomize_power_iteration_of(sn)
    return model


def _spectral(model):
    return [m for m in model.modules() if isinstance(m, parametrizations._SpectralNorm)]


def _randomize_power_iteration_of(sn):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        sn._u.copy_(F.normalize(torch.randn(sn._u.shape, generator=g, dtype=sn._u.dtype), dim=0))
        sn._v.copy_(F.normalize(torch.randn(sn._v.shape, generator=g, dtype=sn._v.dtype), dim=0))


def test_closed_form_pullbacks_take_no_batched_pull_back_and_are_exact(monkeypatch):
    from lightning_dp.privacy.grad_sample.rules import parametrized

    def no_batched(*args, **kwargs):
        raise AssertionError("a closed-form parametrization was pulled back by torch.func")

    monkeypatch.setattr(parametrized, "_pull_back", no_batched)
    model = _closed_model()
    x, y = _data(2, 5)
    _check(model, x, y, train=False)


def test_closed_form_pullbacks_of_users_equal_the_naive_per_user_means():
    """group_norms (user-level DP-SGD): a user's gradient is the mean of its examples', pulled back likewise."""
    from tests.privacy.test_group_norms import _check as check_groups

    model = _closed_model()
    x, _ = _data(2, 5)
    for sizes in ([3, 1, 2, 1], [7]):
        check_groups(model, lambda m, inputs: F.cross_entropy(m(inputs), torch.zeros(inputs.shape[0], dtype=torch.long)),
                     x.double(), sizes)


def test_closed_form_pullbacks_drop_a_non_finite_example():
    """An example whose gradient is not finite: norm +inf, nothing in the clipped sum; the others exact."""
    model = _closed_model()
    x, y = _data(2, 5)
    x = x.double()
    x[3, 0, 2] = float("nan")
    keep = [i for i in range(7) if i != 3]
    params, ref = per_example_gradients(model, F.cross_entropy(model(x[keep]), y[keep], reduction="none"))
    engine = GradSampleEngine(model)
    engine.probe(lambda n: F.cross_entropy(model(x[:n]), y[:n]))
    with engine.record(batch_size=7):
        F.cross_entropy(model(x), y).backward()
    norms = engine.per_sample_norms()
    assert engine.dropped == 1 and math.isinf(norms[3])
    factors = clip_factors(norms, 0.5)
    summed = engine.clipped_sum(factors)
    order = {id(p): i for i, p in enumerate(engine.parameters)}
    engine.remove()
    torch.testing.assert_close(norms[keep], ref.norm(dim=1), rtol=1e-6, atol=1e-9)
    flat = torch.cat([summed[order[id(p)]].reshape(-1) for p in params])
    torch.testing.assert_close(flat, (factors[keep, None] * ref).sum(0), rtol=1e-6, atol=1e-9)


def test_closed_form_pullbacks_instantiate_what_autograd_gives():
    """Pulled.dense (a tied parameter's cross terms read it): every example's gradient of every original."""
    from lightning_dp.privacy.grad_sample.rules.parametrized import Pulled

    model = _closed_model()
    x, y = _data(2, 5)
    x = x.double()
    params, ref = per_example_gradients(model, F.cross_entropy(model(x), y, reduction="none"))
    engine = GradSampleEngine(model)
    engine.probe(lambda n: F.cross_entropy(model(x[:n]), y[:n]))
    with engine.record(batch_size=7):
        F.cross_entropy(model(x), y).backward()
    engine.per_sample_norms()
    start, checked = 0, 0
    for p in params:
        (c,) = engine._contributions[id(p)]
        if isinstance(c, Pulled):
            torch.testing.assert_close(c.dense().reshape(7, -1) * 7, ref[:, start:start + p.numel()],
                                       rtol=1e-6, atol=1e-9)
            checked += 1
        start += p.numel()
    engine.remove()
    assert checked == 6  # g and v of two weight_norms, the original of two spectral_norms (the biases are plain)


def test_closed_form_pullbacks_in_the_fused_pass_compile_once():
    """The compiled private pass (DPSGD(compile_step=...)) over closed-form pull-backs: the naive sums and norms,
    captured once over several steps."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from lightning_dp.callbacks.private_step import compiled_pass, fused_pass
    from tests.privacy.test_fused_pass import run

    model = _closed_model()
    x, y = _data(2, 5)
    x = x.double()
    params, ref = per_example_gradients(model, F.cross_entropy(model(x), y, reduction="none"))
    engine = GradSampleEngine(model)
    engine.probe(lambda n: F.cross_entropy(model(x[:n]), y[:n]))
    counter = CompileCounterWithBackend("eager")
    compiled = compiled_pass({"backend": counter})
    for step in range(3):
        norms, sums, _ = run(engine, model, x, y, compiled if step else fused_pass, 0.5)
        factors = clip_factors(ref.norm(dim=1), 0.5)
        factors[-1] = 0
        order = {id(p): i for i, p in enumerate(engine.parameters)}
        flat = torch.cat([sums[order[id(p)]].reshape(-1) for p in params])
        torch.testing.assert_close(norms, ref.norm(dim=1), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(flat, (factors[:, None] * ref).sum(0), rtol=1e-9, atol=1e-12)
    assert counter.frame_count == 1
    engine.remove()


def _crafted(kind):
    """A float32 layer with one output and one example whose input lies along the weight's direction, up to a small
    perpendicular part: the parametrization's pull-back removes the large part, so its norm is a difference of large
    terms (a review found closed forms giving 0 for a gradient of 59 C)."""
    torch.manual_seed(0)
    layer = nn.Linear(16, 1, bias=False)
    if kind == "spectral_norm":
        layer = parametrizations.spectral_norm(layer).eval()
    else:
        layer = parametrizations.weight_norm(layer)
        layer.parametrizations.weight.original0.requires_grad_(False)  # only the direction trains: all cancels
    direction = layer.weight.detach().double()[0]
    direction = direction / direction.norm()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, dtype=torch.float64, generator=g)
    perp = torch.randn(16, dtype=torch.float64, generator=g)
    perp -= (perp @ direction) * direction
    x[0] = 3e5 * direction + 3e1 * perp / perp.norm()
    return nn.Sequential(layer), x.float(), torch.zeros(8)


@pytest.mark.parametrize("kind", ["spectral_norm", "weight_norm"])
def test_a_norm_that_cancels_is_never_underestimated(kind):
    """The engine's norm of the crafted example is at least its true norm, and its clipped contribution (the clipped
    sum with only it weighted) stays within C."""
    model, x, y = _crafted(kind)

    def loss(out, target):
        return F.binary_cross_entropy_with_logits(out.squeeze(-1), target, reduction="none")

    reference = copy.deepcopy(model).double()
    (theta,) = [p for p in reference.parameters() if p.requires_grad]
    true = torch.autograd.grad(loss(reference(x[:1].double()), y[:1]).sum(), theta)[0].norm()
    engine = GradSampleEngine(model)
    engine.probe(lambda n: loss(model(x[:n]), y[:n]).mean())
    with engine.record(batch_size=8):
        loss(model(x), y).mean().backward()
    norms = engine.per_sample_norms()
    factors = clip_factors(norms, 1.0)
    only = torch.zeros_like(factors)
    only[0] = factors[0]
    released = torch.cat([t.reshape(-1) for t in engine.clipped_sum(only)]).norm()
    engine.remove()
    assert true > 10 and norms[0] >= true * (1 - 1e-6)
    assert released <= 1.0 + 1e-4


def test_weight_norm_of_a_bias_divides_each_entry_by_its_own_size():
    """weight_norm on a 1-D tensor along its dimension (dim=0): every entry is its own row (|v_i|), as torch's
    norm_except_dim computes it; the batched pull-back must not normalize the whole vector."""
    torch.manual_seed(0)
    layer = parametrizations.weight_norm(nn.Linear(5, 6), name="bias", dim=0)
    model = nn.Sequential(layer, nn.Tanh(), nn.Linear(6, 3))
    _check(model, *_data(5))


class _DropConnect(nn.Module):
    def forward(self, w):
        return w * (torch.rand_like(w) > 0.5) * 2 if self.training else w


def test_a_parametrization_that_draws_random_numbers_is_refused():
    torch.manual_seed(0)
    layer = nn.Linear(5, 6)
    parametrize.register_parametrization(layer, "weight", _DropConnect())
    model = nn.Sequential(layer, nn.Tanh(), nn.Linear(6, 3))
    x, y = _data(5)
    engine = GradSampleEngine(model)
    engine.probe(lambda n: F.cross_entropy(model(x[:n]), y[:n]))
    with engine.record(batch_size=7):
        F.cross_entropy(model(x), y).backward()
    with pytest.raises(PerSampleGradientError, match="draws random numbers"):
        engine.per_sample_norms()
    engine.remove()


def test_hooks_on_a_parametrized_layer():
    """An observer on a parametrized layer keeps the chain; a hook of the user's on the parametrization (it runs when
    the forward reads the tensor) sends the layer to the replay, which runs it, exactly; a hook changing the layer's
    output is refused (the engine's watch, as for any layer)."""
    torch.manual_seed(0)
    layer = parametrizations.weight_norm(nn.Linear(5, 6))
    seen = []
    layer.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    model = nn.Sequential(layer, nn.Tanh(), nn.Linear(6, 3))
    _check(model, *_data(5))
    engine = GradSampleEngine(model)
    assert engine.layers[0].rule.inner is not None and seen
    engine.remove()

    from lightning_dp.privacy.grad_sample.rules import functorch

    replayed = []
    original = functorch.per_example_grads
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(functorch, "per_example_grads",
                      lambda layer, *a, **k: (replayed.append(layer.name), original(layer, *a, **k))[1])
        for where in ("the list", "a parametrization", "after the engine", "a global hook"):
            torch.manual_seed(0)
            layer = parametrizations.weight_norm(nn.Linear(5, 6))
            model = nn.Sequential(layer, nn.Tanh(), nn.Linear(6, 3))
            scale = (lambda m, args, out: out * 1.5 if m is layer.parametrizations.weight[0] else None)
            handle = None
            if where == "the list":
                layer.parametrizations.weight.register_forward_hook(scale)
            elif where == "a parametrization":
                layer.parametrizations.weight[0].register_forward_hook(scale)
            elif where == "a global hook":
                from torch.nn.modules.module import register_module_forward_hook

                handle = register_module_forward_hook(scale)
            replayed.clear()
            try:
                if where == "after the engine":  # the hook comes while the engine exists: checked every step
                    _check_hooked_later(model, layer, scale)
                else:
                    _check(model, *_data(5))
            finally:
                if handle is not None:
                    handle.remove()
            assert replayed == ["0"], where

    torch.manual_seed(0)
    layer = parametrizations.weight_norm(nn.Linear(5, 6))
    layer.register_forward_hook(lambda m, args, out: out * m.weight.sum())
    model = nn.Sequential(layer, nn.Tanh(), nn.Linear(6, 3))
    _refused_when_recorded(model, *_data(5), "a forward hook on it changed its output")


def _check_hooked_later(model, layer, hook):
    """The engine built and probed, then a hook put on the parametrization, then a step: exact."""
    model = model.double()
    x, y = _data(5)
    x = x.double()
    engine = GradSampleEngine(model)
    engine.probe(lambda n: F.cross_entropy(model(x[:n]), y[:n]))
    layer.parametrizations.weight[0].register_forward_hook(hook)
    params, ref = per_example_gradients(model, F.cross_entropy(model(x), y, reduction="none"))
    with engine.record(batch_size=7):
        F.cross_entropy(model(x), y).backward()
    norms = engine.per_sample_norms()
    engine.remove()
    torch.testing.assert_close(norms, ref.norm(dim=1), rtol=1e-6, atol=1e-9)


def test_a_scalar_parameter_shared_by_two_layers():
    """One parametrization with a learned scale on two layers: the scalar's per-example gradient is the sum of two
    contributions, with their cross term."""
    torch.manual_seed(0)
    scale = _Scaled()
    a, b = nn.Linear(5, 5), nn.Linear(5, 5)
    parametrize.register_parametrization(a, "weight", scale)
    parametrize.register_parametrization(b, "weight", scale)
    model = nn.Sequential(a, nn.Tanh(), b, nn.Tanh(), nn.Linear(5, 3))
    _check(model, *_data(5))


class _Tokens(nn.Module):
    """A parametrized embedding (or bag) of token sequences, averaged, then a linear head."""

    def __init__(self, table: nn.Module):
        super().__init__()
        self.table, self.head = table, nn.Linear(6, 3)

    def forward(self, x):
        out = self.table(x)
        return self.head(out if out.dim() == 2 else out.mean(1))


EMBEDDINGS = {
    "weight_norm embedding": lambda: parametrizations.weight_norm(nn.Embedding(10, 6)),
    "spectral_norm embedding, padding_idx": lambda: parametrizations.spectral_norm(
        nn.Embedding(10, 6, padding_idx=0)).eval(),
    "orthogonal embedding": lambda: parametrizations.orthogonal(nn.Embedding(10, 6)),
    "weight_norm bag": lambda: parametrizations.weight_norm(nn.EmbeddingBag(10, 6, mode="mean")),
}


@pytest.mark.parametrize("name", EMBEDDINGS)
def test_parametrized_embeddings_are_chained_and_exact(name, monkeypatch):
    """An embedding's rule reads only its indices and output gradients: a parametrized embedding is chained
    through its parametrizations (closed form or batched pull-back, and floored as they are), not replayed by the
    torch.func fallback (which has no floor: tests/privacy/test_cancellation.py, weight_norm_embedding)."""
    from lightning_dp.privacy.grad_sample.rules import functorch

    torch.manual_seed(0)
    model = _Tokens(EMBEDDINGS[name]()).double()

    def replayed(*args, **kwargs):
        raise AssertionError("the parametrized embedding was replayed by the torch.func fallback")

    monkeypatch.setattr(functorch.FunctorchRule, "contributions", replayed)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 10, (7, 5), generator=g), torch.randint(0, 3, (7,), generator=g)
    _check(model, x, y, train=model.table.training)


def test_a_parametrized_embedding_with_max_norm_is_refused_by_the_fallback():
    """``max_norm`` renormalizes the table in place before each forward: not chained; the fallback's replay cannot
    run ``embedding_renorm_`` per example, and says so (as before the embeddings were chained)."""
    torch.manual_seed(0)
    model = _Tokens(parametrizations.weight_norm(nn.Embedding(10, 6, max_norm=1.0))).double()
    x, y = torch.randint(0, 10, (7, 5)), torch.randint(0, 3, (7,))
    engine = GradSampleEngine(model)
    with pytest.raises(PerSampleGradientError, match=r"table \(ParametrizedEmbedding\).*embedding_renorm_"):
        engine.probe(lambda n: F.cross_entropy(model(x[:n]), y[:n]))
        with engine.record(batch_size=7):
            F.cross_entropy(model(x), y).backward()
        engine.per_sample_norms()
    engine.remove()
