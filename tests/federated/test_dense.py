"""The dense client engine's hand-written gradients against vmap(grad) of the same loss, and which models it takes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap

from lightning_dp.federated import FlatParams, local_sgd
from lightning_dp.federated.dense import DenseChain, dense_chain
from lightning_dp.federated.local import forward_and_loss
from lightning_dp.federated.parts import LocalSGD
from lightning_dp.federated.parts.update import AUTO_VMAP_MAX_PARAMETERS
from lightning_dp.models.federated import CIFARConvNet, HospitalMLP, LogisticRegression
from lightning_dp.models.networks import MLP
from tests.helpers import ACCELERATORS, DEVICE


class FunctionalForward(nn.Module):
    """Activations as functions and methods in forward, a squeeze at the end."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 5), nn.Linear(5, 4, bias=False), nn.Linear(4, 1)

    def forward(self, x):
        return self.c(torch.sigmoid(self.b(F.relu(self.a(x.flatten(1)))).tanh())).squeeze(-1)


# (model, example shape, loss, classes or None for real targets)
CASES = {
    "logreg_ce": (lambda: LogisticRegression(12, 4), (1, 3, 4), "cross_entropy", 4),
    "logreg_brier": (lambda: LogisticRegression(12, 4), (3, 4), "rmse", 4),
    "hospital_rmse": (lambda: HospitalMLP(), (3,), "rmse", None),
    "hospital_bce": (lambda: HospitalMLP(), (3,), "binary_cross_entropy", 2),
    "mlp_ce": (lambda: MLP(16, hidden=(7, 5), num_classes=3), (1, 4, 4), "cross_entropy", 3),
    "functional_bce": (lambda: FunctionalForward(), (2, 3), "binary_cross_entropy", 2),
    "sequential_rmse_1_output": (lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)), (3,), "rmse",
                                 None),
}


def clients(shape, classes, c=6, b=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(c, b, *shape, generator=g, dtype=torch.float64)
    if classes:
        y = torch.randint(0, classes, (c, b), generator=g)
        y = y.double() if classes == 2 else y
    else:
        y = torch.randn(c, b, generator=g, dtype=torch.float64)
    mask = torch.rand(c, b, generator=g) < 0.7
    mask[0] = False  # a client with no example in this batch
    mask[1] = True
    mask[2] = False
    mask[2, 3] = True  # one example
    return x, y, mask


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_equal_vmap_grad(case, accelerator):
    """Every loss, masked and empty batches, in float64: the hand-written gradient is autograd's to 1e-12 (on a GPU
    too, in float64 there as well)."""
    device = DEVICE[accelerator]
    make, shape, loss, classes = CASES[case]
    torch.manual_seed(0)
    model = make().double().to(device)
    spec = FlatParams.of(model)
    chain, why = DenseChain.of(model, spec)
    assert chain is not None, why
    assert chain.check(shape, (), loss) == ""
    x, y, mask = (t.to(device) for t in clients(shape, classes))
    theta = spec.flatten(model).repeat(len(x), 1) + 0.3 * torch.randn(len(x), spec.numel, dtype=torch.float64).to(device)

    def batch_loss(t, xb, yb, mb):
        return forward_and_loss(model, spec, t, xb, yb, mb, loss)[1]

    expected = vmap(grad(batch_loss))(theta, x, y, mask)
    got = chain.gradients(theta, x, y, mask, loss)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert torch.equal(got[0], torch.zeros_like(got[0]))  # no example: no step
    # descend applies exactly theta + scale * gradient
    scale = torch.full((len(x), 1), -0.1, dtype=torch.float64, device=device)
    moved = theta.clone()
    chain.descend(moved, x, y, mask, loss, scale)
    torch.testing.assert_close(moved, theta + scale * expected, rtol=1e-12, atol=1e-12)


def test_exact_fit_has_zero_gradient_as_autograd():
    """RMSE of a batch fitted exactly: masked_loss's sqrt is differentiated as 0 there, and so here."""
    model = nn.Sequential(nn.Linear(2, 1, bias=False), nn.Flatten(0)).double()
    spec = FlatParams.of(model)
    chain, why = DenseChain.of(model, spec)
    assert chain is None and "batch" in why  # flatten(0) merges the batch dimension
    model = nn.Sequential(nn.Linear(2, 1, bias=False))
    spec = FlatParams.of(model)
    chain, _ = DenseChain.of(model, spec)
    x = torch.randn(1, 4, 2)
    theta = torch.tensor([[1.0, -2.0]])
    y = x @ theta[0]
    assert torch.equal(chain.gradients(theta, x, y, torch.ones(1, 4, dtype=torch.bool), "rmse"), torch.zeros(1, 2))


@pytest.mark.parametrize("case", ["logreg_ce", "hospital_rmse", "mlp_ce"])
@pytest.mark.parametrize("epochs,batch_size", [(1, 4), (3, 2), (2, 50)])
@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_local_sgd_with_the_chain_equals_vmap(case, epochs, batch_size, accelerator):
    """Unequal clients (1 to 13 examples), the same shuffles: the same trained models in float64."""
    device = DEVICE[accelerator]
    make, shape, loss, classes = CASES[case]
    torch.manual_seed(1)
    model = make().double().to(device)
    spec = FlatParams.of(model)
    chain, _ = DenseChain.of(model, spec)
    sizes = [1, 5, 13, 7, 2]
    x, y, _ = (t.to(device) for t in clients(shape, classes, c=len(sizes), b=13, seed=2))
    mask = (torch.arange(13).unsqueeze(0) < torch.tensor(sizes).unsqueeze(1)).to(device)
    start = spec.flatten(model).repeat(len(sizes), 1)
    runs = [local_sgd(model, spec, start, x, y, mask, epochs=epochs, lr=0.2, batch_size=batch_size, loss=loss,
                      generator=torch.Generator(device).manual_seed(5), chain=c) for c in (None, chain)]
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-10, atol=1e-12)
    assert not torch.equal(runs[0], start)


def test_a_client_does_not_depend_on_its_companions():
    """What sharding clients over processes needs: client c's step alone equals its step among others (float32)."""
    model = LogisticRegression()
    spec = FlatParams.of(model)
    chain, _ = DenseChain.of(model, spec)
    x, y, mask = clients((1, 28, 28), 10, c=8, b=16)
    x, theta = x.float(), spec.flatten(model).repeat(8, 1)
    together = chain.gradients(theta, x, y, mask, "cross_entropy")
    alone = torch.cat([chain.gradients(theta[i:i + 1], x[i:i + 1], y[i:i + 1], mask[i:i + 1], "cross_entropy")
                       for i in range(8)])
    torch.testing.assert_close(together, alone, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", ["logreg_ce", "hospital_rmse", "mlp_ce"])
def test_a_step_from_a_shared_start_is_the_step_in_place(case):
    """The first local step (issue 53): from the round's one hypothesis expanded to the clients (stride 0, one matrix
    product over all their examples) or from their own rows, written into a new tensor, it is descend() on a copy
    (float64, to rounding); a client without examples in the batch (scale 0) keeps its start exactly."""
    make, shape, loss, classes = CASES[case]
    torch.manual_seed(3)
    model = make().double()
    spec = FlatParams.of(model)
    chain, _ = DenseChain.of(model, spec)
    x, y, mask = clients(shape, classes, c=5, b=4, seed=4)
    x = x.double()
    mask[2] = False
    scale = torch.full((5, 1), -0.3, dtype=torch.float64)
    scale[2] = 0.0
    one = spec.flatten(model)
    for start in (one.expand(5, -1), one.repeat(5, 1)):
        expected = start.clone()
        chain.descend(expected, x, y, mask, loss, scale)
        got = chain.step_from(start, x, y, mask, loss, scale)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
        assert torch.equal(got[2], one) and got.data_ptr() != start.data_ptr()


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)

    def forward(self, x):
        return x + self.a(x)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)

    def forward(self, x):
        return self.a(torch.relu(self.a(x)))


class SqueezeAll(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 1)

    def forward(self, x):
        return self.a(x).squeeze()


def frozen():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    return model


@pytest.mark.parametrize("make,reason", [
    (lambda: CIFARConvNet(), "Conv2d"),
    (lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)), "buffers"),
    (lambda: nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.1), nn.Linear(4, 2)), "Dropout"),
    (lambda: nn.Sequential(nn.Linear(3, 4), nn.GELU(), nn.Linear(4, 2)), "GELU"),
    (Residual, "used by 2 steps"),
    (Tied, "used twice"),
    (SqueezeAll, "squeeze() without a dimension"),
    (frozen, "frozen"),
])
def test_models_that_are_not_dense_chains_say_why(make, reason):
    model = make()
    chain, why = DenseChain.of(model, FlatParams.of(model))
    assert chain is None and reason in why


def test_a_model_with_hooks_is_not_a_chain():
    """torch.fx traces around hooks, which functional_call would run: such a model stays on vmap."""
    model = HospitalMLP()
    model.net[2].register_forward_hook(lambda module, args, out: 2 * out)
    chain, why = DenseChain.of(model, FlatParams.of(model))
    assert chain is None and "'net.2' has hooks" in why


def test_check_reads_shapes_before_any_data():
    model = MLP(16, hidden=(5,), num_classes=3)
    chain, _ = DenseChain.of(model, FlatParams.of(model))
    assert chain.check((1, 4, 4), (), "cross_entropy") == ""
    assert "Linear of 16 inputs" in chain.check((1, 5, 4), (), "cross_entropy")
    assert "one output per example" in chain.check((16,), (), "binary_cross_entropy")
    assert "(C,) logits" in chain.check((16,), (2,), "cross_entropy")
    assert "flatten(1, -1) of examples of shape ()" in chain.check((), (), "cross_entropy")
    hospital = HospitalMLP()
    chain, _ = DenseChain.of(hospital, FlatParams.of(hospital))
    assert chain.check((3,), (), "rmse") == "" and "one output per example" in chain.check((3,), (2,), "rmse")


def test_labels_outside_the_classes_are_refused():
    model = LogisticRegression(4, 3)
    spec = FlatParams.of(model)
    chain, _ = DenseChain.of(model, spec)
    x, mask = torch.randn(2, 3, 4), torch.ones(2, 3, dtype=torch.bool)
    y = torch.tensor([[0, 1, 2], [2, 3, 0]])
    with pytest.raises(ValueError, match=r"label outside \[0, 3\)"):
        local_sgd(model, spec, torch.zeros(2, spec.numel), x, y, mask, epochs=1, lr=0.1, batch_size=2,
                  loss="cross_entropy", chain=chain)
    mask[1, 1] = False  # a padding position may hold anything
    local_sgd(model, spec, torch.zeros(2, spec.numel), x, y, mask, epochs=1, lr=0.1, batch_size=2,
              loss="cross_entropy", chain=chain)


def test_the_update_chooses_its_engine():
    x, y = torch.randn(2, 3, 1, 28, 28), torch.zeros(2, 3, dtype=torch.long)
    logreg = LogisticRegression()
    spec = FlatParams.of(logreg)
    assert LocalSGD(engine="auto").dense_chain(logreg, spec, x, y, "cross_entropy") is not None
    assert LocalSGD(engine="dense").dense_chain(logreg, spec, x, y, "cross_entropy") is not None
    assert LocalSGD(engine="vmap").dense_chain(logreg, spec, x, y, "cross_entropy") is None
    cnn = CIFARConvNet()
    assert LocalSGD(engine="auto").dense_chain(cnn, FlatParams.of(cnn), x, y, "cross_entropy") is None
    with pytest.raises(ValueError, match="client_engine='dense' cannot train CIFARConvNet: .*Conv2d.*'auto' or 'vmap'"):
        LocalSGD(engine="dense").dense_chain(cnn, FlatParams.of(cnn), x, y, "cross_entropy")
    with pytest.raises(ValueError, match="Linear of 784 inputs meets examples of shape"):
        LocalSGD(engine="dense").dense_chain(logreg, spec, x[:, :, :, :10], y, "cross_entropy")
    # auto keeps vmap where the data does not fit the chain (vmap then raises torch's own error)
    assert LocalSGD(engine="auto").dense_chain(logreg, spec, x[:, :, :, :10], y, "cross_entropy") is None
    with pytest.raises(ValueError, match="client_engine='gpu' is not allowed; choose 'auto', 'dense'"):
        LocalSGD(engine="gpu")
    # without a chain: vmap up to AUTO_VMAP_MAX_PARAMETERS on the CPU, the loop above; vmap at any size on a GPU
    big = AUTO_VMAP_MAX_PARAMETERS + 1
    assert [LocalSGD(engine="auto").resolved_engine(n, "cpu") for n in (big - 1, big)] == ["vmap", "loop"]
    assert LocalSGD(engine="auto").resolved_engine(big) == "loop"
    assert LocalSGD(engine="auto").resolved_engine(big, torch.device("cuda", 0)) == "vmap"
    assert LocalSGD(engine="loop").resolved_engine(10, "cuda") == "loop"


def test_the_trace_is_kept_per_model_and_layout():
    model = HospitalMLP()
    spec = FlatParams.of(model)
    first = dense_chain(model, spec)
    assert dense_chain(model, spec) is first
    handle = model.net[1].register_forward_hook(lambda module, args, out: out)
    assert dense_chain(model, spec)[0] is None  # a hook registered since: traced again
    handle.remove()
    assert dense_chain(model, spec)[0] is not None
    model.net[1] = nn.GELU()
    assert "GELU" in dense_chain(model, spec)[1]  # a swapped layer
    model.net[1] = nn.ReLU()
    model.net[0].weight.requires_grad_(False)
    assert dense_chain(model, FlatParams.of(model))[0] is None  # another layout: traced again


class FlattenAfterLinear(nn.Module):
    """A Linear per row then flatten: the classes are the flattened outputs (6), not the Linear's width (2)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 2)

    def forward(self, x):
        return self.a(x).flatten(1)


def test_the_label_check_reads_the_output_not_the_last_linear():
    model = FlattenAfterLinear()
    spec = FlatParams.of(model)
    chain, _ = DenseChain.of(model, spec)
    x, mask = torch.randn(2, 3, 3, 4), torch.ones(2, 3, dtype=torch.bool)
    y = torch.tensor([[0, 5, 2], [3, 4, 1]])
    runs = [local_sgd(model, spec, torch.zeros(2, spec.numel), x, y, mask, epochs=1, lr=0.1, batch_size=2,
                      loss="cross_entropy", generator=torch.Generator().manual_seed(0), chain=c) for c in (None, chain)]
    torch.testing.assert_close(runs[1], runs[0])
    with pytest.raises(ValueError, match=r"label outside \[0, 6\)"):
        local_sgd(model, spec, torch.zeros(2, spec.numel), x, y + 1, mask, epochs=1, lr=0.1, batch_size=2,
                  loss="cross_entropy", chain=chain)


class ModeDependent(nn.Module):
    """A forward that branches on Python state: torch.fx records one branch."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)
        self.flag = False

    def forward(self, x):
        h = self.a(x)
        if self.flag:
            h = torch.relu(h)
        return self.b(h)


def test_a_trace_that_no_longer_describes_the_forward_is_not_used():
    """The chain's output is compared with the model's own forward before it trains: a flag changed since the
    trace (invisible to the cache) sends auto to vmap, and dense refuses."""
    torch.manual_seed(0)
    model = ModeDependent()
    spec = FlatParams.of(model)
    x, y = torch.randn(3, 6, 3), torch.randint(0, 2, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.bool)
    start = spec.flatten(model).repeat(3, 1)
    auto = LocalSGD(engine="auto", batch_size=2)
    assert auto.dense_chain(model, spec, x, y, "cross_entropy", start) is not None
    model.flag = True
    assert dense_chain(model, spec)[0] is not None  # the cached trace, still without the relu
    assert auto.dense_chain(model, spec, x, y, "cross_entropy", start) is None
    trained = auto.train(model, spec, start, x, y, mask, loss="cross_entropy", shuffles=torch.Generator())
    assert auto.engine_used == "vmap" and torch.isfinite(trained).all()
    with pytest.raises(ValueError, match="differ from the model's forward"):
        LocalSGD(engine="dense").dense_chain(model, spec, x, y, "cross_entropy", start)


def test_inputs_of_another_dtype_are_refused_as_the_other_engines_refuse_them():
    model = LogisticRegression(4, 3)
    spec = FlatParams.of(model)
    x, y = torch.randn(2, 3, 4, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.long)
    start = spec.flatten(model).repeat(2, 1)
    with pytest.raises(ValueError, match="inputs of dtype torch.float64 for parameters of dtype torch.float32"):
        LocalSGD(engine="dense").dense_chain(model, spec, x, y, "cross_entropy", start)
    chain, _ = DenseChain.of(model, spec)
    with pytest.raises(ValueError, match="inputs of dtype torch.float64"):
        local_sgd(model, spec, start, x, y, torch.ones(2, 3, dtype=torch.bool), epochs=1, lr=0.1, batch_size=2,
                  loss="cross_entropy", chain=chain)
