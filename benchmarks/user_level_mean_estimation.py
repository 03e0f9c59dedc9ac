"""The runs of docs/results_user_level_mean.md: ELS against ULS on synthetic mean estimation (issue 51).

    python benchmarks/user_level_mean_estimation.py [--out /tmp/user_level_mean] [--seeds 0 1 2 3 4] [--report-only]

Charles et al. (SaTML 2025, "Fine-Tuning Large Language Models with User-Level Differential Privacy") check their
ELS/ULS findings on synthetic mean estimation; their setup and numbers are not on this machine, so this one is ours,
built from their abstract. Every run is a Lightning ``Trainer.fit`` of :class:`MeanModel` (one parameter vector
theta, loss ``0.5 ||theta - x||^2``, plain SGD) with lightning-dp's ``DPSGD`` callback, the noise calibrated by
DPSGD to a user-level target epsilon:

- ELS: ``DPSGD(privacy_unit="user", max_examples_per_user=K)`` (mixture accounting): records Poisson-sampled at
  ``q = B / (n K)`` over the kept records, each record's gradient clipped at C;
- ULS: the same with ``sampling="user"``: users Poisson-sampled at the same ``q`` (``B / K`` expected users per
  step, each with its K kept records: the same expected records per step), each user's mean gradient clipped at C.

Data (drawn from the seed of the run, the same for ELS and ULS of one seed): n users with m records each in d
dimensions; user means ``mu_u = mu + tau z_u``, records ``x = mu_u + s e`` (z, e standard normal), with
``tau^2 + s^2 = 1`` per coordinate so every record has the same marginal law ``N(mu, I)`` at every diversity
``r = s / tau``: only how a user's records vary around their own mean changes. The error of a run is
``||theta_T - mu||^2``, against the population mean mu (the generator's), after the last step.

The grid: diversity r x target epsilon x steps (compute) x {ELS, ULS}; C and lr of each algorithm in each cell are
chosen by a sweep on a tuning seed (``--tune-seed``, not among the reported seeds): the pair with the lowest error
of that one run. The reported seeds then run at the chosen pair. Every run is a row of ``<out>/runs.tsv``
(``--report-only`` prints the tables from it without training).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.callbacks import DPSGD

D, USERS, RECORDS, K = 16, 1000, 16, 8  # dimension, users, records per user, records kept per user
BATCH = 400  # expected records per step, both algorithms: q = 400 / (1000 x 8) = 0.05
DELTA = 1e-5  # < 1 / USERS
RATIOS = (0.1, 1.0, 10.0)  # r = s / tau, how varied a user's own records are
EPSILONS = (1.0, 8.0)
STEPS = (20, 160)  # compute: 1 and 8 epochs of the kept records (q = 0.05: 20 steps an epoch)
CLIPS = (1.0, 4.0)  # C: below and at the gradient norms near mu (records ~3.9, user means 1.5 to 3.9: the page)
TRAVEL = (7.0, 10.0, 14.0, 20.0, 28.0, 40.0)  # steps x lr x C: lr = travel / (steps x C)
TUNE_SEED = 100
ACCOUNTANT_KWARGS = {"value_discretization_interval": 1e-3}  # pessimistic PLD (an upper bound), as the configs
MU_SEED = 12345  # mu, the population mean: one fixed vector for every run
FIELDS = ["phase", "algorithm", "ratio", "epsilon", "steps", "clip", "lr", "seed", "error", "sigma",
          "final_epsilon", "global_step", "sample_rate", "seconds"]


def population_mean() -> torch.Tensor:
    return torch.randn(D, generator=torch.Generator().manual_seed(MU_SEED))


class UserRecords(TensorDataset):
    """n x m records ``(1, x)`` with ``user_ids``: the constant input 1 lets ``nn.Linear(1, d)`` hold theta."""

    def __init__(self, ratio: float, seed: int) -> None:
        tau, s = 1 / math.sqrt(1 + ratio**2), ratio / math.sqrt(1 + ratio**2)
        g = torch.Generator().manual_seed(seed)
        user_means = population_mean() + tau * torch.randn(USERS, D, generator=g)
        x = user_means.repeat_interleave(RECORDS, 0) + s * torch.randn(USERS * RECORDS, D, generator=g)
        super().__init__(torch.ones(len(x), 1), x)
        self.user_ids = [u for u in range(USERS) for _ in range(RECORDS)]


class UserData(L.LightningDataModule):
    def __init__(self, dataset: UserRecords, batch_size: int) -> None:
        super().__init__()
        self.dataset, self.batch_size = dataset, batch_size

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False)


class MeanModel(L.LightningModule):
    """theta = the weight of ``nn.Linear(1, d, bias=False)`` (a layer the per-sample engine supports), from 0."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.theta = torch.nn.Linear(1, D, bias=False)
        torch.nn.init.zeros_(self.theta.weight)

    def training_step(self, batch, batch_idx):
        one, x = batch
        return 0.5 * (self.theta(one) - x).square().sum(1).mean()  # the batch MEAN of per-record losses

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def run_one(algorithm: str, ratio: float, epsilon: float, steps: int, clip: float, lr: float, seed: int) -> dict:
    L.seed_everything(seed, verbose=False)
    data = UserRecords(ratio, seed)
    user = {"sampling": "user"} if algorithm == "uls" else {"user_accounting": "mixture"}
    dp = DPSGD(target_epsilon=epsilon, target_delta=DELTA, max_grad_norm=clip, max_steps=steps, accountant="pld",
               accountant_kwargs=ACCOUNTANT_KWARGS, seed=1000 + seed, privacy_unit="user",
               max_examples_per_user=K, log_nonprivate_metrics=False, **user)
    model = MeanModel(lr)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, max_steps=steps, max_epochs=-1,
                        callbacks=[dp])
    start = time.perf_counter()
    trainer.fit(model, UserData(data, BATCH // K if algorithm == "uls" else BATCH))
    seconds = time.perf_counter() - start
    theta = model.theta.weight.detach()[:, 0]
    return {"algorithm": algorithm, "ratio": ratio, "epsilon": epsilon, "steps": steps, "clip": clip, "lr": lr,
            "seed": seed, "error": float((theta - population_mean()).square().sum()),
            "sigma": float(dp.noise_multiplier), "final_epsilon": float(dp.epsilon),
            "global_step": trainer.global_step, "sample_rate": float(dp.sample_rate), "seconds": seconds}



def grid() -> list[tuple[float, float, int]]:
    """The cells: (ratio, epsilon, steps)."""
    return list(itertools.product(RATIOS, EPSILONS, STEPS))


def sweep(steps: int) -> list[tuple[float, float]]:
    """The (C, lr) pairs tried on the tuning seed for a run of ``steps`` steps."""
    return [(clip, round(travel / (steps * clip), 6)) for clip in CLIPS for travel in TRAVEL]


def read(out: Path) -> list[dict]:
    path = out / "runs.tsv"
    if not path.exists():
        return []
    with path.open() as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    for row in rows:
        for key in FIELDS:
            if key not in ("phase", "algorithm"):
                row[key] = float(row[key])
    return rows


def append(out: Path, row: dict) -> None:
    path = out / "runs.tsv"
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, delimiter="\t")
        if new:
            writer.writeheader()
        writer.writerow({key: row[key] for key in FIELDS})


def key_of(row: dict) -> tuple:
    return (row["phase"], row["algorithm"], float(row["ratio"]), float(row["epsilon"]), int(row["steps"]),
            float(row["clip"]), float(row["lr"]), int(row["seed"]))


def chosen(rows: list[dict], algorithm: str, ratio: float, epsilon: float, steps: int) -> dict | None:
    """The tuning run of lowest error of one algorithm in one cell (None before its sweep)."""
    tried = [r for r in rows if r["phase"] == "tune" and r["algorithm"] == algorithm and r["ratio"] == ratio
             and r["epsilon"] == epsilon and r["steps"] == steps]
    return min(tried, key=lambda r: r["error"] if math.isfinite(r["error"]) else math.inf) if tried else None


def train(out: Path, seeds: list[int], tune_seed: int) -> None:
    done = {key_of(r) for r in read(out)}
    cells = sorted(grid(), key=lambda cell: (cell[2], cell[1], cell[0]))  # the short runs first
    total = len(cells) * 2 * (len(CLIPS) * len(TRAVEL) + len(seeds))
    i = 0
    for ratio, epsilon, steps in cells:
        for algorithm in ("els", "uls"):
            plan = [("tune", clip, lr, tune_seed) for clip, lr in sweep(steps)]
            for phase, clip, lr, seed in plan + [("eval", None, None, s) for s in seeds]:
                i += 1
                if phase == "eval":
                    best = chosen(read(out), algorithm, ratio, epsilon, steps)
                    clip, lr = best["clip"], best["lr"]
                key = (phase, algorithm, ratio, epsilon, steps, clip, lr, seed)
                if key in done:
                    continue
                row = {"phase": phase, **run_one(algorithm, ratio, epsilon, steps, clip, lr, seed)}
                append(out, row)
                print(f"[{i}/{total}] {phase} {algorithm} r={ratio:g} eps={epsilon:g} steps={steps} C={clip:g} "
                      f"lr={lr:g} seed={seed}: error {row['error']:.4g}, sigma {row['sigma']:.3f}, "
                      f"{row['seconds']:.1f} s", flush=True)


# ------------------------------------------------------------------------------------------------------ the report
def nonprivate_error(ratio: float, seed: int) -> float:
    """||mean of the records a user-level run keeps (K per user, bound_contributions at the DP seed) - mu||^2."""
    from lightning_dp.privacy.users import bound_contributions

    data = UserRecords(ratio, seed)
    kept = bound_contributions(data.user_ids, K, seed=1000 + seed)
    return float((data.tensors[1][kept].mean(0) - population_mean()).square().sum())


def expected_floor(ratio: float) -> float:
    """E ||mean of n x K kept records - mu||^2 = d (tau^2 / n + s^2 / (n K))."""
    tau2, s2 = 1 / (1 + ratio**2), ratio**2 / (1 + ratio**2)
    return D * (tau2 / USERS + s2 / (USERS * K))


def mean_std(values: list[float], fmt: str = ".4f") -> str:
    if len(values) < 2:
        return format(values[0], fmt) if values else "-"
    return f"{statistics.mean(values):{fmt}} ± {statistics.stdev(values):{fmt}}"


def welch(x: list[float], y: list[float]) -> tuple[float, float]:
    """mean(x) - mean(y) and Welch's t."""
    diff = statistics.mean(x) - statistics.mean(y)
    se = math.sqrt(statistics.variance(x) / len(x) + statistics.variance(y) / len(y))
    return diff, diff / se if se > 0 else math.inf


def paired(els: list[dict], uls: list[dict]) -> str:
    """t of the per-seed differences ELS - ULS (one seed: the same data, the same kept records)."""
    by_seed = {x["seed"]: x["error"] for x in uls}
    d = [x["error"] - by_seed[x["seed"]] for x in els if x["seed"] in by_seed]
    if len(d) < 2 or statistics.stdev(d) == 0:
        return "-"
    return f"{statistics.mean(d) / (statistics.stdev(d) / math.sqrt(len(d))):+.1f}"


def verdict(t: float) -> str:
    return "within noise" if abs(t) < 2 else ("ELS better" if t < 0 else "ULS better")


def report(out: Path, seeds: list[int]) -> str:
    rows = read(out)
    evals = [r for r in rows if r["phase"] == "eval" and int(r["seed"]) in seeds]
    if not evals:
        raise SystemExit(f"no runs in {out / 'runs.tsv'}: run without --report-only first")
    lines = ["### Error ||theta_T - mu||^2 per cell (mean ± sample std over seeds)", "",
             "| r = s/tau | epsilon | steps | algorithm | C | lr | n | error | log10 error | noise multiplier | "
             "final epsilon | steps taken | s per run |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    diffs = ["### ELS minus ULS per cell (Welch's t; within noise: |difference| < 2 standard errors)", "",
             "| r = s/tau | epsilon | steps | ELS error | ULS error | ELS / ULS | ELS - ULS | t | verdict | "
             "t of log10 error | paired t |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for ratio, epsilon, steps in grid():
        got = {}
        for algorithm in ("els", "uls"):
            r = sorted((x for x in evals if x["algorithm"] == algorithm and x["ratio"] == ratio
                        and x["epsilon"] == epsilon and x["steps"] == steps), key=lambda x: x["seed"])
            if not r:
                continue
            got[algorithm] = r
            errors = [x["error"] for x in r]
            sigmas = sorted({round(x["sigma"], 3) for x in r})
            finals = sorted({round(x["final_epsilon"], 3) for x in r})
            taken = sorted({int(x["global_step"]) for x in r})
            lines.append(
                f"| {ratio:g} | {epsilon:g} | {steps} | {algorithm.upper()} | {r[0]['clip']:g} | {r[0]['lr']:.4g} | "
                f"{len(r)} | {mean_std(errors)} | {mean_std([math.log10(e) for e in errors], '.2f')} | "
                f"{', '.join(f'{s:.3f}' for s in sigmas)} | {', '.join(f'{f:.3f}' for f in finals)} | "
                f"{', '.join(map(str, taken))} | {statistics.mean(x['seconds'] for x in r):.1f} |")
        if len(got) == 2 and min(len(v) for v in got.values()) >= 2:
            e, u = [x["error"] for x in got["els"]], [x["error"] for x in got["uls"]]
            diff, t = welch(e, u)
            _, tlog = welch([math.log10(v) for v in e], [math.log10(v) for v in u])
            diffs.append(f"| {ratio:g} | {epsilon:g} | {steps} | {statistics.mean(e):.4f} | {statistics.mean(u):.4f} | "
                         f"{statistics.mean(e) / statistics.mean(u):.2f} | {diff:+.4f} | {t:+.1f} | {verdict(t)} | "
                         f"{tlog:+.1f} | {paired(got['els'], got['uls'])} |")
    floors = ["### Non-private reference: the mean of the kept records (K per user)", "",
              "| r = s/tau | n | error of the kept records' mean | expected d (tau^2/n + s^2/(n K)) |",
              "|---|---|---|---|"]
    for ratio in RATIOS:
        errors = [nonprivate_error(ratio, s) for s in seeds]
        floors.append(f"| {ratio:g} | {len(errors)} | {mean_std(errors)} | {expected_floor(ratio):.4f} |")
    tuning = ["### The sweep on the tuning seed: the pair chosen, and its rank among the others", "",
              "| r = s/tau | epsilon | steps | algorithm | C | lr | steps x lr x C | tuning error | "
              "next best (C, lr: error) | on the travel axis's edge |", "|---|---|---|---|---|---|---|---|---|---|"]
    for ratio, epsilon, steps in grid():
        for algorithm in ("els", "uls"):
            tried = sorted((r for r in rows if r["phase"] == "tune" and r["algorithm"] == algorithm
                            and r["ratio"] == ratio and r["epsilon"] == epsilon and r["steps"] == steps),
                           key=lambda r: r["error"] if math.isfinite(r["error"]) else math.inf)
            if not tried:
                continue
            best, travel = tried[0], tried[0]["steps"] * tried[0]["lr"] * tried[0]["clip"]
            edge = [w for w, hit in (("shortest travel", math.isclose(travel, min(TRAVEL), rel_tol=1e-4)),
                                     ("longest travel", math.isclose(travel, max(TRAVEL), rel_tol=1e-4))) if hit]
            second = tried[1] if len(tried) > 1 else None
            tuning.append(
                f"| {ratio:g} | {epsilon:g} | {steps} | {algorithm.upper()} | {best['clip']:g} | {best['lr']:.4g} | "
                f"{travel:g} | {best['error']:.4f} | "
                + (f"{second['clip']:g}, {second['lr']:.4g}: {second['error']:.4f}" if second else "-")
                + f" | {', '.join(edge) or '-'} |")
    runs = ["### Per run (seed: error)", ""]
    for ratio, epsilon, steps in grid():
        for algorithm in ("els", "uls"):
            r = sorted((x for x in evals if x["algorithm"] == algorithm and x["ratio"] == ratio
                        and x["epsilon"] == epsilon and x["steps"] == steps), key=lambda x: x["seed"])
            if r:
                runs.append(f"- r {ratio:g}, eps {epsilon:g}, {steps} steps, {algorithm.upper()}: "
                            + ", ".join(f"{int(x['seed'])}: {x['error']:.4f}" for x in r))
    return "\n".join(lines + [""] + diffs + [""] + floors + [""] + tuning + [""] + runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/user_level_mean"),
                        help="folder of runs.tsv (outside the repository); a rerun skips the runs it holds")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--tune-seed", type=int, default=TUNE_SEED)
    parser.add_argument("--report-only", action="store_true", help="print the tables of the runs already recorded")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        start = time.perf_counter()
        train(out, args.seeds, args.tune_seed)
        print(f"trained in {time.perf_counter() - start:.0f} s", flush=True)
    print(report(out, args.seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
