"""Shapes, parameter counts and DP-compatibility of the reference networks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dp.models import MLP, DigitsConvNet, MNISTConvNet

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
    shapes = []
    x = torch.zeros(1, 1, 28, 28)
    for layer in net.features:
        x = layer(x)
        shapes.append(tuple(x.shape[1:]))
    assert shapes == [(16, 14, 14), (16, 14, 14), (16, 13, 13), (32, 5, 5), (32, 5, 5), (32, 4, 4)]


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
        (lambda: MNISTConvNet(activation="gelu"), r"activation='gelu'.*\['relu', 'tanh'\]"),
        (lambda: MNISTConvNet(num_classes=0), r"num_classes=0"),
        (lambda: DigitsConvNet(num_classes=2.5), r"num_classes=2.5"),
        (lambda: MLP(0), r"in_features=0"),
        (lambda: MLP(4, hidden=(8, -1)), r"hidden\[1\]=-1"),
    ],
)
def test_invalid_arguments_are_named(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()
