"""The FEMNIST runs of docs/results_user_level.md, part 4: user-level DP-SGD with writers as users (issue 51).

    python benchmarks/user_level_femnist.py --data-dir DIR [--out /tmp/user_level_femnist] [--seeds 0 1 2]
    python benchmarks/user_level_femnist.py --data-dir DIR --out /tmp/user_level_femnist --report-only

``DIR`` holds LEAF's FEMNIST output (``train/`` and ``test/`` folders of JSON files); the page's runs used LEAF's
5 % non-IID sample (``-s niid --sf 0.05``). Every run is ``lightning-dp fit`` (LightningDPCLI, in this process, as
benchmarks/user_level_results.py runs its points) followed by a test on the LEAF test images of the loaded writers,
recorded in the MLflow store ``<out>/mlruns`` (experiment ``user-level-femnist``); the tables are read back from
that store (``--report-only`` prints them again without training) and every run is also written to
``<out>/runs.tsv``.

FEMNISTDataModule (source leaf, rotate_probability 0, seed 0) splits the writers with training images 80 / 20
into training and validation writers (the validation writers' training images, whole, are the validation set);
the test set is the LEAF test images of all those writers. The runs, each for every seed S (``seed_everything=S``;
the DP noise seed ``1000 + S``: DPSGD's ``--trainer.callbacks.init_args.seed``, FederatedRound's
``--model.init_args.noise_seed``), at each target epsilon per writer (delta 1e-5), 100 steps or rounds:

- ``uls``: examples/user_level/uls_femnist.yaml (ULS, k = 8 images per writer, 21 expected writers per step);
- ``els``: the same with example-level sampling and the mixture accountant (166 expected images per step, the
  same records per step as ULS: q x 663 kept images);
- ``group``: ``els`` with group privacy instead of the mixture;
- ``example``: example-level DP-SGD at the same epsilon per EXAMPLE on all training images (no bound), 166
  expected images per step over the same 25 epochs (1,800 steps);
- ``fedavg``: DP-FedAvg, client = writer, epsilon per client (FEDAVG_YAML below);
- ``nonprivate`` (once, not per epsilon): uls_femnist.yaml without DPSGD, all images, shuffled batches of 166,
  lr 0.5 (lr 4 is for updates clipped at 0.1).

Validation runs once, after the last epoch (``check_val_every_n_epoch=25``), to save time; the models are the
same. The LEAF JSON files are parsed once per process (read_leaf_dir is memoized here; the data modules build
their tensors from the parsed arrays every run, as before). Nothing here changes the library.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from user_level_results import difference, finished_runs, fit_and_test, mean_std, paired, per_run  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "examples" / "user_level" / "uls_femnist.yaml"
EXPERIMENT = "user-level-femnist"
EPOCHS = 25
IMAGES_PER_STEP = 166  # ELS's expected batch: q = 0.25 of the 663 images kept at k = 8 (ULS's 21 writers x ~7.9)

ELS = [  # uls_femnist.yaml with example-level sampling: records Poisson-sampled, the mixture over k = 8
    "--trainer.callbacks.init_args.sampling=example",
    "--trainer.callbacks.init_args.user_accounting=mixture",
    f"--data.init_args.federated.init_args.batch_size={IMAGES_PER_STEP}",
]
EXAMPLE_LEVEL = [  # example-level DP-SGD on every training image (no bound)
    "--trainer.callbacks.init_args.privacy_unit=example",
    "--trainer.callbacks.init_args.sampling=example",
    "--trainer.callbacks.init_args.max_examples_per_user=null",
    "--trainer.callbacks.init_args.user_accounting=null",
    f"--data.init_args.federated.init_args.batch_size={IMAGES_PER_STEP}",
]
NONPRIVATE = ["--trainer.callbacks=[]", f"--data.init_args.federated.init_args.batch_size={IMAGES_PER_STEP}",
              "--model.init_args.lr=0.5"]

# DP-FedAvg at the same unit (client = writer) on the same writers, FEMNISTDataModule as the federated data: ~21
# writers per round (q = 0.25, ULS's rate) for 100 rounds (ULS's 100 steps); each selected writer runs one local
# epoch of SGD (lr 0.1, batches of 32: about 5 steps) on ALL its training images from the global model; the server
# clips every update at 0.4 (= lr x C of the centralized runs, 4 x 0.1), adds N(0, (z C)^2) to the sum and
# divides by q N; z calibrated to the target per client at delta 1e-5 over the 100 rounds. The same MLP.
FEDAVG_YAML = """\
seed_everything: 0
model:
  class_path: lightning_dp.federated.FederatedRound
  init_args:
    model:
      class_path: lightning_dp.models.MLP
      init_args: {{in_features: 784, hidden: [32], num_classes: 62}}
    selection:
      class_path: lightning_dp.federated.parts.PoissonSelection
      init_args: {{sample_rate: 0.25}}
    update:
      class_path: lightning_dp.federated.parts.LocalSGD
      init_args: {{epochs: 1, lr: 0.1, batch_size: 32}}
    aggregator: fedavg
    server_privacy:
      class_path: lightning_dp.federated.parts.CentralGaussian
      init_args: {{target_epsilon: 8.0, target_delta: 1.0e-5, clip: 0.4}}
    loss: cross_entropy
    seed: 0
data:
  class_path: lightning_dp.datamodules.FEMNISTDataModule
  init_args:
    data_dir: {data_dir}
    source: leaf
    val_fraction: 0.2
    rotate_probability: 0.0
    seed: 0
trainer:
  max_epochs: 100
  check_val_every_n_epoch: 100
  log_every_n_steps: 10
  accelerator: cpu
  devices: 1
  enable_progress_bar: false
  logger:
    class_path: lightning_dp.tracking.MLFlowLogger
    init_args:
      experiment_name: user-level-femnist
"""

#: name -> (overrides of uls_femnist.yaml, how it is seeded: "dpsgd", "fedavg" or "none")
ALGORITHMS = {
    "els": (ELS, "dpsgd"),
    "group": ([*ELS, "--trainer.callbacks.init_args.user_accounting=group"], "dpsgd"),
    "uls": ([], "dpsgd"),
    "example": (EXAMPLE_LEVEL, "dpsgd"),
    "fedavg": ([], "fedavg"),
    "nonprivate": (NONPRIVATE, "none"),
}
LABELS = {
    "els": "ELS (mixture), k = 8",
    "group": "group privacy, k = 8",
    "uls": "ULS, k = 8",
    "example": "example-level DP-SGD, all images (epsilon per image)",
    "fedavg": "DP-FedAvg, client = writer, all images",
    "nonprivate": "non-private, all images (reference)",
}
USER_LEVEL = ["els", "group", "uls", "fedavg", "example"]
EPSILONS = (32.0, 8.0)  # the looser target first (the one where the methods learn)
NONPRIVATE_EPSILON = float("inf")

DATA_DIR: list[Path] = []  # --data-dir, for the report's largest_writer
_LARGEST: list[int] = []

Run = tuple[str, float, int]  # algorithm, target epsilon, seed
Key = tuple[str, float]


def run_name(algorithm: str, epsilon: float, seed: int) -> str:
    return f"{algorithm}_eps{epsilon:g}_seed{seed}"


def plan(seeds: list[int], epsilons: tuple[float, ...] = EPSILONS) -> list[Run]:
    first, *rest = epsilons  # the non-private reference after the first target's runs
    runs = [(a, first, s) for a in USER_LEVEL for s in seeds] + [("nonprivate", NONPRIVATE_EPSILON, s) for s in seeds]
    return runs + [(a, e, s) for e in rest for a in USER_LEVEL for s in seeds]


def arguments(out: Path, data_dir: Path, algorithm: str, epsilon: float, seed: int) -> list[str]:
    overrides, kind = ALGORITHMS[algorithm]
    common = [f"--seed_everything={seed}", "--trainer.logger.init_args.experiment_name=" + EXPERIMENT,
              "--trainer.logger.init_args.run_name=" + run_name(algorithm, epsilon, seed),
              "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
    if kind == "fedavg":
        return ["fit", "--config", str(out / "fedavg_femnist.yaml"), *common, f"--model.init_args.seed={seed}",
                f"--model.init_args.noise_seed={1000 + seed}",
                f"--model.init_args.server_privacy.init_args.target_epsilon={epsilon}"]
    args = ["fit", "--config", str(CONFIG), *overrides, *common,
            f"--data.init_args.federated.init_args.data_dir={data_dir}",
            f"--trainer.check_val_every_n_epoch={EPOCHS}", "--trainer.log_every_n_steps=50"]
    if kind == "dpsgd":
        args += [f"--trainer.callbacks.init_args.seed={1000 + seed}",
                 f"--trainer.callbacks.init_args.target_epsilon={epsilon}"]
    return args


def parse_once() -> None:
    """Memoize FEMNIST's JSON parsing for this process (every run reads the same files; ~10 s each)."""
    import lightning_dp.datamodules.femnist as femnist

    original, parsed = femnist.read_leaf_dir, {}

    def read_leaf_dir(directory, *, users=None):
        key = (str(Path(directory).resolve()), None if users is None else tuple(sorted(users)))
        if key not in parsed:
            parsed[key] = original(directory, users=users)
        return parsed[key]

    femnist.read_leaf_dir = read_leaf_dir


def train(out: Path, data_dir: Path, runs: list[Run]) -> None:
    parse_once()
    (out / "fedavg_femnist.yaml").write_text(FEDAVG_YAML.format(data_dir=data_dir))
    os.chdir(out)  # the default MLflow store: <out>/mlruns
    for i, (algorithm, epsilon, seed) in enumerate(runs):
        args = arguments(out, data_dir, algorithm, epsilon, seed)
        print(f"[{i + 1}/{len(runs)}] lightning-dp " + " ".join(args), flush=True)
        print(f"    {fit_and_test(args):.1f} s", flush=True)


def collect(out: Path) -> dict[Key, list[dict]]:
    rows: dict[Key, list[dict]] = {}
    for name, found in finished_runs(out, EXPERIMENT).items():
        algorithm, epsilon, seed = name.split("_")
        metrics, params = found.data.metrics, found.data.params
        sigma = params.get("privacy/noise_multiplier", metrics.get("privacy/noise_multiplier"))
        rows.setdefault((algorithm, float(epsilon.removeprefix("eps"))), []).append({
            "seed": int(seed.removeprefix("seed")),
            "test/acc": metrics.get("test/acc"), "test/loss": metrics.get("test/loss"),
            "val/acc": metrics.get("val/acc"), "val/loss": metrics.get("val/loss"),
            "epsilon": metrics.get("privacy/epsilon"),
            "sigma": float(sigma) if sigma not in (None, "None") else float("nan"),
            "sample_rate": params.get("privacy/sample_rate", metrics.get("privacy/sample_rate")),
            "dataset_size": params.get("privacy/dataset_size"),
            "steps": metrics.get("privacy/steps"),
            "seconds": metrics.get("results/wall_seconds"),
        })
    for values in rows.values():
        values.sort(key=lambda r: r["seed"])
    return rows


def write_tsv(rows: dict[Key, list[dict]], path: Path) -> None:
    fields = ["algorithm", "target_epsilon", "seed", "test/acc", "test/loss", "val/acc", "val/loss",
              "noise_multiplier", "epsilon", "sample_rate", "dataset_size", "steps", "seconds"]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle, delimiter="\t")
        writer.writerow(fields)
        for (algorithm, epsilon), runs in sorted(rows.items()):
            for r in runs:
                writer.writerow([algorithm, f"{epsilon:g}", r["seed"], r["test/acc"], r["test/loss"], r["val/acc"],
                                 r["val/loss"], r["sigma"], r["epsilon"], r["sample_rate"], r["dataset_size"],
                                 r["steps"], r["seconds"]])


def table(rows: dict, keys: list[Key]) -> list[str]:
    lines = ["| algorithm | n | test/acc | test/loss | val/acc | noise multiplier per run | final epsilon per run | "
             "steps | s per run |", "|---|---|---|---|---|---|---|---|---|"]
    for key in keys:
        r = rows.get(key, [])
        if not r:
            continue
        steps = "100 rounds" if key[0] == "fedavg" else per_run(r, "steps", ".0f")
        lines.append(f"| {LABELS[key[0]]} | {len(r)} | {mean_std([x['test/acc'] for x in r])} | "
                     f"{mean_std([x['test/loss'] for x in r])} | {mean_std([x['val/acc'] for x in r])} | "
                     f"{per_run(r, 'sigma', '.3f')} | {per_run(r, 'epsilon', '.3f')} | {steps} | "
                     f"{mean_std([x['seconds'] for x in r], 0)} |")
    return lines


def per_writer_of_example_level(rows: dict, epsilon: float, timeout: float = 120.0) -> str:
    """The per-writer epsilon of an example-level run by ``lightning-dp epsilon``: every training image kept, so k is
    the largest writer's count (ELS's mixture over k, and group privacy), q and the steps as trained."""
    runs = rows.get(("example", epsilon), [])
    if not runs:
        return ""
    sigma = runs[0]["sigma"]
    n, k = int(runs[0]["dataset_size"]), largest_writer()
    found = {}
    for accounting in ("group", "mixture"):
        command = ["lightning-dp", "epsilon", "--dataset-size", str(n), "--batch-size", str(IMAGES_PER_STEP),
                   "--epochs", str(EPOCHS), "--noise-multiplier", f"{sigma:.4f}", "--max-examples-per-user", str(k),
                   "--user-accounting", accounting]
        try:
            first = subprocess.run(command, capture_output=True, text=True, check=True,
                                   timeout=timeout).stdout.splitlines()[0]
            found[accounting] = first.split("epsilon = ")[1].split(" ")[0]
        except subprocess.TimeoutExpired:
            found[accounting] = f"not computed within {timeout:.0f} s"
    return (f"epsilon {epsilon:g} per image (sigma {sigma:.4f}, N = {n}, B = {IMAGES_PER_STEP}, {EPOCHS} epochs), "
            f"per writer with k = {k} (the largest writer's images): group privacy {found['group']}, "
            f"mixture {found['mixture']}")


def largest_writer() -> int:
    """The most training images of one training writer (read from the data module the runs used)."""
    if not _LARGEST:
        from lightning_dp.datamodules import FEMNISTDataModule

        dm = FEMNISTDataModule(data_dir=DATA_DIR[0], source="leaf", val_fraction=0.2, rotate_probability=0.0, seed=0)
        dm.setup()
        _LARGEST.append(max(len(c.y) for c in dm.clients("train")))
    return _LARGEST[0]


def name_of(key: Key) -> str:
    algorithm, epsilon = key
    return f"{algorithm} (eps {epsilon:g})" if epsilon != NONPRIVATE_EPSILON else algorithm


def report(out: Path, per_writer: bool = True) -> str:
    rows = collect(out)
    write_tsv(rows, out / "runs.tsv")
    epsilons = sorted({e for (_, e) in rows if e != NONPRIVATE_EPSILON})
    lines = []
    for epsilon in epsilons:
        lines += [f"### epsilon {epsilon:g} per writer (delta 1e-5)", ""]
        lines += table(rows, [(a, epsilon) for a in USER_LEVEL] + [("nonprivate", NONPRIVATE_EPSILON)])
        if per_writer and ("example", epsilon) in rows:
            lines += ["", "Per-writer epsilon of the example-level runs (`lightning-dp epsilon`): "
                      + per_writer_of_example_level(rows, epsilon)]
        lines.append("")
    lines += ["### Differences (Welch's t over seeds; within noise: |difference| < 2 standard errors)", ""]
    for epsilon in epsilons:
        for a, b in (("uls", "els"), ("els", "group"), ("uls", "group"), ("fedavg", "uls"), ("fedavg", "els"),
                     ("example", "fedavg")):
            if (a, epsilon) in rows and (b, epsilon) in rows:
                lines.append(f"- {name_of((a, epsilon))} minus {name_of((b, epsilon))}: test/acc "
                             f"{difference(rows, (a, epsilon), (b, epsilon))}; test/loss "
                             f"{difference(rows, (a, epsilon), (b, epsilon), 'test/loss')}")
    lines += ["", "Paired by seed (ELS and group privacy of one seed share the DP seed):", ""]
    for epsilon in epsilons:
        a, b = ("els", epsilon), ("group", epsilon)
        if a in rows and b in rows:
            lines.append(f"- {name_of(a)} minus {name_of(b)}: {paired(rows, a, b)}")
    lines += ["", "Per run (seed: test/acc):", ""]
    for key, r in sorted(rows.items()):
        lines.append(f"- {name_of(key)}: " + ", ".join(f"{x['seed']}: {x['test/acc']:.4f}" for x in r))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, required=True,
                        help="LEAF's FEMNIST directory (train/ and test/ of JSON files)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/user_level_femnist"),
                        help="folder of the MLflow store and runs.tsv (outside the repository)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epsilons", type=float, nargs="+", default=list(EPSILONS),
                        help="target epsilons per writer (delta 1e-5)")
    parser.add_argument("--only", nargs="+", choices=sorted(ALGORITHMS), help="run only these algorithms")
    parser.add_argument("--report-only", action="store_true", help="print the tables of the runs already recorded")
    parser.add_argument("--no-per-writer", action="store_true",
                        help="skip the per-writer epsilon of the example-level runs (calls lightning-dp epsilon)")
    args = parser.parse_args(argv)
    out, data_dir = args.out.resolve(), args.data_dir.resolve()
    DATA_DIR.append(data_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        runs = [r for r in plan(args.seeds, tuple(args.epsilons)) if not args.only or r[0] in args.only]
        start = time.perf_counter()
        train(out, data_dir, runs)
        print(f"{len(runs)} runs in {time.perf_counter() - start:.0f} s", flush=True)
    print(report(out, per_writer=not args.no_per_writer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
