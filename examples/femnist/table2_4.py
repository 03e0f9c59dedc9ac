"""The thesis' Table 2.4 (FEMNIST accuracy against the noise multiplier nu) beside ours: collect runs, summarize, draw.

Runs come from ``benchmarks/run_configs_parallel.py`` (or ``lightning-dp grid``) on ``examples/fl_femnist.yaml``
composed with ``examples/femnist/convergence.yaml`` (the thesis' stopping rule); see
docs/results_femnist_noise.md, "At convergence", for the commands.

    # one row per run: its JSON line (test accuracy, rounds, client epsilon) and, where its CSV log is there,
    # the validation accuracy at the best check (the check whose weights were restored)
    python examples/femnist/table2_4.py collect --loss cross_entropy --jsonl ce.jsonl --logs csv/ce \\
        --out docs/figures/femnist_table2_4.tsv
    # runs of some points redone elsewhere (their earlier rows' logs not here): --update keeps the loss's other rows
    python examples/femnist/table2_4.py collect --loss rmse --jsonl rmse.jsonl --logs csv --update \\
        --out docs/figures/femnist_table2_4.tsv
    # mean +- sample std per (loss, nu) beside the thesis' numbers, the pooled comparisons, and the figure
    python examples/femnist/table2_4.py figure docs/figures/femnist_table2_4.tsv docs/figures/femnist_table2_4.png
    # hypothesis 3 (the dimension): each thesis nu beside our nu with the same noise along a direction, and a figure
    python examples/femnist/table2_4.py dimension docs/figures/femnist_table2_4.tsv \\
        docs/figures/femnist_dimension.tsv --png docs/figures/femnist_dimension.png
"""

from __future__ import annotations

import argparse
import csv
import functools
import glob
import json
import math
import os
import statistics
import sys
from typing import Any, Optional

#: The thesis' Table 2.4 (docs/reproductions.md lists the papers; about line 795 of its text): validation accuracy,
#: mean and standard deviation over three seeds, per nu; cross-entropy and RMSE.
PAPER = {
    "cross_entropy": {0: (0.832, 0.012), 0.001: (0.843, 0.006), 0.01: (0.832, 0.017), 0.1: (0.834, 0.026),
                      1: (0.834, 0.014), 3: (0.835, 0.017), 5: (0.812, 0.016), 10: (0.692, 0.002),
                      15: (0.561, 0.005)},
    "rmse": {0: (0.801, 0.001), 0.001: (0.813, 0.014), 0.01: (0.805, 0.008), 0.1: (0.808, 0.019),
             1: (0.814, 0.012), 3: (0.825, 0.010), 5: (0.787, 0.003), 10: (0.687, 0.014), 15: (0.622, 0.003)},
}
FIELDS = ["loss", "nu", "seed", "finished", "rounds", "best_round", "val_acc_best", "test_acc", "client_epsilon_median",
          "checks", "unanimous_checks", "logged_rounds", "one_cluster_rounds"]


def _name_values(name: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in name.split(","))


def best_check(metrics_csv: str) -> Optional[tuple[int, float, int]]:
    """(round of the lowest val/loss, val/acc there, rounds trained) from a CSVLogger's metrics.csv, over
    split.py's ``trained_rows``: a finished run's final validation and test rows are not checks."""
    with open(metrics_csv) as f:
        trained = _split().trained_rows(list(csv.DictReader(f)))
    checks = [(float(r["val/loss"]), int(r["epoch"]) + 1, float(r["val/acc"])) for r in trained if r.get("val/loss")]
    if not checks:
        return None
    rounds = max(int(r["epoch"]) + 1 for r in trained)
    loss, epoch, acc = min(checks)
    return epoch, acc, rounds


def collect(loss: str, jsonl: list[str], logs: list[str]) -> list[dict]:
    """One row per run: finished runs from their JSON lines, unfinished ones (a log, no line) marked so.

    A finished run's best check comes from the log its line names (``log_dir``); for lines without one, from the
    log of the same point that trained as many rounds as the line says (a point cut on one machine and rerun on
    another has two logs), else the longest."""
    rows: dict[tuple[str, str], dict] = {}
    named: dict[tuple[str, str], str] = {}
    for path in jsonl:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if "error" in r:
                    continue
                v = {k.split(".")[-1]: str(val) for k, val in r["values"].items()}
                key = (v["noise_multiplier"], v["seed_everything"])
                rows[key] = {
                    "loss": loss, "nu": key[0], "seed": key[1], "finished": 1,
                    "rounds": r["epochs"], "test_acc": r["metrics"].get("test/acc"),
                    "val_acc_best": r["metrics"].get("restored val/acc"),
                    "client_epsilon_median": r["privacy"].get("client_epsilon_median", math.inf)}
                if r.get("log_dir"):
                    log_dir = r["log_dir"]
                    if not os.path.isabs(log_dir) and not os.path.exists(log_dir):
                        # relative to where the runner ran: the JSON lines' folder, usually
                        log_dir = os.path.join(os.path.dirname(os.path.abspath(path)), log_dir)
                    named[key] = os.path.join(log_dir, "metrics.csv")
    found: dict[tuple[str, str], list[tuple[str, tuple[int, float, int]]]] = {}
    for log_dir in logs:
        for path in glob.glob(os.path.join(log_dir, "*", "version_*", "metrics.csv")):
            v = _name_values(path.split(os.sep)[-3])
            check = best_check(path)
            if check is not None:
                found.setdefault((v["noise_multiplier"], v["seed_everything"]), []).append((path, check))
    for key, candidates in found.items():
        row = rows.get(key)
        picked = None
        if row is not None and key in named and os.path.exists(named[key]):
            picked = next(((p, c) for p, c in candidates if os.path.samefile(p, named[key])), None)
        if picked is None and row is not None:
            picked = next(((p, c) for p, c in candidates if c[2] == int(row["rounds"])), None)
        if picked is None:
            picked = max(candidates, key=lambda pc: pc[1][2])
            if row is not None:
                print(f"warning: no log of {key} trained {row['rounds']} rounds; its best check is from the longest "
                      f"({picked[1][2]} rounds)", file=sys.stderr)
        path, chosen = picked
        row = rows.setdefault(key, {"loss": loss, "nu": key[0], "seed": key[1], "finished": 0, "rounds": chosen[2]})
        row["best_round"] = chosen[0]
        if row.get("val_acc_best") is None:
            row["val_acc_best"] = chosen[1]
        # whether the k hypotheses personalized: split.py's counts of the same log
        split = log_split(path)
        row.update({"checks": split["checks"], "unanimous_checks": split["unanimous_checks"],
                    "logged_rounds": split["rounds"], "one_cluster_rounds": split["one_cluster_rounds"]})
    return sorted(rows.values(), key=lambda r: (float(r["nu"]), int(r["seed"])))


@functools.lru_cache(maxsize=None)
def _split() -> Any:
    """examples/femnist/split.py, loaded once (beside this file; run as a script or loaded by path in the tests)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("femnist_split", os.path.join(os.path.dirname(
        os.path.abspath(__file__)), "split.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def log_split(metrics_csv: str) -> dict:
    """examples/femnist/split.py's counts of one log (unanimous validation checks, one-cluster rounds)."""
    return _split().log_split(metrics_csv)


def personalization(rows: list[dict], loss: str) -> Optional[str]:
    """Over the runs' logs (the rows that have counts): checks at which every validation writer chose the same
    hypothesis, and rounds whose releases the k-means put in one cluster."""
    have = [r for r in rows if r["loss"] == loss and r.get("checks") not in ("", None)]
    if not have:
        return None
    total = {k: sum(int(r[k]) for r in have) for k in ("checks", "unanimous_checks", "logged_rounds",
                                                        "one_cluster_rounds")}
    return (f"{loss} ({len(have)} logs): every validation writer chose one hypothesis at {total['unanimous_checks']} "
            f"of {total['checks']} checks; the k-means put a round's releases in one cluster in "
            f"{total['one_cluster_rounds']} of {total['logged_rounds']} rounds")


def read(path: str) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f, delimiter="\t"))


def _num(text: str) -> Optional[float]:
    return float(text) if text not in ("", "None", None) else None


def summary(rows: list[dict]) -> dict[tuple[str, float], dict[str, tuple[float, float, int]]]:
    """Per (loss, nu): mean, sample std and n of the finished runs' test and best-check validation accuracies."""
    out: dict[tuple[str, float], dict[str, tuple[float, float, int]]] = {}
    for loss, nu in sorted({(r["loss"], float(r["nu"])) for r in rows}):
        cell = [r for r in rows if r["loss"] == loss and float(r["nu"]) == nu and str(r["finished"]) == "1"]
        stats = {}
        for metric in ("test_acc", "val_acc_best"):
            xs = [x for x in (_num(r[metric]) for r in cell) if x is not None]
            if xs:
                stats[metric] = (statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else math.nan, len(xs))
        out[(loss, nu)] = stats
    return out


def _fmt(stat: Optional[tuple[float, float, int]]) -> str:
    if not stat:
        return "-"
    mean, std, n = stat
    return f"{mean:.3f} ± {std:.3f} (n = {n})" if n > 1 else f"{mean:.3f} (n = 1)"


def markdown(rows: list[dict]) -> str:
    lines = ["| loss | nu | thesis (val, n = 3) | ours: test/acc | ours: val/acc at the best check |",
             "|---|---|---|---|---|"]
    for (loss, nu), stats in summary(rows).items():
        paper = PAPER[loss].get(nu)
        nu_text = f"{nu:g}"
        paper_text = f"{paper[0]:.3f} ± {paper[1]:.3f}" if paper else "-"
        lines.append(f"| {loss} | {nu_text} | {paper_text} | {_fmt(stats.get('test_acc'))} | "
                     f"{_fmt(stats.get('val_acc_best'))} |")
    return "\n".join(lines)


def pooled(rows: list[dict], loss: str, metric: str, exclude: tuple[float, ...] = ()) -> Optional[str]:
    """The finished runs of the thesis' flat range (nu <= 3) against nu >= 10, pooled over cells: mean ± sample std
    (n) of each side, their difference and Welch's t-test p-value (a cell's three runs are too few on their own)."""
    from scipy import stats

    def side(keep) -> list[float]:
        return [x for r in rows if r["loss"] == loss and str(r["finished"]) == "1" and keep(float(r["nu"]))
                and float(r["nu"]) not in exclude and (x := _num(r[metric])) is not None]

    low, high = side(lambda nu: nu <= 3), side(lambda nu: nu >= 10)
    if len(low) < 2 or len(high) < 2:
        return None
    p = stats.ttest_ind(low, high, equal_var=False).pvalue
    without = f" (without nu = {', '.join(f'{nu:g}' for nu in exclude)})" if exclude else ""
    shown = f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"  # three decimals would print a tiny p as 0.000
    return (f"{loss} {metric}{without}: nu <= 3 {statistics.mean(low):.3f} ± {statistics.stdev(low):.3f} "
            f"(n = {len(low)}), nu >= 10 {statistics.mean(high):.3f} ± {statistics.stdev(high):.3f} "
            f"(n = {len(high)}): {statistics.mean(low) - statistics.mean(high):.3f} lower, Welch p = {shown}")


def figure(rows: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats = summary(rows)
    losses = sorted({loss for loss, _ in stats})
    fig, axes = plt.subplots(1, len(losses), figsize=(5.2 * len(losses), 4.2), sharey=True, squeeze=False)
    for ax, loss in zip(axes[0], losses):
        ours = sorted(nu for lo, nu in stats if lo == loss)
        nus = sorted(set(PAPER.get(loss, {})) | set(ours))
        x = {nu: i for i, nu in enumerate(nus)}  # the nu values evenly spaced (0 has no log position)
        paper = PAPER.get(loss, {})
        ax.errorbar([x[nu] for nu in paper], [m for m, _ in paper.values()], [e for _, e in paper.values()],
                    marker="s", capsize=3, label="thesis (validation, n = 3)")
        for metric, label, marker in (("test_acc", "ours: test", "o"), ("val_acc_best", "ours: validation", "^")):
            pts = [(x[nu], stats[(loss, nu)][metric]) for nu in ours if metric in stats[(loss, nu)]]
            if not pts:
                continue
            errs = [0 if math.isnan(s[1]) else s[1] for _, s in pts]  # one run: no bar
            ax.errorbar([p for p, _ in pts], [s[0] for _, s in pts], errs, marker=marker, capsize=3,
                        linestyle="--", label=label)
            for p, (mean, _, n) in pts:
                if n < 3:  # say where a point holds fewer runs than the thesis' three
                    ax.annotate(f"n={n}", (p, mean), textcoords="offset points", xytext=(4, -10), fontsize=7)
        ax.set_xticks(range(len(nus)), [f"{nu:g}" for nu in nus])
        ax.set_xlabel("noise multiplier nu")
        ax.set_title(f"FEMNIST, {'RMSE' if loss == 'rmse' else loss.replace('_', '-')}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy (mean ± sample std)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(out, dpi=110)


#: Parameter counts: our CNN (``FEMNISTConvNet``, the paper's Table 3 layers; checked in the tests) and the two the
#: paper states for its model (000 L189 and 003 L93: 206,590, in the sentence on the leakage n / nu, which no
#: variant of Table 3's layers gives; 000 L391 and the thesis L703, L775: 1,206,590, Table 3's layers with 3x3
#: kernels).
OUR_PARAMETERS = 1_400_990
PAPER_PARAMETERS = (206_590, 1_206_590)


def direction_scale(drawn: int, epsilon_from: Optional[int] = None) -> float:
    """The factor by which the paper's release takes more noise along any one direction than ours at the same nu,
    in units of each model's own update norm ||delta||, for a whole-vector release (one Laplace draw over all
    parameters, our ``per_layer=False``) in a model of ``drawn`` parameters whose epsilon was computed from
    ``epsilon_from`` parameters (default: the same). The noise is drawn in ``drawn`` dimensions with
    epsilon ||delta|| = epsilon_from / nu, so its norm is about drawn / epsilon = (drawn / epsilon_from) nu ||delta||
    (ours: nu ||delta||), and its component along a direction that norm over sqrt(drawn): the factor is
    (drawn / epsilon_from) sqrt(ours / drawn). The thesis' nu corresponds to ours times this factor
    (hypothesis 3)."""
    if drawn < 1 or (epsilon_from is not None and epsilon_from < 1):
        raise ValueError(f"parameter counts must be positive, got drawn={drawn}, epsilon_from={epsilon_from}")
    return (drawn / (drawn if epsilon_from is None else epsilon_from)) * math.sqrt(OUR_PARAMETERS / drawn)


#: The readings of the paper's model that hypothesis 3 compares: (label, factor): each stated count, and the
#: larger one drawn with the epsilon of the smaller (what a code that computed epsilon from the text's count would do).
READINGS = tuple((f"{n:,} parameters", direction_scale(n)) for n in PAPER_PARAMETERS) + (
    (f"{max(PAPER_PARAMETERS):,} drawn, epsilon from {min(PAPER_PARAMETERS):,}",
     direction_scale(max(PAPER_PARAMETERS), min(PAPER_PARAMETERS))),)


def _drop(stats: dict, loss: str, nu: float, metric: str) -> Optional[float]:
    base, cell = stats.get((loss, 0.0), {}).get(metric), stats.get((loss, nu), {}).get(metric)
    return None if base is None or cell is None else base[0] - cell[0]


def _finished_nus(stats: dict, loss: str) -> list[float]:
    """The nu of ``loss`` with at least one finished run (``summary`` keeps a nu whose runs are all unfinished,
    with no statistics)."""
    return sorted(nu for (lo, nu), cell in stats.items() if lo == loss and cell)


def _dedupe(rows: list[dict]) -> list[dict]:
    """One row per (loss, nu, seed) over several TSVs (a run collected into two files counts once): a finished
    row over an unfinished one, else the first."""
    kept: dict[tuple[str, float, str], dict] = {}
    for r in rows:
        key = (r["loss"], float(r["nu"]), str(r["seed"]))
        if key not in kept or (str(kept[key]["finished"]) != "1" and str(r["finished"]) == "1"):
            kept[key] = r
    return list(kept.values())


def dimension(rows: list[dict], loss: str = "cross_entropy") -> str:
    """Hypothesis 3 as a table: each thesis nu >= 1 (those below 1 map to ours below 1 under every reading: the
    flat range) beside the nu of ours that puts the same noise along a direction (for each reading of the paper's model,
    ``READINGS``), the thesis' change from nu = 0 beside ours at the finished nu of ours nearest to it, if within
    10 % (validation accuracy at the best check, the thesis' metric, and test accuracy; "-" for a metric the runs
    lack, no change without our nu = 0)."""
    stats = summary(rows)
    ours = _finished_nus(stats, loss)
    lines = ["| thesis nu | thesis val, change from nu 0 | the paper's model | our nu with the same noise per "
             "direction | ours: val at the best check, change | ours: test, change |", "|---|---|---|---|---|---|"]
    paper = PAPER[loss]
    for nu_t in sorted(paper):
        if nu_t < 1:
            continue
        for label, scale in READINGS:
            nu_o = nu_t * scale
            near = min(ours, key=lambda nu: abs(nu - nu_o)) if ours else None
            run = near is not None and abs(near - nu_o) <= 0.1 * nu_o  # within 10 %: "run at" says where
            cells = []
            for metric in ("val_acc_best", "test_acc"):
                if not run:
                    cells.append("not run")
                    continue
                stat, drop = stats[(loss, near)].get(metric), _drop(stats, loss, near, metric)
                cells.append("-" if stat is None else _fmt(stat) + ("" if drop is None else f", {-drop:+.3f}"))
            lines.append(f"| {nu_t:g} | {paper[nu_t][0]:.3f}, {paper[nu_t][0] - paper[0][0]:+.3f} | {label} | "
                         f"{nu_o:.1f}{f' (run at {near:g})' if run else ''} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def dimension_figure(rows: list[dict], out: str, loss: str = "cross_entropy") -> None:
    """Accuracy lost from nu = 0 against the noise along a direction, in units of our nu: ours at their nu, the
    thesis' at its nu times the factor of each reading of its model (``READINGS``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats = summary(rows)
    ours = _finished_nus(stats, loss)
    fig, ax = plt.subplots(figsize=(7.2, 4.8))
    paper = PAPER[loss]
    for (label, scale), marker in zip(READINGS, ("s", "D", "v")):
        ax.plot([nu * scale for nu in paper], [m - paper[0][0] for m, _ in paper.values()], marker=marker,
                label=f"thesis, validation ({label}: nu x {scale:.2f})")
    for metric, label, marker in (("val_acc_best", "ours: validation at the best check", "^"),
                                  ("test_acc", "ours: test", "o")):
        pts = [(nu, stats[(loss, nu)][metric]) for nu in ours if metric in stats[(loss, nu)]]
        base = stats.get((loss, 0.0), {}).get(metric)
        if not pts or base is None:
            continue
        ax.errorbar([nu for nu, _ in pts], [s[0] - base[0] for _, s in pts],
                    [0 if math.isnan(s[1]) else s[1] for _, s in pts], marker=marker, capsize=3, linestyle="--",
                    label=label)
    ax.axhline(0, color="grey", lw=0.8)
    # a factor on the noise shifts a curve along a log axis without changing its shape (linear below 1, for nu = 0)
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlim(-0.05, 1.3 * max([*ours, *(max(paper) * scale for _, scale in READINGS)]))
    ax.set_xlabel(f"noise along a direction, as our nu ({OUR_PARAMETERS:,} parameters; symmetric log scale)")
    ax.set_ylabel("accuracy minus accuracy at nu = 0")
    ax.set_title(f"FEMNIST, {'RMSE' if loss == 'rmse' else loss.replace('_', '-')}: the dimension (hypothesis 3)")
    ax.grid(alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(out, dpi=110)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect", help="runs -> TSV rows (appended to --out's rows of other losses)")
    c.add_argument("--loss", required=True, choices=sorted(PAPER))
    c.add_argument("--jsonl", action="append", default=[])
    c.add_argument("--logs", action="append", default=[], help="CSVLogger save_dir(s) of the runs")
    c.add_argument("--out", required=True)
    c.add_argument("--update", action="store_true", help=(
        "replace only the collected points' rows and keep the loss's other rows in --out (runs collected from "
        "another machine, whose logs are not here; a point unfinished here keeps a finished row); without it, every "
        "row of --loss is replaced"))
    f = sub.add_parser("figure", help="TSV -> markdown summary on stdout and the figure")
    f.add_argument("tsv")
    f.add_argument("png", nargs="?")
    d = sub.add_parser("dimension", help="TSV(s) -> hypothesis 3's table on stdout (the thesis' nu at the same noise "
                       "per direction) and its figure")
    d.add_argument("tsv", nargs="+", help="collected rows (e.g. the table's and the dimension runs')")
    d.add_argument("--loss", default="cross_entropy", choices=sorted(PAPER))
    d.add_argument("--png")
    args = parser.parse_args(argv)
    if args.command == "dimension":
        rows = _dedupe([r for path in args.tsv for r in read(path)])
        print(dimension(rows, args.loss))
        if args.png:
            dimension_figure(rows, args.png, args.loss)
        return 0
    if args.command == "collect":
        rows = collect(args.loss, args.jsonl, args.logs)
        if not rows:
            print(f"no runs found in {args.jsonl + args.logs}", file=sys.stderr)
            return 1
        old = read(args.out) if os.path.exists(args.out) else []
        if args.update:
            # the collected points over their earlier rows, except that a point cut here (a log, no line) does not
            # replace a finished row collected elsewhere: _dedupe's rule, the new rows first
            merged = _dedupe(rows + [r for r in old if r["loss"] == args.loss])
            for r in rows:
                if r not in merged:
                    print(f"warning: nu = {r['nu']}, seed {r['seed']}: unfinished here, the finished row in "
                          f"{args.out} kept", file=sys.stderr)
            rows = merged
        kept = [r for r in old if r["loss"] != args.loss]
        with open(args.out, "w", newline="") as fh:
            w = csv.DictWriter(fh, FIELDS, delimiter="\t", lineterminator="\n", restval="")
            w.writeheader()
            w.writerows(sorted(kept + rows, key=lambda r: (r["loss"], float(r["nu"]), int(r["seed"]))))
        return 0
    rows = read(args.tsv)
    print(markdown(rows))
    for loss in sorted({r["loss"] for r in rows}):
        for metric in ("test_acc", "val_acc_best"):
            for exclude in ((), (0.1,)):  # 0.1: the cell of the cross-entropy run stopped at 105 rounds
                line = pooled(rows, loss, metric, exclude)
                if line:
                    print(line)
        line = personalization(rows, loss)
        if line:
            print(line)
    if args.png:
        figure(rows, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
