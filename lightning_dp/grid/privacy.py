"""The privacy of a grid: what each run spent, the grid's composed cost, budgeted grids and fresh noise seeds.

See :mod:`lightning_dp.grid` for why a grid's cost is the composition of all its runs' costs.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from lightning_dp.grid.axes import run_args, run_name
from lightning_dp.grid.points import GridPoint

__all__ = ["BudgetPlan", "check_against_plan", "check_points", "dp_callback", "grid_privacy", "plan_budget", "plan_point", "privacy_of",
           "reseed", "secret_seeded"]

def privacy_of(trainer: Any, module: Any) -> dict[str, Any]:
    """What a finished run spent: every component's :class:`~lightning_dp.privacy.spend.Spend` (``"spends"``), and
    for the report the run's own epsilon and per-client maxima; ``"accountant"`` is the DP-SGD callback's (the
    budgeted grid checks it against its plan)."""
    from lightning_dp.callbacks import DPSGD
    from lightning_dp.gate import nonprivate_allowed
    from lightning_dp.privacy.spend import spends_of

    components = [*trainer.callbacks, module]
    spends = spends_of(components)
    # whether every component let nonprivate/ statistics into the record (the grid's nonprivate/ totals follow)
    out: dict[str, Any] = {"spends": spends, "nonprivate": nonprivate_allowed(components)}
    for cb in trainer.callbacks:
        if isinstance(cb, DPSGD):  # a run that took no step is private too (epsilon 0), not unprotected
            out["accountant"] = copy.deepcopy(cb.accountant)
    for s in spends:
        if s.level in ("example", "user", "client"):
            out["epsilon"] = s.epsilon
            if s.delta is not None:
                out["delta"] = s.delta
        elif s.unsanitized or s.secret_participation:  # no per-client column where participation is secret
            continue
        else:
            prefix = "client_epsilon" if s.level == "client_ledger" else "record_epsilon"
            if len(s.ledger):
                out[f"{prefix}_median"], out[f"{prefix}_max"] = s.ledger.median(), s.ledger.max()
    return out


def check_points(config: Sequence[str], combos: Sequence[dict[str, Any]], extra: Sequence[str] = ()) -> None:
    """Refuse, before any run trains, a grid point with a component that holds privacy state (a secret seed,
    a ledger, an accountant) but reports no spend (``privacy_spend``): the grid could not compose it, and
    counting it as private would under-state the grid's cost; and a grid whose runs' spends cannot compose
    (example- and client-level epsilon, accountants or ledgers of different kinds).

    Raises:
        ValueError: Naming the point and the components, or the kinds that do not compose.
    """
    from lightning_dp.config.lightning_cli import LightningDPCLI
    from lightning_dp.privacy.spend import compose, spends_of, unreported_components

    planned = []  # every point's spend before training: the kinds of its accountants and ledgers
    shapes: dict[str, list[Any]] = {}  # DPSGD's max_batch_size per point: another shape is another mechanism
    for values in combos:
        cli = LightningDPCLI(args=run_args(config, values, extra), run=False)
        components = [*cli.trainer.callbacks, cli.model]  # type: ignore[attr-defined]  # set by Lightning, undeclared
        planned.append(spends_of(components))
        shapes[run_name(values)] = [c.settings.max_batch_size for c in components
                                    if hasattr(getattr(c, "settings", None), "max_batch_size")]
        missing = unreported_components(components)
        if missing:
            raise ValueError(
                f"grid point {run_name(values)!r}: {'; '.join(missing)} holds privacy state but reports no spend "
                "(no privacy_spend() method), so the grid cannot compose its cost and will not count it as private. "
                "Implement privacy_spend() returning lightning_dp.privacy.spend.Spend objects (see "
                "lightning_dp.privacy.spend), or leave the component out of the grid.")
    if len({tuple(v) for v in shapes.values()}) > 1:
        raise ValueError(f"the grid's points train with different batch shapes (max_batch_size per point: {shapes}): "
                         "truncated batches are another mechanism than plain Poisson batches (and another bound "
                         "another one), and their spends do not compose. Set the same max_batch_size in every point.")
    compose(planned)  # runs whose spends cannot compose (mixed units, accountants, ledgers) are refused now


def grid_privacy(points: Sequence[GridPoint]) -> dict[str, Any]:
    """The composed privacy cost of all runs of the grid (:func:`lightning_dp.privacy.spend.compose`); its
    ``nonprivate/`` totals only if every run let nonprivate statistics into its record."""
    from lightning_dp.privacy.spend import compose

    totals = compose([p.privacy.get("spends", []) for p in points])
    if not all(p.privacy.get("nonprivate", True) for p in points):
        totals = {k: v for k, v in totals.items() if not k.startswith("nonprivate/")}
    return totals


def dp_callback(trainer: Any, values: dict[str, Any]) -> Any:
    from lightning_dp.callbacks import DPSGD

    found = [cb for cb in trainer.callbacks if isinstance(cb, DPSGD)]
    if len(found) != 1:
        raise ValueError(
            f"grid point {run_name(values)!r} has {len(found)} DP-SGD callbacks (DPSGD, OnlineSensitivity, "
            "QuantileClipping); a budgeted grid (--budget) needs exactly one in every run, so that its noise "
            "multiplier can be chosen for the grid. Add one to trainer.callbacks of the config.")
    return found[0]


def plan_point(config: Sequence[str], values: dict[str, Any], extra: Sequence[str] = ()) -> dict[str, Any]:
    """Instantiate a grid point (no training) and return its DP callback's planned mechanism and accountant.

    Returns:
        ``{"plan": PlannedMechanism, "accountant": name, "accountant_kwargs": dict, "delta": target_delta}``.
    """
    from lightning_dp.config.lightning_cli import LightningDPCLI

    cli = LightningDPCLI(args=run_args(config, values, extra), run=False)
    callback = dp_callback(cli.trainer, values)
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


def check_against_plan(point: GridPoint, budget: BudgetPlan, index: int) -> None:
    """A run may stop early, never spend more than planned (else the grid's bound would not hold)."""
    plan = budget.plans[index]
    history = point.privacy["accountant"].history if "accountant" in point.privacy else []
    expected_sigma = budget.noise_multiplier * plan.multiplier_scale
    for sigma, q, steps in history:
        if sigma != expected_sigma or q != plan.sample_rate:
            raise RuntimeError(f"grid run {run_name(point.values)!r} was accounted with (sigma={sigma}, q={q}) but "
                               f"planned with (sigma={expected_sigma}, q={plan.sample_rate}); please report this.")
    if sum(steps for _, _, steps in history) > plan.events:
        raise RuntimeError(f"grid run {run_name(point.values)!r} took more steps than its plan of {plan.events}.")


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
