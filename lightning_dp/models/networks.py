"""Reference networks of the DP-SGD papers, as plain ``torch.nn.Module`` s.

None of these networks mixes the examples of a batch (no BatchNorm, no dropout whose
mask is shared): DP-SGD needs each example's gradient to depend on that example only,
otherwise clipping per example no longer bounds the sensitivity of the summed update.
Use GroupNorm or LayerNorm if a normalisation layer is needed.

Example:
    >>> import torch
    >>> from lightning_dp.models import MNISTConvNet
    >>> MNISTConvNet()(torch.zeros(2, 1, 28, 28)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.fx
from torch import nn

from lightning_dp import checks

__all__ = ["BagOfWordsMLP", "ConvAutoencoder", "DigitsConvNet", "MLP", "MNISTConvNet", "SigmoidLeNet"]

_ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU, "leaky_relu": nn.LeakyReLU}


class MaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` that pools a CPU batch in the channels-last layout and hands it back contiguous.

    torch 2.13's CPU max-pool of a contiguous (N, C, H, W) tensor is 5-11 times slower than of the same tensor
    in channels-last layout, conversions both ways included (one thread: 15.6 against 2.6 ms for the MNIST CNN's
    (256, 16, 14, 14) 2x2 stride-1 pool, 36 against 7.0 ms for a (64, 32, 28, 28) 3x3 stride-1 pool; 2026-12-06):
    a quarter of the MNIST CNN's whole training step, with or without DP. The values, the indices chosen at ties
    and so the gradients are the same, bit for bit (tested on saturated tanh outputs, which tie often). Other
    devices, other layouts, a compiled forward and tensors inside ``torch.func`` transforms (``vmap`` cannot change a
    layout) take ``nn.MaxPool2d``'s own path. ``torch.fx`` records the pool as one call (:func:`_max_pool2d`).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.return_indices:
            return super().forward(x)
        return _max_pool2d(x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)


@torch.fx.wrap
def _max_pool2d(x: torch.Tensor, kernel_size: Any, stride: Any, padding: Any, dilation: Any,
                ceil_mode: bool) -> torch.Tensor:
    """:class:`MaxPool2d`'s pool (a function ``torch.fx`` does not trace into: its branches read the tensor)."""
    if torch.compiler.is_compiling() or x.device.type != "cpu" or x.dim() != 4 or not x.is_contiguous() \
            or _functorch_wrapped(x):  # a compiler chooses its own layouts
        return nn.functional.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode=ceil_mode)
    pooled = nn.functional.max_pool2d(x.contiguous(memory_format=torch.channels_last), kernel_size, stride, padding,
                                      dilation, ceil_mode=ceil_mode)
    return pooled.contiguous()


def _functorch_wrapped(x: torch.Tensor) -> bool:
    """Whether ``x`` is a ``torch.func`` transform's tensor (vmap, grad); True where torch cannot say."""
    check = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
    return True if check is None else bool(check(x))


def _activation(name: str) -> nn.Module:
    """Return a fresh activation module for ``name`` (one of ``_ACTIVATIONS``)."""
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"activation={name!r} is not supported; choose one of {sorted(_ACTIVATIONS)} "
            f"(e.g. activation='tanh', the choice of Papernot et al. 2021 for DP-SGD)."
        )
    return _ACTIVATIONS[name]()


class MNISTConvNet(nn.Module):
    """The standard DP-SGD CNN for 1x28x28 images (MNIST, Fashion-MNIST), or the thesis' stride-1 variant.

    ``layers="papernot"`` (default): the architecture of the TF-Privacy MNIST tutorial and of Papernot et al.
    2021 ("Tempered sigmoid activations for deep learning with differential privacy", AAAI 2021): two strided
    convolutions each followed by a 2x2 max-pool of stride 1, then a 32-unit hidden layer, 26,010 parameters
    for 10 classes. Shapes for a 28x28 input::

        Conv2d(1, 16, 8, stride=2, padding=3)  -> 16x14x14 -> act -> MaxPool2d(2, 1) -> 16x13x13
        Conv2d(16, 32, 4, stride=2)            -> 32x5x5   -> act -> MaxPool2d(2, 1) -> 32x4x4
        Flatten -> Linear(512, 32) -> act -> Linear(32, num_classes)

    ``layers="thesis"``: the MNIST model of the thesis' chapter 3 (F. Galli, "Sense and Sensitivity", Table 3.5:
    Conv 16 8x8 stride 1, MaxPool 2x2 stride 1, Conv 32 4x4 stride 1, Linear 32, Linear 10, ReLU) at its Table 3.1
    size, 551,322 parameters for 10 classes: the Papernot layers with both strides 1 and without the second
    max-pool, as Table 3.5 lists them, need a 32x23x23 last map for that size, i.e. 3 pixels of padding in all;
    we put them on the first convolution, where Papernot's network has them::

        Conv2d(1, 16, 8, stride=1, padding=3)  -> 16x27x27 -> act -> MaxPool2d(2, 1) -> 16x26x26
        Conv2d(16, 32, 4, stride=1)            -> 32x23x23 -> act
        Flatten -> Linear(16928, 32) -> act -> Linear(32, num_classes)

    (1,040 + 8,224 + 541,728 + 330 parameters; paddings (0, 3), (1, 2) or (2, 1) on the two convolutions give the
    same count.) Table 3.5 also lists a ReLU after the output layer ("Linear 10, ReLU"); we leave the logits linear,
    a deliberate difference: a ReLU on the logits zeroes the gradient of every negative logit. Its forward pass
    is 5.62 million multiply-adds per example, 13 times the strided network's 0.42 million.

    Args:
        num_classes: Number of output logits.
        activation: ``"tanh"`` (Papernot et al. 2021: bounded activations keep the
            gradient norm small, so less signal is lost to clipping), ``"relu"`` (the thesis) or ``"leaky_relu"``;
            ``None`` (default): the layers' own, ``"tanh"`` for ``"papernot"``, ``"relu"`` for ``"thesis"``.
        layers: ``"papernot"`` or ``"thesis"`` (above).

    Raises:
        ValueError: If ``activation`` or ``layers`` is not one of the choices or
            ``num_classes`` is not a positive integer.

    Example:
        >>> import torch
        >>> MNISTConvNet(activation="relu")(torch.zeros(3, 1, 28, 28)).shape
        torch.Size([3, 10])
        >>> sum(p.numel() for p in MNISTConvNet(layers="thesis").parameters())
        551322
    """

    def __init__(self, num_classes: int = 10, activation: str | None = None,
                 layers: Literal["papernot", "thesis"] = "papernot") -> None:
        super().__init__()
        num_classes = checks.positive_int("num_classes", num_classes)
        if layers not in ("papernot", "thesis"):
            raise ValueError(f"layers={layers!r} is not supported; choose 'papernot' (two strided convolutions, "
                             "26,010 parameters, the default) or 'thesis' (thesis Table 3.5: stride-1 convolutions, "
                             "551,322 parameters).")
        if activation is None:
            activation = "tanh" if layers == "papernot" else "relu"
        self.num_classes = num_classes
        self.activation = activation
        self.layers = layers
        stride, side = (2, 4) if layers == "papernot" else (1, 23)
        features: list[nn.Module] = [
            nn.Conv2d(1, 16, kernel_size=8, stride=stride, padding=3),
            _activation(activation),
            MaxPool2d(kernel_size=2, stride=1),
            nn.Conv2d(16, 32, kernel_size=4, stride=stride),
            _activation(activation),
        ]
        if layers == "papernot":
            features.append(MaxPool2d(kernel_size=2, stride=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(32 * side * side, 32),
            _activation(activation),
            nn.Linear(32, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape ``(batch, num_classes)`` for ``x`` of shape ``(batch, 1, 28, 28)``."""
        return self.classifier(self.features(x))


class DigitsConvNet(nn.Module):
    """A small CNN for the 1x8x8 images of scikit-learn's digits data set.

    Shapes::

        Conv2d(1, 16, 3, padding=1)  -> 16x8x8 -> ReLU -> MaxPool2d(2) -> 16x4x4
        Conv2d(16, 32, 3, padding=1) -> 32x4x4 -> ReLU
        Flatten -> Linear(512, 64) -> ReLU -> Linear(64, num_classes)

    Args:
        num_classes: Number of output logits.

    Raises:
        ValueError: If ``num_classes`` is not a positive integer.

    Example:
        >>> import torch
        >>> DigitsConvNet()(torch.zeros(5, 1, 8, 8)).shape
        torch.Size([5, 10])
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        num_classes = checks.positive_int("num_classes", num_classes)
        self.num_classes = num_classes
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            MaxPool2d(kernel_size=2),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.ReLU(),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 64),
            nn.ReLU(),
            nn.Linear(64, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape ``(batch, num_classes)`` for ``x`` of shape ``(batch, 1, 8, 8)``."""
        return self.classifier(self.features(x))


class MLP(nn.Module):
    """A fully connected network: Flatten -> [Linear -> ReLU] * len(hidden) -> Linear.

    The input is flattened, so images can be fed directly (``in_features`` is then the
    product of the image shape, e.g. 64 for 1x8x8 digits, 784 for MNIST).

    Args:
        in_features: Number of input features after flattening.
        hidden: Widths of the hidden layers; ``()`` gives multinomial logistic regression.
        num_classes: Number of output logits.

    Raises:
        ValueError: If ``in_features``, ``num_classes`` or any hidden width is not a
            positive integer.

    Example:
        >>> import torch
        >>> MLP(64, hidden=(32,), num_classes=10)(torch.zeros(4, 1, 8, 8)).shape
        torch.Size([4, 10])
    """

    def __init__(self, in_features: int, hidden: Sequence[int] = (128,), num_classes: int = 10) -> None:
        super().__init__()
        in_features = checks.positive_int("in_features", in_features)
        num_classes = checks.positive_int("num_classes", num_classes)
        hidden = tuple(hidden)
        for i, width in enumerate(hidden):
            checks.positive_int(f"hidden[{i}]", width)
        self.in_features = in_features
        self.hidden = hidden
        self.num_classes = num_classes
        layers: list[nn.Module] = [nn.Flatten()]
        width_in = in_features
        for width in hidden:
            layers += [nn.Linear(width_in, width), nn.ReLU()]
            width_in = width
        layers.append(nn.Linear(width_in, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape ``(batch, num_classes)``; ``x`` is flattened from dimension 1 on."""
        return self.net(x)


class BagOfWordsMLP(nn.Module):
    """An MLP over word-vector features (AG News, thesis ch. 3).

    The text classifier of the project's AG News runs (thesis chapter 3: Galli et al., "Online sensitivity
    optimization in differentially private learning", AAAI 2024); its input is the feature of
    :class:`~lightning_dp.datamodules.AGNewsDataModule`. Shapes, for ``hidden = (h_1, ..., h_n)``::

        Linear(in_features, h_1) -> act -> ... -> Linear(h_{n-1}, h_n) -> act -> Linear(h_n, num_classes)

    - The thesis' model (its Table 3.7, "Bag of Words - FC": Linear 128, Linear 128, Linear 4, LeakyReLU):
      ``BagOfWordsMLP(in_features=750, hidden=(128, 128), activation="leaky_relu")``, 113,156 parameters, exactly
      its Table 3.1 model size (128 x 750 + 128 + 128 x 128 + 128 + 128 x 4 + 4). The 750 inputs are what that
      size implies; with the 50-d GloVe vectors the thesis names they are the concatenated vectors of 15
      tokens (the data module's ``pooling="concat"``, ``max_tokens=15``), where its text says "up to the first 25
      words" (25 x 50 = 1,250 inputs would make 177,156 parameters). Table 3.7 also lists a LeakyReLU after the
      output layer; it is not applied here (logits are left linear).
    - ``BagOfWordsMLP()`` (defaults): one hidden layer of 32 over the 50-d mean vector (``pooling="mean"``),
      1,764 parameters, a smaller model for CPU runs.

    Args:
        in_features: Dimension of the input features (``embedding_dim`` for the mean of the vectors,
            ``max_tokens * embedding_dim`` for their concatenation).
        hidden: Width of the hidden layer, or a sequence of widths, one per hidden layer.
        num_classes: Number of output logits (4 AG News topics).
        activation: ``"tanh"``, ``"relu"`` or ``"leaky_relu"``.

    Raises:
        ValueError: If a width is not a positive integer, ``hidden`` is empty or ``activation`` is unknown.

    Example:
        >>> import torch
        >>> BagOfWordsMLP()(torch.zeros(3, 50)).shape
        torch.Size([3, 4])
        >>> sum(p.numel() for p in BagOfWordsMLP(750, (128, 128), activation="leaky_relu").parameters())
        113156
    """

    def __init__(self, in_features: int = 50, hidden: int | Sequence[int] = 32, num_classes: int = 4,
                 activation: str = "tanh") -> None:
        super().__init__()
        self.in_features = checks.positive_int("in_features", in_features)
        single = not isinstance(hidden, Sequence)
        if isinstance(hidden, str) or (not single and not hidden):
            raise ValueError(f"hidden={hidden!r} is not a width; give one positive integer (e.g. hidden=32) or one "
                             "per hidden layer (e.g. hidden=[128, 128], the thesis' Table 3.7).")
        widths = [checks.positive_int("hidden", hidden)] if single else [
            checks.positive_int(f"hidden[{i}]", width) for i, width in enumerate(hidden)]  # type: ignore[arg-type]
        self.hidden = widths[0] if single else tuple(widths)
        self.num_classes = checks.positive_int("num_classes", num_classes)
        self.activation = activation
        layers: list[nn.Module] = []
        for width_in, width_out in zip([in_features, *widths], widths):
            layers += [nn.Linear(width_in, width_out), _activation(activation)]
        self.net = nn.Sequential(*layers, nn.Linear(widths[-1], num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape ``(batch, num_classes)`` for features of shape ``(batch, in_features)``."""
        return self.net(x)


_OUTPUTS: dict[str, type[nn.Module]] = {"identity": nn.Identity, "sigmoid": nn.Sigmoid}


class ConvAutoencoder(nn.Module):
    """A convolutional autoencoder for 1x28x28 images (MNIST, Fashion-MNIST), trained with the mean squared error
    by :class:`~lightning_dp.models.Autoencoder` (thesis chapter 3: Galli et al., "Online sensitivity optimization in
    differentially private learning", AAAI 2024).

    ``layers="thesis"``: the thesis' Table 3.6, four 3x3 convolutions of stride 1 without padding (8, 16, 32, 64
    channels) and four transposed ones back (32, 16, 8, 1), 48,705 parameters, Table 3.1's model size for
    FashionMNIST; with ``activation="leaky_relu"`` and ``output="sigmoid"`` (pixels in [0, 1]) as in the thesis::

        Conv2d(1, 8, 3) -> 8x26x26, (8, 16) -> 16x24x24, (16, 32) -> 32x22x22, (32, 64) -> 64x20x20, each -> act
        ConvTranspose2d(64, 32, 3) -> 32x22x22, ... (8, 1) -> 1x28x28 -> output

    ``layers="strided"`` (default, 9,569 parameters): two strided convolutions down to a 32x7x7 code and two
    transposed convolutions back, a smaller model chosen before the thesis' table was at hand::

        Conv2d(1, 16, 3, stride=2, padding=1)                             -> 16x14x14 -> act
        Conv2d(16, 32, 3, stride=2, padding=1)                            -> 32x7x7   -> act
        ConvTranspose2d(32, 16, 3, stride=2, padding=1, output_padding=1) -> 16x14x14 -> act
        ConvTranspose2d(16, 1, 3, stride=2, padding=1, output_padding=1)  -> 1x28x28  -> output

    No layer mixes examples, so DP-SGD's per-sample clipping applies; the per-sample gradient engine
    (:mod:`lightning_dp.privacy.grad_sample`) handles the convolutions with its fast rule and the transposed
    convolutions with its exact ``torch.func`` fallback.

    Args:
        activation: Hidden activation, ``"tanh"`` (default, Papernot et al. 2021), ``"relu"`` or
            ``"leaky_relu"`` (the thesis).
        output: ``"identity"`` (default) for standardized inputs, such as those of
            :class:`~lightning_dp.datamodules.MNISTDataModule` with ``normalize=True``
            (pixels roughly in [-0.4, 2.8], outside a sigmoid's range); ``"sigmoid"``
            for pixels in [0, 1] (``normalize=False``).
        layers: ``"strided"`` or ``"thesis"`` (above).

    Raises:
        ValueError: If ``activation``, ``output`` or ``layers`` is not one of the choices.

    Example:
        >>> import torch
        >>> ConvAutoencoder()(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 1, 28, 28])
        >>> sum(p.numel() for p in ConvAutoencoder(layers="thesis").parameters())
        48705
    """

    def __init__(self, activation: str = "tanh", output: str = "identity",
                 layers: Literal["strided", "thesis"] = "strided") -> None:
        super().__init__()
        if output not in _OUTPUTS:
            raise ValueError(
                f"output={output!r} is not supported; choose one of {sorted(_OUTPUTS)} ('identity' for "
                "standardized pixels, 'sigmoid' for pixels in [0, 1])."
            )
        if layers not in ("strided", "thesis"):
            raise ValueError(f"layers={layers!r} is not supported; choose 'strided' (two strided convolutions, the "
                             "default) or 'thesis' (thesis Table 3.6: four stride-1 convolutions, 48,705 parameters).")
        self.activation, self.output, self.layers = activation, output, layers
        down: tuple[int, ...]
        up: tuple[int, ...]
        if layers == "thesis":  # 3x3, stride 1, no padding: 28 -> 26 -> 24 -> 22 -> 20 and back
            down, up, stride, padding, output_padding = (1, 8, 16, 32, 64), (64, 32, 16, 8, 1), 1, 0, 0
        else:  # 3x3, stride 2, padding 1: 28 -> 14 -> 7 and back
            down, up, stride, padding, output_padding = (1, 16, 32), (32, 16, 1), 2, 1, 1
        encoder: list[nn.Module] = []
        for c_in, c_out in zip(down, down[1:]):
            encoder += [nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=padding), _activation(activation)]
        decoder: list[nn.Module] = []
        for c_in, c_out in zip(up, up[1:]):
            decoder += [nn.ConvTranspose2d(c_in, c_out, kernel_size=3, stride=stride, padding=padding,
                                           output_padding=output_padding), _activation(activation)]
        decoder[-1] = _OUTPUTS[output]()
        self.encoder, self.decoder = nn.Sequential(*encoder), nn.Sequential(*decoder)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the reconstruction of ``x`` (shape ``(batch, 1, 28, 28)``), of the same shape."""
        return self.decoder(self.encoder(x))


class SigmoidLeNet(nn.Module):
    """The twice-differentiable LeNet of Deep Leakage from Gradients (DLG).

    The network of Zhu, Liu & Han, "Deep leakage from gradients", NeurIPS 2019 (and of
    their code, github.com/mit-han-lab/dlg, ``models/vision.py``): three 5x5
    convolutions of 12 channels with sigmoid activations and no pooling, then one
    linear layer. Sigmoid (unlike ReLU) has a non-zero second derivative everywhere,
    which the gradient-matching attack needs: it differentiates the model's gradient
    with respect to the input. :mod:`lightning_dp.audit.dlg` audits with it. Shapes for
    an ``S x S`` input with ``c`` channels::

        Conv2d(c, 12, 5, stride=2, padding=2)  -> 12 x ceil(S/2) x ceil(S/2)  -> Sigmoid
        Conv2d(12, 12, 5, stride=2, padding=2) -> 12 x s x s, s = ceil(ceil(S/2)/2) -> Sigmoid
        Conv2d(12, 12, 5, stride=1, padding=2) -> 12 x s x s  -> Sigmoid
        Flatten -> Linear(12 s^2, num_classes)

    Parameters: ``(300 c + 12) + 2 * 3612 + (12 s^2 + 1) * num_classes``, e.g. 44,054
    for FEMNIST (c = 1, S = 28, s = 7, 62 classes), 8,026 for the 8x8 digits (s = 2,
    10 classes) and 85,036 for the paper's CIFAR-100 setting (c = 3, S = 32, 100 classes).

    Initialization: with ``init_range=0.5`` (default) every weight and bias is drawn
    from ``U(-0.5, 0.5)``, the ``weights_init`` of the DLG code (its gradients are
    larger than with PyTorch's default fan-in scaling, which makes the attack easier:
    the audit then measures the stronger attacker). ``init_range=None`` keeps
    PyTorch's default initialization. Draws use the global RNG, like every
    ``nn.Module``; seed it (or wrap in ``torch.random.fork_rng``) for reproducibility.

    Args:
        in_channels: Channels of the input images (1 for grayscale, 3 for RGB).
        image_size: Height and width ``S`` of the (square) input images.
        num_classes: Number of output logits.
        init_range: Half-width of the uniform initialization, a number > 0, or ``None``.

    Raises:
        ValueError: If an argument is outside its range, or (in ``forward``) if the
            input is not of shape ``(batch, in_channels, image_size, image_size)``.

    Example:
        >>> import torch
        >>> net = SigmoidLeNet(image_size=8, num_classes=10)
        >>> net(torch.zeros(2, 1, 8, 8)).shape, sum(p.numel() for p in net.parameters())
        (torch.Size([2, 10]), 8026)
    """

    def __init__(self, in_channels: int = 1, image_size: int = 28, num_classes: int = 62,
                 init_range: float | None = 0.5) -> None:
        super().__init__()
        self.in_channels = checks.positive_int("in_channels", in_channels)
        self.image_size = checks.positive_int("image_size", image_size)
        self.num_classes = checks.positive_int("num_classes", num_classes)
        if init_range is not None and (isinstance(init_range, bool) or not isinstance(init_range, (int, float))
                                       or not 0 < init_range < float("inf")):
            raise ValueError(
                f"init_range={init_range!r} is not allowed: it must be a finite number > 0 (weights and biases "
                "drawn from U(-init_range, init_range); the DLG code uses 0.5) or None for PyTorch's default "
                "initialization."
            )
        self.init_range = None if init_range is None else float(init_range)
        side = math.ceil(math.ceil(image_size / 2) / 2)  # after the two stride-2 convolutions
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, 12, kernel_size=5, stride=2, padding=2),
            nn.Sigmoid(),
            nn.Conv2d(12, 12, kernel_size=5, stride=2, padding=2),
            nn.Sigmoid(),
            nn.Conv2d(12, 12, kernel_size=5, stride=1, padding=2),
            nn.Sigmoid(),
        )
        self.fc = nn.Linear(12 * side * side, num_classes)
        if self.init_range is not None:
            with torch.no_grad():
                for parameter in self.parameters():
                    parameter.uniform_(-self.init_range, self.init_range)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape ``(batch, num_classes)`` for ``x`` of shape ``(batch, in_channels, S, S)``."""
        expected = (self.in_channels, self.image_size, self.image_size)
        if x.dim() != 4 or tuple(x.shape[1:]) != expected:
            raise ValueError(
                f"SigmoidLeNet(in_channels={self.in_channels}, image_size={self.image_size}) expects inputs of shape "
                f"(batch, {', '.join(map(str, expected))}), got {tuple(x.shape)}; build it with the data's shape, "
                f"e.g. SigmoidLeNet(in_channels={x.shape[1] if x.dim() == 4 else 1}, "
                f"image_size={x.shape[-1] if x.dim() >= 2 else 28})."
            )
        return self.fc(self.body(x).flatten(1))
