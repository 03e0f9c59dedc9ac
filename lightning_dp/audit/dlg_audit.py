"""The DLG audit: every image attacked at every noise level of a sanitizer, with the results as a table and a
figure (the functional core of ``lightning-dp audit``)."""

from __future__ import annotations

import math
import numbers
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor, nn

from lightning_dp import checks
from lightning_dp.audit._common import (
    DUMMY_STREAM,
    NOISE_STREAM,
    SanitizerFactory,
    parameter_sizes,
)
from lightning_dp.audit.dlg import dlg_attack
from lightning_dp.audit.metrics import image_grid, mse, psnr
from lightning_dp.audit.release import _check_batch, client_release, observed_gradient
from lightning_dp.audit.sanitizers import EuclideanLaplaceSanitizer
from lightning_dp.privacy.noise import derive_generator

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["AuditResult", "AuditRow", "run_dlg_audit"]


@dataclass(frozen=True)
class AuditRow:
    """One attack: image ``image`` released with noise multiplier ``noise_multiplier``.

    ``mse``/``psnr`` compare the reconstruction with the private image on the image
    scale (after ``x * input_std + input_mean`` and clipping to ``pixel_range``).
    """

    image: int
    noise_multiplier: float
    label: int
    recovered_label: int
    label_recovered: bool
    mse: float
    psnr: float
    match_loss: float
    seconds: float


@dataclass
class AuditResult:
    """Everything :func:`run_dlg_audit` measured.

    Attributes:
        noise_multipliers: The audited noise levels, in order (the ``step`` of the metrics).
        rows: One :class:`AuditRow` per image and noise level (image-major).
        originals: The private images on the image scale, ``(N, *input_shape)``.
        reconstructions: The reconstructions on the image scale, ``(N, K, *input_shape)``.
        labels: The private labels.
        pixel_range: The image scale's ``(low, high)``.
    """

    noise_multipliers: list[float]
    rows: list[AuditRow]
    originals: Tensor
    reconstructions: Tensor
    labels: list[int]
    pixel_range: tuple[float, float] = (0.0, 1.0)

    def summary(self) -> list[dict[str, float]]:
        """Per noise level (in order): mean MSE, mean PSNR, fraction of labels recovered, median matching loss."""
        out = []
        for nu in self.noise_multipliers:
            rows = [row for row in self.rows if row.noise_multiplier == nu]
            losses = sorted(row.match_loss for row in rows)
            out.append({
                "noise_multiplier": nu,
                "mse": sum(row.mse for row in rows) / len(rows),
                "psnr": sum(row.psnr for row in rows) / len(rows),
                "label_recovered": sum(row.label_recovered for row in rows) / len(rows),
                "match_loss": losses[len(losses) // 2] if len(losses) % 2 else
                0.5 * (losses[len(losses) // 2 - 1] + losses[len(losses) // 2]),
                "images": float(len(rows)),
            })
        return out

    def table(self) -> str:
        """The summary as a Markdown table."""
        lines = ["| nu | MSE (mean) | PSNR dB (mean) | labels recovered | matching loss (median) |",
                 "|---|---|---|---|---|"]
        for s in self.summary():
            lines.append(f"| {s['noise_multiplier']:g} | {s['mse']:.4g} | {s['psnr']:.2f} | "
                         f"{round(s['label_recovered'] * s['images'])}/{int(s['images'])} | {s['match_loss']:.3g} |")
        return "\n".join(lines) + "\n"

    def tsv(self) -> str:
        """Every row as tab-separated values with a header line."""
        names = list(AuditRow.__dataclass_fields__)
        lines = ["\t".join(names)]
        for row in self.rows:
            lines.append("\t".join(repr(v) if isinstance(v, float) else str(v) for v in
                                   (getattr(row, name) for name in names)))
        return "\n".join(lines) + "\n"

    def figure(self) -> Figure:
        """:func:`image_grid` of the originals and reconstructions, titled with nu and MSE."""
        k = len(self.noise_multipliers)
        mses = [[row.mse for row in self.rows[i * k:(i + 1) * k]] for i in range(len(self.labels))]
        recovered = [[row.recovered_label for row in self.rows[i * k:(i + 1) * k]] for i in range(len(self.labels))]
        return image_grid(self.originals, self.reconstructions, self.labels, noise_multipliers=self.noise_multipliers,
                          mses=mses, recovered_labels=recovered, value_range=self.pixel_range)


def _check_noise_multipliers(noise_multipliers: Any) -> list[float]:
    try:
        values = list(noise_multipliers)
    except TypeError:
        values = None
    if not values or any(not checks.is_real(v) or not (math.isfinite(v) and v >= 0) for v in values):
        raise ValueError(f"noise_multipliers={noise_multipliers!r} is not allowed: it must be a non-empty sequence of "
                         "finite numbers >= 0 (0 = no noise), e.g. [0, 0.001, 0.01, 0.1, 1, 3, 5, 10].")
    if len(set(map(float, values))) != len(values):
        raise ValueError(f"noise_multipliers={noise_multipliers!r} lists a value twice; each noise level is audited "
                         "once (its release is seeded by the level), so pass distinct values.")
    return [float(v) for v in values]


def _float_key(value: float) -> int:
    """The bits of a float64 as an integer: a counter of :func:`derive_generator` that names a noise level."""
    return int.from_bytes(struct.pack("<d", float(value)), "little")


def run_dlg_audit(model: nn.Module, x: Tensor, y: Tensor, *,
                  noise_multipliers: Sequence[float] = (0.0, 1e-3, 1e-2, 1e-1, 1.0, 3.0, 5.0, 10.0),
                  lr: float = 0.1, local_steps: int = 1, iterations: int = 300, attack_lr: float = 1.0,
                  restarts: int = 1, seed: int = 0, sanitizer_factory: Optional[SanitizerFactory] = None,
                  known_label: bool = False, num_classes: Optional[int] = None, input_mean: float = 0.0,
                  input_std: float = 1.0, pixel_range: tuple[float, float] = (0.0, 1.0),
                  on_row: Optional[Callable[[AuditRow], None]] = None) -> AuditResult:
    """DLG against every image (one client each, a batch of one) at every noise level.

    For image ``i`` and noise level ``nu``: the client releases
    ``client_release(model, x[i:i+1], y[i:i+1], lr, local_steps, sanitizer_factory(nu))``
    with noise from ``derive_generator(seed, NOISE_STREAM, i, bits of nu)`` (the release
    depends on the seed, the image and ``nu`` only, not on the other audited levels); the attacker runs
    :func:`dlg_attack` on :func:`observed_gradient` with dummies from
    ``derive_generator(seed, DUMMY_STREAM, i)``: the same initializations at every
    noise level (common random numbers, so the noise is the only difference between
    the columns). Reconstruction and image are compared on the image scale
    ``clip(x * input_std + input_mean, *pixel_range)`` (the attacker knows the pixel
    range; clipping never increases the error), PSNR with ``data_range = high - low``.

    Args:
        model: The model at the clients' starting point (e.g. a freshly initialized
            :class:`~lightning_dp.models.SigmoidLeNet`); not modified.
        x: Private images ``(N, *input_shape)`` in the model's input scale.
        y: Their labels ``(N,)``.
        noise_multipliers: The noise levels ``nu >= 0`` to audit.
        lr: The client's learning rate (known to the attacker).
        local_steps: The client's SGD steps on its image.
        iterations: L-BFGS steps of the attack.
        attack_lr: L-BFGS learning rate.
        restarts: Attack initializations per release (the lowest matching loss wins).
        seed: Seed of all noise and initializations.
        sanitizer_factory: ``nu -> sanitizer``; ``None`` for
            ``EuclideanLaplaceSanitizer.for_model(model, nu)`` (layer-wise, the seed's
            release), or e.g. ``make_sanitizer_factory("gaussian", model=model, lr=lr)``.
        known_label: Give the attacker the true label (only the image is reconstructed).
        num_classes: Number of classes; ``None`` reads it from ``model``'s output.
        input_mean: Mean the inputs were standardized with (0 if not standardized).
        input_std: Standard deviation the inputs were standardized with (1 if not).
        pixel_range: ``(low, high)`` of the image scale.
        on_row: Called with every :class:`AuditRow` as soon as it is measured (progress).

    Returns:
        An :class:`AuditResult`.

    Raises:
        ValueError: On arguments outside their range.
    """
    _check_batch(x, y)
    nus = _check_noise_multipliers(noise_multipliers)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed={seed!r} must be an integer.")
    input_std = checks.positive_real("input_std", input_std, hint="Pass the std the inputs were standardized with, or 1.")
    if not checks.is_real(input_mean) or not math.isfinite(input_mean):
        raise ValueError(f"input_mean={input_mean!r} must be a finite number (0 if the inputs are not standardized).")
    try:
        low, high = (float(v) for v in pixel_range)
    except (TypeError, ValueError):
        low, high = math.nan, math.nan
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(f"pixel_range={pixel_range!r} must be two finite numbers (low, high) with low < high, e.g. "
                         "(0.0, 1.0) for images in [0, 1].")
    if sanitizer_factory is None:
        sizes = parameter_sizes(model)
        sanitizer_factory = lambda nu: EuclideanLaplaceSanitizer(nu, layer_sizes=sizes)  # noqa: E731
    if num_classes is None:
        with torch.no_grad():
            num_classes = int(model(x[:1]).shape[-1])
    if int(y.min()) < 0 or int(y.max()) >= num_classes:
        raise ValueError(f"labels {y.tolist()} must be class indices in 0..{num_classes - 1} (the model has "
                         f"{num_classes} outputs); use a model with as many outputs as the data has classes.")

    def to_image(t: Tensor) -> Tensor:
        return (t.detach() * input_std + input_mean).clamp(low, high)

    rows, reconstructions = [], []
    for i in range(x.shape[0]):
        xi, yi = x[i:i + 1], y[i:i + 1]
        original = to_image(xi[0])
        per_image = []
        for nu in nus:
            began = time.perf_counter()
            start, released = client_release(model, xi, yi, lr=lr, local_steps=local_steps,
                                              sanitizer=sanitizer_factory(nu),
                                              generator=derive_generator(seed, NOISE_STREAM, i, _float_key(nu),
                                                                         device=x.device))
            result = dlg_attack(model, observed_gradient(start, released, lr, model), input_shape=xi.shape[1:],
                                num_classes=num_classes, iterations=iterations, attack_lr=attack_lr,
                                generator=derive_generator(seed, DUMMY_STREAM, i, device=x.device), restarts=restarts,
                                known_label=int(yi[0]) if known_label else None)
            image = to_image(result.reconstruction[0])
            row = AuditRow(image=i, noise_multiplier=nu, label=int(yi[0]), recovered_label=result.label,
                           label_recovered=result.label == int(yi[0]), mse=mse(image, original),
                           psnr=psnr(image, original, data_range=high - low), match_loss=result.match_loss,
                           seconds=time.perf_counter() - began)
            rows.append(row)
            per_image.append(image)
            if on_row is not None:
                on_row(row)
        reconstructions.append(torch.stack(per_image))
    return AuditResult(nus, rows, to_image(x), torch.stack(reconstructions), [int(v) for v in y], (low, high))
