"""``lightning-dp grid``: the command line (see :mod:`lightning_dp.grid` for what a grid does)."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from lightning_dp.commands.errors import ShortArgumentParser, is_user_error, short_error, show_tracebacks
from lightning_dp.grid.axes import grid_points, parse_set, run_args, run_name
from lightning_dp.grid.report import report
from lightning_dp.grid.run import run_grid

__all__ = ["DESCRIPTION", "main"]

#: One line: what ``lightning-dp grid`` does (its ``--help`` and the command list of ``lightning-dp --help``).
DESCRIPTION = "run one config over a grid of overrides, side by side in MLflow, with the grid's composed privacy cost"

def main(argv: Sequence[str]) -> int:
    """Entry point of ``lightning-dp grid`` (see the module docstring)."""
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = ShortArgumentParser(prog="lightning-dp grid", description=DESCRIPTION)
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
    parser.add_argument("--print_config", action="store_true",
                        help="print the resolved config of every grid point (no training) and exit")
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
    try:
        if args.print_config:
            return print_configs(args.config, sets, extra)
        result = run_grid(args.config, sets, test=args.test, extra=extra, mean_over=mean_over, budget=args.budget,
                          budget_delta=args.budget_delta, select=args.select, mode=args.mode, plot=args.plot,
                          plot_x=plot_x, plot_hue=plot_hue, seed=args.seed)
    except Exception as err:  # a refused value of a point, a missing dataset, a grid that cannot be planned
        if show_tracebacks() or not (is_user_error(err) or isinstance(err, ValueError)):
            raise
        sys.stderr.write(short_error("lightning-dp grid", str(err).strip() or type(err).__name__))
        return 2
    table = report(result)
    print(table, flush=True)
    if args.summary:
        with open(args.summary, "w", encoding="utf-8") as handle:
            handle.write(table)
    if args.plot_file and result.figure is not None:
        result.figure.savefig(args.plot_file, dpi=120)
    return 0


def print_configs(config: Sequence[str], sets: Sequence[tuple[str, list[Any]]], extra: Sequence[str] = ()) -> int:
    """Print every grid point's resolved config (``lightning-dp fit --print_config``), headed by its values.

    The secret noise seeds the grid gives each run at its start (:func:`~lightning_dp.grid.privacy.reseed`)
    are not in these configs.

    Returns:
        0, or 2 when a point's arguments were refused (its error is printed in its place).
    """
    from lightning_dp.commands.fit import LightningDPCLI

    combos = grid_points(sets)
    failed = False
    for i, values in enumerate(combos):
        print(f"# grid point {i + 1}/{len(combos)}: {run_name(values)}", flush=True)
        try:
            LightningDPCLI(args=["fit", *run_args(config, values, extra), "--print_config"], run=True)
        except SystemExit as done:  # LightningCLI exits after printing (0), or after a refused argument (2)
            failed = failed or done.code not in (0, None)
    return 2 if failed else 0
