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

Every component reports what its run spent through one method, ``privacy_spend()``
(:mod:`lightning_dp.privacy.spend`), and the grid composes the reports level by level; before
the first run it instantiates every point and refuses one whose component holds privacy state
(a secret seed, a ledger, an accountant) but reports no spend, rather than count it as private.

- Example level (:class:`~lightning_dp.callbacks.DPSGD` and its subclasses): every run's
  mechanism history is replayed into one accountant of the same kind (PLD or RDP over
  dp-accounting): ``grid/epsilon`` at the largest ``target_delta`` of the runs, with
  ``grid/privacy_level = example``.
- Client level (DP-FedAvg, :class:`~lightning_dp.federated.parts.CentralGaussian`): the
  same for the server's accountant, ``grid/privacy_level = client``; under replacement with a
  bounded update set each valid bound (replace-one, disjoint-pair) is composed over the runs
  and the smaller composition is reported.
- Per-client ledgers (the d-privacy round, local DP sanitizers): ledgers add up per client as
  each ledger composes; ``grid/client_epsilon_median`` and ``grid/client_epsilon_max`` are
  over the per-client totals. Record-level ledgers of local DP-SGD: every client's histories
  composed, ``grid/record_epsilon_median``/``_max``. Where the selection is secret (central DP
  beside the ledgers) these totals show who took part and are ``nonprivate/grid_...``.
- A level that some run leaves unprotected (a sanitizer with ``noise_multiplier=0``, a run
  without DPSGD, ``NoiselessDPSGD``) is infinite for the grid, and reported so; example- and
  client-level runs in one grid are refused (different neighbours do not compose).

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

from lightning_dp.grid.axes import parse_set
from lightning_dp.grid.points import GridPoint, GridResult
from lightning_dp.grid.privacy import BudgetPlan, grid_privacy, plan_budget, plan_point, reseed, secret_seeded
from lightning_dp.grid.report import bar_plot, best_table, default_mode, mean_table, report, select_best, summary_table
from lightning_dp.grid.run import run_grid

__all__ = ["BudgetPlan", "GridPoint", "GridResult", "bar_plot", "best_table", "default_mode", "grid_privacy",
           "mean_table", "parse_set", "plan_budget", "plan_point", "report", "reseed", "run_grid", "secret_seeded",
           "select_best", "summary_table"]
