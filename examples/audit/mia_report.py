"""Table of membership-inference audits: mean +- std over the seeds of each (target training) group.

Reads the audit runs written by ``lightning-dp audit mia --config examples/audit/mia_lm*.yaml`` (several
``--seed``) and prints a markdown table per attack (docs/results_mia.md):

    python examples/audit/mia_report.py --experiment mia-lm [--tracking-uri URI ...] [--sigma-png PNG]

Several ``--tracking-uri`` pool the runs of several stores (runs made in separate stores, one per process); runs
on pools of different sizes (``audit/pool_size``) are separate rows. ``--sigma-png`` draws every run's sigma search.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections import defaultdict

import numpy as np

ATTACKS = ("loss", "shadow", "noisy")
COLUMNS = [("audit/auc/{a}", "AUC"), ("audit/tpr_at_fpr_0.01/{a}", "TPR @ 1 % FPR"),
           ("audit/tpr_at_fpr_0.1/{a}", "TPR @ 10 % FPR"), ("audit/epsilon/{a}", "empirical eps (95 %)"),
           ("audit/cost/seconds/{a}", "seconds"), ("audit/cost/forward_passes/{a}", "scoring forward passes")]


def _cell(values: list[float]) -> str:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}"


def _label(key: tuple[str, int]) -> str:
    """A row's name: its target, and its pool size when the runs recorded one (-1: not recorded)."""
    target, pool = key
    return target if pool < 0 else f"{target}, pool {pool}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default="mia-lm")
    parser.add_argument("--tracking-uri", action="append", default=None,
                        help="a store to read (repeat to pool several); default: the project's store (./mlruns)")
    parser.add_argument("--sigma-png", default=None,
                        help="also draw every run's calibration AUC against sigma (audit/auc_vs_sigma.tsv), one "
                             "curve per run, its searched sigma marked, into this PNG")
    args = parser.parse_args(argv)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one bar per downloaded table otherwise
    import mlflow

    from mlflow.exceptions import MlflowException

    from lightning_dp import tracking
    from lightning_dp.commands.compare import mixed_versions

    # keyed by (target, pool size): rows sort by target, then by pool size as a number (500 before 1500)
    groups: dict[tuple[str, int], list] = defaultdict(list)
    params: dict[tuple[str, int], list] = defaultdict(list)
    curves: list[tuple[str, np.ndarray, float]] = []
    for uri in args.tracking_uri or [tracking.default_tracking_uri()]:
        client = mlflow.MlflowClient(uri)
        experiment = client.get_experiment_by_name(args.experiment)
        if experiment is None:
            raise SystemExit(f"no experiment {args.experiment!r} in {client.tracking_uri}")
        for run in client.search_runs([experiment.experiment_id], max_results=10_000):
            if run.info.status != "FINISHED" or "audit/target_run_id" not in run.data.tags:
                continue
            target = client.get_run(run.data.tags["audit/target_run_id"])
            eps = target.data.metrics.get("privacy/epsilon")
            pool = run.data.params.get("audit/pool_size")  # pools of other sizes are other settings: never one row
            group = ("non-private" if eps is None else f"DP-SGD, eps {eps:.2f}", -1 if pool is None else int(pool))
            groups[group].append(run.data.metrics)
            params[group].append(run.data.params)
            if args.sigma_png and "audit/noisy/sigma" in run.data.metrics:
                try:
                    with tempfile.TemporaryDirectory() as tmp:
                        path = client.download_artifacts(run.info.run_id, "audit/auc_vs_sigma.tsv", tmp)
                        table = np.loadtxt(path, skiprows=1, ndmin=2)
                except (OSError, ValueError, MlflowException) as err:
                    print(f"left out of --sigma-png: {run.info.run_id[:8]} ({type(err).__name__}: {err})")
                    continue
                curves.append((f"{_label(group)}, seed {run.data.params.get('audit/seed', '?')}", table,
                               run.data.metrics["audit/noisy/sigma"]))
    print("| target | attack | runs | " + " | ".join(name for _, name in COLUMNS) + " |")
    print("|---|---|---|" + "---|" * len(COLUMNS))
    for group, runs in sorted(groups.items()):
        for attack in ATTACKS:
            present = [r for r in runs if f"audit/auc/{attack}" in r]
            if present:
                cells = [_cell([r.get(c.format(a=attack)) for r in present]) for c, _ in COLUMNS]
                print(f"| {_label(group)} | {attack} | {len(present)} | " + " | ".join(cells) + " |")
    for group, runs in sorted(groups.items()):
        both = [r for r in runs if "audit/auc/noisy_over_shadow" in r]
        if both:
            print(f"\n{_label(group)}: noisy / shadow AUC {_cell([r['audit/auc/noisy_over_shadow'] for r in both])}; "
                  f"shadow / noisy wall time {_cell([r['audit/cost/ratio_seconds'] for r in both])}; noisy sigma "
                  f"{_cell([r['audit/noisy/sigma'] for r in both])} ({len(both)} runs)")

    for note in mixed_versions({_label(key): runs for key, runs in sorted(params.items())}):
        print(f"\nNote: {note}.")
    if args.sigma_png:
        _sigma_figure(sorted(curves, key=lambda c: c[0]), args.sigma_png)
        print(f"\n{len(curves)} curves of the sigma search in {args.sigma_png}")


def _sigma_figure(curves: list[tuple[str, np.ndarray, float]], path: str) -> None:
    """Calibration AUC against sigma, one line per run (the search's points in sigma order), a ring at the sigma
    the search chose."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not curves:
        raise SystemExit("no run with a noisy-neighbour search (audit/noisy/sigma) to draw")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, table, chosen in curves:
        order = np.argsort(table[:, 0])
        line, = ax.plot(table[order, 0], table[order, 1], marker=".", label=label)
        best = int(np.argmin(np.abs(np.log(table[:, 0]) - math.log(chosen))))
        ax.plot(table[best, 0], table[best, 1], "o", mfc="none", ms=10, color=line.get_color())
    ax.set_xscale("log")
    ax.set_xlabel("sigma (noise at the embedding output)")
    ax.set_ylabel("AUC on the calibration split")
    ax.set_title("noisy neighbours: the sigma search of each run (ring: chosen)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
