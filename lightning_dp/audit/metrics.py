"""How close a reconstruction is to the private image: mean squared error, PSNR, and the image grid figure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch  # noqa: F401 (the examples below use it)
from torch import Tensor

from lightning_dp import checks

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["image_grid", "mse", "psnr"]


def mse(a: Tensor, b: Tensor) -> float:
    """Mean squared error ``mean((a - b)^2)`` over all elements, computed in float64.

    Example:
        >>> mse(torch.zeros(4), torch.tensor([0.0, 0.0, 1.0, 1.0]))
        0.5
    """
    if not isinstance(a, Tensor) or not isinstance(b, Tensor) or a.shape != b.shape:
        raise ValueError(f"mse needs two tensors of the same shape, got {tuple(getattr(a, 'shape', ()))} and "
                         f"{tuple(getattr(b, 'shape', ()))}.")
    return float((a.detach().double() - b.detach().double()).pow(2).mean())


def psnr(a: Tensor, b: Tensor, data_range: float = 1.0) -> float:
    """Peak signal-to-noise ratio ``10 log10(data_range^2 / mse(a, b))`` in dB (``inf`` when equal).

    Compare images on the scale whose range is ``data_range`` (pixels in [0, 1]: 1.0).

    Example:
        >>> round(psnr(torch.zeros(4), torch.full((4,), 0.1)), 6)  # mse 0.01 -> 20 dB
        20.0
    """
    data_range = checks.positive_real("data_range", data_range, hint="Pass the pixel range, 1.0 for images in [0, 1].")
    error = mse(a, b)
    return math.inf if error == 0 else 10.0 * math.log10(data_range ** 2 / error)


def image_grid(original: Tensor, reconstructions: Tensor, labels: Optional[Sequence[int]] = None, *,
               noise_multipliers: Sequence[float], mses: Optional[Sequence[Sequence[float]]] = None,
               recovered_labels: Optional[Sequence[Sequence[int]]] = None,
               value_range: tuple[float, float] = (0.0, 1.0)) -> Figure:
    """One row per image: the original, then its reconstruction at every noise level.

    The columns are titled with ``nu`` and, when given, the MSE and the recovered label
    (the layout of the seed's reconstruction figure). Images are drawn on
    ``value_range`` (grayscale for one channel, RGB for three). Built on the Agg
    canvas without ``pyplot``: no display is needed and no global figure stays open.

    Args:
        original: ``(N, C, H, W)`` (or one image ``(C, H, W)``).
        reconstructions: ``(N, K, C, H, W)`` (or ``(K, C, H, W)`` for one image).
        labels: The true label of each image (shown above the original).
        noise_multipliers: The ``K`` noise levels.
        mses: ``mses[i][k]``, shown under ``nu``.
        recovered_labels: ``recovered_labels[i][k]``, shown next to the MSE.
        value_range: ``(low, high)`` mapped to black and white.

    Raises:
        ValueError: If the shapes do not agree.

    Example:
        >>> fig = image_grid(torch.rand(2, 1, 8, 8), torch.rand(2, 3, 1, 8, 8), [3, 5], noise_multipliers=[0, 1, 10])
        >>> len(fig.axes)
        8
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if original.dim() == 3:
        original, reconstructions = original.unsqueeze(0), reconstructions.unsqueeze(0)
    nus = list(noise_multipliers)
    if (original.dim() != 4 or reconstructions.dim() != 5 or reconstructions.shape[0] != original.shape[0]
            or reconstructions.shape[1] != len(nus) or reconstructions.shape[2:] != original.shape[1:]):
        raise ValueError(f"original {tuple(original.shape)} must be (N, C, H, W) and reconstructions "
                         f"{tuple(reconstructions.shape)} (N, K, C, H, W) with K = {len(nus)} noise multipliers.")
    n, k = original.shape[0], len(nus)
    low, high = value_range
    figure = Figure(figsize=(1.4 * (k + 1), 1.6 * n + 0.3), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(n, k + 1, squeeze=False)

    def show(ax: Any, image: Tensor, title: str) -> None:
        picture = image.detach().cpu().float()
        if picture.shape[0] == 1:
            ax.imshow(picture[0].numpy(), cmap="gray", vmin=low, vmax=high)
        else:
            ax.imshow(((picture.permute(1, 2, 0) - low) / (high - low)).clamp(0, 1).numpy())
        ax.set_title(title, fontsize=7)
        ax.set_xticks([])
        ax.set_yticks([])

    for i in range(n):
        show(axes[i][0], original[i], "original" + (f" (y={labels[i]})" if labels is not None else ""))
        for j, nu in enumerate(nus):
            title = f"nu={nu:g}"
            if mses is not None:
                title += f"\nMSE {mses[i][j]:.3g}"
            if recovered_labels is not None:
                title += f" y={recovered_labels[i][j]}"
            show(axes[i][j + 1], reconstructions[i, j], title)
    return figure
