"""The grid's report: Markdown tables (every run, means over repetitions, chosen runs) and grouped bar plots."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

from lightning_dp.grid.axes import short_name
from lightning_dp.grid.points import GridPoint, GridResult

__all__ = ["bar_plot", "best_table", "default_mode", "fmt", "mean_table", "report", "select_best", "summary_table"]

def fmt(value: Any) -> str:
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.4g}"
    return str(value)


#: The per-run privacy columns of the tables (``GridPoint.privacy``, :func:`~lightning_dp.grid.privacy.privacy_of`).
PRIVACY_COLUMNS = ("epsilon", "client_epsilon_median", "client_epsilon_max", "record_epsilon_median",
                   "record_epsilon_max")
_COLUMN_LEVEL = {"epsilon": ("example", "user", "client"), "client_epsilon": ("client_ledger",), "record_epsilon": ("record",)}


def privacy_value(point: GridPoint, name: str) -> Any:
    """A run's privacy column: its value, ``inf`` where the run released at that level unsanitized, else ''."""
    if name in point.privacy:
        return point.privacy[name]
    levels = _COLUMN_LEVEL[name.rsplit("_", 1)[0] if name != "epsilon" else "epsilon"]
    if any(s.unsanitized and s.level in levels for s in point.privacy.get("spends", [])):
        return math.inf
    return ""


def summary_table(points: Sequence[GridPoint], totals: dict[str, Any]) -> str:
    """The grid as a Markdown table (one row per run) followed by the grid's privacy totals."""
    keys = list(points[0].values) if points else []
    metric_names = sorted({m for p in points for m in p.metrics})
    privacy_names = [n for n in PRIVACY_COLUMNS if any(privacy_value(p, n) != "" for p in points)]
    header = [short_name(k) for k in keys] + metric_names + privacy_names + ["run"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for p in points:
        cells = [fmt(p.values[k]) for k in keys] + [fmt(p.metrics.get(m, "")) for m in metric_names]
        cells += [fmt(privacy_value(p, n)) for n in privacy_names]
        cells.append(p.run_id or "")
        lines.append("| " + " | ".join(cells) + " |")
    if totals:
        lines += ["", "Grid total (composition over all runs): " + ", ".join(f"{k} = {fmt(v)}"
                                                                              for k, v in totals.items())]
    return "\n".join(lines) + "\n"


def mean_table(points: Sequence[GridPoint], over: str) -> str:
    """Mean ± sample std over the values of axis ``over`` (e.g. seeds), one row per combination of the others."""
    import statistics

    if not points or over not in points[0].values:
        raise ValueError(f"--mean-over {over!r} is not a grid axis; axes: {list(points[0].values) if points else []}")
    keys = [k for k in points[0].values if k != over]
    groups: dict[tuple, list[GridPoint]] = {}
    for p in points:
        groups.setdefault(tuple(p.values[k] for k in keys), []).append(p)
    columns = sorted({m for p in points for m in p.metrics})
    privacy = [n for n in PRIVACY_COLUMNS if any(privacy_value(p, n) != "" for p in points)]
    columns += privacy

    def cell(group: list[GridPoint], name: str) -> str:
        vals = [privacy_value(p, name) if name in privacy else p.metrics.get(name) for p in group]
        if any(v == math.inf for v in vals):
            return "inf"
        numbers = [float(v) for v in vals if isinstance(v, (int, float))]
        if not numbers:
            return ""
        if len(numbers) == 1:
            return fmt(numbers[0])
        return f"{statistics.mean(numbers):.4g} ± {statistics.stdev(numbers):.2g}"

    header = [short_name(k) for k in keys] + columns + [f"runs ({short_name(over)})"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for combo, group in groups.items():
        runs = ",".join(fmt(p.values[over]) for p in group)
        lines.append("| " + " | ".join([fmt(v) for v in combo] + [cell(group, c) for c in columns] + [runs]) + " |")
    return "\n".join(lines) + "\n"


def bar_plot(points: Sequence[GridPoint], metrics: Sequence[str], x: str, hue: str,
             over: Optional[str] = None) -> Any:
    """Grouped bar plots: one panel per metric, groups along axis ``x``, one bar per value of axis ``hue``.

    Bars are means over the axis ``over`` (repetitions, e.g. seeds) with sample-std error
    bars (none with one repetition). Every other grid axis must have a single value, so
    that a bar is one set of repetitions. Runs missing a metric are left out of its bar.

    Returns:
        A :class:`matplotlib.figure.Figure`.

    Raises:
        ValueError: If an axis is not a grid axis, another axis has several values, or a
            metric is in no run.
    """
    import statistics

    from matplotlib.figure import Figure

    axes = list(points[0].values) if points else []
    for name, key in (("--plot-x", x), ("--plot-hue", hue)):
        if key not in axes:
            raise ValueError(f"{name} {key!r} is not a grid axis; axes: {axes}")
    if x == hue:
        raise ValueError(f"--plot-x and --plot-hue are both {x!r}; pass two different grid axes")
    others = [k for k in axes if k not in (x, hue, over)]
    for k in others:
        if len({repr(p.values[k]) for p in points}) > 1:
            raise ValueError(f"grid axis {k!r} has several values, so a bar would mix them: plot grids whose axes "
                             f"are --plot-x {x!r}, --plot-hue {hue!r} and --mean-over, or split the grid")
    missing = [m for m in metrics if not any(m in p.metrics for p in points)]
    if missing:
        names = sorted({m for p in points for m in p.metrics})
        raise ValueError(f"--plot {missing}: no run has these metrics; metrics of the runs: {names}")
    xs = list(dict.fromkeys(p.values[x] for p in points))
    hues = list(dict.fromkeys(p.values[hue] for p in points))
    fig = Figure(figsize=(4.5 * len(metrics), 3.8), layout="constrained")
    panels = fig.subplots(1, len(metrics), squeeze=False)[0]
    width = 0.8 / len(hues)
    for ax, metric in zip(panels, metrics):
        for j, h in enumerate(hues):
            means, errs = [], []
            for xv in xs:
                vals = [p.metrics[metric] for p in points
                        if p.values[x] == xv and p.values[hue] == h and metric in p.metrics]
                means.append(statistics.mean(vals) if vals else math.nan)
                errs.append(statistics.stdev(vals) if len(vals) > 1 else 0.0)
            ax.bar([i + (j - (len(hues) - 1) / 2) * width for i in range(len(xs))], means, width, yerr=errs,
                   capsize=3, label=f"{short_name(hue)}={fmt(h)}")
        ax.set_xticks(range(len(xs)), [fmt(v) for v in xs])
        ax.set_xlabel(short_name(x))
        ax.set_title(metric, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    panels[0].legend(fontsize=8)
    if over:
        fig.suptitle(f"mean ± std over {short_name(over)}", fontsize=9)
    return fig


def _better(a: float, b: float, mode: str) -> bool:
    return a > b if mode == "max" else a < b


def select_best(points: Sequence[GridPoint], metric: str, mode: str) -> GridPoint:
    """The point with the best ``metric`` (``mode`` ``"max"`` or ``"min"``); NaN and missing values never win."""
    best: Optional[GridPoint] = None
    for p in points:
        value = p.metrics.get(metric)
        if value is None or math.isnan(value):
            continue
        if best is None or _better(value, best.metrics[metric], mode):
            best = p
    if best is None:
        names = sorted({m for p in points for m in p.metrics})
        raise ValueError(f"--select {metric!r}: no run of the grid has this metric; available: {names}")
    return best


def default_mode(metric: str) -> str:
    """``"min"`` for losses and errors (names containing loss, error, mse, rmse), else ``"max"``."""
    return "min" if any(w in metric.lower() for w in ("loss", "error", "mse")) else "max"


def best_table(result: GridResult) -> str:
    """The chosen run of each repetition, then mean ± std of its metrics over repetitions."""
    import statistics

    rows = list(result.best.items())
    columns = sorted({m for _, p in rows for m in p.metrics})
    keys = [k for k in (rows[0][1].values if rows else {}) if k != result.mean_over]
    lead = [short_name(result.mean_over)] if result.mean_over else []
    extra = ["noise_multiplier"] if result.budgets else []
    header = lead + [short_name(k) for k in keys] + extra + columns + ["epsilon", "run"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for group, p in rows:
        cells = ([fmt(group)] if result.mean_over else []) + [fmt(p.values[k]) for k in keys]
        if result.budgets:
            cells.append(fmt(result.budgets[group].noise_multiplier))
        cells += [fmt(p.metrics.get(c, "")) for c in columns] + [fmt(p.privacy.get("epsilon", "")), p.run_id or ""]
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    if len(rows) > 1:
        means = []
        for c in columns:
            vals = [p.metrics[c] for _, p in rows if c in p.metrics]
            if len(vals) > 1:
                means.append(f"{c} = {statistics.mean(vals):.4g} ± {statistics.stdev(vals):.2g}")
        text += f"\nChosen runs over {len(rows)} repetitions: " + "; ".join(means) + "\n"
    return text


def report(result: GridResult) -> str:
    """The Markdown report of a grid: every run, the grid's privacy, the chosen runs, the means."""
    text = ""
    if result.budgets:
        text += (f"Budget of each grid: epsilon = {fmt(result.totals['grid/budget_epsilon'])} at delta = "
                 f"{fmt(result.totals['grid/delta'])}, composed over its runs by the accountant.\n\n")
    text += summary_table(result.points, result.totals)
    if result.select:
        text += f"\nBest run by {result.select} ({result.mode}):\n\n" + best_table(result)
    if result.mean_over and not result.budgets:
        text += f"\nMean ± std over {short_name(result.mean_over)}:\n\n" + mean_table(result.points, result.mean_over)
    return text
