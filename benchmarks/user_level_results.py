"""The runs of docs/results_user_level.md: which user-level algorithm for which data (issue 51).

    python benchmarks/user_level_results.py [--out /tmp/user_level_results] [--seeds 0 1 2] [--report-only]

Every run is ``lightning-dp fit`` (LightningDPCLI, in this process, as ``lightning-dp grid`` runs its points) of a
config of examples/user_level/ with overrides, followed by a test on the data's 200 held-out test users (2,000
samples), recorded in the MLflow store ``<out>/mlruns`` (experiment ``user-level-results``); the tables are read
back from that store, so ``--report-only`` prints them again without training.

The runs, each for every seed S (``seed_everything=S``; the DP noise seed ``1000 + S``: DPSGD's
``--trainer.callbacks.init_args.seed``, FederatedRound's ``--model.init_args.noise_seed``):

- part 1, the configs' data (800 users of g1's rule, 200 of g2's opposite rule; 1000 x 10 samples), the configs'
  target (epsilon 4 per user at delta 1e-5), 10 epochs of ~400 expected records per step:
  ``els`` (els_synthetic.yaml), ``group`` (group_synthetic.yaml), ``uls`` (uls_synthetic.yaml), ``example``
  (els_synthetic.yaml at privacy_unit example on all 10 records per user: epsilon 4 per EXAMPLE, 250 steps),
  ``fedavg`` (DP-FedAvg, client = user, epsilon 4 per client; the config below, 100 rounds of ~100 users) and
  ``nonprivate`` (els_synthetic.yaml without DPSGD, all records: the ceiling);
- part 1b, strong privacy: ``els``, ``group``, ``uls``, ``fedavg`` at epsilon 0.05 per user (delta 1e-5);
- part 2, ELS and ULS again with ``minority_fraction`` 0.02 (980 users of g1's rule, 20 of g2's: users alike) at
  both targets (the configs' data, 0.2, is part 1's and 1b's runs);
- part 3, compute: ELS and ULS for 30 epochs (300 steps, the noise calibrated for them) instead of 10, at both
  targets, on the configs' data.

Nothing here changes the library; the configs are the examples' with the overrides below.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "examples" / "user_level"
EXPERIMENT = "user-level-results"

EXAMPLE_LEVEL = [  # els_synthetic.yaml at the example level, on every record (no bound)
    "--trainer.callbacks.init_args.privacy_unit=example",
    "--trainer.callbacks.init_args.max_examples_per_user=null",
    "--trainer.callbacks.init_args.user_accounting=null",
]

# DP-FedAvg at the same unit (client = user) on the same generated clients, as a FederatedDataModule: ~100 users
# per round (q = 0.1, ULS's users' rate) for 100 rounds (ULS's 100 steps); each selected user runs one local epoch
# of SGD (lr 0.5, batches of 5: two steps) on all its 10 records from the global model; the server clips every
# update at 0.5 (= lr x ULS's gradient clip 1.0), adds N(0, (z C)^2) to the sum and divides by q N; z calibrated
# to epsilon 4 per client at delta 1e-5 over the 100 rounds.
FEDAVG_YAML = """\
seed_everything: 0
model:
  class_path: lightning_dp.federated.FederatedRound
  init_args:
    model:
      class_path: lightning_dp.models.LogisticRegression
      init_args: {in_features: 2, num_classes: 2}
    selection:
      class_path: lightning_dp.federated.parts.PoissonSelection
      init_args: {sample_rate: 0.1}
    update:
      class_path: lightning_dp.federated.parts.LocalSGD
      init_args: {epochs: 1, lr: 0.5, batch_size: 5}
    aggregator: fedavg
    server_privacy:
      class_path: lightning_dp.federated.parts.CentralGaussian
      init_args: {target_epsilon: 4.0, target_delta: 1.0e-5, clip: 0.5}
    loss: cross_entropy
    seed: 0
data:
  class_path: lightning_dp.datamodules.SyntheticFairnessDataModule
  init_args:
    num_clients: 1000
    samples_per_client: 10
    num_val_clients: 100
    num_test_clients: 200
    seed: 0
trainer:
  max_epochs: 100
  check_val_every_n_epoch: 10
  log_every_n_steps: 10
  accelerator: cpu
  devices: 1
  enable_progress_bar: false
  logger:
    class_path: lightning_dp.tracking.MLFlowLogger
    init_args:
      experiment_name: user-level-results
"""

#: name -> (config, overrides, how it is seeded: "dpsgd" or "fedavg")
ALGORITHMS = {
    "els": ("els_synthetic.yaml", [], "dpsgd"),
    "group": ("group_synthetic.yaml", [], "dpsgd"),
    "uls": ("uls_synthetic.yaml", [], "dpsgd"),
    "example": ("els_synthetic.yaml", EXAMPLE_LEVEL, "dpsgd"),
    "fedavg": ("fedavg_synthetic.yaml", [], "fedavg"),  # written into <out> from FEDAVG_YAML
    "nonprivate": ("els_synthetic.yaml", ["--trainer.callbacks=[]"], "none"),
}
LABELS = {
    "els": "ELS (mixture), k = 4",
    "group": "group privacy, k = 4",
    "uls": "ULS, k = 4",
    "example": "example-level DP-SGD, all 10 records",
    "fedavg": "DP-FedAvg, client = user, all 10 records",
    "nonprivate": "non-private, all 10 records (reference)",
}
PART1 = ["els", "group", "uls", "example", "fedavg", "nonprivate"]
STRONG = ["els", "group", "uls", "fedavg"]
PART2 = ["els", "uls"]
EPSILON, STRONG_EPSILON = 4.0, 0.05
ALIKE = 0.02  # part 2's minority_fraction (the configs' data: 0.2)
EPOCHS, LONG_EPOCHS = 10, 30  # the configs' and part 3's

Run = tuple[str, float, float, int, int]  # algorithm, minority_fraction, target epsilon per user, epochs, seed
Key = tuple[str, float, float, int]  # a Run without its seed


def run_name(algorithm: str, minority: float, epsilon: float, epochs: int, seed: int) -> str:
    return f"{algorithm}_minority{minority:g}_eps{epsilon:g}_epochs{epochs}_seed{seed}"


def plan(seeds: list[int]) -> list[Run]:
    runs = [(a, 0.2, EPSILON, EPOCHS, s) for a in PART1 for s in seeds]
    runs += [(a, 0.2, STRONG_EPSILON, EPOCHS, s) for a in STRONG for s in seeds]
    runs += [(a, ALIKE, e, EPOCHS, s) for e in (EPSILON, STRONG_EPSILON) for a in PART2 for s in seeds]
    runs += [(a, 0.2, e, LONG_EPOCHS, s) for e in (EPSILON, STRONG_EPSILON) for a in PART2 for s in seeds]
    return runs


def arguments(out: Path, algorithm: str, minority: float, epsilon: float, epochs: int, seed: int) -> list[str]:
    config, overrides, kind = ALGORITHMS[algorithm]
    path = out / config if kind == "fedavg" else CONFIGS / config
    args = ["fit", "--config", str(path), *overrides, f"--seed_everything={seed}",
            "--trainer.logger.init_args.experiment_name=" + EXPERIMENT,
            "--trainer.logger.init_args.run_name=" + run_name(algorithm, minority, epsilon, epochs, seed),
            "--trainer.enable_progress_bar=false"]
    if epochs != EPOCHS:
        if kind != "dpsgd":
            raise ValueError(f"{algorithm}: only the DPSGD runs are planned at {epochs} epochs")
        args += [f"--trainer.max_epochs={epochs}", f"--trainer.callbacks.init_args.epochs={epochs}"]
    if kind == "fedavg":
        args += [f"--model.init_args.seed={seed}", f"--model.init_args.noise_seed={1000 + seed}"]
        if epsilon != EPSILON:
            args.append(f"--model.init_args.server_privacy.init_args.target_epsilon={epsilon}")
        if minority != 0.2:
            args.append(f"--data.init_args.minority_fraction={minority}")
        return args
    if kind == "dpsgd":
        args.append(f"--trainer.callbacks.init_args.seed={1000 + seed}")
        if epsilon != EPSILON:
            args.append(f"--trainer.callbacks.init_args.target_epsilon={epsilon}")
    if minority != 0.2:
        args.append(f"--data.init_args.federated.init_args.minority_fraction={minority}")
    return args


def fit_and_test(args: list[str]) -> float:
    """``lightning-dp fit`` with ``args``, then a test of the trained model; the seconds both took, also logged to
    the run as ``results/wall_seconds``. Shared with benchmarks/user_level_femnist.py."""
    from lightning_dp.commands.fit import LightningDPCLI

    start = time.perf_counter()
    cli = LightningDPCLI(args=args)
    cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)
    seconds = time.perf_counter() - start
    for logger in cli.trainer.loggers:
        run_id, client = getattr(logger, "run_id", None), getattr(logger, "experiment", None)
        if run_id and client is not None:
            client.log_metric(run_id, "results/wall_seconds", seconds)
    return seconds


def finished_runs(out: Path, experiment_name: str) -> dict[str, Any]:
    """The latest finished MLflow run of every run name in ``experiment_name`` of ``<out>/mlruns`` (a rerun of one
    name replaces the earlier one). Shared with benchmarks/user_level_femnist.py."""
    import mlflow
    from mlflow.tracking import MlflowClient

    mlflow.set_tracking_uri(f"sqlite:///{(out / 'mlruns' / 'mlflow.db').as_posix()}")
    client = MlflowClient()
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        raise SystemExit(f"no experiment {experiment_name!r} in {out / 'mlruns'}: run without --report-only first")
    latest = {}
    for found in client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"]):
        if found.info.status == "FINISHED":
            latest[found.info.run_name] = found
    return latest


def train(out: Path, runs: list[Run]) -> None:
    (out / "fedavg_synthetic.yaml").write_text(FEDAVG_YAML)
    os.chdir(out)  # the default MLflow store: <out>/mlruns
    for i, (algorithm, minority, epsilon, epochs, seed) in enumerate(runs):
        args = arguments(out, algorithm, minority, epsilon, epochs, seed)
        print(f"[{i + 1}/{len(runs)}] lightning-dp " + " ".join(args), flush=True)
        print(f"    {fit_and_test(args):.1f} s", flush=True)


def collect(out: Path) -> dict[Key, list[dict]]:
    rows: dict[Key, list[dict]] = {}
    for name, found in finished_runs(out, EXPERIMENT).items():
        algorithm, minority, epsilon, epochs, seed = name.split("_")
        metrics, params = found.data.metrics, found.data.params
        key = (algorithm, float(minority.removeprefix("minority")), float(epsilon.removeprefix("eps")),
               int(epochs.removeprefix("epochs")))
        rows.setdefault(key, []).append({
            "seed": int(seed.removeprefix("seed")),
            "test/acc": metrics.get("test/acc"), "val/acc": metrics.get("val/acc"), "test/loss": metrics.get("test/loss"),
            "epsilon": metrics.get("privacy/epsilon"),
            "sigma": float(params.get("privacy/noise_multiplier", metrics.get("privacy/noise_multiplier", "nan"))),
            "steps": metrics.get("privacy/steps"),
            "seconds": metrics.get("results/wall_seconds"),
        })
    for values in rows.values():
        values.sort(key=lambda r: r["seed"])
    return rows


def mean_std(values: list[float], digits: int = 3) -> str:
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return f"{values[0]:.{digits}f} (n = 1)" if values else "-"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def per_run(rows: list[dict], key: str, fmt: str) -> str:
    return ", ".join(format(r[key], fmt) if r[key] is not None and r[key] == r[key] else "-" for r in rows)


def per_user_of_example_level(sigma: float) -> str:
    """The per-user epsilon of an example-level run (all 10 records, q = 400 / 10000, 250 steps) by the calculator."""
    found = {}
    for accounting in ("group", "mixture"):
        command = ["lightning-dp", "epsilon", "--dataset-size", "10000", "--batch-size", "400", "--epochs", "10",
                   "--noise-multiplier", f"{sigma:.4f}", "--max-examples-per-user", "10",
                   "--user-accounting", accounting]
        first = subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()[0]
        found[accounting] = first.split("epsilon = ")[1].split(" ")[0]
    return f"group privacy {found['group']}, mixture {found['mixture']}"


def table(rows: dict, keys: list[Key], first: str) -> list[str]:
    lines = [f"| {first} | n | test/acc | test/loss | val/acc | noise multiplier per run | final epsilon per run | "
             "steps | s per run |", "|---|---|---|---|---|---|---|---|---|"]
    for key in keys:
        r = rows.get(key, [])
        if not r:
            continue
        algorithm, minority, epsilon, epochs = key
        label = LABELS[algorithm]
        if first != "algorithm":
            label += f", minority_fraction {minority:g}" if "data" in first else f", {epochs} epochs"
        steps = "100 rounds" if algorithm == "fedavg" else per_run(r, "steps", ".0f")
        lines.append(f"| {label} | {len(r)} | {mean_std([x['test/acc'] for x in r])} | "
                     f"{mean_std([x['test/loss'] for x in r])} | "
                     f"{mean_std([x['val/acc'] for x in r])} | {per_run(r, 'sigma', '.3f')} | "
                     f"{per_run(r, 'epsilon', '.3f')} | {steps} | {mean_std([x['seconds'] for x in r], 0)} |")
    return lines


def difference(rows: dict, a: Key, b: Key, metric: str = "test/acc") -> str:
    """``a - b`` in ``metric``: the mean difference and Welch's t (the difference over its standard error)."""
    x, y = [r[metric] for r in rows.get(a, [])], [r[metric] for r in rows.get(b, [])]
    if len(x) < 2 or len(y) < 2:
        return "-"
    diff = statistics.mean(x) - statistics.mean(y)
    se = (statistics.variance(x) / len(x) + statistics.variance(y) / len(y)) ** 0.5
    verdict = "within noise" if abs(diff) < 2 * se else "beyond noise"
    return f"{diff:+.3f} (t = {diff / se:+.1f}, {verdict})" if se > 0 else f"{diff:+.3f}"


def paired(rows: dict, a: Key, b: Key, metric: str = "test/acc") -> str:
    """Per-seed differences ``a - b`` (runs of one seed share the DP seed)."""
    x = {r["seed"]: r[metric] for r in rows.get(a, [])}
    y = {r["seed"]: r[metric] for r in rows.get(b, [])}
    d = [x[s] - y[s] for s in sorted(x) if s in y]
    if len(d) < 2:
        return "-"
    t = statistics.mean(d) / (statistics.stdev(d) / len(d) ** 0.5) if statistics.stdev(d) > 0 else float("inf")
    return f"mean {statistics.mean(d):+.3f}, per seed " + ", ".join(f"{v:+.3f}" for v in d) + f" (paired t = {t:+.1f})"


def report(out: Path) -> str:
    rows = collect(out)
    E, S, N = EPSILON, STRONG_EPSILON, EPOCHS
    lines = [f"### Part 1: epsilon {E:g} per user (delta 1e-5), the configs' data (800 + 200 users)", ""]
    lines += table(rows, [(a, 0.2, E, N) for a in PART1], "algorithm")
    example = rows.get(("example", 0.2, E, N), [])
    if example:
        sigmas = sorted({round(x["sigma"], 4) for x in example})
        lines += ["", "Per-user epsilon at delta 1e-5 of the example-level runs (k = 10 records per user, q = 0.04, "
                  "250 steps; `lightning-dp epsilon`): "
                  + "; ".join(f"sigma {s}: {per_user_of_example_level(s)}" for s in sigmas)]
    lines += ["", f"### Part 1b: epsilon {S:g} per user (delta 1e-5), the same data", ""]
    lines += table(rows, [(a, 0.2, S, N) for a in STRONG], "algorithm")
    lines += ["", f"### Part 2: users alike (minority_fraction {ALIKE:g}) and the configs' data (0.2)", ""]
    for epsilon in (E, S):
        lines += [f"epsilon {epsilon:g} per user:", ""]
        lines += table(rows, [(a, m, epsilon, N) for m in (0.2, ALIKE) for a in PART2], "algorithm, data")
        lines.append("")
    lines += [f"### Part 3: {LONG_EPOCHS} epochs against {N}, the configs' data", ""]
    for epsilon in (E, S):
        lines += [f"epsilon {epsilon:g} per user:", ""]
        lines += table(rows, [(a, 0.2, epsilon, n) for n in (N, LONG_EPOCHS) for a in PART2], "algorithm, epochs")
        lines.append("")
    lines += ["### Differences (Welch's t over seeds; within noise: |difference| < 2 standard errors)", ""]
    comparisons = []
    for epsilon in (E, S):
        for other in ("group", "uls", "example", "fedavg"):
            comparisons.append((("els", 0.2, epsilon, N), (other, 0.2, epsilon, N)))
        comparisons.append((("uls", 0.2, epsilon, N), ("fedavg", 0.2, epsilon, N)))
        comparisons.append((("els", ALIKE, epsilon, N), ("uls", ALIKE, epsilon, N)))
        comparisons.append((("els", 0.2, epsilon, LONG_EPOCHS), ("uls", 0.2, epsilon, LONG_EPOCHS)))
    for a, b in comparisons:
        if a in rows and b in rows:
            lines.append(f"- {name_of(a)} minus {name_of(b)}: test/acc {difference(rows, a, b)}; "
                         f"test/loss {difference(rows, a, b, 'test/loss')}")
    lines += ["", "Paired by seed (ELS and group privacy of one seed draw the same batches and the same standard "
              "normal noise, scaled by their own sigma):", ""]
    for epsilon in (E, S):
        a, b = ("els", 0.2, epsilon, N), ("group", 0.2, epsilon, N)
        if a in rows and b in rows:
            lines.append(f"- {name_of(a)} minus {name_of(b)}: {paired(rows, a, b)}")
    lines += ["", "Per run (seed: test/acc):", ""]
    for key, r in sorted(rows.items()):
        lines.append(f"- {name_of(key)}: " + ", ".join(f"{x['seed']}: {x['test/acc']:.4f}" for x in r))
    return "\n".join(lines)


def name_of(key: Key) -> str:
    algorithm, minority, epsilon, epochs = key
    return f"{algorithm} (minority {minority:g}, eps {epsilon:g}, {epochs} epochs)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/user_level_results"),
                        help="folder of the MLflow store (outside the repository)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--only", nargs="+", choices=sorted(ALGORITHMS), help="run only these algorithms")
    parser.add_argument("--report-only", action="store_true", help="print the tables of the runs already recorded")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        runs = [r for r in plan(args.seeds) if not args.only or r[0] in args.only]
        start = time.perf_counter()
        train(out, runs)
        print(f"{len(runs)} runs in {time.perf_counter() - start:.0f} s", flush=True)
    print(report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
