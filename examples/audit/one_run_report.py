"""Table of one-run audits: mean +- std over the runs of each (canary, mechanism, target epsilon) group.

Reads the MLflow runs written by ``lightning-dp fit --config examples/audit/one_run_mnist*.yaml`` (or a grid
of them) and prints a markdown table (docs/results_mia.md):

    python examples/audit/one_run_report.py --experiment one-run-audit-mnist [--tracking-uri URI] [--recompute]

Each bound stands beside its ceiling (``audit/epsilon_ceiling*``: the largest value the audit could report with the
run's canaries, every guess correct), and the column "claim above ceiling" reads ``audit/claim_above_ceiling``:
"yes" means no outcome of the audit could have refuted the run's claim, so its "not refuted" carries no information.

``--recompute`` recomputes every bound from the run's logged canary scores (``audit/one_run.tsv``) and its
mechanism (params ``privacy/noise_multiplier``, ``privacy/sample_rate``, ``privacy/planned_events``) with the
installed version of :func:`lightning_dp.audit.one_run.one_run_audit`, so that runs logged by different versions
are compared with one analysis. Runs logged before the ceilings existed get them computed from their params
(``audit/num_canaries``, ``audit/confidence``, the mechanism) with :func:`lightning_dp.audit.one_run.epsilon_ceiling`
and the default guess candidates.
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict

import numpy as np

COLUMNS = [("privacy/epsilon", "accounted eps"), ("audit/epsilon_lower_bound", "Steinke bound"),
           ("audit/epsilon_ceiling", "Steinke ceiling"),
           ("audit/epsilon_lower_bound_fdp", "f-DP bound (accounted family)"),
           ("audit/epsilon_ceiling_fdp", "f-DP ceiling (accounted family)"),
           ("audit/epsilon_lower_bound_gdp", "f-DP bound (GDP)"), ("audit/epsilon_ceiling_gdp", "f-DP ceiling (GDP)"),
           ("audit/claim_above_ceiling", "claim above ceiling"), ("audit/canary_auc", "canary AUC"),
           ("val/acc", "val acc")]
METHODS = ("steinke", "fdp_gaussian", "fdp_accounted")
BOUND = {"steinke": "audit/epsilon_lower_bound", "fdp_accounted": "audit/epsilon_lower_bound_fdp",
         "fdp_gaussian": "audit/epsilon_lower_bound_gdp"}
CEILING = {"steinke": "audit/epsilon_ceiling", "fdp_accounted": "audit/epsilon_ceiling_fdp",
           "fdp_gaussian": "audit/epsilon_ceiling_gdp"}


def _cell(values: list[float]) -> str:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}"


def _flag_cell(values: list[float]) -> str:
    """``audit/claim_above_ceiling`` over a group: yes (every run), no (none) or "k of n"."""
    flags = [bool(v) for v in values if v is not None and math.isfinite(v)]
    if not flags:
        return "-"
    return "yes" if all(flags) else "no" if not any(flags) else f"{sum(flags)} of {len(flags)}"


def _history(run) -> list[tuple[float, float, int]]:
    p = run.data.params
    return [(float(p["privacy/noise_multiplier"]), float(p["privacy/sample_rate"]),
             int(float(p["privacy/planned_events"])))]


def _ceiling_metrics(ceiling, accounted: float | None) -> dict[str, float]:
    out = {CEILING[name]: value for name, value in ceiling.epsilon.items()}
    if accounted is not None:
        out["audit/claim_above_ceiling"] = float(all(ceiling.claim_above(accounted).values()))
    return out


def _recompute(client, run) -> dict[str, float]:
    import tempfile

    from lightning_dp.audit.one_run import AccountedFamily, one_run_audit

    with tempfile.TemporaryDirectory() as tmp:
        path = client.download_artifacts(run.info.run_id, "audit/one_run.tsv", tmp)
        table = np.loadtxt(path, skiprows=1, ndmin=2)
    p = run.data.params
    result = one_run_audit(table[:, 2], table[:, 1].astype(bool), delta=float(p["privacy/target_delta"]),
                           confidence=float(p.get("audit/confidence", 0.95)), methods=METHODS,
                           accounted=AccountedFamily(_history(run)))
    out = {BOUND[name]: result.epsilon[name] for name in METHODS}
    assert result.ceiling is not None
    out.update(_ceiling_metrics(result.ceiling, run.data.metrics.get("privacy/epsilon")))
    return out


def _ceiling_from_params(run) -> dict[str, float]:
    """The ceilings of a run logged before they existed: from its number of canaries, confidence and mechanism."""
    from lightning_dp.audit.one_run import AccountedFamily, epsilon_ceiling

    p = run.data.params
    methods = tuple(p.get("audit/methods", ",".join(METHODS)).split(","))
    family = AccountedFamily(_history(run)) if "fdp_accounted" in methods else None
    ceiling = epsilon_ceiling(int(float(p["audit/num_canaries"])), delta=float(p["privacy/target_delta"]),
                              confidence=float(p.get("audit/confidence", 0.95)), methods=methods, accounted=family)
    return _ceiling_metrics(ceiling, run.data.metrics.get("privacy/epsilon"))


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
        elif "audit/epsilon_ceiling" not in m and "audit/num_canaries" in p:
            m.update(_ceiling_from_params(run))
        key = (p.get("audit/canary"), p.get("audit/mechanism"), float(p.get("privacy/target_epsilon") or "nan"))
        groups[key].append(m)
    print("| canary | mechanism | target eps | runs | " + " | ".join(name for _, name in COLUMNS) + " |")
    print("|---|---|---|---|" + "---|" * len(COLUMNS))
    for (canary, mechanism, target), runs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        cells = [(_flag_cell if metric == "audit/claim_above_ceiling" else _cell)([r.get(metric) for r in runs])
                 for metric, _ in COLUMNS]
        print(f"| {canary} | {mechanism} | {target:g} | {len(runs)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
