"""``lightning-dp grid``: one config over the Cartesian product of ``--set`` overrides, each point a
``lightning-dp fit`` nested under one MLflow parent run (tags ``grid.id``, ``grid.<key>``; ``grid.md``, the table
of every point), with the grid's privacy cost.

Privacy semantics (docs/privacy.md, "Model selection and grids", "Grids: independent noise per run", "Budgeted
grids"): a search releases every trained model, so its cost is the composition of all runs' costs
(:mod:`lightning_dp.privacy.spend`: each component's ``privacy_spend()``, composed level by level: example,
client, per-client ledgers; a level some run leaves unprotected is infinite; a component holding privacy state
but reporting no spend is refused before the first run). Every run draws its own noise: the grid reseeds every
secret seed, fresh from the OS or derived from ``--seed`` (:func:`lightning_dp.privacy.seeds.derive_seed`).

Hand-written because LightningCLI runs one config and MLflow or Optuna sweeps know nothing of privacy budgets.
"""

from lightning_dp.grid.axes import parse_set
from lightning_dp.grid.points import GridPoint, GridResult
from lightning_dp.grid.privacy import BudgetPlan, grid_privacy, plan_budget, plan_point, reseed, secret_seeded
from lightning_dp.grid.report import bar_plot, best_table, default_mode, mean_table, report, select_best, summary_table
from lightning_dp.grid.run import run_grid

__all__ = ["BudgetPlan", "GridPoint", "GridResult", "bar_plot", "best_table", "default_mode", "grid_privacy",
           "mean_table", "parse_set", "plan_budget", "plan_point", "report", "reseed", "run_grid", "secret_seeded",
           "select_best", "summary_table"]
