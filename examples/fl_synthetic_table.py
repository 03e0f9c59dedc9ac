"""Thesis Fig. 2.1 without noise over seeds: one row per run of ``examples/fl_synthetic.yaml`` at nu = 0 (FedAvg, k = 1,
and IFCA, k = 2), then mean ± sample std per model and stopping rule, the table of docs/results_fl_synthetic.md.

    lightning-dp fit --config examples/fl_synthetic.yaml --model.init_args.noise_multiplier=0 \\
        --model.init_args.num_hypotheses=K --model.init_args.seed=S --data.init_args.seed=S --seed_everything=S \\
        [--trainer.check_val_every_n_epoch=1]      # K = 1, 2; S = 0..4; the flag: the paper's stopping rule
    python examples/fl_synthetic_table.py [--tracking-uri URI ...] --tsv docs/figures/fl_synthetic_fig2_1.tsv
    python examples/fl_synthetic_table.py --from-tsv docs/figures/fl_synthetic_fig2_1.tsv   # no runs needed

Per finished run without noise (``noise_multiplier`` 0) with ``data/thetas``: the stopping rule (the validation
period of its ``config.yaml``: every round is the paper's, every 10 the example's), the seed, the rounds (the epochs
run), the best ``val/loss`` (RMSE), and the restored hypotheses (``model/best.ckpt``, else ``model/final.ckpt``, as
``fl_synthetic_report.py`` reads them). For k >= 2, the distance of the farther hypothesis to its theta* (matched one
to one, ``fl_synthetic_report.matched_distances``); for k = 1, where the hypothesis lies along the segment from
theta1* to theta2* (0 at theta1*, 1 at theta2*), its distance off that line and to the nearer theta*. Without noise
nothing here is released under privacy; with it, the same values are the released hypotheses.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from figure_table import finished_runs, mean_std, runs_table_main  # noqa: E402  (examples/ is on the path from here)
from fl_synthetic_report import matched_distances  # noqa: E402

COLUMNS = ["num_hypotheses", "rule", "seed", "rounds", "best_val_loss", "farther_distance", "segment_position",
           "segment_offset", "nearer_distance", "hypotheses"]
RULES = {1: "paper's", 10: "example's"}


def segment_geometry(hypothesis: np.ndarray, thetas: np.ndarray) -> tuple[float, float, float]:
    """Position of ``hypothesis`` along theta1* -> theta2* (0 at theta1*, 1 at theta2*), its distance off that line,
    and its distance to the nearer theta*."""
    start, direction = thetas[0], thetas[1] - thetas[0]
    position = float(np.dot(hypothesis - start, direction) / np.dot(direction, direction))
    offset = float(np.linalg.norm(hypothesis - (start + position * direction)))
    nearer = float(np.linalg.norm(thetas - hypothesis, axis=1).min())
    return position, offset, nearer


def read_runs(uris: list[str], experiment: str) -> list[list]:
    import torch
    import yaml

    rows = []
    for client, run in finished_runs(uris, experiment, max_results=10_000):
        params = run.data.params
        if "data/thetas" not in params or float(params.get("noise_multiplier", "nan")) != 0.0:
            continue
        run_id = run.info.run_id
        logged = {a.path for a in client.list_artifacts(run_id, "model")}
        which = "best" if "model/best.ckpt" in logged else "final"
        with tempfile.TemporaryDirectory() as tmp:
            state = torch.load(client.download_artifacts(run_id, f"model/{which}.ckpt", tmp), map_location="cpu",
                               weights_only=False)["state_dict"]
            config = yaml.safe_load(Path(client.download_artifacts(run_id, "config.yaml", tmp)).read_text()) or {}
        k = int(params["num_hypotheses"])
        thetas = np.asarray(json.loads(params["data/thetas"]), dtype=float)
        hypotheses = state["hypotheses"].double().numpy().reshape(k, -1)
        every = int((config.get("trainer") or {}).get("check_val_every_n_epoch", 1))
        losses = [m.value for m in client.get_metric_history(run_id, "val/loss")]
        farther = float(matched_distances(hypotheses, thetas).max()) if k >= len(thetas) else float("nan")
        geometry = segment_geometry(hypotheses[0], thetas) if k == 1 else (float("nan"),) * 3
        rows.append([k, RULES.get(every, f"every {every}"), int(params["seed"]), int(run.data.metrics["epoch"]) + 1,
                     float(np.nanmin(losses)), farther, *geometry, json.dumps(np.round(hypotheses, 4).tolist())])
    return sorted(rows, key=lambda r: (r[0], r[1] != "paper's", r[2]))


def _sig(value: float, digits: int) -> str:
    """``value`` to ``digits`` significant digits, trailing zeros kept, no exponent (130, 6.3, 0.050)."""
    if value == 0 or not np.isfinite(value):
        return f"{value:g}"
    decimals = digits - 1 - int(np.floor(np.log10(abs(value))))
    return f"{round(value, decimals):.{max(decimals, 0)}f}"


def _cell(values: list[float], digits: int = 3) -> str:
    """Mean ± sample std, the mean to ``digits`` significant digits and the std to 2."""
    return f"{_sig(float(np.mean(values)), digits)} ± {_sig(float(np.std(values, ddof=1)), 2)}"


def summarize(table: list[dict]) -> str:
    """The page's table: one row per model and stopping rule, then each run's hypotheses."""
    lines = ["| model | rule | rounds | best val. RMSE | hypotheses against theta* |", "|---" * 5 + "|"]
    keys = sorted({(int(r["num_hypotheses"]), r["rule"]) for r in table}, key=lambda k: (k[0], k[1] != "paper's"))
    for k, rule in keys:
        runs = [r for r in table if (int(r["num_hypotheses"]), r["rule"]) == (k, rule)]
        column = {c: [float(r[c]) for r in runs] for c in COLUMNS[3:9]}
        rounds = column["rounds"]
        if k == 1:
            position, near = column["segment_position"], column["nearer_distance"]
            where = (f"at {mean_std(position, 2)} of the segment ({min(position):.2f}-{max(position):.2f}), "
                     f"{mean_std(column['segment_offset'], 2)} off it; {min(near):.2f}-{max(near):.2f} from the nearer "
                     "theta*")
        else:
            farther = column["farther_distance"]
            where = (f"farther hypothesis {_cell(farther, 2)} from its theta* ({_sig(min(farther), 2)}-"
                     f"{_sig(max(farther), 2)})")
        model = "FedAvg" if k == 1 else "IFCA"
        lines.append(f"| {model} (k = {k}) | {rule} | {_cell(rounds)} ({min(rounds):.0f}-{max(rounds):.0f}) | "
                     f"{_cell(column['best_val_loss'])} | {where} |")
    lines.append("")
    lines += [f"k = {r['num_hypotheses']}, {r['rule']}, seed {r['seed']}: {r['rounds']} rounds, hypotheses "
              f"{r['hypotheses']}" for r in table]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    runs_table_main(argv, description=__doc__, experiment="fl-synthetic", columns=COLUMNS, read_runs=read_runs,
                    as_text=lambda r: r[:4] + [f"{v:.6g}" for v in r[4:9]] + [r[9]], summarize=summarize)


if __name__ == "__main__":
    main()
