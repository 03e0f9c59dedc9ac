"""Thesis ch. 3 figures: Fig. 3.1 (cosine against C), Fig. 3.2 (OSO's noise frontier), Figs. 3.4, 3.7, 3.10 (the
MNIST grids at k = 7, 9, 5: Tables 3.2, 3.8, 3.11).

    python examples/oso/figures.py fig3.1            # docs/figures/oso_fig3_1.{png,tsv}, about a minute
    python examples/oso/figures.py fig3.2            # docs/figures/oso_fig3_2.{png,tsv}
    python examples/oso/figures.py fig3.10 --tracking-uri sqlite:///mlruns/oso.db   # the budgeted grids (repeatable)
    python examples/oso/figures.py fig3.7 --tracking-uri sqlite:///a.db --tracking-uri sqlite:///b.db   # k = 9 grids
    python examples/oso/figures.py fig3.2 --replot   # redraw from the TSV (any figure)

Figs. 3.10, 3.4 and 3.7 (MNIST test accuracy against epsilon, grids of k = 5, 7 and 9 points per range): read the
``lightning-dp grid --budget`` runs of docs/results_oso_mnist.md from MLflow (every grid parent with
``grid/budget_epsilon`` whose lr axis, its ``grid.lr`` param, has k values; its chosen runs ``grid.best_runs``, their
``test/acc`` and chosen lr, C and target quantile; the strategy is the config's name in the parent's run name) and
draw their mean and sample std per budget beside the thesis' Table 3.11 or 3.8 (dashed; Fig. 3.4's values are only
in the thesis' plot, its Table 3.2 gives the chosen hyper-parameters).

Fig. 3.1: why C matters. A CNN for character recognition is trained; at iterations t in {100, 250, 500,
750, 950} the DP-SGD gradient of one batch (clipped at C, averaged, noised) is compared with the batch's
true mean gradient by their cosine, averaged over 20 draws of the noise
(:func:`lightning_dp.privacy.clipping.sanitized_cosine`): small C biases the direction, large C drowns it
in noise. The thesis states neither the training nor nu of that figure; here: MNISTConvNet (Papernot's
strided CNN, tanh, not the thesis' Table 3.5 model) on 8,000 images of the official MNIST test split
(./data/mnist, downloaded there on first use; ``--data-dir`` reads a local copy), plain SGD at lr 0.1
(the trajectory is not private; only the measured release is DP-SGD's), the thesis' batch 512 (its Table
3.1), nu = 0.788 (the multiplier of one run at epsilon 3, delta 1e-5, over the thesis' 10 epochs of
60,000 images at batch 512).

OSO-DPSGD releases two sums of the same Poisson batch at each step: the clipped gradients with noise
multiplier nu_g and the unit vectors q_i with nu_q. Together they are one Gaussian mechanism of
multiplier nu when nu_g = (nu^-2 - nu_q^-2)^(-1/2) (thesis Proposition 1; in the code
:func:`lightning_dp.privacy.adaptive.oso_noise_split`). For a privacy requirement, nu is what the
accountant calibrates; every pair (nu_q, nu_g) on that curve spends the same. The thesis picks the point
where nu_g is 1 % above nu, nu_q = 7.124 nu. Fig. 3.2 draws the curves for several epsilons "from the MNIST
experiments": 60,000 training images, batch 512 (thesis Table 3.1), 10 epochs; the thesis does not state
delta nor how many runs share the budget there (its grids compose their runs), so the curves here are for
ONE run at delta 1e-5 with Poisson batches of expected size 512 and the PLD accountant, stated on the figure.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from figure_table import table_then_figure  # noqa: E402  (examples/ is on the path from here)

#: The setting of the curves (thesis ch. 3's MNIST: N, batch 512, 10 epochs; delta is ours): see the docstring.
SETTING = {"dataset_size": 60_000, "batch_size": 512, "epochs": 10, "delta": 1e-5}
EPSILONS = (1.0, 3.0, 5.0, 7.0, 9.0)
#: nu_q / nu along each curve (a curve exists for nu_q > nu only).
RATIOS = [1.0 + 0.02 * i for i in range(1, 50)] + [2.0 + 0.25 * i for i in range(1, 57)]


def frontier(noise_multiplier: float) -> list[tuple[float, float]]:
    """``(nu_q, nu_g)`` along the curve of one overall multiplier ``nu`` (every point composes to ``nu``)."""
    from lightning_dp.privacy.adaptive import oso_noise_split

    return [(nu_q, nu_g) for nu_g, nu_q in (oso_noise_split(noise_multiplier, q_noise_multiplier=r * noise_multiplier)
                                            for r in RATIOS)]


def measure_fig3_2() -> list[list]:
    from lightning_dp.privacy.adaptive import oso_noise_split
    from lightning_dp.privacy.calibration import calibrate_noise_multiplier, steps_for_epochs

    q = SETTING["batch_size"] / SETTING["dataset_size"]
    steps = steps_for_epochs(epochs=SETTING["epochs"], sample_rate=q)
    rows = [["epsilon", "nu", "nu_q", "nu_g", "chosen"]]
    for eps in EPSILONS:
        nu = calibrate_noise_multiplier(target_epsilon=eps, target_delta=SETTING["delta"], sample_rate=q,
                                        steps=steps)
        rows += [[eps, nu, nu_q, nu_g, 0] for nu_q, nu_g in frontier(nu)]
        nu_g, nu_q = oso_noise_split(nu)
        rows.append([eps, nu, nu_q, nu_g, 1])
    return rows


def draw_fig3_2(table: list[dict]):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4), layout="constrained")
    ax = fig.subplots()
    for i, eps in enumerate(dict.fromkeys(r["epsilon"] for r in table)):
        curve = [r for r in table if r["epsilon"] == eps and r["chosen"] == "0"]
        (chosen,) = [r for r in table if r["epsilon"] == eps and r["chosen"] == "1"]
        ax.plot([float(r["nu_q"]) for r in curve], [float(r["nu_g"]) for r in curve], color=f"C{i}",
                label=f"epsilon {float(eps):g} (nu = {float(chosen['nu']):.3f})")
        ax.plot([float(chosen["nu_q"])], [float(chosen["nu_g"])], "o", color=f"C{i}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("nu_q (noise multiplier of the sum of q_i)")
    ax.set_ylabel("nu_g (noise multiplier of the clipped gradient sum)")
    ax.set_title("OSO: pairs of equal privacy (Prop. 1); dots: nu_q = 7.124 nu, nu_g = 1.01 nu\n"
                 f"N = {SETTING['dataset_size']:,}, batch {SETTING['batch_size']}, {SETTING['epochs']} epochs, "
                 f"delta {SETTING['delta']:g}, PLD", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return fig


#: Fig. 3.1's setting (the thesis states none of it).
FIG31 = {"iterations": (100, 250, 500, 750, 950), "batch_size": 512, "lr": 0.1, "noise_multiplier": 0.788,
         "realizations": 20, "seed": 0, "clip_norms": [10 ** (-3 + 0.2 * i) for i in range(26)]}


def measure_fig3_1(data_dir: str | None = None) -> list[list]:
    import torch
    from torch.func import functional_call, grad, vmap

    from lightning_dp.datamodules import MNISTDataModule
    from lightning_dp.models import MNISTConvNet
    from lightning_dp.privacy.clipping import sanitized_cosine

    torch.manual_seed(FIG31["seed"])
    data = MNISTDataModule(data_dir=data_dir or "./data/mnist", download=True,
                           subset="t10k", train_fraction=0.8, val_fraction=0.1, batch_size=FIG31["batch_size"],
                           seed=FIG31["seed"])
    data.prepare_data()
    data.setup("fit")
    loader = data.train_dataloader()
    model = MNISTConvNet(activation="tanh")
    optimizer = torch.optim.SGD(model.parameters(), lr=FIG31["lr"])
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_of(p, x, y):
        out = functional_call(model, p, (x.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(out, y.unsqueeze(0))

    generator = torch.Generator().manual_seed(FIG31["seed"])
    norms = torch.tensor(FIG31["clip_norms"])
    rows, step = [["iteration", "max_grad_norm", "cosine", "cosine_without_noise"]], 0
    while step < max(FIG31["iterations"]):
        for x, y in loader:
            step += 1
            if step in FIG31["iterations"]:
                params = {k: v.detach() for k, v in model.named_parameters()}
                grads = vmap(grad(loss_of), in_dims=(None, 0, 0))(params, x, y)
                flat = torch.cat([g.flatten(1) for g in grads.values()], dim=1)
                cos = sanitized_cosine(flat, norms, noise_multiplier=FIG31["noise_multiplier"], generator=generator,
                                       realizations=FIG31["realizations"])
                bias = sanitized_cosine(flat, norms, noise_multiplier=0.0, generator=generator, realizations=1)
                rows += [[step, float(c), float(v), float(b)] for c, v, b in zip(norms, cos, bias)]
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step >= max(FIG31["iterations"]):
                break
    return rows


def draw_fig3_1(table: list[dict]):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.subplots()
    for i, t in enumerate(dict.fromkeys(r["iteration"] for r in table)):
        rows = [r for r in table if r["iteration"] == t]
        ax.plot([float(r["max_grad_norm"]) for r in rows], [float(r["cosine"]) for r in rows], marker=".",
                color=f"C{i}", label=f"t = {t}")
        ax.plot([float(r["max_grad_norm"]) for r in rows], [float(r["cosine_without_noise"]) for r in rows],
                linestyle=":", color=f"C{i}")
    ax.axhline(0, color="0.5", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("clipping norm C")
    ax.set_ylabel("cosine(sanitized gradient, true mean gradient)")
    ax.set_title(f"MNISTConvNet, batch {FIG31['batch_size']}, nu = {FIG31['noise_multiplier']:g}, mean over "
                 f"{FIG31['realizations']} noise draws\n(dotted: the same without noise, the clipping bias alone)",
                 fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return fig


#: Thesis Table 3.11 (MNIST, k = 5): {strategy: {epsilon: (accuracy %, std)}}.
THESIS_3_11 = {
    "online": {3: (91.19, 0.51), 5: (91.66, 0.50), 7: (92.96, 0.90), 9: (94.11, 0.63)},
    "adamwosm": {3: (91.27, 0.46), 5: (92.16, 0.38), 7: (92.76, 0.52), 9: (93.22, 0.70)},
    "fixed_threshold": {3: (89.2, 0.39), 5: (90.9, 0.49), 7: (91.4, 0.43), 9: (91.7, 0.42)},
    "fixed_quantile": {3: (87.91, 0.62), 5: (90.71, 0.69), 7: (91.16, 0.49), 9: (91.21, 0.47)},
}
#: Thesis Table 3.8 (MNIST, k = 9), the same layout.
THESIS_3_8 = {
    "online": {3: (90.69, 0.53), 5: (91.62, 0.83), 7: (92.94, 0.90), 9: (93.62, 0.91)},
    "adamwosm": {3: (90.62, 0.52), 5: (91.60, 0.39), 7: (92.19, 0.37), 9: (92.53, 0.33)},
    "fixed_threshold": {3: (86.83, 0.70), 5: (88.69, 0.57), 7: (90.04, 0.49), 9: (90.72, 0.47)},
    "fixed_quantile": {3: (85.48, 0.39), 5: (88.13, 0.59), 7: (90.73, 0.72), 9: (91.09, 0.51)},
}
STRATEGIES = tuple(THESIS_3_11)
#: The grid figures: figure -> (k, the thesis' table of accuracies or None where its values are only in the plot).
GRID_FIGURES = {"fig3.10": (5, THESIS_3_11), "fig3.4": (7, None), "fig3.7": (9, THESIS_3_8)}
#: The chosen run's hyper-parameters in the table (the grid's tags of its axes; empty where not an axis).
AXES = ("lr", "max_grad_norm", "target_quantile")


def measure_grids(tracking_uri: str | list[str] | None = None, experiment_name: str | None = None,
                  k: int | None = None) -> list[list]:
    """One row per chosen run of every budgeted grid: strategy, budget, run id, test accuracy (%) and the chosen
    point's lr, C and target quantile. ``tracking_uri``: one MLflow store or several (grids run apart, e.g. two at
    once on two cores, are read together). ``experiment_name``: only that experiment's grids (the scaled setting's
    is ``oso-mnist-t10k``; grids of another setting must not be pooled with them). ``k``: only grids whose lr axis
    has ``k`` values (the thesis' granularity; a grid's axes are its parent's ``grid.*`` params)."""
    from mlflow import MlflowClient

    rows = [["strategy", "epsilon", "run", "test_acc", *AXES]]
    uris = tracking_uri if isinstance(tracking_uri, list) else [tracking_uri]
    for uri in uris:
        rows += _chosen_runs(MlflowClient(uri), experiment_name, k)
    if len(rows) == 1:
        where = ", ".join(map(str, uris)) if tracking_uri else "MLFLOW_TRACKING_URI"
        raise SystemExit(f"no budgeted OSO grid{f' with k = {k}' if k else ''} with chosen runs in {where}: run the "
                         "grids of docs/results_oso_mnist.md (lightning-dp grid ... --budget EPS --select val/acc "
                         "--test) first")
    return rows


def _chosen_runs(client, experiment_name: str | None, k: int | None) -> list[list]:
    rows = []
    experiments = [e for e in client.search_experiments() if experiment_name in (None, e.name)]
    for experiment in experiments:
        for parent in client.search_runs([experiment.experiment_id], filter_string="attributes.run_name LIKE 'grid-%'",
                                         max_results=1000):
            budget = parent.data.metrics.get("grid/budget_epsilon")
            best = parent.data.tags.get("grid.best_runs")
            name = parent.info.run_name.split(" ", 1)
            if budget is None or not best or len(name) < 2 or name[1] not in STRATEGIES:
                continue
            if k is not None and len(parent.data.params.get("grid.lr", "").split(",")) != k:
                continue
            for run_id in filter(None, best.split(",")):  # a grid point without a run id leaves an empty item
                run = client.get_run(run_id)
                acc = run.data.metrics.get("test/acc")
                if acc is not None:
                    rows.append([name[1], f"{budget:g}", run_id, 100 * acc,
                                 *(run.data.tags.get(f"grid.{axis}", "") for axis in AXES)])
    return rows


def draw_grids(table: list[dict], k: int, thesis: dict | None, number: str):
    import statistics

    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4), layout="constrained")
    ax = fig.subplots()
    for i, strategy in enumerate(STRATEGIES):
        shift = 0.06 * (i - 1.5)
        ours: dict[float, list[float]] = {}
        for r in table:
            if r["strategy"] == strategy:
                ours.setdefault(float(r["epsilon"]), []).append(float(r["test_acc"]))
        if thesis is not None:
            eps = sorted(thesis[strategy])
            ax.errorbar([e + shift for e in eps], [thesis[strategy][e][0] for e in eps],
                        [thesis[strategy][e][1] for e in eps], color=f"C{i}", linestyle="--", marker="x", alpha=0.6,
                        capsize=2, label=None if ours else f"{strategy} (thesis only)")
        if ours:
            xs = sorted(ours)
            ax.errorbar([e + shift for e in xs], [statistics.mean(ours[e]) for e in xs],
                        [statistics.stdev(ours[e]) if len(ours[e]) > 1 else 0.0 for e in xs], color=f"C{i}",
                        marker="o", capsize=2, label=f"{strategy} (ours, n = {min(len(v) for v in ours.values())})")
    if thesis is not None:
        ax.plot([], [], "k--x", alpha=0.6, label=f"thesis Table {number} (n = 5)")
    ax.set_xlabel("epsilon (delta 1e-5, composed over each grid)")
    ax.set_ylabel("MNIST test accuracy (%), mean and sample std")
    figure = next(f for f, (size, _) in GRID_FIGURES.items() if size == k)
    ax.set_title(f"Thesis Fig. {figure[3:]} (k = {k}); ours: 8,000 images, 160 steps"
                 + ("" if thesis is not None else "; the thesis' values are only in its plot"), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def measure_fig3_10(tracking_uri=None, experiment_name=None):
    return measure_grids(tracking_uri, experiment_name, k=5)


def measure_fig3_4(tracking_uri=None, experiment_name=None):
    return measure_grids(tracking_uri, experiment_name, k=7)


def measure_fig3_7(tracking_uri=None, experiment_name=None):
    return measure_grids(tracking_uri, experiment_name, k=9)


def draw_fig3_10(table: list[dict]):
    return draw_grids(table, 5, THESIS_3_11, "3.11")


def draw_fig3_4(table: list[dict]):
    return draw_grids(table, 7, None, "3.2")


def draw_fig3_7(table: list[dict]):
    return draw_grids(table, 9, THESIS_3_8, "3.8")


FIGURES = {"fig3.1": (measure_fig3_1, draw_fig3_1), "fig3.2": (measure_fig3_2, draw_fig3_2),
           "fig3.4": (measure_fig3_4, draw_fig3_4), "fig3.7": (measure_fig3_7, draw_fig3_7),
           "fig3.10": (measure_fig3_10, draw_fig3_10)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("figure", choices=sorted(FIGURES))
    parser.add_argument("--out", default=str(ROOT / "docs" / "figures"))
    parser.add_argument("--replot", action="store_true", help="redraw the figure from its TSV in --out")
    parser.add_argument("--data-dir", default=None, help="fig3.1: the MNIST IDX files (default ./data/mnist, downloaded there on first use)")
    parser.add_argument("--tracking-uri", action="append", default=None,
                        help="fig3.4/3.7/3.10: an MLflow store of the grids, repeatable (default: MLFLOW_TRACKING_URI)")
    parser.add_argument("--experiment", default="oso-mnist-t10k", help="fig3.4/3.7/3.10: the grids' MLflow experiment")
    args = parser.parse_args(argv)
    measure, draw = FIGURES[args.figure]
    rows = (partial(measure, args.data_dir) if args.figure == "fig3.1" else
            partial(measure, args.tracking_uri, args.experiment) if args.figure in GRID_FIGURES else measure)
    table_then_figure(Path(args.out), "oso_" + args.figure.replace(".", "_"), rows, draw, replot=args.replot, dpi=120)

if __name__ == "__main__":
    main()
