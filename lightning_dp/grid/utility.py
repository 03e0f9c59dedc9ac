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

__all__ = ["METRIC_PREFERENCE", "PRIVACY_AXES", "Group", "GridSpend", "Outcome", "choose_metric", "curve_key",
           "grid_outcomes", "group_outcomes", "utility_figure", "utility_table"]

#: The metric drawn when none is given: the first that some run logged.
METRIC_PREFERENCE = ("val/acc", "test/acc", "val/perplexity", "test/perplexity", "val/loss", "test/loss")
#: Settings (the last part of a parameter's or axis' name) that only move a run along the privacy axis: groups that
#: differ in these alone are one privacy-utility curve, joined by a line; groups that differ in anything else are not.
PRIVACY_AXES = ("target_epsilon", "noise_multiplier", "epsilon", "budget_epsilon", "nu")


@dataclass(frozen=True)
class Outcome:
    """One run: its group (configuration without seeds), its epsilon (None: non-private) and its metric."""

    run_id: str
    group: str
    epsilon: Optional[float]
    value: float
    curve: Optional[str] = None
    """Groups of one curve differ only in :data:`PRIVACY_AXES` (:func:`curve_key`); None: joined to no other."""


@dataclass(frozen=True)
class Group:
    """Runs of one setting: means and sample stds (0 for one run) of epsilon and of the metric."""

    label: str
    runs: tuple[str, ...]
    epsilon: Optional[float]
    epsilon_std: float
    value: float
    value_std: float
    curve: Optional[str] = None


@dataclass(frozen=True)
class GridSpend:
    """What a grid search spent in all (its parent run's ``grid/*`` metrics), beside its runs' own epsilons.

    A search releases every model it trained, so its cost is the composition of all its runs' costs
    (docs/privacy.md, "Model selection and grids"): ``epsilon`` per repetition of a budgeted grid (or the whole grid),
    ``all_repetitions`` over every repetition together, ``budget`` what it was allowed.
    """

    label: str
    epsilon: float
    delta: Optional[float] = None
    runs: int = 0
    all_repetitions: Optional[float] = None
    budget: Optional[float] = None

    def describe(self) -> str:
        """One line: ``grid X (4 runs) spent epsilon = 2.965 per repetition, 4.117 over all repetitions, ...``."""
        scope = "per repetition" if self.all_repetitions is not None else "over all its runs"
        text = (f"{self.label}{f' ({self.runs} runs)' if self.runs else ''} spent epsilon = {_num(self.epsilon)} "
                f"{scope}")
        if self.all_repetitions is not None:
            text += f", {_num(self.all_repetitions)} over all repetitions"
        if self.delta is not None:
            text += f", at delta = {self.delta:g}"
        if self.budget is not None:
            text += f" (budget {_num(self.budget)})"
        return text


def _num(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.4g}"


def curve_key(settings: dict[str, Any]) -> str:
    """The settings of a group without its :data:`PRIVACY_AXES`: groups with equal keys lie on one curve.

    >>> curve_key({"lr": 0.1, "privacy/target_epsilon": 3}) == curve_key({"lr": 0.1, "privacy/target_epsilon": 8})
    True
    >>> curve_key({"lr": 0.1}) == curve_key({"lr": 0.2})
    False
    """
    def leaf(key: str) -> str:
        return key.replace("/", ".").rsplit(".", 1)[-1]

    return repr(sorted((k, str(v)) for k, v in settings.items() if leaf(k) not in PRIVACY_AXES))


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
        curves = {o.curve for o in members}
        curve = curves.pop() if len(curves) == 1 else None
        groups.append(Group(label, tuple(o.run_id for o in members), eps, eps_std, value, value_std, curve))
    return sorted(groups, key=lambda g: (g.epsilon is None, g.epsilon if g.epsilon is not None else 0.0))


def _pm(mean: float, std: float, n: int) -> str:
    return f"{mean:.4g} ± {std:.2g}" if n > 1 else f"{mean:.4g}"


def utility_table(groups: Sequence[Group], metric: str, spends: Sequence[GridSpend] = ()) -> str:
    """The groups as a Markdown table: setting, runs, epsilon and the metric (mean ± sample std); then, for runs of
    a grid search, what the search spent in all (``spends``): more than any of its runs."""
    lines = [f"| setting | runs | epsilon | {metric} |", "|---|---|---|---|"]
    for g in groups:
        eps = "non-private" if g.epsilon is None else _pm(g.epsilon, g.epsilon_std, len(g.runs))
        lines.append(f"| {g.label} | {len(g.runs)} | {eps} | {_pm(g.value, g.value_std, len(g.runs))} |")
    text = "\n".join(lines) + "\n"
    if spends:
        text += ("\nThe epsilon column is each run's own spend. A grid search releases every model it trained, so "
                 "its cost composes them all:\n\n" + "".join(f"- {s.describe()}\n" for s in spends))
    return text


def utility_figure(groups: Sequence[Group], metric: str, title: str = "", spends: Sequence[GridSpend] = ()) -> Any:
    """``metric`` against epsilon: private groups as points with error bars, baselines as lines (with bands).

    Points are joined only along one curve (groups whose settings differ in :data:`PRIVACY_AXES` alone, same
    ``curve``); the composed spend of each grid search (``spends``) is a dotted vertical line, labelled. The legend
    sits below the axes, where it covers no point.

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
    curves: dict[str, list[Group]] = {}
    for g in private:  # a line joins one setting's points along the privacy axis, never different settings
        if g.curve is not None:
            curves.setdefault(g.curve, []).append(g)
    for members in curves.values():
        if len(members) > 1:
            members = sorted(members, key=lambda g: float(g.epsilon or 0.0))
            ax.plot([float(g.epsilon or 0.0) for g in members], [g.value for g in members], color="0.6",
                    linewidth=0.8, zorder=0)
    lines = [(value, s.label, what, style) for s in spends
             for value, what, style in ((s.epsilon, "per repetition" if s.all_repetitions is not None else "all runs",
                                         ":"), (s.all_repetitions, "all repetitions", "-."))
             if value is not None and math.isfinite(value)]
    xs = [float(g.epsilon) for g in private if g.epsilon is not None] + [line[0] for line in lines]
    if len(xs) > 1 and max(xs) / max(min(xs), 1e-12) > 20:
        ax.set_xscale("log")
    for value, label, what, style in lines:
        ax.axvline(value, color="0.25", linestyle=style, linewidth=1.0,
                   label=f"{label}: the search spent {_num(value)} ({what})")
    if xs and ax.get_xscale() == "linear":  # epsilon from 0: how far each point is from no privacy at all
        ax.set_xlim(0, 1.15 * max(xs + [float(g.epsilon) + g.epsilon_std for g in private if g.epsilon is not None]))
    for g in groups:
        if g.epsilon is None:
            color = next(colors)
            ax.axhline(g.value, color=color, linestyle="--", label=f"{g.label}: non-private (n={len(g.runs)})")
            if g.value_std > 0:
                ax.axhspan(g.value - g.value_std, g.value + g.value_std, color=color, alpha=0.15)
    ax.set_xlabel("epsilon (each point: its run's own spend, at its delta)")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:  # outside the axes: a legend inside covers points wherever "best" puts it
        fig.legend(handles, labels, loc="outside lower center", fontsize=8, ncols=1 if len(labels) > 4 else 2)
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
        setting = {k: v for k, v in p.values.items() if k != over}
        label = ", ".join(f"{short_name(k)}={v}" for k, v in setting.items()) or "all"
        outcomes.append(Outcome(p.run_id or "", label, None if eps == math.inf else float(eps),
                                float(p.metrics[chosen]), curve_key(setting)))
    return chosen, outcomes
