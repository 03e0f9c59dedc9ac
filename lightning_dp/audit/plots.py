"""Figures of membership-inference audits: ROC curves (log-log), AUC against a parameter, epsilon against FPR.

Built on the Agg canvas without ``pyplot`` (no display, no global figure left open), like
:func:`lightning_dp.tracking.plot_series`; log them with :func:`lightning_dp.tracking.log_figure`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["auc_curve_figure", "roc_figure"]

_FLOOR = 1e-5  # where 0 rates are drawn on log axes


def _figure(size: tuple[float, float] = (4.8, 4.5)):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def roc_figure(curves: Mapping[str, Any], *, title: str = "ROC", log: bool = True):
    """ROC curves (``name -> RocCurve``), on log-log axes by default: the low-FPR regime is what matters
    for privacy (Carlini et al. 2022)."""
    figure, ax = _figure()
    for name, curve in curves.items():
        ax.plot(np.maximum(curve.fpr, _FLOOR), np.maximum(curve.tpr, _FLOOR), label=f"{name} (AUC {curve.auc:.3f})")
    ax.plot([_FLOOR, 1], [_FLOOR, 1], color="gray", linestyle=":", label="chance")
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(True, alpha=0.3)
    return figure


def auc_curve_figure(xs: Sequence[float], aucs: Sequence[float], *, xlabel: str, title: str, log_x: bool = True,
                     references: Mapping[str, float] | None = None):
    """AUC against a parameter (e.g. the noisy-neighbour sigma), with horizontal reference AUCs (e.g. shadow)."""
    figure, ax = _figure((5.5, 4.0))
    order = np.argsort(np.asarray(xs, dtype=float))
    ax.plot(np.asarray(xs, dtype=float)[order], np.asarray(aucs, dtype=float)[order], marker=".", label="AUC")
    for i, (name, value) in enumerate((references or {}).items()):
        ax.axhline(value, linestyle="--", color=f"C{i + 1}", label=f"{name} ({value:.3f})")
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("AUC")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    return figure
