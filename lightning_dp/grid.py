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

Why hand-written: LightningCLI runs one config, MLflow and Optuna sweeps know nothing of
privacy budgets; a grid is a loop over LightningDPCLI plus the accounting above.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

__all__ = ["GridPoint", "main", "parse_set", "run_grid"]


@dataclass
class GridPoint:
    """One finished run of the grid: its overrides, MLflow ids, final metrics and privacy."""

    values: dict[str, Any]
    run_id: Optional[str] = None
    metrics: dict[str, float] = field(default_factory=dict)
    privacy: dict[str, Any] = field(default_factory=dict)


def parse_set(text: str) -> tuple[str, list[Any]]:
    """``"model.init_args.lr=0.1,0.2"`` -> ``("model.init_args.lr", [0.1, 0.2])`` (values parsed as YAML scalars).

    Raises:
        ValueError: If there is no ``=`` or no value.
    """
    key, sep, values = text.partition("=")
    key = key.strip().lstrip("-")
    if not sep or not key or not values.strip():
        raise ValueError(f"--set {text!r}: expected KEY=V1,V2,... such as model.init_args.lr=0.05,0.1")
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
        if isinstance(cb, DPSGD) and len(cb.accountant):
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


def _final_metrics(trainer: Any, module: Any) -> dict[str, float]:
    import torch

    out = {}
    for name, value in trainer.callback_metrics.items():
        if (name.startswith(("test/", "val/")) and "/chose_" not in name  # per-hypothesis shares stay in MLflow
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
             extra: Sequence[str] = (), grid_id: Optional[str] = None,
             mean_over: Optional[str] = None) -> tuple[list[GridPoint], dict[str, float], str]:
    """Run every point of the grid; return the points, the grid's privacy totals and the grid id."""
    from lightning_dp import tracking
    from lightning_dp.cli import LightningDPCLI

    grid_id = grid_id or secrets.token_hex(4)
    keys = [k for k, _ in sets]
    points: list[GridPoint] = []
    location: Optional[tuple[Any, str]] = None  # (MlflowClient, experiment id) of the first run
    for combo in itertools.product(*(values for _, values in sets)):
        values = dict(zip(keys, combo))
        args = ["fit"] + [a for c in config for a in ("--config", c)]
        args += [f"--{k}={_cli_value(v)}" for k, v in values.items()]
        args += list(extra)
        print(f"[grid {grid_id}] {len(points) + 1}: {_run_name(values)}", flush=True)
        cli = LightningDPCLI(args=args)
        if test:
            cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)
        point = GridPoint(values, metrics=_final_metrics(cli.trainer, cli.model),
                          privacy=_privacy_of(cli.trainer, cli.model))
        for logger in tracking.mlflow_loggers(cli.trainer):
            point.run_id = logger.run_id
            client = logger.experiment
            location = location or (client, logger.experiment_id)
            client.set_tag(logger.run_id, "mlflow.runName", _run_name(values))
            client.set_tag(logger.run_id, "grid.id", grid_id)
            for k, v in values.items():
                client.set_tag(logger.run_id, f"grid.{_short(k)}", str(v))
        points.append(point)
    totals = grid_privacy(points)
    if location is not None:
        client, experiment_id = location
        parent = client.create_run(experiment_id, run_name=f"grid-{grid_id}", tags={"grid.id": grid_id})
        pid = parent.info.run_id
        for p in points:
            if p.run_id:
                client.set_tag(p.run_id, "mlflow.parentRunId", pid)
        for name, value in totals.items():
            if math.isfinite(value):
                client.log_metric(pid, name, value)
            else:
                client.set_tag(pid, name, "inf")
        client.log_param(pid, "grid.config", " ".join(config))
        for key, values in sets:
            client.log_param(pid, f"grid.{_short(key)}", ",".join(map(str, values)))
        client.log_text(pid, _report(points, totals, mean_over), "grid.md")
        client.set_terminated(pid)
    return points, totals, grid_id


def _report(points: Sequence[GridPoint], totals: dict[str, float], mean_over: Optional[str]) -> str:
    text = summary_table(points, totals)
    if mean_over:
        text += f"\nMean ± std over {_short(mean_over)}:\n\n" + mean_table(points, mean_over)
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
    parser.add_argument("--mean-over", metavar="KEY", help="add a table of mean ± std over this axis (e.g. a seed)")
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
    points, totals, _ = run_grid(args.config, sets, test=args.test, extra=extra, mean_over=mean_over)
    table = _report(points, totals, mean_over)
    print(table, flush=True)
    if args.summary:
        with open(args.summary, "w", encoding="utf-8") as handle:
            handle.write(table)
    return 0
