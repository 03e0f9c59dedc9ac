"""The figures of the budget-agnostic personalized-DP FL seed, one command each, on real MNIST.

    python examples/pdpfl/figures.py fig2   # update-norm mean and std per round: noise level x partition, seeds 0-2
    python examples/pdpfl/figures.py fig3   # accuracy of the indirect split after the warm start
    python examples/pdpfl/figures.py fig4   # accuracy per round: PFA (direct, indirect), FedAvg, Minimum, NP
    python examples/pdpfl/figures.py fig4 --partition "NIID(2)"   # the same on label-skewed clients
    python examples/pdpfl/figures.py fig4 --regime pfa --partition "shards(2)" --rounds 100   # PFA's code's settings
    python examples/pdpfl/figures.py fig3 --replot   # redraw from docs/figures/pdpfl_fig3.tsv, no runs

Every run is the config of this folder with overrides, through ``lightning-dp fit`` (``LightningDPCLI``),
logged to MLflow (``MLFLOW_TRACKING_URI``, default ``sqlite:///mlruns/mlflow.db``) in the experiment
``pdpfl-<figure>``; the figure is drawn from the runs' metric histories and written to ``--out``
(default ``docs/figures``) and logged as an artifact of a summary run, with a TSV of the numbers.
``--data-dir`` points to the MNIST files (default ``./data/mnist``, downloaded there on first use). ``--dataset cifar10`` runs
the same configs on CIFAR-10 with McMahan et al.'s CNN (``--data-dir`` holding the official python
batches; not run here: the files are not available offline).
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

PARTITIONS = {"IID": ["--data.init_args.partition=iid"],
              "NIID(2)": ["--data.init_args.partition=pathological", "--data.init_args.classes_per_client=2"],
              "Dir(0.5)": ["--data.init_args.partition=dirichlet", "--data.init_args.alpha=0.5"]}
# fig4 only (fig2 and fig3 run the three above): PFA's code's non-IID partition, 2 label shards per client
FIG4_PARTITIONS = {**PARTITIONS, "shards(2)": ["--data.init_args.partition=shards",
                                               "--data.init_args.classes_per_client=2"]}


_RUN_IDS: list[str] = []  # the figure's runs, children of its summary run
_DATASET_ARGS: list[str] = []  # overrides that switch the dataset and model (--dataset)


def _run(config: str, overrides: list[str], *, data_dir: str, experiment: str, run_name: str) -> str:
    """One ``lightning-dp fit`` run in a scratch directory; returns its MLflow run id."""
    from lightning_dp.commands.fit import LightningDPCLI

    args = ["fit", "--config", str(HERE / config), f"--data.init_args.data_dir={data_dir}", *_DATASET_ARGS,
            f"--trainer.logger.init_args.experiment_name={experiment}",
            f"--trainer.logger.init_args.run_name={run_name}", "--trainer.enable_checkpointing=false",
            "--trainer.check_val_every_n_epoch=1000", *overrides]
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(scratch)
        try:
            cli = LightningDPCLI(args=args, run=True)
        finally:
            os.chdir(cwd)
    _RUN_IDS.append(cli.trainer.logger.run_id)
    return cli.trainer.logger.run_id


def _history(run_id: str, key: str) -> list[float]:
    import mlflow

    client = mlflow.MlflowClient()
    return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


LEVELS = [("eps 0.4", "norms_mnist.yaml", ["--model.init_args.update.init_args.target_epsilon=0.4"]),
          ("eps 3", "norms_mnist.yaml", ["--model.init_args.update.init_args.target_epsilon=3.0"]),
          ("eps 20", "norms_mnist.yaml", ["--model.init_args.update.init_args.target_epsilon=20.0"]),
          ("non-private", "nonprivate_mnist.yaml", [])]
DISTRIBUTIONS = ["MixGauss1", "MixGauss2", "MixGauss3", "MixGauss4", "Gauss", "Uniform"]
METHODS = [("PFA (indirect)", "indirect_mnist.yaml"), ("PFA (direct)", "direct_mnist.yaml"),
           ("FedAvg", "fedavg_mnist.yaml"), ("Minimum", "minimum_mnist.yaml"), ("NP-FedAvg", "nonprivate_mnist.yaml")]


def measure_fig2(args) -> list[list]:
    """Mean and std over clients of the released update norms per round, for epsilon in {0.4, 3, 20} and
    non-private local SGD (every client at that budget), per partition, once per seed in ``--seeds``.

    Seed s overrides ``seed_everything``, the data's seed (the 80/20 pool/test split, the partition, the held-out
    client) and the round's public seed (the initialization, the non-private local shuffles); the secret noise
    seed (DP noise, Poisson batches) is fresh for every run. Every client takes part in every round (10 of 10),
    so there is no selection to vary. Seed 0 is the configs' own. The seeds are the outer loop, so that an
    interrupted measurement leaves whole seeds in MLflow."""
    rows = [["partition", "level", "seed", "round", "norm_mean", "norm_std"]]
    for seed in args.seeds:
        for partition, data_args in PARTITIONS.items():
            for label, config, update_args in LEVELS:
                seeds = [f"--seed_everything={seed}", f"--data.init_args.seed={seed}",
                         f"--model.init_args.seed={seed}"]
                run_id = _run(config, data_args + update_args + seeds + [f"--trainer.max_epochs={args.rounds}"],
                              data_dir=args.data_dir, experiment="pdpfl-fig2",
                              run_name=f"{partition} {label} seed {seed}")
                # the non-private releases are not sanitized: their norms are exact statistics of the clients'
                # data, recorded under nonprivate/ (lightning_dp.privacy.record.RoundNames)
                prefix = "nonprivate" if config == "nonprivate_mnist.yaml" else "round"
                mean = _history(run_id, f"{prefix}/update_norm_mean")
                std = _history(run_id, f"{prefix}/update_norm_std")
                rows += [[partition, label, seed, r, m, sd] for r, (m, sd) in enumerate(zip(mean, std), start=1)]
    return rows


def draw_fig2(table: list[dict]):
    """Per round, the mean over seeds of the clients' mean norm, with the sample std over seeds as error bars
    and the mean over seeds of the std over clients as a band (a table without a ``seed`` column, one run per
    cell before issue 54: the std over clients as error bars)."""
    import numpy as np
    from matplotlib.figure import Figure

    seeds = sorted({r.get("seed", "0") for r in table}, key=int)
    fig = Figure(figsize=(12, 3.8))
    axes = fig.subplots(1, len(PARTITIONS), sharey=True)
    for ax, partition in zip(axes, PARTITIONS):
        for label, _, _ in LEVELS:
            points = [r for r in table if r["partition"] == partition and r["level"] == label]
            rounds = sorted({int(r["round"]) for r in points})
            means = np.array([[float(r["norm_mean"]) for r in points if int(r["round"]) == t] for t in rounds])
            clients = np.array([[float(r["norm_std"]) for r in points if int(r["round"]) == t] for t in rounds])
            mean = means.mean(1)
            if len(seeds) > 1:
                line = ax.errorbar(rounds, mean, yerr=means.std(1, ddof=1), label=label, marker=".", capsize=2)
                ax.fill_between(rounds, mean - clients.mean(1), mean + clients.mean(1), alpha=0.15,
                                color=line[0].get_color(), linewidth=0)
            else:
                ax.errorbar(rounds, mean, yerr=clients[:, 0], label=label, marker=".", capsize=2)
        ax.set_title(partition)
        ax.set_xlabel("round")
        ax.set_yscale("log")
    axes[0].set_ylabel(f"update L2 norm (mean ± sample std\nover {len(seeds)} seeds; band: std over clients)"
                       if len(seeds) > 1 else "update L2 norm (mean ± std over clients)", fontsize="small")
    axes[-1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: the bands fill the panels
    fig.suptitle("Released update norms per round: logistic regression, 10 clients, local DP-SGD (B 64, C 1, lr 0.01)")
    return fig


def measure_fig3(args) -> list[list]:
    """Accuracy of the budget-agnostic split after the warm-start round, per partition and budget distribution
    (each client's noise calibrated for the full run of ``--rounds`` rounds), over budget seeds."""
    rows = [["partition", "distribution", "budget_seed", "split_accuracy", "public_clients"]]
    for partition, data_args in PARTITIONS.items():
        for dist in DISTRIBUTIONS:
            for seed in args.seeds:
                overrides = data_args + [
                    f"--model.init_args.update.init_args.budgets.init_args.distribution={dist}",
                    f"--model.init_args.update.init_args.budgets.init_args.seed={seed}",
                    f"--model.init_args.update.init_args.participations={args.rounds}",
                    "--trainer.max_epochs=1"]
                run_id = _run("indirect_mnist.yaml", overrides, data_dir=args.data_dir, experiment="pdpfl-fig3",
                              run_name=f"{partition} {dist} budgets {seed}")
                rows.append([partition, dist, seed, _history(run_id, "pdpfl/split_accuracy")[0],
                             _history(run_id, "pdpfl/public_clients")[0]])
    return rows


def draw_fig3(table: list[dict]):
    import numpy as np
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4))
    ax = fig.subplots()
    width = 0.8 / len(DISTRIBUTIONS)
    seeds = len({r["budget_seed"] for r in table})
    for j, dist in enumerate(DISTRIBUTIONS):
        values = [[float(r["split_accuracy"]) for r in table if r["partition"] == p and r["distribution"] == dist]
                  for p in PARTITIONS]
        ax.bar(np.arange(len(PARTITIONS)) + j * width, [np.mean(v) for v in values], width,
               yerr=[np.std(v, ddof=1) if len(v) > 1 else 0.0 for v in values], capsize=2, label=dist)
    ax.set_xticks(np.arange(len(PARTITIONS)) + width * (len(DISTRIBUTIONS) - 1) / 2, list(PARTITIONS))
    ax.set_ylabel(f"split accuracy (mean ± sample std, {seeds} draws)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize="small", ncol=3, loc="lower left")
    ax.set_title("Budget-agnostic split after the warm start (mixture on update norms), MNIST, 10 clients")
    return fig


# PFA's own code (Emory-AIMS/PFA, main.py defaults and README): 1 public client (top 10 % of 10), WeiPFA, local lr
# 0.1 at batch 4, 8 of 10 clients per round, 100 rounds, label shards (every class present). Its clients take 100
# local steps; ours take an epoch (200 steps at batch 4 on 800 images): the same for every method.
PFA_REGIME = {"common": ["--model.init_args.update.init_args.lr=0.1", "--model.init_args.update.init_args.batch_size=4",
                         "--model.init_args.selection.init_args.clients_per_round=8"],
              "direct": ["--model.init_args.aggregator.init_args.weighted=true"]}


def _fig4_name(args) -> str:
    parts = ["fig4"] + ([] if args.partition == "IID" else [args.partition.lower().replace("(", "").replace(")", "")])
    return "_".join(parts + ([] if args.regime == "project" else ["pfa_regime"]))


def measure_fig4(args) -> list[list]:
    """Accuracy per round of PFA (direct, indirect), FedAvg, Minimum and NP-FedAvg, over seeds: on the held-out
    validation client (``val_acc``) and on the 10 test clients (``test_acc``, every class: ``test_every_check``)."""
    rows = [["method", "seed", "round", "val_acc", "test_acc"]]
    data_args = FIG4_PARTITIONS[args.partition]
    for label, config in METHODS:
        regime = []
        if args.regime == "pfa":
            # the update's lr and batch apply to LocalSGD (NP-FedAvg) as to LocalDPSGD
            regime = PFA_REGIME["common"] + (PFA_REGIME["direct"] if config == "direct_mnist.yaml" else [])
        for seed in args.seeds:
            run_id = _run(config, [*data_args, *regime, f"--model.init_args.seed={seed}",
                                   f"--trainer.max_epochs={args.rounds}", "--trainer.check_val_every_n_epoch=1",
                                   "--model.init_args.test_every_check=true", f"--data.init_args.seed={seed}"],
                          data_dir=args.data_dir, experiment="pdpfl-fig4",
                          run_name=f"{label} {args.partition} {args.regime} seed {seed}")
            val, test = _history(run_id, "val/acc"), _history(run_id, "test/acc")
            rows += [[label, seed, r, a, t] for r, (a, t) in enumerate(zip(val, test), start=1)]
    return rows


def draw_fig4(table: list[dict], title: str = ""):
    import numpy as np
    from matplotlib.figure import Figure

    key = "test_acc" if "test_acc" in table[0] else "val_acc"  # tables before test_every_check: val only
    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    seeds = sorted({r["seed"] for r in table})
    for label, _ in METHODS:
        curves = [[float(r[key]) for r in table if r["method"] == label and r["seed"] == s] for s in seeds]
        length = min(len(c) for c in curves)
        values = np.array([c[:length] for c in curves])
        rounds = np.arange(1, length + 1)
        ax.plot(rounds, values.mean(0), marker="." if length <= 30 else None, label=label)
        spread = values.std(0, ddof=1) if len(values) > 1 else np.zeros(length)  # sample std over the seeds
        ax.fill_between(rounds, values.mean(0) - spread, values.mean(0) + spread, alpha=0.2)
    ax.set_xlabel("round")
    where = "the 10 test clients (all classes)" if key == "test_acc" else "the held-out client"
    ax.set_ylabel(f"accuracy on {where}\n(mean ± sample std, {len(seeds)} seeds)", fontsize="small")
    ax.legend(fontsize="small")
    ax.set_title(title or "MNIST, 10 clients (IID partition), MixGauss1 budgets, local DP-SGD", fontsize="small")
    return fig


FIGURES = {"fig2": (measure_fig2, draw_fig2), "fig3": (measure_fig3, draw_fig3), "fig4": (measure_fig4, draw_fig4)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("figure", choices=["fig2", "fig3", "fig4"])
    parser.add_argument("--data-dir", default=None, help="default: ./data/mnist (downloaded on first use), or ./data/cifar10")
    parser.add_argument("--dataset", choices=["mnist", "cifar10"], default="mnist")
    parser.add_argument("--out", default=str(ROOT / "docs" / "figures"))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seeds", type=lambda s: [int(v) for v in s.split(",")], default=[0, 1, 2],
                        help="comma-separated: fig2 and fig4, the runs' seeds (data, initialization); fig3, the budget "
                             "draws' seeds (default 0,1,2)")
    parser.add_argument("--replot", action="store_true", help="redraw the figure from its TSV in --out, no runs")
    parser.add_argument("--partition", choices=list(FIG4_PARTITIONS), default="IID",
                        help="fig4: the clients' partition (written to pdpfl_fig4_<partition>.*; default IID)")
    parser.add_argument("--regime", choices=["project", "pfa"], default="project",
                        help="fig4: 'pfa' runs PFA's code's settings (1 public client, WeiPFA, lr 0.1, batch 4, 8 of "
                             "10 clients per round; pass --rounds 100 --partition shards(2) for its 100 rounds on "
                             "label shards); default: this folder's configs")
    args = parser.parse_args(argv)
    if args.dataset == "cifar10":
        _DATASET_ARGS[:] = ["--data.init_args.dataset=cifar10", "--data.init_args.subset=full",
                            "--model.init_args.model=lightning_dp.models.CIFARConvNet"]
    if args.data_dir is None:
        args.data_dir = str(Path("data/mnist" if args.dataset == "mnist" else "data/cifar10").resolve())
    measure, draw = FIGURES[args.figure]
    name = _fig4_name(args) if args.figure == "fig4" else args.figure
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tsv, png = out / f"pdpfl_{name}.tsv", out / f"pdpfl_{name}.png"
    if not args.replot:
        logging.getLogger("absl").setLevel(logging.ERROR)
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{(Path.cwd() / 'mlruns' / 'mlflow.db').resolve()}")
        (Path.cwd() / "mlruns").mkdir(exist_ok=True)
        rows = measure(args)
        tsv.write_text("".join("\t".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in row) + "\n"
                               for row in rows))
    with tsv.open() as handle:
        table = list(csv.DictReader(handle, delimiter="\t"))
    if args.figure == "fig4":
        regime = "PFA's code's settings" if args.regime == "pfa" else "this folder's configs"
        fig = draw(table, f"MNIST, 10 clients ({args.partition} partition), MixGauss1 budgets, local DP-SGD, {regime}")
    else:
        fig = draw(table)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    if args.replot:
        print(f"redrew {png} from {tsv}")
        return
    import mlflow

    mlflow.set_experiment(f"pdpfl-{args.figure}")
    with mlflow.start_run(run_name=f"{name} summary") as parent:  # the runs of the figure are its children
        mlflow.log_artifact(str(png))
        mlflow.log_artifact(str(tsv))
        client = mlflow.MlflowClient()
        for run_id in _RUN_IDS:
            client.set_tag(run_id, "mlflow.parentRunId", parent.info.run_id)
    print(f"wrote {png} and {tsv.name}")


if __name__ == "__main__":
    main(sys.argv[1:])
