"""Thesis Fig. 2.6 (003 Fig. 6): the synthetic fairness data, g1 and g2 apart and superimposed.

    python examples/fairness/figures.py fig2.6            # docs/figures/fairness_fig2_6.{png,tsv}, seconds
    python examples/fairness/figures.py fig2.6 --replot   # redraw from the TSV

The training clients of ``examples/fairness/synthetic.yaml`` (``SyntheticFairnessDataModule``, seed 0: 800 clients
of g1, 200 of g2, 10 samples each), drawn as the paper's figure is: the samples of g1, of g2, and both in the same
space, coloured by their binary label. The paper does not say what its axes are; here they are the two input
features, where each group's label is a half-plane up to the noise u in [0, 1) (g1: ``x^T theta1 + u >= 0``,
g2: ``x^T theta2 + u <= 0``), so the figure shows why one global model cannot serve both groups. The paper does
not state x's distribution either (ours: ``N(0, I)``, the DataModule's default).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from figure_table import table_then_figure  # noqa: E402  (examples/ is on the path from here)

CONFIG = ROOT / "examples" / "fairness" / "synthetic.yaml"


def measure_fig2_6() -> list[list]:
    """One row per training sample of the config's DataModule: group (1 = g1, 2 = g2), x1, x2, label."""
    import yaml

    from lightning_dp.datamodules import SyntheticFairnessDataModule

    settings = yaml.safe_load(CONFIG.read_text())["data"]["init_args"]
    datamodule = SyntheticFairnessDataModule(**settings)
    datamodule.setup("fit")
    rows = [["group", "x1", "x2", "label"]]
    for client in datamodule.train_clients:
        group = datamodule.group_of[client.client_id] + 1
        for x, y in zip(client.x.tolist(), client.y.tolist()):
            rows.append([group, f"{x[0]:.3f}", f"{x[1]:.3f}", y])
    return rows


def draw_fig2_6(table: list[dict]):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10.5, 3.6), layout="constrained")
    axes = fig.subplots(1, 3, sharex=True, sharey=True)
    groups = {"1": "g1 (majority, 80 %)", "2": "g2 (minority, 20 %)"}
    markers = {"1": "o", "2": "^"}
    for ax, shown, title in zip(axes, (["1"], ["2"], ["1", "2"]), (groups["1"], groups["2"], "g1 and g2 together")):
        for group in shown:
            for label, colour in (("0", "C0"), ("1", "C3")):
                points = [r for r in table if r["group"] == group and r["label"] == label]
                ax.scatter([float(r["x1"]) for r in points], [float(r["x2"]) for r in points], s=3, alpha=0.35,
                           marker=markers[group], color=colour,
                           label=f"g{group}, label {label} ({len(points)})")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("x1")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, markerscale=3, loc="upper right")
    axes[0].set_ylabel("x2")
    fig.suptitle("Thesis Fig. 2.6 (003 Fig. 6): the training samples of examples/fairness/synthetic.yaml "
                 "(x ~ N(0, I), seed 0)", fontsize=9)
    return fig


FIGURES = {"fig2.6": (measure_fig2_6, draw_fig2_6)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("figure", choices=sorted(FIGURES))
    parser.add_argument("--out", default=str(ROOT / "docs" / "figures"))
    parser.add_argument("--replot", action="store_true", help="redraw the figure from its TSV in --out")
    args = parser.parse_args(argv)
    measure, draw = FIGURES[args.figure]
    table_then_figure(Path(args.out), "fairness_" + args.figure.replace(".", "_"), measure, draw, replot=args.replot,
                      dpi=110)

if __name__ == "__main__":
    main()
