"""The privacy-utility picture: a task metric against epsilon, over a grid's points or MLflow runs.

A grid writes it to its parent run (``privacy_utility.png`` and ``.md``, :func:`grid_outcomes`), and
``lightning-dp compare`` draws it from finished MLflow runs (:mod:`lightning_dp.commands.compare`, which reads the
runs and groups them over seeds); both draw with :func:`group_outcomes`, :func:`utility_table` and
:func:`utility_figure`. It lives here, in the grid, because the grid runs below the commands (docs/architecture.md,
"Layers"): the command imports it, the grid imports no command.

Everything drawn is a final metric the runs already logged (post-processing of released values), so the picture
costs no privacy.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from lightning_dp.grid.axes import short_name
from lightning_dp.grid.report import privacy_value

__all__ = ["METRIC_PREFERENCE", "Group", "Outcome", "choose_metric", "grid_outcomes", "group_outcomes",
           "utility_figure", "utility_table"]

#: The metric drawn when none is given: the first that some run logged.
METRIC_PREFERENCE = ("val/acc", "test/acc", "val/perplexity", "test/perplexity", "val/loss", "test/loss")


@dataclass(frozen=True)
class Outcome:
    """One run: its group (configuration without seeds), its epsilon (None: non-private) and its metric."""

    run_id: str
    group: str
    epsilon: Optional[float]
    value: float


@dataclass(frozen=True)
class Group:
    """Runs of one setting: means and sample stds (0 for one run) of epsilon and of the metric."""

    label: str
    runs: tuple[str, ...]
    epsilon: Optional[float]
    epsilon_std: float
    value: float
    value_std: float


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def group_outcomes(outcomes: Sequence[Outcome]) -> list[Group]:
    """One :class:`Group` per group label, private groups by increasing epsilon, then the baselines.

    Raises:
        ValueError: a group mixes private and non-private runs.

    Example:
        >>> g = group_outcomes([Outcome("a", "eps=1", 0.99, 0.8), Outcome("b", "eps=1", 0.99, 0.9),
        ...                     Outcome("c", "baseline", None, 0.95)])
        >>> [(x.label, x.epsilon, round(x.value, 3), round(x.value_std, 4)) for x in g]
        [('eps=1', 0.99, 0.85, 0.0707), ('baseline', None, 0.95, 0.0)]
    """
    by: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by.setdefault(o.group, []).append(o)
    groups = []
    for label, members in by.items():
        kinds = {o.epsilon is None for o in members}
        if len(kinds) > 1:
            raise ValueError(f"group {label!r} mixes private and non-private runs: "
                             f"{[o.run_id for o in members]}; compare them as separate groups")
        value, value_std = _mean_std([o.value for o in members])
        if members[0].epsilon is None:
            eps, eps_std = None, 0.0
        else:
            eps, eps_std = _mean_std([float(o.epsilon) for o in members if o.epsilon is not None])
        groups.append(Group(label, tuple(o.run_id for o in members), eps, eps_std, value, value_std))
    return sorted(groups, key=lambda g: (g.epsilon is None, g.epsilon if g.epsilon is not None else 0.0))


def _pm(mean: float, std: float, n: int) -> str:
    return f"{mean:.4g} ± {std:.2g}" if n > 1 else f"{mean:.4g}"


def utility_table(groups: Sequence[Group], metric: str) -> str:
    """The groups as a Markdown table: setting, runs, epsilon and the metric (mean ± sample std)."""
    lines = [f"| setting | runs | epsilon | {metric} |", "|---|---|---|---|"]
    for g in groups:
        eps = "non-private" if g.epsilon is None else _pm(g.epsilon, g.epsilon_std, len(g.runs))
        lines.append(f"| {g.label} | {len(g.runs)} | {eps} | {_pm(g.value, g.value_std, len(g.runs))} |")
    return "\n".join(lines) + "\n"


def utility_figure(groups: Sequence[Group], metric: str, title: str = "") -> Any:
    """``metric`` against epsilon: private groups as points with error bars, baselines as lines (with bands).

    Returns:
        A :class:`matplotlib.figure.Figure`.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.subplots()
    private = [g for g in groups if g.epsilon is not None]
    colors = iter(f"C{i}" for i in range(1, 1000))
    for g in private:
        ax.errorbar([float(g.epsilon or 0.0)], [g.value], yerr=[g.value_std], xerr=[g.epsilon_std], fmt="o", capsize=4,
                    color=next(colors), label=f"{g.label} (n={len(g.runs)})")
    if len(private) > 1:
        xs = [float(g.epsilon) for g in private if g.epsilon is not None]
        ax.plot(xs, [g.value for g in private], color="0.6", linewidth=0.8, zorder=0)
        if max(xs) / max(min(xs), 1e-12) > 20:
            ax.set_xscale("log")
    if private and ax.get_xscale() == "linear":  # epsilon from 0: how far each point is from no privacy at all
        ax.set_xlim(0, 1.15 * max(float(g.epsilon) + g.epsilon_std for g in private if g.epsilon is not None))
    for g in groups:
        if g.epsilon is None:
            color = next(colors)
            ax.axhline(g.value, color=color, linestyle="--", label=f"{g.label}: non-private (n={len(g.runs)})")
            if g.value_std > 0:
                ax.axhspan(g.value - g.value_std, g.value + g.value_std, color=color, alpha=0.15)
    ax.set_xlabel("epsilon (spent, at each run's delta)")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(title or f"{metric} against epsilon (mean ± sample std over seeds)", fontsize=10)
    return fig


def choose_metric(available: Sequence[set[str]], metric: Optional[str] = None) -> str:
    """The metric to draw: ``metric`` when given (and logged by some run), else the first of
    :data:`METRIC_PREFERENCE` some run logged.

    Raises:
        ValueError: no run has it, with the metrics the runs have.
    """
    seen = set().union(*available) if available else set()
    if metric is not None and not metric.startswith(("val/", "test/")):
        raise ValueError(f"--metric {metric}: the picture is a release, so it draws a metric of the released model "
                         "on held-out data (val/* or test/*); training statistics (nonprivate/*) are not covered by "
                         "epsilon")
    if metric is not None:
        if metric not in seen:
            from lightning_dp.config.errors import closest

            near = closest(metric, seen)
            raise ValueError(f"--metric {metric}: no run logged it" + (f"; did you mean {' or '.join(near)}?" if near
                                                                        else f"; metrics of the runs: {sorted(seen)}"))
        return metric
    for name in METRIC_PREFERENCE:
        if name in seen:
            return name
    task = sorted(m for m in seen if m.startswith(("val/", "test/")))
    if task:
        return task[0]
    raise ValueError(f"no task metric (val/* or test/*) in the runs; their metrics: {sorted(seen)}; pass --metric")


def grid_outcomes(points: Sequence[Any], metric: Optional[str], over: Optional[str]) -> tuple[str, list[Outcome]]:
    """Outcomes of a grid's points (:class:`~lightning_dp.grid.points.GridPoint`), grouped over ``over`` (seeds).

    A point whose epsilon is infinite (it released without sanitization) is a non-private baseline; a
    point with no epsilon at all is left out.
    """
    chosen = choose_metric([set(p.metrics) for p in points], metric)
    outcomes = []
    for p in points:
        if chosen not in p.metrics:
            continue
        eps = next((privacy_value(p, n) for n in ("epsilon", "client_epsilon_max") if privacy_value(p, n) != ""),
                   "")
        if eps == "":
            continue
        label = ", ".join(f"{short_name(k)}={v}" for k, v in p.values.items() if k != over) or "all"
        outcomes.append(Outcome(p.run_id or "", label, None if eps == math.inf else float(eps),
                                float(p.metrics[chosen])))
    return chosen, outcomes
