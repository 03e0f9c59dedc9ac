"""Running a grid: every point one ``lightning-dp fit`` (LightningDPCLI), nested under a parent MLflow run."""

from __future__ import annotations

import math
import os
import secrets
import sys
from collections.abc import Sequence
from typing import Any, Optional

from lightning_dp.grid.axes import grid_points, run_args, run_name, short_name
from lightning_dp.grid.points import GridPoint, GridResult
from lightning_dp.grid.privacy import (
    BudgetPlan,
    check_against_plan,
    check_points,
    dp_callback,
    grid_privacy,
    plan_budget,
    plan_point,
    privacy_of,
    reseed,
)
from lightning_dp.grid.report import bar_plot, default_mode, report, select_best
from lightning_dp.grid.utility import GridSpend, grid_outcomes, group_outcomes, utility_figure, utility_table

__all__ = ["ParentRuns", "base_name", "final_metrics", "run_grid"]

def final_metrics(trainer: Any, module: Any) -> dict[str, float]:
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
        plot_x: The axis of the bar groups (required with ``plot``).
        plot_hue: The axis of the bars within a group (required with ``plot``).
        seed: The grid seed: run i's noise seeds are derived from ``(seed, i)``; None (default)
            draws a fresh secret seed for every run (module docstring, "Noise").
    """
    from lightning_dp import tracking
    from lightning_dp.config.lightning_cli import LightningDPCLI

    grid_id = grid_id or secrets.token_hex(4)
    combos = grid_points(sets)

    def group_of(values: dict[str, Any]) -> Any:
        return values[mean_over] if mean_over else None

    result = GridResult(points=[], totals={}, grid_id=grid_id, select=select, mode=mode or default_mode(select or ""),
                        mean_over=mean_over)
    check_points(config, combos, extra)  # every point's privacy can be composed, before any run trains
    run_budget: dict[int, tuple[BudgetPlan, int]] = {}
    if budget is not None:
        groups: dict[Any, list[int]] = {}
        for i, values in enumerate(combos):
            groups.setdefault(group_of(values), []).append(i)
        for group, indices in groups.items():
            planned = []
            for i in indices:
                print(f"[grid {grid_id}] planning {i + 1}/{len(combos)}: {run_name(combos[i])}", flush=True)
                planned.append(plan_point(config, combos[i], extra))
            plan = plan_budget(planned, budget, budget_delta)
            result.budgets[group] = plan
            for j, i in enumerate(indices):
                run_budget[i] = (plan, j)
            label = f"{short_name(mean_over)}={group}: " if mean_over else ""
            print(f"[grid {grid_id}] {label}{len(indices)} runs compose to epsilon={budget} at delta={plan.delta:g} "
                  f"with noise_multiplier={plan.noise_multiplier:.4f}", flush=True)

    print(f"[grid {grid_id}] every run draws its own noise: "
          + (f"seeds derived from --seed {seed}" if seed is not None else "a fresh secret seed per run"), flush=True)
    parents = ParentRuns(grid_id)
    try:
        for i, values in enumerate(combos):
            print(f"[grid {grid_id}] {i + 1}/{len(combos)}: {run_name(values)}", flush=True)

            class _GridCLI(LightningDPCLI):
                def before_fit(self, i: int = i, values: dict = values) -> None:
                    reseed(self.trainer, self.model, i, seed)  # no two runs share noise
                    if i in run_budget:
                        plan, j = run_budget[i]
                        dp_callback(self.trainer, values).fix_noise_multiplier(
                            plan.noise_multiplier, target_epsilon=plan.run_epsilon(j), target_delta=plan.delta)
                    super().before_fit()  # the settings-only refusals, before the child run exists
                    if self.trainer.is_global_zero:  # nested under the grid's parent run before it logs anything
                        for logger in tracking.mlflow_loggers(self.trainer):
                            parents.adopt(logger, base_name(logger, config), values)

            cli = _GridCLI(args=["fit"] + run_args(config, values, extra))
            metrics = final_metrics(cli.trainer, cli.model)  # before test, which resets the val/* metrics
            if test:
                cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)
                metrics.update(final_metrics(cli.trainer, cli.model))
            point = GridPoint(values, metrics=metrics, privacy=privacy_of(cli.trainer, cli.model))
            if i in run_budget:
                check_against_plan(point, *run_budget[i])
            for logger in tracking.mlflow_loggers(cli.trainer):
                point.run_id = logger.run_id
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
        result.utility = privacy_utility(points, select, mean_over, totals=result.totals, grid_id=grid_id)

        parents.finish(result, config, sets, budget)
    except BaseException:
        parents.fail()
        raise
    return result


def privacy_utility(points: Sequence[GridPoint], metric: Optional[str], over: Optional[str], *,
                    totals: Optional[dict[str, float]] = None,
                    grid_id: str = "") -> Optional[tuple[str, Any]]:
    """The grid's privacy-utility table and figure (``select``'s metric, else the task metric; groups over the
    ``mean_over`` axis), with the grid's composed spend (``totals``, its ``grid/*`` metrics) beside its runs' own,
    or None when no point has both an epsilon and a task metric."""
    try:
        chosen, outcomes = grid_outcomes(points, metric, over)
        groups = group_outcomes(outcomes)
    except ValueError:  # no task metric in the runs, or a group that mixes private and non-private points
        return None
    if not groups:
        return None
    spends = []
    if totals and "grid/epsilon" in totals:
        spends.append(GridSpend(f"grid {grid_id}", totals["grid/epsilon"], totals.get("grid/delta"),
                                len(points), totals.get("grid/epsilon_all_repetitions"),
                                totals.get("grid/budget_epsilon")))
    return utility_table(groups, chosen, spends), utility_figure(groups, chosen, spends=spends)


def base_name(logger: Any, config: Sequence[str]) -> str:
    """The name a grid gives its runs before their values: the logger's ``run_name``, else the last config's stem."""
    name = getattr(logger, "_run_name", None)
    return str(name) if name else os.path.splitext(os.path.basename(config[-1]))[0]


class ParentRuns:
    """The grid's parent MLflow run in each experiment its runs log to, created when the first run starts.

    Every run is nested under it (tag ``mlflow.parentRunId``) and named ``"<base> key=value ..."``
    (:func:`base_name`) before it logs anything, so the MLflow UI shows the grid as one
    expandable row from its first step on, and grids of different configs in one experiment
    (a method and its non-private baseline) keep distinct names. The parent is ``RUNNING``
    while the grid runs, then holds the grid's report and privacy totals (:meth:`finish`),
    or ends ``FAILED`` when a run raises (:meth:`fail`).
    """

    def __init__(self, grid_id: str) -> None:
        self.grid_id = grid_id
        self.parents: dict[str, str] = {}  # experiment id -> parent run id
        self.client: Any = None

    def adopt(self, logger: Any, base: str, values: dict[str, Any]) -> None:
        """Nest the logger's run under the parent of its experiment (created if missing), named and tagged."""
        client, experiment_id = logger.experiment, logger.experiment_id
        self.client = client
        run_id = logger.run_id
        if experiment_id not in self.parents:  # started with its first run, which the logger has just created
            parent = client.create_run(experiment_id, run_name=f"grid-{self.grid_id} {base}",
                                       start_time=client.get_run(run_id).info.start_time,
                                       tags={"grid.id": self.grid_id})
            self.parents[experiment_id] = parent.info.run_id
        client.set_tag(run_id, "mlflow.parentRunId", self.parents[experiment_id])
        client.set_tag(run_id, "mlflow.runName", f"{base} {run_name(values)}")
        client.set_tag(run_id, "grid.id", self.grid_id)
        for k, v in values.items():
            client.set_tag(run_id, f"grid.{short_name(k)}", str(v))

    def fail(self) -> None:
        """Mark every parent ``FAILED`` (or ``KILLED`` when interrupted); never hides the grid's own error."""
        if self.client is None:  # no run was created (or not on this rank)
            return
        status = "KILLED" if isinstance(sys.exc_info()[1], KeyboardInterrupt) else "FAILED"
        for pid in self.parents.values():
            try:
                self.client.set_terminated(pid, status=status)
            except Exception:  # noqa: BLE001 - the tracking server's failure must not replace the grid's error
                pass

    def finish(self, result: GridResult, config: Sequence[str], sets: Sequence[tuple[str, list[Any]]],
               budget: Optional[float]) -> None:
        """Log the grid's totals, settings, choices, report and figure to every parent, and end them."""
        client = self.client
        if client is None:  # no MLflow logger, or not rank zero
            return
        for pid in self.parents.values():
            for name, value in result.totals.items():
                if isinstance(value, str):  # grid/privacy_level
                    client.set_tag(pid, name, value)
                elif math.isfinite(value):
                    client.log_metric(pid, name, value)
                else:
                    client.set_tag(pid, name, "inf")
            client.log_param(pid, "grid.config", " ".join(config))
            for key, values in sets:
                client.log_param(pid, f"grid.{short_name(key)}", ",".join(map(str, values)))
            if budget is not None:
                client.log_param(pid, "grid.budget_epsilon", budget)
                client.log_param(pid, "grid.budget_delta", result.totals["grid/delta"])
                sigmas = sorted({b.noise_multiplier for b in result.budgets.values()})
                client.log_param(pid, "grid.noise_multiplier", ",".join(repr(s) for s in sigmas))
            if result.select:
                client.log_param(pid, "grid.select", f"{result.select} ({result.mode})")
                client.set_tag(pid, "grid.best_runs", ",".join(p.run_id or "" for p in result.best.values()))
            client.log_text(pid, report(result), "grid.md")
            if result.figure is not None:
                client.log_figure(pid, result.figure, "grid_bars.png")
            if result.utility is not None:
                client.log_text(pid, result.utility[0], "privacy_utility.md")
                client.log_figure(pid, result.utility[1], "privacy_utility.png")
            client.set_terminated(pid)
        if result.select:
            for p in result.best.values():
                if p.run_id:
                    client.set_tag(p.run_id, "grid.best", "true")
