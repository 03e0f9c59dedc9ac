"""Table of one-run audits: mean +- std over the runs of each (canary, mechanism, target epsilon) group.

Reads the MLflow runs written by ``lightning-dp fit --config examples/audit/one_run_mnist*.yaml`` (or a grid
of them) and prints a markdown table (docs/results_mia.md):

    python examples/audit/one_run_report.py --experiment one-run-audit-mnist [--tracking-uri URI] [--recompute]

``--recompute`` recomputes every bound from the run's logged canary scores (``audit/one_run.tsv``) and its
mechanism (params ``privacy/noise_multiplier``, ``privacy/sample_rate``, ``privacy/planned_events``) with the
installed version of :func:`lightning_dp.audit.one_run.one_run_audit`, so that runs logged by different versions
are compared with one analysis.
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict

import numpy as np

COLUMNS = [("privacy/epsilon", "accounted eps"), ("audit/epsilon_lower_bound", "Steinke bound"),
           ("audit/epsilon_lower_bound_fdp", "f-DP bound (accounted family)"),
           ("audit/epsilon_lower_bound_gdp", "f-DP bound (GDP)"), ("audit/canary_auc", "canary AUC"),
           ("val/acc", "val acc")]


def _cell(values: list[float]) -> str:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}"


def _recompute(client, run) -> dict[str, float]:
    import tempfile

    from lightning_dp.audit.one_run import AccountedFamily, one_run_audit

    with tempfile.TemporaryDirectory() as tmp:
        path = client.download_artifacts(run.info.run_id, "audit/one_run.tsv", tmp)
        table = np.loadtxt(path, skiprows=1, ndmin=2)
    p = run.data.params
    history = [(float(p["privacy/noise_multiplier"]), float(p["privacy/sample_rate"]),
                int(float(p["privacy/planned_events"])))]
    result = one_run_audit(table[:, 2], table[:, 1].astype(bool), delta=float(p["privacy/target_delta"]),
                           methods=("steinke", "fdp_gaussian", "fdp_accounted"), accounted=AccountedFamily(history))
    return {"audit/epsilon_lower_bound": result.epsilon["steinke"],
            "audit/epsilon_lower_bound_fdp": result.epsilon["fdp_accounted"],
            "audit/epsilon_lower_bound_gdp": result.epsilon["fdp_gaussian"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default="one-run-audit-mnist")
    parser.add_argument("--tracking-uri", default=None, help="default: the project's store (./mlruns)")
    parser.add_argument("--recompute", action="store_true", help="recompute the bounds from the logged scores")
    args = parser.parse_args()
    import mlflow

    from lightning_dp import tracking

    client = mlflow.MlflowClient(args.tracking_uri or tracking.default_tracking_uri())
    experiment = client.get_experiment_by_name(args.experiment)
    if experiment is None:
        raise SystemExit(f"no experiment {args.experiment!r} in {client.tracking_uri}")
    groups: dict[tuple, list] = defaultdict(list)
    for run in client.search_runs([experiment.experiment_id], max_results=10_000):
        p, m = run.data.params, dict(run.data.metrics)
        if "audit/epsilon_lower_bound" not in m:
            continue
        if args.recompute:
            m.update(_recompute(client, run))
        key = (p.get("audit/canary"), p.get("audit/mechanism"), float(p.get("privacy/target_epsilon") or "nan"))
        groups[key].append(m)
    print("| canary | mechanism | target eps | runs | " + " | ".join(name for _, name in COLUMNS) + " |")
    print("|---|---|---|---|" + "---|" * len(COLUMNS))
    for (canary, mechanism, target), runs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        cells = [_cell([r.get(metric) for r in runs]) for metric, _ in COLUMNS]
        print(f"| {canary} | {mechanism} | {target:g} | {len(runs)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
