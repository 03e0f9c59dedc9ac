"""Thesis Figs. 2.1 and 2.2 from runs of ``examples/fl_synthetic.yaml``: how close each run's hypotheses end to the
true ones, its length and its clients' largest privacy spend, one row per run and mean ± sample std over runs.

    lightning-dp fit --config examples/fl_synthetic.yaml --trainer.check_val_every_n_epoch=1 \\
        --model.init_args.seed=S --data.init_args.seed=S --seed_everything=S        # S = 0..9
    python examples/fl_synthetic_report.py --experiment fl-synthetic [--tracking-uri URI ...] [--within 1.0]

Per finished run: rounds (the epochs run), ``privacy/client_epsilon_max`` (Fig. 2.2's largest composed leakage),
the best validation loss, and the distances of the released hypotheses to the true ``data/thetas``: the best
check's (``model/best.ckpt``, which RestoreBestWeights logs and restores), else the last round's (``model/final.ckpt``), hypotheses matched to thetas one to one so that the
farther of the matched pairs is smallest (a run whose two hypotheses sit on one theta is far from the other).
Everything read is already released or public configuration: this costs no privacy.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import tempfile

import numpy as np


def matched_distances(hypotheses: np.ndarray, thetas: np.ndarray) -> np.ndarray:
    """Distances ``|h_pi(c) - theta_c|`` for the one-to-one matching ``pi`` whose largest distance is smallest (ties:
    smallest sum); ``hypotheses`` (k, d), ``thetas`` (k', d) with k >= k'. Exhaustive over the matchings: k is a
    handful here (the papers use 2 to 7)."""
    if hypotheses.ndim != 2 or thetas.ndim != 2 or hypotheses.shape[1] != thetas.shape[1]:
        raise ValueError(f"hypotheses {hypotheses.shape} and thetas {thetas.shape} must be (k, d) with one d")
    if hypotheses.shape[0] < thetas.shape[0]:
        raise ValueError(f"{hypotheses.shape[0]} hypotheses cannot match {thetas.shape[0]} thetas one to one")
    cost = np.linalg.norm(hypotheses[:, None, :] - thetas[None, :, :], axis=2)  # (k, k')
    best = min((cost[list(p), range(thetas.shape[0])] for p in itertools.permutations(range(hypotheses.shape[0]),
                                                                                       thetas.shape[0])),
               key=lambda d: (d.max(), d.sum()))
    return best


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3g}"
    return f"{np.mean(values):.3g} ± {np.std(values, ddof=1):.2g}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default="fl-synthetic")
    parser.add_argument("--tracking-uri", action="append", default=None,
                        help="a store to read (repeat to pool several); default: the project's store (./mlruns)")
    parser.add_argument("--within", type=float, default=1.0,
                        help="count the runs whose every true theta has a hypothesis this close (default 1.0)")
    args = parser.parse_args(argv)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow
    import torch

    from lightning_dp import tracking

    rows = []
    for uri in args.tracking_uri or [tracking.default_tracking_uri()]:
        client = mlflow.MlflowClient(uri)
        experiment = client.get_experiment_by_name(args.experiment)
        if experiment is None:
            raise SystemExit(f"no experiment {args.experiment!r} in {client.tracking_uri}")
        for run in client.search_runs([experiment.experiment_id], "attributes.status = 'FINISHED'",
                                      max_results=10_000):
            metrics, params = run.data.metrics, run.data.params
            if "data/thetas" not in params or "privacy/client_epsilon_max" not in metrics:
                continue  # another kind of run (a compare run, a non-synthetic fit)
            logged = {a.path for a in client.list_artifacts(run.info.run_id, "model")}
            which = "best" if "model/best.ckpt" in logged else "final"
            with tempfile.TemporaryDirectory() as tmp:
                path = client.download_artifacts(run.info.run_id, f"model/{which}.ckpt", tmp)
                state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
            thetas = np.asarray(json.loads(params["data/thetas"]), dtype=float)
            hypotheses = state["hypotheses"].double().numpy().reshape(int(params["num_hypotheses"]), -1)
            losses = [m.value for m in client.get_metric_history(run.info.run_id, "val/loss")]
            rows.append({"run": run.info.run_name or run.info.run_id[:8], "seed": params.get("seed", "?"), "which": which,
                         "rounds": int(metrics["epoch"]) + 1, "leakage": metrics["privacy/client_epsilon_max"],
                         "best_val": min(losses) if losses else math.nan,
                         "distances": matched_distances(hypotheses, thetas)})
    if not rows:
        raise SystemExit(f"no finished run of {args.experiment!r} with data/thetas and privacy/client_epsilon_max")
    rows.sort(key=lambda r: r["rounds"])
    print("| run | seed | rounds | max client leakage | best val/loss | hypotheses of | distance to each theta* |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['seed']} | {r['rounds']} | {r['leakage']:.3g} | {r['best_val']:.3g} | "
              f"{'best check' if r['which'] == 'best' else 'last round'} | " + ", ".join(f"{d:.2f}" for d in r["distances"]) + " |")
    farther = [float(r["distances"].max()) for r in rows]
    close = sum(f <= args.within for f in farther)
    print(f"\n{len(rows)} runs: max client leakage {_mean_std([r['leakage'] for r in rows])} "
          f"(range {min(r['leakage'] for r in rows):.3g}-{max(r['leakage'] for r in rows):.3g}); rounds "
          f"{_mean_std([r['rounds'] for r in rows])} (range {rows[0]['rounds']}-{rows[-1]['rounds']}); best val/loss "
          f"{_mean_std([r['best_val'] for r in rows])}; the farther hypothesis {min(farther):.2f}-{max(farther):.2f} "
          f"from its theta* (median {np.median(farther):.2f}); every theta* within {args.within:g} in {close} of "
          f"{len(rows)}")


if __name__ == "__main__":
    main()
