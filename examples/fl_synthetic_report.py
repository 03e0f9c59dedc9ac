"""Thesis Figs. 2.1 and 2.2 from runs of ``examples/fl_synthetic.yaml``: how close each run's hypotheses end to the
true ones, its length and its clients' largest privacy spend, one row per run and mean ± sample std over the runs of
each stopping rule.

    lightning-dp fit --config examples/fl_synthetic.yaml --trainer.check_val_every_n_epoch=1 \\
        --model.init_args.seed=S --data.init_args.seed=S --seed_everything=S        # S = 0..9: the paper's rule
    lightning-dp fit --config examples/fl_synthetic.yaml --model.init_args.noise_seed=K  # K = 1..15: the example's
    python examples/fl_synthetic_report.py --experiment fl-synthetic [--tracking-uri URI ...] [--within 1.0]

Per finished run: rounds (the epochs run), ``privacy/client_epsilon_max`` (Fig. 2.2's largest composed leakage),
the best validation loss, and the distances of the released hypotheses to the true ``data/thetas``: the best
check's (``model/best.ckpt``, which RestoreBestWeights logs and restores), else the last round's
(``model/final.ckpt``), hypotheses matched to thetas one to one so that the farther of the matched pairs is
smallest (a run whose two hypotheses sit on one theta is far from the other). Runs are summarized per stopping rule
(validation period and EarlyStopping patience, from the run's ``config.yaml``), so the two commands above can share
an experiment. Everything read is already released or public configuration: this costs no privacy.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import tempfile
from pathlib import Path

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
    """Mean ± sample std to 3 significant digits (4 for means of 1,000 and more: rounds up to max_epochs)."""
    digits = 4 if abs(float(np.mean(values))) >= 1000 else 3
    if len(values) == 1:
        return f"{values[0]:.{digits}g}"
    return f"{np.mean(values):.{digits}g} ± {np.std(values, ddof=1):.2g}"


def _stopping_rule(config: dict) -> str:
    """``validate every N rounds, patience P`` from a run's resolved config (P: its EarlyStopping's; none: no
    early stopping)."""
    trainer = config.get("trainer") or {}
    every = trainer.get("check_val_every_n_epoch", 1)
    stops = [cb.get("init_args", {}).get("patience", 3) for cb in trainer.get("callbacks") or []
             if isinstance(cb, dict) and str(cb.get("class_path", "")).endswith("EarlyStopping")]
    return f"validate every {every} rounds, " + (f"patience {stops[0]}" if stops else "no early stopping")


def _run_row(client, run, torch, yaml) -> dict:
    metrics, params = run.data.metrics, run.data.params
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "model")}
    which = "best" if "model/best.ckpt" in logged else "final"
    with tempfile.TemporaryDirectory() as tmp:
        state = torch.load(client.download_artifacts(run.info.run_id, f"model/{which}.ckpt", tmp),
                           map_location="cpu", weights_only=False)["state_dict"]
        config = yaml.safe_load(Path(client.download_artifacts(run.info.run_id, "config.yaml", tmp)).read_text()) or {}
    thetas = np.asarray(json.loads(params["data/thetas"]), dtype=float)
    hypotheses = state["hypotheses"].double().numpy().reshape(int(params["num_hypotheses"]), -1)
    losses = [m.value for m in client.get_metric_history(run.info.run_id, "val/loss")]
    return {"run": run.info.run_id[:8], "seed": params.get("seed", "?"), "which": which,
            "rule": _stopping_rule(config), "params": params, "rounds": int(metrics["epoch"]) + 1,
            "leakage": metrics["privacy/client_epsilon_max"],
            "best_val": float(np.nanmin(losses)) if losses and not np.isnan(losses).all() else math.nan,
            "distances": matched_distances(hypotheses, thetas)}


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
    import yaml
    from mlflow.exceptions import MlflowException

    from lightning_dp import tracking
    from lightning_dp.commands.compare import mixed_versions

    rows, skipped = [], []
    for uri in args.tracking_uri or [tracking.default_tracking_uri()]:
        client = mlflow.MlflowClient(uri)
        experiment = client.get_experiment_by_name(args.experiment)
        if experiment is None:
            raise SystemExit(f"no experiment {args.experiment!r} in {client.tracking_uri}")
        for run in client.search_runs([experiment.experiment_id], "attributes.status = 'FINISHED'",
                                      max_results=10_000):
            if "data/thetas" not in run.data.params or "privacy/client_epsilon_max" not in run.data.metrics:
                continue  # another kind of run (a compare run, a non-synthetic fit)
            try:
                rows.append(_run_row(client, run, torch, yaml))
            except (KeyError, OSError, ValueError, MlflowException) as err:  # no checkpoint, config or params
                skipped.append(f"{run.info.run_id[:8]}: {type(err).__name__}: {err}")
    for note in skipped:
        print(f"left out: {note}")
    if not rows:
        raise SystemExit(f"no finished run of {args.experiment!r} with data/thetas and privacy/client_epsilon_max")
    rows.sort(key=lambda r: (r["rule"], r["rounds"]))
    print("| stopping rule | run | seed | rounds | max client leakage | best val/loss | hypotheses of | "
          "distance to each theta* |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rule']} | {r['run']} | {r['seed']} | {r['rounds']} | {r['leakage']:.3g} | {r['best_val']:.3g} | "
              f"{'best check' if r['which'] == 'best' else 'last round'} | "
              + ", ".join(f"{d:.2f}" for d in r["distances"]) + " |")
    by_rule: dict[str, list[dict]] = {}
    for r in rows:  # rows are sorted by rule: so is this
        by_rule.setdefault(r["rule"], []).append(r)
    for rule, group in by_rule.items():
        farther = [float(r["distances"].max()) for r in group]
        leak, rounds = [r["leakage"] for r in group], [r["rounds"] for r in group]
        print(f"\n{rule}: {len(group)} runs: max client leakage {_mean_std(leak)} (range {min(leak):.3g}-"
              f"{max(leak):.3g}); rounds {_mean_std(rounds)} (range {min(rounds)}-{max(rounds)}); best val/loss "
              f"{_mean_std([r['best_val'] for r in group])}; the farther hypothesis {min(farther):.2f}-"
              f"{max(farther):.2f} from its theta* (median {np.median(farther):.2f}); every theta* within "
              f"{args.within:g} in {sum(f <= args.within for f in farther)} of {len(group)}")
    for note in mixed_versions({rule: [r["params"] for r in group] for rule, group in by_rule.items()}):
        print(f"Note: {note}.")


if __name__ == "__main__":
    main()
