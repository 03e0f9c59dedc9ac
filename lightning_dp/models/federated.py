"""The networks of the personalized federated learning experiments (Galli et al., thesis ch. 2).

Plain ``torch.nn.Module`` s without BatchNorm. Their parameter counts ``n`` matter (a release costs ``n / nu``,
:func:`~lightning_dp.privacy.mechanisms.sanitize_update`), so each is stated and asserted in the tests:
:class:`LinearRegression` 2, :class:`HospitalMLP` 11, :class:`FEMNISTConvNet` 1,400,990,
:class:`LogisticRegression` 7,850, :class:`CIFARConvNet` 1,756,426. The list: docs/api/models.md.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_dp import checks
from lightning_dp.models.networks import MaxPool2d


__all__ = ["CIFARConvNet", "FEMNISTConvNet", "HospitalMLP", "LinearRegression", "LogisticRegression"]


class LinearRegression(nn.Module):
    """The seed's synthetic model ``y = x^T theta``: ``nn.Linear(in_features, 1, bias=bias)``.

    ``in_features`` parameters (2 by default, the seed's two features), plus one with
    ``bias=True``. Its output is also a logit: with ``loss="binary_cross_entropy"`` it is
    logistic regression (the fairness settings use ``bias=True``, n = 3).

    Args:
        in_features: Number of features.
        bias: Add an intercept (default ``False``, the seed's regression model).

    Raises:
        ValueError: If ``in_features`` is not a positive integer or ``bias`` not a bool.

    Example:
        >>> import torch
        >>> model = LinearRegression()
        >>> sum(p.numel() for p in model.parameters()), model(torch.zeros(4, 2)).shape
        (2, torch.Size([4]))
    """

    def __init__(self, in_features: int = 2, bias: bool = False) -> None:
        super().__init__()
        self.in_features = checks.positive_int("in_features", in_features)
        if not isinstance(bias, bool):
            raise ValueError(f"bias={bias!r} is not allowed: pass True (with an intercept) or False")
        self.linear = nn.Linear(self.in_features, 1, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return predictions of shape ``(batch,)`` for ``x`` of shape ``(batch, in_features)``.

        The trailing output dimension is squeezed so that ``mse_loss(model(x), y)`` with
        targets ``y`` of shape ``(batch,)`` does not silently broadcast to
        ``(batch, batch)``.
        """
        return self.linear(x).squeeze(-1)


class HospitalMLP(nn.Module):
    """The seed's small network for the hospital data: Linear(3, 2) -> ReLU -> Linear(2, 1).

    ``6 + 2 + 2 + 1 = 11`` parameters with the defaults.

    Args:
        in_features: Number of input features (3 in the seed).
        hidden: Width of the hidden layer (2 in the seed).

    Raises:
        ValueError: If ``in_features`` or ``hidden`` is not a positive integer.

    Example:
        >>> import torch
        >>> model = HospitalMLP()
        >>> sum(p.numel() for p in model.parameters()), model(torch.zeros(5, 3)).shape
        (11, torch.Size([5]))
    """

    def __init__(self, in_features: int = 3, hidden: int = 2) -> None:
        super().__init__()
        self.in_features = checks.positive_int("in_features", in_features)
        self.hidden = checks.positive_int("hidden", hidden)
        self.net = nn.Sequential(nn.Linear(self.in_features, self.hidden), nn.ReLU(), nn.Linear(self.hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return one output per example, shape ``(batch,)``, for ``x`` of shape ``(batch, in_features)``.

        A regression output or a binary logit (``binary_cross_entropy_with_logits``),
        squeezed like :class:`LinearRegression`'s.
        """
        return self.net(x).squeeze(-1)


class FEMNISTConvNet(nn.Module):
    """The seed's CNN for FEMNIST (LEAF, 1x28x28 handwritten characters, 62 classes): the layers of the paper's
    Table 3 (the thesis' Table 2.5).

    Shapes for a 28x28 input with the table's 2x2 kernels (``kernel_size=2``, the default)::

        Conv2d(1, 32, 2)   -> 32x27x27 -> ReLU
        Conv2d(32, 64, 2)  -> 64x26x26 -> ReLU -> MaxPool2d(2) -> 64x13x13
        Flatten -> Linear(10816, 128) -> ReLU -> Linear(128, num_classes)

    Parameters: ``160 + 8,256 + 1,384,576 + 7,998 = 1,400,990`` for 62 classes
    (``1,392,992 + 129 * num_classes`` with 2x2 kernels; ``2,080 k^2 + 8,192 (15 - k)^2 + 224 + 129 * num_classes``
    with ``kernel_size=k``). The papers state 1,206,590 parameters (000 L391, the thesis L703 and L775) and
    206,590 (000 L189, 003 L93; 1,000,000 less, no variant of these layers gives it): these layers give 1,206,590
    with 3x3 kernels, the only kernel size (one for both convolutions, any padding, PyTorch's default biases) that
    does: ``kernel_size=3`` (``320 + 18,496 + 1,179,776 + 7,998``, a 64x12x12 map; the layers of PyTorch's MNIST
    example). docs/results_femnist_noise.md, "The dimension (hypothesis 3)", for why the count matters.

    Args:
        num_classes: Number of output logits (62 for FEMNIST's digits and letters).
        kernel_size: Both convolutions' square kernel (stride 1, no padding); the 28x28 input must leave a
            feature map after them and the pooling.

    Raises:
        ValueError: If ``num_classes`` is not a positive integer, or ``kernel_size`` is not an integer from 1 to
            14.

    Example:
        >>> import torch
        >>> sum(p.numel() for p in FEMNISTConvNet().parameters())
        1400990
        >>> sum(p.numel() for p in FEMNISTConvNet(kernel_size=3).parameters())
        1206590
    """

    def __init__(self, num_classes: int = 62, kernel_size: int = 2) -> None:
        super().__init__()
        self.num_classes = checks.positive_int("num_classes", num_classes)
        allowed = "1 to 14 (larger leaves no feature map of a 28x28 image after two convolutions and a 2x2 " \
                  "pooling); the paper's table: 2"
        kernel_size = checks.positive_int("kernel_size", kernel_size, hint=f"allowed: {allowed}")
        side = (28 - 2 * (kernel_size - 1)) // 2  # two valid convolutions, then a 2x2 pooling
        if side < 1:
            raise ValueError(f"kernel_size={kernel_size} is not allowed: kernel_size must be {allowed}")
        self.kernel_size = kernel_size
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, kernel_size=kernel_size),
            nn.ReLU(),
            nn.Conv2d(32, 64, kernel_size=kernel_size),
            nn.ReLU(),
            MaxPool2d(kernel_size=2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * side * side, 128),
            nn.ReLU(),
            nn.Linear(128, self.num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape ``(batch, num_classes)`` for ``x`` of shape ``(batch, 1, 28, 28)``."""
        return self.classifier(self.features(x))


class LogisticRegression(nn.Module):
    """Multinomial logistic regression on flattened images: ``Flatten -> Linear(in_features, num_classes)``.

    The DP-FedAvg baseline model for MNIST (McMahan et al. 2018 use it beside a CNN):
    ``784 * 10 + 10 = 7,850`` parameters with the defaults. Outputs logits
    (``loss="cross_entropy"``).

    Example:
        >>> import torch
        >>> model = LogisticRegression()
        >>> sum(p.numel() for p in model.parameters()), model(torch.zeros(3, 1, 28, 28)).shape
        (7850, torch.Size([3, 10]))
    """

    def __init__(self, in_features: int = 784, num_classes: int = 10) -> None:
        super().__init__()
        self.in_features = checks.positive_int("in_features", in_features)
        self.num_classes = checks.positive_int("num_classes", num_classes)
        self.linear = nn.Linear(self.in_features, self.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, num_classes)`` for inputs of any shape ``(batch, ...)`` with ``in_features`` values."""
        return self.linear(x.flatten(1))


class CIFARConvNet(nn.Module):
    """The CNN of McMahan et al. (2017) for CIFAR-10, after the TensorFlow CIFAR-10 tutorial.

    Shapes for a 3x32x32 input (the tutorial crops to 24x24; here the full image, so the
    first dense layer is larger)::

        Conv2d(3, 64, 5, padding=2)  -> ReLU -> MaxPool2d(3, 2, padding=1) -> 64x16x16
        Conv2d(64, 64, 5, padding=2) -> ReLU -> MaxPool2d(3, 2, padding=1) -> 64x8x8
        Flatten -> Linear(4096, 384) -> ReLU -> Linear(384, 192) -> ReLU -> Linear(192, num_classes)

    The tutorial's local response normalization is left out (it mixes channels of one
    example only, but adds nothing the ReLU network needs here and no per-sample rule
    is kept for it). Parameters: ``4,864 + 102,464 + 1,573,248 + 73,920 + 1,930 = 1,756,426``.

    Example:
        >>> import torch
        >>> model = CIFARConvNet()
        >>> sum(p.numel() for p in model.parameters()), model(torch.zeros(2, 3, 32, 32)).shape
        (1756426, torch.Size([2, 10]))
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.num_classes = checks.positive_int("num_classes", num_classes)
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=5, padding=2), nn.ReLU(), MaxPool2d(3, stride=2, padding=1),
            nn.Conv2d(64, 64, kernel_size=5, padding=2), nn.ReLU(), MaxPool2d(3, stride=2, padding=1),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * 8 * 8, 384), nn.ReLU(), nn.Linear(384, 192), nn.ReLU(),
            nn.Linear(192, self.num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, num_classes)`` for images ``(batch, 3, 32, 32)``."""
        return self.classifier(self.features(x))
