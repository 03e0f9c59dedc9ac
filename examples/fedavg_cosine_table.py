"""Thesis Fig. 5.4 over seeds: one row per run of ``examples/fedavg_cosine_mnist.yaml``, then mean ± sample std per
partition and Welch's t-tests of the page's two claims.

    lightning-dp fit --config examples/fedavg_cosine_mnist.yaml \\
        --model.init_args.model.class_path=lightning_dp.models.MNISTConvNet --data.init_args.partition=P \\
        --model.init_args.seed=S --data.init_args.seed=S --seed_everything=S      # P = pathological, iid; S = 0..9
    python examples/fedavg_cosine_table.py [--tracking-uri URI ...] --tsv docs/figures/fedavg_cosine_fig5_4.tsv
    python examples/fedavg_cosine_table.py --from-tsv docs/figures/fedavg_cosine_fig5_4.tsv   # no runs needed

Per finished run with the diagnostics (``nonprivate/update_cosine``, ``nonprivate/gradient_cosine``, logged at step
r - 1 for round r): the mean of each over rounds 1-5 (early) and 41-50 (late), and the last ``val/acc`` (after 50
rounds with the config's validation every 10). The claims tested (docs/results_dp_fedavg.md, section 3): client
updates are more aligned than per-sample gradients early (update vs gradient cosine, rounds 1-5), and the updates'
agreement falls later in training (update cosine, rounds 1-5 vs 41-50); Welch's t-test
(``scipy.stats.ttest_ind(equal_var=False)``) over the runs, n seeds against n. Several ``--tracking-uri`` pool stores
(one per process). Everything read is unsanitized diagnostics of a run without privacy.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from figure_table import finished_runs, mean_std, runs_table_main  # noqa: E402  (examples/ is on the path from here)

EARLY, LATE = (1, 5), (41, 50)
COLUMNS = ["partition", "model", "seed", "update_cosine_early", "update_cosine_late", "gradient_cosine_early",
           "gradient_cosine_late", "val_acc", "rounds"]
NAMES = {"iid": "IID", "pathological": "NIID(2)"}


def rounds_mean(history, rounds: tuple[int, int]) -> float:
    """Mean of a metric history over rounds ``rounds`` (inclusive, 1-based; round r is logged at step r - 1)."""
    values = [m.value for m in history if rounds[0] - 1 <= m.step <= rounds[1] - 1]
    if len(values) != rounds[1] - rounds[0] + 1:
        raise ValueError(f"rounds {rounds[0]}-{rounds[1]}: {len(values)} values logged; did the run finish?")
    return float(np.mean(values))


def read_runs(uris: list[str], experiment: str) -> list[list]:
    rows = []
    for client, run in finished_runs(uris, experiment):
        if "nonprivate/update_cosine" not in run.data.metrics:
            continue
        run_id = run.info.run_id
        model = run.data.params["model_class"].rsplit(".", 1)[-1]
        updates = client.get_metric_history(run_id, "nonprivate/update_cosine")
        gradients = client.get_metric_history(run_id, "nonprivate/gradient_cosine")
        val_acc = max(client.get_metric_history(run_id, "val/acc"), key=lambda m: m.step)
        rows.append([run.data.params["data/partition"], model, int(run.data.params["seed"]),
                     rounds_mean(updates, EARLY), rounds_mean(updates, LATE), rounds_mean(gradients, EARLY),
                     rounds_mean(gradients, LATE), val_acc.value, len(updates)])
    return sorted(rows, key=lambda r: (r[0], r[1], r[2]))


def summarize(table: list[dict]) -> str:
    """Mean ± sample std per partition and model, and the Welch p-values of the two claims."""
    from scipy import stats

    keys = sorted({(r["partition"], r["model"]) for r in table})
    lines = ["| partition | update cosine, rounds 1-5 | update cosine, rounds 41-50 | gradient cosine, rounds 1-5 | "
             "gradient cosine, rounds 41-50 | val/acc after 50 rounds |", "|---" * 6 + "|"]
    for key in keys:
        runs = [r for r in table if (r["partition"], r["model"]) == key]
        lines.append(f"| {NAMES.get(key[0], key[0])} | " + " | ".join(
            mean_std([float(r[c]) for r in runs]) for c in COLUMNS[3:8]) + " |")
    lines.append("")
    for key in keys:
        runs = [r for r in table if (r["partition"], r["model"]) == key]
        column = {c: np.array([float(r[c]) for r in runs]) for c in COLUMNS[3:8]}
        cells = ", ".join(f"{c} {mean_std(v)}" for c, v in column.items())
        lines.append(f"{NAMES.get(key[0], key[0])} ({key[1]}, n = {len(runs)}, seeds "
                     f"{','.join(str(r['seed']) for r in runs)}): {cells}")
        for label, a, b in (("update vs gradient cosine, early", "update_cosine_early", "gradient_cosine_early"),
                            ("update cosine, early vs late", "update_cosine_early", "update_cosine_late"),
                            ("gradient cosine, early vs late", "gradient_cosine_early", "gradient_cosine_late")):
            test = stats.ttest_ind(column[a], column[b], equal_var=False)
            ratio = column[a].mean() / column[b].mean()
            lines.append(f"  {label}: ratio of means {ratio:.3g}, Welch t = {test.statistic:.3g}, "
                         f"p = {test.pvalue:.2g} (n = {len(runs)} vs {len(runs)})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    runs_table_main(argv, description=__doc__, experiment="dp-fedavg-mnist", columns=COLUMNS, read_runs=read_runs,
                    as_text=lambda r: r[:3] + [f"{v:.6g}" for v in r[3:8]] + [r[8]], summarize=summarize)


if __name__ == "__main__":
    main()
