"""What a grid produced: one :class:`GridPoint` per run, and the :class:`GridResult` of the whole grid."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from lightning_dp.grid.privacy import BudgetPlan

__all__ = ["GridPoint", "GridResult"]

@dataclass
class GridPoint:
    """One finished run of the grid: its overrides, MLflow ids, final metrics and privacy."""

    values: dict[str, Any]
    run_id: Optional[str] = None
    metrics: dict[str, float] = field(default_factory=dict)
    privacy: dict[str, Any] = field(default_factory=dict)


@dataclass
class GridResult:
    """Everything a grid produced: points, privacy totals, id and, for budgeted grids, plans and choices."""

    points: list[GridPoint]
    totals: dict[str, Any]
    grid_id: str
    budgets: dict[Any, BudgetPlan] = field(default_factory=dict)
    """Per repetition (the ``--mean-over`` value, or None): the grid's noise multiplier."""
    best: dict[Any, GridPoint] = field(default_factory=dict)
    """Per repetition: the point chosen by ``select``."""
    select: Optional[str] = None
    mode: str = "max"
    mean_over: Optional[str] = None
    figure: Any = None
    """The grouped bar plot of ``plot`` (a matplotlib Figure), or None."""
    utility: Optional[tuple[str, Any]] = None
    """The privacy-utility table and figure (:mod:`lightning_dp.grid.utility`), or None when no run has an epsilon."""
