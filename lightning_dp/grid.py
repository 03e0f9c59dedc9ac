"""``lightning-dp grid``: run one config over a grid of overrides, side by side in MLflow, with the grid's privacy cost.

Usage::

    lightning-dp grid --config examples/fl_hospital.yaml \\
        --set model.init_args.num_hypotheses=1,3,5,7 \\
        --set model.init_args.noise_multiplier=0,0.1,1,2,3,5 \\
        --set model.init_args.seed=0,1,2 --test --summary grid.md

Every point of the Cartesian product of the ``--set`` lists is one ``lightning-dp fit``
(any further arguments after ``--`` are passed to every run). With ``--test`` the fitted
module (the best checkpoint when the config has
:class:`~lightning_dp.callbacks.RestoreBestWeights`) is then tested on the same trainer,
so ``test/*`` metrics land in the same MLflow run.

MLflow: every run gets the tags ``grid.id`` and ``grid.<key>`` and a run name made of
its values, and is nested under a parent run ``grid-<id>`` (in the UI, expand it and
compare the children). The parent run holds ``grid.md``, the table of every point's
final metrics and privacy, and the grid's total privacy cost as metrics.

Why the grid's privacy is reported: a hyperparameter search on private data releases
every trained model (or at least the chosen one, which depends on all of them), so its
cost is the composition of all runs' costs, not the cost of the best run.

- Runs with the :class:`~lightning_dp.callbacks.DPSGD` callback: every run's mechanism
  history is replayed into one accountant of the same kind (PLD or RDP over
  dp-accounting): ``grid/epsilon`` at the largest ``target_delta`` of the runs; infinite
  when some run of the grid trained without DPSGD.
- Runs of :class:`~lightning_dp.federated.PersonalizedFederatedModule`: per-client
  ledgers add up over runs (composition of d-privacy); ``grid/client_epsilon_median``
  and ``grid/client_epsilon_max`` are over the per-client totals. A run with
  ``noise_multiplier=0`` releases unsanitized models: the grid's client cost is then
  infinite, and reported so.

Noise: every run of a grid draws its own noise. Runs that shared a noise seed would
release the same noise twice, which cancels in the difference of two released models, and
the grid's composed epsilon assumes independent noise. So before each fit the grid gives
every component with a secret seed (``DPSGD`` and its subclasses, the federated module's
``noise_seed``) a new one, replacing any seed the config fixes: fresh from the operating
system by default, or, with ``--seed S``, derived from ``(S, run index, component index)``
(:func:`lightning_dp.privacy.seeds.derive_seed`), so that a grid can be reproduced exactly.
A grid seed is as public as the command line that holds it: use it for experiments, not for
models you release.

Why hand-written: LightningCLI runs one config, MLflow and Optuna sweeps know nothing of
privacy budgets; a grid is a loop over LightningDPCLI plus the accounting above.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

__all__ = ["BudgetPlan", "GridPoint", "GridResult", "bar_plot", "main", "parse_set", "plan_budget", "plan_point", "report",
           "reseed", "run_grid", "secret_seeded", "select_best"]


@dataclass
class GridPoint:
    """One finished run of the grid: its overrides, MLflow ids, final metrics and privacy."""

    values: dict[str, Any]
    run_id: Optional[str] = None
    metrics: dict[str, float] = field(default_factory=dict)
    privacy: dict[str, Any] = field(default_factory=dict)


_SPACE = re.compile(r"^(log|lin)space:([^:]+):([^:]+):([0-9]+)$")


def _space(kind: str, start: float, stop: float, num: int) -> list[float]:
    """``num`` evenly spaced values from start to stop (of the exponent for ``log``), 6 significant digits."""
    if num < 1:
        raise ValueError("needs at least 1 point")
    points = [start + (stop - start) * i / (num - 1) for i in range(num)] if num > 1 else [start]
    return [float(f"{(10 ** p if kind == 'log' else p):.6g}") for p in points]


def parse_set(text: str) -> tuple[str, list[Any]]:
    """``"model.init_args.lr=0.1,0.2"`` -> ``("model.init_args.lr", [0.1, 0.2])`` (values parsed as YAML scalars).

    ``KEY=logspace:A:B:K`` gives K values ``10^a`` for ``a`` evenly spaced from A to B (the
    thesis' grids, e.g. ``logspace:-2.5:1.5:5`` = 0.00316, 0.0316, ..., 31.6), and
    ``KEY=linspace:A:B:K`` K values evenly spaced from A to B; both rounded to 6 significant digits.

    Raises:
        ValueError: If there is no ``=`` or no value, or a malformed space.
    """
    key, sep, values = text.partition("=")
    key = key.strip().lstrip("-")
    if not sep or not key or not values.strip():
        raise ValueError(f"--set {text!r}: expected KEY=V1,V2,... such as model.init_args.lr=0.05,0.1")
    space = _SPACE.match(values.strip())
    if space:
        try:
            return key, _space(space[1], float(space[2]), float(space[3]), int(space[4]))
        except ValueError as err:
            raise ValueError(f"--set {text!r}: {space[1]}space:START:STOP:NUM needs numbers and NUM >= 1 ({err}), "
                             "e.g. model.init_args.lr=logspace:-2.5:1.5:5") from None
    if values.strip().startswith(("logspace", "linspace")):
        raise ValueError(f"--set {text!r}: write logspace:START:STOP:NUM (colons), e.g. "
                         f"{key}=logspace:-2.5:1.5:5")
    parsed = [yaml.safe_load(v.strip()) for v in values.split(",")]
    if any(v is None for v in parsed):
        raise ValueError(f"--set {text!r}: empty value in the list; write every value, e.g. {key}=1,2,3")
    return key, parsed


def _short(key: str) -> str:
    """``model.init_args.noise_multiplier`` -> ``noise_multiplier``."""
    return key.split(".")[-1]


def _cli_value(value: Any) -> str:
    """A parsed YAML scalar back as command-line text (``True`` -> ``true``, ``None`` -> ``null``)."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)


def _run_name(values: dict[str, Any]) -> str:
    return " ".join(f"{_short(k)}={v}" for k, v in values.items())


def _privacy_of(trainer: Any, module: Any) -> dict[str, Any]:
    """What a finished run spent: a DPSGD accountant and/or a federated ledger (copies)."""
    from lightning_dp.callbacks import DPSGD
    from lightning_dp.privacy.ledger import PrivacyLedger

    out: dict[str, Any] = {}
    for cb in trainer.callbacks:
        if isinstance(cb, DPSGD):  # a run that took no step is private too (epsilon 0), not unprotected
            out["accountant"] = copy.deepcopy(cb.accountant)
            out["delta"] = cb.target_delta
            out["epsilon"] = cb.epsilon
    ledger = getattr(module, "ledger", None)
    if isinstance(ledger, PrivacyLedger):
        sanitized = float(getattr(module, "noise_multiplier", 1.0)) > 0
        out["ledger"] = ledger.as_dict() if sanitized else None  # None: unsanitized releases, infinite cost
        if sanitized and len(ledger):
            out["client_epsilon_median"] = ledger.median()
            out["client_epsilon_max"] = ledger.max()
    return out


def grid_privacy(points: Sequence[GridPoint]) -> dict[str, float]:
    """The composed privacy cost of all runs of the grid (see the module docstring)."""
    import statistics

    total: dict[str, float] = {}
    accountants = [p.privacy["accountant"] for p in points if "accountant" in p.privacy]
    if accountants:
        composed = copy.deepcopy(accountants[0])
        for acc in accountants[1:]:
            if type(acc) is not type(composed):
                raise ValueError("the grid mixes accountant kinds; compose runs with the same accountant")
            for sigma, q, steps in acc.history:
                composed.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
        delta = max(p.privacy["delta"] for p in points if "accountant" in p.privacy)
        # a run without DPSGD trained on the same data without privacy: the grid has no finite bound
        private = all("accountant" in p.privacy for p in points)
        total["grid/epsilon"] = composed.get_epsilon(delta) if private else math.inf
        total["grid/delta"] = delta
    ledgers = [p.privacy["ledger"] for p in points if "ledger" in p.privacy]
    if ledgers:
        if any(ledger is None for ledger in ledgers):
            total["grid/client_epsilon_median"] = total["grid/client_epsilon_max"] = math.inf
        else:
            per_client: dict[str, float] = {}
            for ledger in ledgers:
                for cid, spent in ledger.items():
                    per_client[cid] = per_client.get(cid, 0.0) + spent
            if per_client:
                total["grid/client_epsilon_median"] = float(statistics.median(per_client.values()))
                total["grid/client_epsilon_max"] = max(per_client.values())
    return total


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.4g}"
    return str(value)


def summary_table(points: Sequence[GridPoint], totals: dict[str, float]) -> str:
    """The grid as a Markdown table (one row per run) followed by the grid's privacy totals."""
    keys = list(points[0].values) if points else []
    metric_names = sorted({m for p in points for m in p.metrics})
    privacy_names = ["epsilon", "client_epsilon_median", "client_epsilon_max"]
    privacy_names = [n for n in privacy_names if any(n in p.privacy for p in points)]
    header = [_short(k) for k in keys] + metric_names + privacy_names + ["run"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for p in points:
        cells = [_fmt(p.values[k]) for k in keys] + [_fmt(p.metrics.get(m, "")) for m in metric_names]
        unsanitized = "ledger" in p.privacy and p.privacy["ledger"] is None  # nu = 0: infinite client cost
        cells += [_fmt(p.privacy.get(n, "inf" if unsanitized and n.startswith("client_") else ""))
                  for n in privacy_names]
        cells.append(p.run_id or "")
        lines.append("| " + " | ".join(cells) + " |")
    if totals:
        lines += ["", "Grid total (composition over all runs): " + ", ".join(f"{k} = {_fmt(v)}"
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
    columns += [n for n in ("epsilon", "client_epsilon_median", "client_epsilon_max")
                if any(n in p.privacy for p in points)]

    def cell(group: list[GridPoint], name: str) -> str:
        vals = [p.metrics.get(name, p.privacy.get(name)) for p in group]
        if any("ledger" in p.privacy and p.privacy["ledger"] is None for p in group) and name.startswith("client_"):
            return "inf"
        vals = [float(v) for v in vals if isinstance(v, (int, float))]
        if not vals:
            return ""
        if len(vals) == 1:
            return _fmt(vals[0])
        return f"{statistics.mean(vals):.4g} ± {statistics.stdev(vals):.2g}"

    header = [_short(k) for k in keys] + columns + [f"runs ({_short(over)})"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for combo, group in groups.items():
        runs = ",".join(_fmt(p.values[over]) for p in group)
        lines.append("| " + " | ".join([_fmt(v) for v in combo] + [cell(group, c) for c in columns] + [runs]) + " |")
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
                   capsize=3, label=f"{_short(hue)}={_fmt(h)}")
        ax.set_xticks(range(len(xs)), [_fmt(v) for v in xs])
        ax.set_xlabel(_short(x))
        ax.set_title(metric, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    panels[0].legend(fontsize=8)
    if over:
        fig.suptitle(f"mean ± std over {_short(over)}", fontsize=9)
    return fig


def _final_metrics(trainer: Any, module: Any) -> dict[str, float]:
    import torch

    out = {}
    for name, value in trainer.callback_metrics.items():
        # per-hypothesis shares and per-group rates stay in MLflow (the tables keep one column per summary)
        if (name.startswith(("test/", "val/")) and "/chose_" not in name and "/group_" not in name
                and isinstance(value, torch.Tensor) and value.numel() == 1):
            out[name] = float(value)
    if hasattr(module, "rounds"):
        out["rounds"] = float(module.rounds)
    else:
        out["steps"] = float(trainer.global_step)
    for cb in trainer.checkpoint_callbacks:
        if getattr(cb, "monitor", None) and cb.best_model_score is not None:
            out[f"best {cb.monitor}"] = float(cb.best_model_score)
    return out


def _args(config: Sequence[str], values: dict[str, Any], extra: Sequence[str]) -> list[str]:
    args = [a for c in config for a in ("--config", c)]
    args += [f"--{k}={_cli_value(v)}" for k, v in values.items()]
    return args + list(extra)


def _dp_callback(trainer: Any, values: dict[str, Any]) -> Any:
    from lightning_dp.callbacks import DPSGD

    found = [cb for cb in trainer.callbacks if isinstance(cb, DPSGD)]
    if len(found) != 1:
        raise ValueError(
            f"grid point {_run_name(values)!r} has {len(found)} DP-SGD callbacks (DPSGD, OnlineSensitivity, "
            "QuantileClipping); a budgeted grid (--budget) needs exactly one in every run, so that its noise "
            "multiplier can be chosen for the grid. Add one to trainer.callbacks of the config.")
    return found[0]


def plan_point(config: Sequence[str], values: dict[str, Any], extra: Sequence[str] = ()) -> dict[str, Any]:
    """Instantiate a grid point (no training) and return its DP callback's planned mechanism and accountant.

    Returns:
        ``{"plan": PlannedMechanism, "accountant": name, "accountant_kwargs": dict, "delta": target_delta}``.
    """
    from lightning_dp.cli import LightningDPCLI

    cli = LightningDPCLI(args=_args(config, values, extra), run=False)
    callback = _dp_callback(cli.trainer, values)
    if cli.datamodule is not None:
        cli.datamodule.prepare_data()
        cli.datamodule.setup("fit")
        loader = cli.datamodule.train_dataloader()
    else:
        loader = cli.model.train_dataloader()
    return {"plan": callback.plan(cli.trainer, loader), "accountant": callback.accountant_name,
            "accountant_kwargs": dict(callback.accountant_kwargs), "delta": callback.target_delta}


@dataclass
class BudgetPlan:
    """The noise multiplier of one budgeted (sub-)grid and what each of its runs may spend."""

    epsilon: float
    delta: float
    noise_multiplier: float
    accountant: str
    accountant_kwargs: dict[str, Any]
    plans: list[Any]
    """:class:`~lightning_dp.callbacks.dp_sgd.PlannedMechanism` per run, in grid order."""

    def run_epsilon(self, index: int) -> float:
        """The spend of run ``index`` alone when it runs as planned (its own cap)."""
        from lightning_dp.privacy.accounting import get_accountant

        p = self.plans[index]
        return get_accountant(self.accountant, **self.accountant_kwargs).epsilon_after(
            self.delta, noise_multiplier=self.noise_multiplier * p.multiplier_scale, sample_rate=p.sample_rate,
            num_steps=p.events)


def plan_budget(planned: Sequence[dict[str, Any]], epsilon: float, delta: Optional[float] = None) -> BudgetPlan:
    """One noise multiplier for all ``planned`` runs (:func:`plan_point`) so that they compose to ``(epsilon, delta)``.

    Raises:
        ValueError: If the runs use different accountants, or disagree on delta when none is given.
    """
    from lightning_dp.privacy.calibration import calibrate_composed_noise_multiplier

    kinds = {(p["accountant"], tuple(sorted(p["accountant_kwargs"].items()))) for p in planned}
    if len(kinds) != 1:
        raise ValueError(f"the runs of a budgeted grid must share one accountant configuration, got {sorted(kinds)}; "
                         "set the same accountant/accountant_kwargs in every point.")
    if delta is None:
        deltas = {p["delta"] for p in planned}
        if len(deltas) != 1:
            raise ValueError(f"the runs have different target_delta values {sorted(deltas)}; pass --budget-delta.")
        delta = deltas.pop()
    name, kwargs = planned[0]["accountant"], dict(planned[0]["accountant_kwargs"])
    plans = [p["plan"] for p in planned]
    sigma = calibrate_composed_noise_multiplier(
        target_epsilon=epsilon, target_delta=delta, accountant=name, accountant_kwargs=kwargs,
        runs=[(p.sample_rate, p.events, p.multiplier_scale) for p in plans])
    return BudgetPlan(epsilon=float(epsilon), delta=float(delta), noise_multiplier=sigma, accountant=name,
                      accountant_kwargs=kwargs, plans=plans)


def _check_against_plan(point: GridPoint, budget: BudgetPlan, index: int) -> None:
    """A run may stop early, never spend more than planned (else the grid's bound would not hold)."""
    plan = budget.plans[index]
    history = point.privacy.get("accountant").history if "accountant" in point.privacy else []
    expected_sigma = budget.noise_multiplier * plan.multiplier_scale
    for sigma, q, steps in history:
        if sigma != expected_sigma or q != plan.sample_rate:
            raise RuntimeError(f"grid run {_run_name(point.values)!r} was accounted with (sigma={sigma}, q={q}) but "
                               f"planned with (sigma={expected_sigma}, q={plan.sample_rate}); please report this.")
    if sum(steps for _, _, steps in history) > plan.events:
        raise RuntimeError(f"grid run {_run_name(point.values)!r} took more steps than its plan of {plan.events}.")


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


@dataclass
class GridResult:
    """Everything a grid produced: points, privacy totals, id and, for budgeted grids, plans and choices."""

    points: list[GridPoint]
    totals: dict[str, float]
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


def secret_seeded(trainer: Any, module: Any) -> list[Any]:
    """The run's components that draw privacy noise from a secret seed (they have ``set_secret_seed``)."""
    return [obj for obj in [*trainer.callbacks, module] if callable(getattr(obj, "set_secret_seed", None))]


def reseed(trainer: Any, module: Any, run_index: int, grid_seed: Optional[int]) -> int:
    """Give every secret-seeded component of run ``run_index`` its own noise seed (module docstring).

    Returns:
        The number of components reseeded.
    """
    from lightning_dp.privacy.seeds import derive_seed, fresh_seed

    components = secret_seeded(trainer, module)
    for j, obj in enumerate(components):
        obj.set_secret_seed(fresh_seed() if grid_seed is None else derive_seed(grid_seed, run_index, j))
    return len(components)


def run_grid(config: Sequence[str], sets: Sequence[tuple[str, list[Any]]], *, test: bool = False,
             extra: Sequence[str] = (), grid_id: Optional[str] = None, mean_over: Optional[str] = None,
             budget: Optional[float] = None, budget_delta: Optional[float] = None, select: Optional[str] = None,
             mode: Optional[str] = None, plot: Sequence[str] = (), plot_x: Optional[str] = None,
             plot_hue: Optional[str] = None, seed: Optional[int] = None) -> GridResult:
    """Run every point of the grid; return its points, privacy totals, id and (budgeted) choices.

    Args:
        config: Config files, as for ``lightning-dp fit``.
        sets: The axes: ``(dotted key, values)``.
        test: Test every fitted module after fitting.
        extra: Further arguments of every run.
        grid_id: Id of the grid (random by default).
        mean_over: An axis whose values are repetitions (e.g. seeds): the tables report mean ±
            std over it; with ``budget``, every repetition is one grid with its own budget.
        budget: The epsilon of the whole grid (per repetition): one noise multiplier is
            calibrated so that all runs compose to ``(budget, budget_delta)`` (module docstring).
        budget_delta: Its delta (default: the runs' common ``target_delta``).
        select: A metric to choose the best run by (per repetition), e.g. ``val/acc``.
        mode: ``"max"`` or ``"min"`` for ``select`` (default: :func:`default_mode`).
        plot: Metrics to draw as grouped bars (:func:`bar_plot`, artifact ``grid_bars.png``
            of the parent run; the figure is also kept in ``GridResult.figure``).
        plot_x, plot_hue: The axes of the bar groups and of the bars (required with ``plot``).
        seed: The grid seed: run i's noise seeds are derived from ``(seed, i)``; None (default)
            draws a fresh secret seed for every run (module docstring, "Noise").
    """
    from lightning_dp import tracking
    from lightning_dp.cli import LightningDPCLI

    grid_id = grid_id or secrets.token_hex(4)
    keys = [k for k, _ in sets]
    combos = [dict(zip(keys, combo)) for combo in itertools.product(*(values for _, values in sets))]

    def group_of(values: dict[str, Any]) -> Any:
        return values[mean_over] if mean_over else None

    result = GridResult(points=[], totals={}, grid_id=grid_id, select=select, mode=mode or default_mode(select or ""),
                        mean_over=mean_over)
    run_budget: dict[int, tuple[BudgetPlan, int]] = {}
    if budget is not None:
        groups: dict[Any, list[int]] = {}
        for i, values in enumerate(combos):
            groups.setdefault(group_of(values), []).append(i)
        for group, indices in groups.items():
            planned = []
            for i in indices:
                print(f"[grid {grid_id}] planning {i + 1}/{len(combos)}: {_run_name(combos[i])}", flush=True)
                planned.append(plan_point(config, combos[i], extra))
            plan = plan_budget(planned, budget, budget_delta)
            result.budgets[group] = plan
            for j, i in enumerate(indices):
                run_budget[i] = (plan, j)
            label = f"{_short(mean_over)}={group}: " if mean_over else ""
            print(f"[grid {grid_id}] {label}{len(indices)} runs compose to epsilon={budget} at delta={plan.delta:g} "
                  f"with noise_multiplier={plan.noise_multiplier:.4f}", flush=True)

    print(f"[grid {grid_id}] every run draws its own noise: "
          + (f"seeds derived from --seed {seed}" if seed is not None else "a fresh secret seed per run"), flush=True)
    location: Optional[tuple[Any, str]] = None  # (MlflowClient, experiment id) of the first run
    for i, values in enumerate(combos):
        print(f"[grid {grid_id}] {i + 1}/{len(combos)}: {_run_name(values)}", flush=True)

        class _GridCLI(LightningDPCLI):
            def before_fit(self, i: int = i, values: dict = values) -> None:
                reseed(self.trainer, self.model, i, seed)  # no two runs share noise
                if i in run_budget:
                    plan, j = run_budget[i]
                    _dp_callback(self.trainer, values).fix_noise_multiplier(
                        plan.noise_multiplier, target_epsilon=plan.run_epsilon(j), target_delta=plan.delta)

        cli = _GridCLI(args=["fit"] + _args(config, values, extra))
        metrics = _final_metrics(cli.trainer, cli.model)  # before test, which resets the val/* metrics
        if test:
            cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)
            metrics.update(_final_metrics(cli.trainer, cli.model))
        point = GridPoint(values, metrics=metrics, privacy=_privacy_of(cli.trainer, cli.model))
        if i in run_budget:
            _check_against_plan(point, *run_budget[i])
        for logger in tracking.mlflow_loggers(cli.trainer):
            point.run_id = logger.run_id
            client = logger.experiment
            location = location or (client, logger.experiment_id)
            client.set_tag(logger.run_id, "mlflow.runName", _run_name(values))
            client.set_tag(logger.run_id, "grid.id", grid_id)
            for k, v in values.items():
                client.set_tag(logger.run_id, f"grid.{_short(k)}", str(v))
        result.points.append(point)

    points = result.points
    if budget is not None:
        per_group = {}
        for group in result.budgets:
            members = [p for p, v in zip(points, combos) if group_of(v) == group]
            per_group[group] = grid_privacy(members)
            spent = per_group[group].get("grid/epsilon", math.inf)
            if spent > budget:
                raise RuntimeError(f"the grid spent epsilon={spent} > budget {budget}; please report this.")
        result.totals = {"grid/epsilon": max(t["grid/epsilon"] for t in per_group.values()),
                         "grid/delta": result.budgets[next(iter(result.budgets))].delta,
                         "grid/budget_epsilon": float(budget)}
        if mean_over:
            result.totals["grid/epsilon_all_repetitions"] = grid_privacy(points)["grid/epsilon"]
    else:
        result.totals = grid_privacy(points)
    if select:
        for group in dict.fromkeys(group_of(v) for v in combos):
            members = [p for p, v in zip(points, combos) if group_of(v) == group]
            result.best[group] = select_best(members, select, result.mode)

    if plot:
        if plot_x is None or plot_hue is None:
            raise ValueError("plot needs plot_x and plot_hue: the axes of the bar groups and of the bars")
        result.figure = bar_plot(points, plot, plot_x, plot_hue, mean_over)

    if location is not None:
        client, experiment_id = location
        parent = client.create_run(experiment_id, run_name=f"grid-{grid_id}", tags={"grid.id": grid_id})
        pid = parent.info.run_id
        for p in points:
            if p.run_id:
                client.set_tag(p.run_id, "mlflow.parentRunId", pid)
        for name, value in result.totals.items():
            if math.isfinite(value):
                client.log_metric(pid, name, value)
            else:
                client.set_tag(pid, name, "inf")
        client.log_param(pid, "grid.config", " ".join(config))
        for key, values in sets:
            client.log_param(pid, f"grid.{_short(key)}", ",".join(map(str, values)))
        if budget is not None:
            client.log_param(pid, "grid.budget_epsilon", budget)
            client.log_param(pid, "grid.budget_delta", result.totals["grid/delta"])
            sigmas = sorted({b.noise_multiplier for b in result.budgets.values()})
            client.log_param(pid, "grid.noise_multiplier", ",".join(repr(s) for s in sigmas))
        if select:
            client.log_param(pid, "grid.select", f"{select} ({result.mode})")
            client.set_tag(pid, "grid.best_runs", ",".join(p.run_id or "" for p in result.best.values()))
            for p in result.best.values():
                if p.run_id:
                    client.set_tag(p.run_id, "grid.best", "true")
        client.log_text(pid, report(result), "grid.md")
        if result.figure is not None:
            client.log_figure(pid, result.figure, "grid_bars.png")
        client.set_terminated(pid)
    return result


def best_table(result: GridResult) -> str:
    """The chosen run of each repetition, then mean ± std of its metrics over repetitions."""
    import statistics

    rows = list(result.best.items())
    columns = sorted({m for _, p in rows for m in p.metrics})
    keys = [k for k in (rows[0][1].values if rows else {}) if k != result.mean_over]
    lead = [_short(result.mean_over)] if result.mean_over else []
    extra = ["noise_multiplier"] if result.budgets else []
    header = lead + [_short(k) for k in keys] + extra + columns + ["epsilon", "run"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for group, p in rows:
        cells = ([_fmt(group)] if result.mean_over else []) + [_fmt(p.values[k]) for k in keys]
        if result.budgets:
            cells.append(_fmt(result.budgets[group].noise_multiplier))
        cells += [_fmt(p.metrics.get(c, "")) for c in columns] + [_fmt(p.privacy.get("epsilon", "")), p.run_id or ""]
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
        text += (f"Budget of each grid: epsilon = {_fmt(result.totals['grid/budget_epsilon'])} at delta = "
                 f"{_fmt(result.totals['grid/delta'])}, composed over its runs by the accountant.\n\n")
    text += summary_table(result.points, result.totals)
    if result.select:
        text += f"\nBest run by {result.select} ({result.mode}):\n\n" + best_table(result)
    if result.mean_over and not result.budgets:
        text += f"\nMean ± std over {_short(result.mean_over)}:\n\n" + mean_table(result.points, result.mean_over)
    return text


def main(argv: Sequence[str]) -> int:
    """Entry point of ``lightning-dp grid`` (see the module docstring)."""
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="lightning-dp grid", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", required=True, help="config file(s), as for lightning-dp fit")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=V1,V2,...",
                        help="a grid axis: a dotted config key and its values (repeat for more axes)")
    parser.add_argument("--test", action="store_true", help="test every fitted module (test/* metrics in its run)")
    parser.add_argument("--summary", help="also write the Markdown table to this file")
    parser.add_argument("--mean-over", metavar="KEY",
                        help="an axis of repetitions (e.g. a seed): mean ± std over it; with --budget every "
                             "repetition is one grid with its own budget")
    parser.add_argument("--budget", type=float, metavar="EPSILON",
                        help="privacy budget of the whole grid: one noise multiplier is calibrated so that all runs "
                             "compose to it (every run needs a DPSGD-family callback)")
    parser.add_argument("--budget-delta", type=float, metavar="DELTA",
                        help="delta of --budget (default: the runs' common target_delta)")
    parser.add_argument("--select", metavar="METRIC", help="choose the best run by this metric, e.g. val/acc")
    parser.add_argument("--plot", action="append", default=[], metavar="METRIC",
                        help="draw this metric as grouped bars, mean ± std over --mean-over (repeat for more panels; "
                             "artifact grid_bars.png of the parent run)")
    parser.add_argument("--plot-x", metavar="KEY", help="with --plot: the grid axis along which bars are grouped")
    parser.add_argument("--plot-hue", metavar="KEY", help="with --plot: the grid axis of the bars within a group")
    parser.add_argument("--plot-file", metavar="PATH", help="with --plot: also save the figure to this file")
    parser.add_argument("--seed", type=int, metavar="S",
                        help="grid seed: derive every run's secret noise seed from (S, run index) for an exactly "
                             "reproducible grid (default: a fresh secret seed per run); public, like this command")
    parser.add_argument("--mode", choices=("max", "min"),
                        help="whether --select is maximized or minimized (default: min for loss/error/mse, else max)")
    args = parser.parse_args(argv)
    try:
        sets = [parse_set(s) for s in args.set]
    except ValueError as err:
        parser.error(str(err))
    if not sets:
        parser.error("give at least one axis with --set KEY=V1,V2,... (e.g. --set model.init_args.seed=0,1,2)")
    for config in args.config:
        if not os.path.isfile(config):
            parser.error(f"--config {config}: no such file")
    if args.mean_over and args.mean_over.lstrip("-") not in [k for k, _ in sets]:
        parser.error(f"--mean-over {args.mean_over}: not one of the --set keys {[k for k, _ in sets]}")
    mean_over = args.mean_over.lstrip("-") if args.mean_over else None
    if args.budget is not None and not (args.budget > 0 and math.isfinite(args.budget)):
        parser.error(f"--budget {args.budget}: pass a finite epsilon > 0 for the whole grid, e.g. --budget 3")
    if args.budget_delta is not None and not 0 < args.budget_delta < 1:
        parser.error(f"--budget-delta {args.budget_delta}: delta must be in (0, 1), e.g. 1e-5")
    if args.budget_delta is not None and args.budget is None:
        parser.error("--budget-delta needs --budget")
    if args.seed is not None and args.seed < 0:
        parser.error(f"--seed {args.seed}: pass a non-negative integer, or leave it out for fresh secret seeds")
    if args.mode and not args.select:
        parser.error("--mode needs --select METRIC")
    keys = [k for k, _ in sets]
    plot_x = args.plot_x.lstrip("-") if args.plot_x else None
    plot_hue = args.plot_hue.lstrip("-") if args.plot_hue else None
    if args.plot or plot_x or plot_hue or args.plot_file:
        if not (args.plot and plot_x and plot_hue):
            parser.error("a bar plot needs --plot METRIC, --plot-x KEY and --plot-hue KEY")
        for name, key in (("--plot-x", plot_x), ("--plot-hue", plot_hue)):
            if key not in keys:
                parser.error(f"{name} {key}: not one of the --set keys {keys}")
        if plot_x == plot_hue:
            parser.error("--plot-x and --plot-hue must be two different axes")
        others = [k for k, values in sets if k not in (plot_x, plot_hue, mean_over) and len(values) > 1]
        if others:
            parser.error(f"--plot: the axes {others} have several values, so a bar would mix them; bars need every "
                         "axis other than --plot-x, --plot-hue and --mean-over to have one value")
    result = run_grid(args.config, sets, test=args.test, extra=extra, mean_over=mean_over, budget=args.budget,
                      budget_delta=args.budget_delta, select=args.select, mode=args.mode, plot=args.plot,
                      plot_x=plot_x, plot_hue=plot_hue, seed=args.seed)
    table = report(result)
    print(table, flush=True)
    if args.summary:
        with open(args.summary, "w", encoding="utf-8") as handle:
            handle.write(table)
    if args.plot_file and result.figure is not None:
        result.figure.savefig(args.plot_file, dpi=120)
    return 0
