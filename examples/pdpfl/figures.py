"""The figures of the budget-agnostic personalized-DP FL seed, one command each, on real MNIST.

    python examples/pdpfl/figures.py fig2   # update-norm mean and std per round: noise level x partition
    python examples/pdpfl/figures.py fig3   # accuracy of the indirect split after the warm start
    python examples/pdpfl/figures.py fig4   # test accuracy per round: PFA (direct, indirect), FedAvg, Minimum, NP

Every run is the config of this folder with overrides, through ``lightning-dp fit`` (``LightningDPCLI``),
logged to MLflow (``MLFLOW_TRACKING_URI``, default ``sqlite:///mlruns/mlflow.db``) in the experiment
``pdpfl-<figure>``; the figure is drawn from the runs' metric histories and written to ``--out``
(default ``docs/figures``) and logged as an artifact of a summary run, with a TSV of the numbers.
``--data-dir`` points to the MNIST files (default ``../shared/data/mnist``; CIFAR-10: the same
configs with ``--data.init_args.dataset=cifar10`` and the CNN, when a user has the files).
"""

from __future__ import annotations

import argparse
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


_RUN_IDS: list[str] = []  # the figure's runs, children of its summary run


def _run(config: str, overrides: list[str], *, data_dir: str, experiment: str, run_name: str) -> str:
    """One ``lightning-dp fit`` run in a scratch directory; returns its MLflow run id."""
    from lightning_dp.cli import LightningDPCLI

    args = ["fit", "--config", str(HERE / config), f"--data.init_args.data_dir={data_dir}",
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


def fig2(args) -> tuple[object, str]:
    """Mean and std over clients of the released update norms per round, for epsilon in {0.4, 3, 20} and
    non-private local SGD, per partition."""
    from matplotlib.figure import Figure

    levels = [("eps 0.4", "norms_mnist.yaml", ["--model.init_args.update.init_args.target_epsilon=0.4"]),
              ("eps 3", "norms_mnist.yaml", ["--model.init_args.update.init_args.target_epsilon=3.0"]),
              ("eps 20", "norms_mnist.yaml", ["--model.init_args.update.init_args.target_epsilon=20.0"]),
              ("non-private", "nonprivate_mnist.yaml", [])]
    fig = Figure(figsize=(12, 3.6))
    axes = fig.subplots(1, len(PARTITIONS), sharey=True)
    rows = ["partition\tlevel\tround\tnorm_mean\tnorm_std"]
    for ax, (partition, data_args) in zip(axes, PARTITIONS.items()):
        for label, config, update_args in levels:
            run_id = _run(config, data_args + update_args + [f"--trainer.max_epochs={args.rounds}"],
                          data_dir=args.data_dir, experiment="pdpfl-fig2", run_name=f"{partition} {label}")
            mean, std = _history(run_id, "round/update_norm_mean"), _history(run_id, "round/update_norm_std")
            rounds = list(range(1, len(mean) + 1))
            ax.errorbar(rounds, mean, yerr=std, label=label, marker=".", capsize=2)
            rows += [f"{partition}\t{label}\t{r}\t{m:.6g}\t{s:.6g}" for r, m, s in zip(rounds, mean, std)]
        ax.set_title(partition)
        ax.set_xlabel("round")
        ax.set_yscale("log")
    axes[0].set_ylabel("L2 norm of released updates (mean ± std)")
    axes[-1].legend()
    fig.suptitle("MNIST logistic regression, 10 clients, local DP-SGD (B = 64, C = 1, lr 0.01)")
    return fig, "\n".join(rows) + "\n"


def fig3(args) -> tuple[object, str]:
    """Accuracy of the budget-agnostic split after the warm-start round, per partition and budget distribution
    (each client's noise calibrated for the full run of ``--rounds`` rounds), over budget seeds."""
    import numpy as np
    from matplotlib.figure import Figure

    distributions = ["MixGauss1", "MixGauss2", "MixGauss3", "MixGauss4", "Gauss", "Uniform"]
    rows = ["partition\tdistribution\tbudget_seed\tsplit_accuracy\tpublic_clients"]
    results: dict[tuple[str, str], list[float]] = {}
    for partition, data_args in PARTITIONS.items():
        for dist in distributions:
            for seed in args.seeds:
                overrides = data_args + [
                    f"--model.init_args.update.init_args.budgets.init_args.distribution={dist}",
                    f"--model.init_args.update.init_args.budgets.init_args.seed={seed}",
                    f"--model.init_args.update.init_args.participations={args.rounds}",
                    "--trainer.max_epochs=1"]
                run_id = _run("indirect_mnist.yaml", overrides, data_dir=args.data_dir, experiment="pdpfl-fig3",
                                 run_name=f"{partition} {dist} budgets {seed}")
                accuracy = _history(run_id, "pdpfl/split_accuracy")[0]
                public = _history(run_id, "pdpfl/public_clients")[0]
                results.setdefault((partition, dist), []).append(accuracy)
                rows.append(f"{partition}\t{dist}\t{seed}\t{accuracy:.4g}\t{public:g}")
    fig = Figure(figsize=(9, 3.8))
    ax = fig.subplots()
    width = 0.8 / len(distributions)
    for j, dist in enumerate(distributions):
        means = [np.mean(results[(p, dist)]) for p in PARTITIONS]
        stds = [np.std(results[(p, dist)]) for p in PARTITIONS]
        ax.bar(np.arange(len(PARTITIONS)) + j * width, means, width, yerr=stds, capsize=2, label=dist)
    ax.set_xticks(np.arange(len(PARTITIONS)) + width * (len(distributions) - 1) / 2, list(PARTITIONS))
    ax.set_ylabel(f"split accuracy after the warm start (mean ± std, {len(args.seeds)} budget draws)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize="small", ncol=3)
    ax.set_title("Budget-agnostic split: 2-component mixture on the update norms, MNIST, 10 clients")
    return fig, "\n".join(rows) + "\n"


def fig4(args) -> tuple[object, str]:
    """Test accuracy per round of PFA (direct, indirect), FedAvg, Minimum and NP-FedAvg, over seeds."""
    import numpy as np
    from matplotlib.figure import Figure

    methods = [("PFA (indirect)", "indirect_mnist.yaml"), ("PFA (direct)", "direct_mnist.yaml"),
               ("FedAvg", "fedavg_mnist.yaml"), ("Minimum", "minimum_mnist.yaml"),
               ("NP-FedAvg", "nonprivate_mnist.yaml")]
    rows = ["method\tseed\tround\ttest_acc"]
    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    for label, config in methods:
        curves = []
        for seed in args.seeds:
            run_id = _run(config, [f"--model.init_args.seed={seed}", f"--trainer.max_epochs={args.rounds}",
                                      "--trainer.check_val_every_n_epoch=1", f"--data.init_args.seed={seed}"],
                             data_dir=args.data_dir, experiment="pdpfl-fig4", run_name=f"{label} seed {seed}")
            curve = _history(run_id, "val/acc")
            curves.append(curve)
            rows += [f"{label}\t{seed}\t{r}\t{a:.4g}" for r, a in enumerate(curve, start=1)]
        length = min(len(c) for c in curves)
        values = np.array([c[:length] for c in curves])
        rounds = np.arange(1, length + 1)
        ax.plot(rounds, values.mean(0), marker=".", label=label)
        ax.fill_between(rounds, values.mean(0) - values.std(0), values.mean(0) + values.std(0), alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel(f"held-out accuracy (mean ± std over {len(args.seeds)} seeds)")
    ax.legend()
    ax.set_title("MNIST, 10 clients, MixGauss1 budgets, local DP-SGD")
    return fig, "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("figure", choices=["fig2", "fig3", "fig4"])
    parser.add_argument("--data-dir", default=str((ROOT / "../shared/data/mnist").resolve()))
    parser.add_argument("--out", default=str(ROOT / "docs" / "figures"))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seeds", type=lambda s: [int(v) for v in s.split(",")], default=[0, 1, 2])
    args = parser.parse_args(argv)
    logging.getLogger("absl").setLevel(logging.ERROR)
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{(Path.cwd() / 'mlruns' / 'mlflow.db').resolve()}")
    (Path.cwd() / "mlruns").mkdir(exist_ok=True)
    fig, table = {"fig2": fig2, "fig3": fig3, "fig4": fig4}[args.figure](args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out / f"pdpfl_{args.figure}.png", dpi=120)
    (out / f"pdpfl_{args.figure}.tsv").write_text(table)
    import mlflow

    mlflow.set_experiment(f"pdpfl-{args.figure}")
    with mlflow.start_run(run_name=f"{args.figure} summary") as parent:  # the runs of the figure are its children
        mlflow.log_artifact(str(out / f"pdpfl_{args.figure}.png"))
        mlflow.log_artifact(str(out / f"pdpfl_{args.figure}.tsv"))
        client = mlflow.MlflowClient()
        for run_id in _RUN_IDS:
            client.set_tag(run_id, "mlflow.parentRunId", parent.info.run_id)
    print(f"wrote {out / f'pdpfl_{args.figure}.png'} and .tsv")


if __name__ == "__main__":
    main(sys.argv[1:])
