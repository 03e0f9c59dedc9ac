"""Thesis Fig. 2.7 (003 Fig. 7) per seed: one row per run of the grid of docs/results_fairness.md, then the page's
table (mean ± sample std over seeds), the k = 1 / k = 2 ratios and Welch's t-tests.

    lightning-dp grid --config examples/fairness/synthetic.yaml ...    # the command of docs/results_fairness.md
    python examples/fairness/fig2_7_table.py [--tracking-uri URI ...] --tsv docs/figures/fairness_fig2_7.tsv
    python examples/fairness/fig2_7_table.py --from-tsv docs/figures/fairness_fig2_7.tsv   # no runs needed

Per finished run of the experiment that has test metrics: k (``num_hypotheses``), nu (``noise_multiplier``), the
module seed, the last logged ``epoch`` (0-based), ``test/acc``, the three ``test/fairness/*_difference`` gaps, the
median client epsilon, and the per-group rates (g1 = group_0, g2 = group_1). Printed: mean ± sample std per (k, nu);
per nu and gap the ratio of the k = 1 and k = 2 means with Welch's p (``scipy.stats.ttest_ind(equal_var=False)``,
n seeds against n) and the ratio's lower end when the k = 2 mean is replaced by the upper end of its one-sided 95 %
t-interval (how loose a ratio over a gap as small as its own std is); and, for k = 2, each gap at the smallest
against the largest nu and a least-squares line through every nu (the claim that fairness worsens with nu).
Everything read is released metrics or public configuration.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from figure_table import finished_runs, mean_std, runs_table_main  # noqa: E402  (examples/ is on the path from here)

GAPS = {"dp": "demographic_parity_difference", "eo": "equalized_odds_difference",
        "eopp": "equal_opportunity_difference"}
RATES = ["selection_rate", "true_positive_rate", "false_positive_rate", "accuracy"]
COLUMNS = (["k", "nu", "seed", "epoch", "acc", *GAPS, "client_epsilon_median"]
           + [f"{rate}_g{g}" for rate in RATES for g in (1, 2)])


def read_runs(uris: list[str], experiment: str) -> list[list]:
    rows = []
    for _, run in finished_runs(uris, experiment, max_results=5000):
        metrics, params = run.data.metrics, run.data.params
        if "test/acc" not in metrics:
            continue  # a grid's parent run, or a run without --test
        rows.append([int(params["num_hypotheses"]), float(params["noise_multiplier"]), int(params["seed"]),
                     int(metrics["epoch"]), metrics["test/acc"],
                     *(metrics[f"test/fairness/{name}"] for name in GAPS.values()),
                     metrics["privacy/client_epsilon_median"],
                     *(metrics[f"test/fairness/{rate}/group_{g}"] for rate in RATES for g in (0, 1))])
    return sorted(rows, key=lambda r: (r[0], r[1], r[2]))


def summarize(table: list[dict]) -> str:
    from scipy import stats

    def column(k: str, nu: str, name: str) -> np.ndarray:
        return np.array([float(r[name]) for r in table if r["k"] == k and float(r["nu"]) == float(nu)])

    cells = sorted({(r["k"], float(r["nu"])) for r in table}, key=lambda c: (int(c[0]), c[1]))
    lines = ["| k | nu | n | accuracy | demographic parity diff. | equalized odds diff. | "
             "equal opportunity diff. | client epsilon (median) |", "|---" * 8 + "|"]
    for k, nu in cells:
        col = {name: column(k, nu, name) for name in ["acc", *GAPS, "client_epsilon_median"]}
        lines.append(f"| {k} | {nu:g} | {len(col['acc'])} | " + " | ".join(
            mean_std(col[name]) for name in ["acc", *GAPS]) + f" | {col['client_epsilon_median'].mean():.4g} |")
    lines += ["", "| k | selection rate g1 / g2 | TPR g1 / g2 | FPR g1 / g2 | accuracy g1 / g2 |", "|---" * 5 + "|"]
    for k in sorted({c[0] for c in cells}, key=int):
        runs = [r for r in table if r["k"] == k]
        lines.append(f"| {k} (all nu, n = {len(runs)}) | " + " | ".join(
            " / ".join(f"{np.mean([float(r[f'{rate}_g{g}']) for r in runs]):.2f}" for g in (1, 2)) for rate in RATES)
            + " |")
    lines.append("")
    nus = sorted({c[1] for c in cells})
    for nu in nus:
        for gap in GAPS:
            one, two = column("1", nu, gap), column("2", nu, gap)
            if len(one) < 2 or len(two) < 2:
                continue
            test = stats.ttest_ind(one, two, equal_var=False)
            upper = two.mean() + stats.t.ppf(0.95, len(two) - 1) * two.std(ddof=1) / np.sqrt(len(two))
            lines.append(f"nu = {nu:g}, {gap}: k = 1 {mean_std(one)} vs k = 2 {mean_std(two)}; ratio "
                         f"{one.mean() / two.mean():.3g} (>= {one.mean() / upper:.3g} with k = 2 at its 95 % upper end "
                         f"{upper:.4f}); k = 2 values {', '.join(f'{v:.4f}' for v in two)}; Welch p = "
                         f"{test.pvalue:.2g} (n = {len(one)} vs {len(two)})")
    for gap in GAPS:
        low, high = column("2", nus[0], gap), column("2", nus[-1], gap)
        if len(low) > 1 and len(high) > 1:
            test = stats.ttest_ind(low, high, equal_var=False)
            runs = [r for r in table if r["k"] == "2"]
            line = stats.linregress([float(r["nu"]) for r in runs], [float(r[gap]) for r in runs])
            lines.append(f"k = 2, {gap}: nu = {nus[0]:g} {mean_std(low)} vs nu = {nus[-1]:g} {mean_std(high)}; "
                         f"Welch p = {test.pvalue:.2g} (n = {len(low)} vs {len(high)}); least-squares slope over all nu "
                         f"{line.slope:.2g} per unit of nu, p = {line.pvalue:.2g} (n = {len(runs)})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    runs_table_main(argv, description=__doc__, experiment="fairness-synthetic", columns=COLUMNS, read_runs=read_runs,
                    as_text=lambda r: [r[0], f"{r[1]:g}", *r[2:4], *(f"{v:.6g}" for v in r[4:])],
                    summarize=summarize)


if __name__ == "__main__":
    main()
