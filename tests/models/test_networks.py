"""Shapes, parameter counts and DP-compatibility of the reference networks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp.models import MLP, BagOfWordsMLP, ConvAutoencoder, DigitsConvNet, MNISTConvNet
from lightning_dp.privacy.clipping import clip_factors
from lightning_dp.privacy.grad_sample import GradSampleEngine
from tests.helpers import output_shapes, probe

_NORMS_MIXING_EXAMPLES = (nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm)


def _assert_no_batch_mixing(module: nn.Module) -> None:
    offenders = [name for name, m in module.named_modules() if isinstance(m, _NORMS_MIXING_EXAMPLES)]
    assert offenders == []


@pytest.mark.parametrize("activation", ["tanh", "relu"])
@pytest.mark.parametrize("num_classes", [10, 3])
def test_mnist_convnet_shapes(activation: str, num_classes: int) -> None:
    net = MNISTConvNet(num_classes=num_classes, activation=activation)
    assert net(torch.randn(5, 1, 28, 28)).shape == (5, num_classes)
    assert net(torch.randn(0, 1, 28, 28)).shape == (0, num_classes)
    _assert_no_batch_mixing(net)
    act = nn.Tanh if activation == "tanh" else nn.ReLU
    assert sum(isinstance(m, act) for m in net.modules()) == 3


def test_mnist_convnet_matches_reference_architecture() -> None:
    net = MNISTConvNet()
    # conv 16*1*8*8+16, conv 32*16*4*4+32, fc 512*32+32, fc 32*10+10 (TF-Privacy tutorial / Papernot et al. 2021)
    assert sum(p.numel() for p in net.parameters()) == 1040 + 8224 + 16416 + 330 == 26010
    assert output_shapes(net.features, torch.zeros(1, 1, 28, 28)) == [
        (16, 14, 14), (16, 14, 14), (16, 13, 13), (32, 5, 5), (32, 5, 5), (32, 4, 4)]


def test_the_thesis_mnist_cnn_is_table_3_5_with_table_3_1s_size() -> None:
    """layers='thesis': thesis Table 3.5's layers (8x8 and 4x4 convolutions of stride 1, one 2x2 max-pool of
    stride 1, Linear 32, Linear 10) with 551,322 parameters, Table 3.1's MNIST model size."""
    net = MNISTConvNet(layers="thesis")  # ReLU, the thesis' activation, by default
    # conv 16*64+16, conv 32*16*16+32, fc 32*23*23*32+32, fc 32*10+10
    assert sum(p.numel() for p in net.parameters()) == 1040 + 8224 + 541_728 + 330 == 551_322
    assert all(m.stride == (1, 1) for m in net.modules() if isinstance(m, nn.Conv2d))
    assert sum(isinstance(m, nn.MaxPool2d) for m in net.modules()) == 1
    assert output_shapes(net.features, torch.zeros(1, 1, 28, 28)) == [
        (16, 27, 27), (16, 27, 27), (16, 26, 26), (32, 23, 23), (32, 23, 23)]
    assert net(torch.randn(3, 1, 28, 28)).shape == (3, 10)
    assert sum(isinstance(m, nn.ReLU) for m in net.modules()) == 3  # none on the logits
    # the default keeps its module names, so checkpoints of earlier runs still load
    assert [name for name, _ in MNISTConvNet().named_parameters()] == [
        "features.0.weight", "features.0.bias", "features.3.weight", "features.3.bias",
        "classifier.1.weight", "classifier.1.bias", "classifier.3.weight", "classifier.3.bias"]
    _assert_no_batch_mixing(net)
    with pytest.raises(ValueError, match="layers='lenet' is not supported"):
        MNISTConvNet(layers="lenet")  # type: ignore[arg-type]


def test_the_thesis_bag_of_words_model_is_table_3_7_with_table_3_1s_size() -> None:
    """Table 3.7 (Linear 128, Linear 128, Linear 4, LeakyReLU) over 750 inputs: 113,156 parameters, Table 3.1's
    AG News model size; one width still means one hidden layer."""
    net = BagOfWordsMLP(in_features=750, hidden=(128, 128), activation="leaky_relu")
    assert sum(p.numel() for p in net.parameters()) == 128 * 750 + 128 + 128 * 128 + 128 + 128 * 4 + 4 == 113_156
    assert [(m.in_features, m.out_features) for m in net.modules() if isinstance(m, nn.Linear)] == [
        (750, 128), (128, 128), (128, 4)]
    assert sum(isinstance(m, nn.LeakyReLU) for m in net.modules()) == 2 and net.hidden == (128, 128)
    assert net(torch.randn(2, 750)).shape == (2, 4)
    assert [(m.in_features, m.out_features) for m in BagOfWordsMLP().modules() if isinstance(m, nn.Linear)] == [
        (50, 32), (32, 4)]
    with pytest.raises(ValueError, match=r"hidden=\[\] is not a width"):
        BagOfWordsMLP(hidden=[])


def test_digits_convnet_and_mlp_shapes() -> None:
    digits = DigitsConvNet(num_classes=10)
    assert digits(torch.randn(7, 1, 8, 8)).shape == (7, 10)
    assert digits(torch.randn(0, 1, 8, 8)).shape == (0, 10)
    mlp = MLP(64, hidden=(32, 16), num_classes=4)
    assert mlp(torch.randn(3, 1, 8, 8)).shape == (3, 4)
    assert MLP(6, hidden=(), num_classes=3)(torch.randn(2, 6)).shape == (2, 3)
    linear_sizes = [(m.in_features, m.out_features) for m in mlp.modules() if isinstance(m, nn.Linear)]
    assert linear_sizes == [(64, 32), (32, 16), (16, 4)]
    for net in (digits, mlp):
        _assert_no_batch_mixing(net)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: MNISTConvNet(activation="gelu"), r"activation='gelu'.*\['leaky_relu', 'relu', 'tanh'\]"),
        (lambda: MNISTConvNet(num_classes=0), r"num_classes=0"),
        (lambda: DigitsConvNet(num_classes=2.5), r"num_classes=2.5"),
        (lambda: MLP(0), r"in_features=0"),
        (lambda: MLP(4, hidden=(8, -1)), r"hidden\[1\]=-1"),
        (lambda: BagOfWordsMLP(hidden=0), r"hidden=0"),
        (lambda: BagOfWordsMLP(hidden=(128, -1)), r"hidden\[1\]=-1"),
        (lambda: BagOfWordsMLP(hidden="128"), r"hidden='128' is not a width"),
        (lambda: BagOfWordsMLP(in_features=50.0), r"in_features=50.0"),
        (lambda: BagOfWordsMLP(activation="sigmoid"), r"activation='sigmoid'"),
        (lambda: ConvAutoencoder(activation="gelu"), r"activation='gelu'"),
        (lambda: ConvAutoencoder(output="softmax"), r"output='softmax'.*\['identity', 'sigmoid'\]"),
    ],
)
def test_invalid_arguments_are_named(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_bag_of_words_mlp_architecture() -> None:
    net = BagOfWordsMLP()
    assert net.num_classes == 4 and net.in_features == 50 and net.hidden == 32
    assert net(torch.randn(6, 50)).shape == (6, 4)
    assert net(torch.randn(0, 50)).shape == (0, 4)
    linear_sizes = [(m.in_features, m.out_features) for m in net.modules() if isinstance(m, nn.Linear)]
    assert linear_sizes == [(50, 32), (32, 4)]
    assert sum(p.numel() for p in net.parameters()) == 50 * 32 + 32 + 32 * 4 + 4 == 1764
    assert sum(isinstance(m, nn.Tanh) for m in net.modules()) == 1
    wide = BagOfWordsMLP(in_features=100, hidden=8, num_classes=3, activation="relu")
    assert wide(torch.randn(2, 100)).shape == (2, 3) and any(isinstance(m, nn.ReLU) for m in wide.modules())
    _assert_no_batch_mixing(net)


def test_conv_autoencoder_architecture() -> None:
    net = ConvAutoencoder()
    assert net(torch.randn(3, 1, 28, 28)).shape == (3, 1, 28, 28)
    assert net(torch.randn(0, 1, 28, 28)).shape == (0, 1, 28, 28)
    assert net.encoder(torch.zeros(1, 1, 28, 28)).shape == (1, 32, 7, 7)
    # conv 16*9+16, conv 32*16*9+32, transposed 32*16*9+16, transposed 16*9+1
    assert sum(p.numel() for p in net.parameters()) == 160 + 4640 + 4624 + 145 == 9569
    assert isinstance(net.decoder[-1], nn.Identity)
    with torch.no_grad():
        squashed = ConvAutoencoder(output="sigmoid")(torch.randn(2, 1, 28, 28) * 10)
    assert float(squashed.min()) >= 0.0 and float(squashed.max()) <= 1.0
    _assert_no_batch_mixing(net)


def test_the_thesis_autoencoder_is_table_3_6() -> None:
    """layers='thesis': thesis Table 3.6, 3x3 stride-1 convolutions (8, 16, 32, 64) and transposed ones back, with
    the 48,705 parameters of Table 3.1 (FashionMNIST's model size)."""
    net = ConvAutoencoder(layers="thesis", activation="leaky_relu", output="sigmoid")
    assert [m.out_channels for m in net.encoder if isinstance(m, nn.Conv2d)] == [8, 16, 32, 64]
    assert [m.out_channels for m in net.decoder if isinstance(m, nn.ConvTranspose2d)] == [32, 16, 8, 1]
    assert all(m.stride == (1, 1) and m.kernel_size == (3, 3) for m in net.modules()
               if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)))
    assert net.encoder(torch.zeros(1, 1, 28, 28)).shape == (1, 64, 20, 20)
    assert sum(p.numel() for p in net.parameters()) == 48_705
    assert isinstance(net.decoder[-1], nn.Sigmoid) and isinstance(net.encoder[1], nn.LeakyReLU)
    assert net(torch.rand(3, 1, 28, 28)).shape == (3, 1, 28, 28)
    _assert_no_batch_mixing(net)
    with pytest.raises(ValueError, match="layers='wide' is not supported"):
        ConvAutoencoder(layers="wide")  # type: ignore[arg-type]


def _naive_per_sample(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One backward per example: flat per-sample gradients of shape (B, P)."""
    params = list(model.parameters())
    rows = []
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(loss_fn(model(x[i : i + 1]), y[i : i + 1]), params)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


@pytest.mark.parametrize("case", ["bag_of_words_mlp", "bag_of_words_mlp_thesis", "mnist_convnet_thesis",
                                  "conv_autoencoder", "conv_autoencoder_sigmoid_relu"])
def test_per_sample_gradients_match_naive_loop(case: str) -> None:
    """DP-SGD compatibility: the engine's per-sample norms and clipped sum equal a per-example loop (float32)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if case == "bag_of_words_mlp":
        model, loss_fn = BagOfWordsMLP(), F.cross_entropy
        x, y = torch.randn(9, 50, generator=g), torch.randint(0, 4, (9,), generator=g)
    elif case == "bag_of_words_mlp_thesis":
        model, loss_fn = BagOfWordsMLP(750, (128, 128), activation="leaky_relu"), F.cross_entropy
        x, y = torch.randn(6, 750, generator=g), torch.randint(0, 4, (6,), generator=g)
    elif case == "mnist_convnet_thesis":
        model, loss_fn = MNISTConvNet(layers="thesis", activation="relu"), F.cross_entropy
        x, y = torch.randn(4, 1, 28, 28, generator=g), torch.randint(0, 10, (4,), generator=g)
    else:
        kwargs = {"output": "sigmoid", "activation": "relu"} if case.endswith("sigmoid_relu") else {}
        model, loss_fn = ConvAutoencoder(**kwargs), F.mse_loss
        x = torch.randn(5, 1, 28, 28, generator=g)
        y = x  # reconstruction target: the input itself
    reference = _naive_per_sample(model, loss_fn, x, y)
    model.zero_grad(set_to_none=True)
    engine = GradSampleEngine(model)
    probe(engine, model, x)
    with engine.record():
        loss_fn(model(x), y).backward()
    engine.check_parameter_gradients()
    norms = engine.per_sample_norms()
    factors = clip_factors(norms, 0.5 * float(norms.median()))
    summed = engine.clipped_sum(factors)
    engine.remove()
    torch.testing.assert_close(norms, reference.norm(dim=1), rtol=1e-5, atol=0)
    order = {id(p): i for i, p in enumerate(engine.parameters)}
    flat = torch.cat([summed[order[id(p)]].reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(flat, (factors[:, None] * reference).sum(0), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("kernel", "stride", "padding", "ceil_mode"),
                         [(2, 1, 0, False), (3, 2, 1, False), (2, 2, 0, True)])
def test_the_channels_last_max_pool_equals_nn_max_pool_bit_for_bit(kernel, stride, padding, ceil_mode):
    """The models' MaxPool2d pools a CPU batch in channels-last layout (faster on torch 2.13's CPU); its output and
    its input gradient equal nn.MaxPool2d's exactly, also where saturated tanh outputs tie; inside torch.func's
    vmap (which cannot change a layout) it takes nn.MaxPool2d's own path."""
    from torch.func import grad, vmap

    from lightning_dp.models.networks import MaxPool2d

    x = torch.tanh(torch.randn(16, 6, 13, 13, generator=torch.Generator().manual_seed(0)) * 20)  # many exact +-1
    ours, theirs = MaxPool2d(kernel, stride, padding, ceil_mode=ceil_mode), nn.MaxPool2d(kernel, stride, padding,
                                                                                         ceil_mode=ceil_mode)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_a, out_b = ours(a), theirs(b)
    assert out_a.is_contiguous() and torch.equal(out_a, out_b)
    g = torch.randn_like(out_b)
    out_a.backward(g)
    out_b.backward(g)
    assert torch.equal(a.grad, b.grad)
    traced = torch.fx.symbolic_trace(MNISTConvNet())  # one call in the graph, not its branches
    assert "_max_pool2d" in str(traced.graph)
    per_example = vmap(grad(lambda t: ours(t.unsqueeze(0)).square().sum()))(x)
    torch.testing.assert_close(per_example, vmap(grad(lambda t: theirs(t.unsqueeze(0)).square().sum()))(x),
                               rtol=0, atol=0)
