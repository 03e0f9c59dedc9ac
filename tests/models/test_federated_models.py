"""Parameter counts and shapes of the personalized federated learning networks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dp.models.federated import FEMNISTConvNet, HospitalMLP, LinearRegression
from tests.helpers import output_shapes


def _num_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _assert_no_batch_mixing(module: nn.Module) -> None:
    assert not any(isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm)) for m in module.modules())


def test_linear_regression_is_the_seed_model() -> None:
    model = LinearRegression()
    assert _num_parameters(model) == 2 and model.linear.bias is None
    x = torch.randn(7, 2)
    y = model(x)
    assert y.shape == (7,)
    torch.testing.assert_close(y, x @ model.linear.weight[0])  # y = x^T theta
    assert model(torch.zeros(0, 2)).shape == (0,)
    assert _num_parameters(LinearRegression(in_features=5)) == 5
    _assert_no_batch_mixing(model)


def test_hospital_mlp_has_eleven_parameters() -> None:
    model = HospitalMLP()
    assert _num_parameters(model) == 6 + 2 + 2 + 1 == 11
    assert [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)] == [(3, 2), (2, 1)]
    assert sum(isinstance(m, nn.ReLU) for m in model.modules()) == 1
    assert model(torch.randn(5, 3)).shape == (5,)
    assert _num_parameters(HospitalMLP(in_features=4, hidden=8)) == 4 * 8 + 8 + 8 + 1
    _assert_no_batch_mixing(model)


def test_femnist_convnet_matches_the_seed_architecture() -> None:
    model = FEMNISTConvNet()
    # conv 32*1*2*2+32, conv 64*32*2*2+64, fc 64*13*13*128+128, fc 128*62+62
    assert _num_parameters(model) == 160 + 8256 + 1_384_576 + 7998 == 1_400_990
    assert _num_parameters(FEMNISTConvNet(num_classes=10)) == 1_392_992 + 129 * 10
    assert output_shapes(model.features, torch.zeros(1, 1, 28, 28)) == [
        (32, 27, 27), (32, 27, 27), (64, 26, 26), (64, 26, 26), (64, 13, 13)]
    assert model(torch.randn(3, 1, 28, 28)).shape == (3, 62)
    assert model(torch.randn(0, 1, 28, 28)).shape == (0, 62)
    _assert_no_batch_mixing(model)


def test_femnist_convnet_with_3x3_kernels_has_the_papers_stated_count() -> None:
    """kernel_size=3: the paper's 1,206,590 parameters (conv 32*9+32, conv 64*32*9+64, fc 64*12*12*128+128,
    fc 128*62+62); the smallest and largest kernels that leave a feature map."""
    model = FEMNISTConvNet(kernel_size=3)
    assert _num_parameters(model) == 320 + 18_496 + 1_179_776 + 7998 == 1_206_590
    assert output_shapes(model.features, torch.zeros(1, 1, 28, 28))[-1] == (64, 12, 12)
    assert model(torch.randn(3, 1, 28, 28)).shape == (3, 62)
    _assert_no_batch_mixing(model)
    assert output_shapes(FEMNISTConvNet(kernel_size=1).features, torch.zeros(1, 1, 28, 28))[-1] == (64, 14, 14)
    assert output_shapes(FEMNISTConvNet(kernel_size=14).features, torch.zeros(1, 1, 28, 28))[-1] == (64, 1, 1)


def test_per_layer_sizes_of_the_cnn_for_layerwise_sanitization() -> None:
    sizes = [p.numel() for p in FEMNISTConvNet().parameters()]
    assert sizes == [128, 32, 8192, 64, 1_384_448, 128, 7936, 62] and sum(sizes) == 1_400_990


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: LinearRegression(in_features=0), r"in_features=0"),
        (lambda: HospitalMLP(hidden=1.5), r"hidden=1.5"),
        (lambda: FEMNISTConvNet(num_classes=0), r"num_classes=0"),
        (lambda: FEMNISTConvNet(kernel_size=15), r"kernel_size=15 is not allowed: kernel_size must be 1 to 14"),
        (lambda: FEMNISTConvNet(kernel_size=0), r"kernel_size=0 is not allowed.*allowed: 1 to 14"),
        (lambda: FEMNISTConvNet(kernel_size=2.0), r"kernel_size=2.0"),
    ],
)
def test_invalid_arguments(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()
