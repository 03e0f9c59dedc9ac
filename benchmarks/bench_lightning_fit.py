"""Times whole Lightning epochs without privacy and with each DP callback, in one process.

Where ``bench_dp_step.py`` times the step alone, this includes everything a user pays for:
the Poisson DataLoader, the hooks, the all-reduce-free single-process path, epsilon
computed by the PLD accountant whenever Lightning writes logs and at the end, and the logging itself.
The accountant's caches are cleared before every fit (``--warm-accounting`` keeps them: the repeats after
the first then find their epsilons computed).
Runs alternate (plain, DPSGD, DPSGD-unchecked, OnlineSensitivity, QuantileClipping, plain, ...)
and the median epoch time per step is reported with its ratio to the plain run.
``DPSGD-unchecked`` is DPSGD without the last line of defence (the check that every gradient
the optimizer uses was released by DPSGD): DPSGD / DPSGD-unchecked is that check's cost. The
probe of the batch dimensions (three ``training_step`` runs on 3, 5 and 7 examples when
training starts) is inside every DP fit time. OnlineSensitivity computes
a second weighted sum of the per-sample gradients (the q sum) and two dot products per step;
QuantileClipping only a count.

``--model digits_mlp`` is the new user's case instead: scikit-learn's 8x8 digits (1,797 images, real data) and an
MLP written as one writes it (flatten, 64 -> 128 -> ReLU -> 10, cross-entropy, SGD), batch 64, 3 epochs per fit:
a model so small that the callback's fixed cost per step (hooks, sampling, noise, the accountant's epsilon at
Lightning's logging cadence) shows.

Usage:
    python benchmarks/bench_lightning_fit.py                   # MNIST CNN, 12,800 random images, batch 256
    python benchmarks/bench_lightning_fit.py --repeats 5 --log-every 10 --runs plain,DPSGD
    python benchmarks/bench_lightning_fit.py --model digits_mlp --runs plain,DPSGD --repeats 5
    python benchmarks/bench_lightning_fit.py --runs plain,DPSGD,DPSGD-static   # batches of one shape (padded)
    OMP_NUM_THREADS=1 python benchmarks/bench_lightning_fit.py --runs plain,DPSGD --clock cpu   # on a shared machine
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_dp.callbacks import DPSGD, OnlineSensitivity, QuantileClipping  # noqa: E402
from lightning_dp.models import ImageClassifier, MNISTConvNet  # noqa: E402


class RandomImages(L.LightningDataModule):
    def __init__(self, n: int, batch_size: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)


class UncheckedDPSGD(DPSGD):
    """DPSGD without its last line of defence (the check of every gradient inside optimizer.step): for timing it."""

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._guard.remove()  # the optimizer-step check (callbacks/release_guard.py) off, for timing it


RUNS = {
    "plain": lambda: [],
    "DPSGD": lambda: [DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)],
    "DPSGD-unchecked": lambda: [UncheckedDPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)],
    # batches of one shape (issue 53): truncated at the bound a batch exceeds with probability 1e-6, padded
    "DPSGD-static": lambda: [DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=0, max_batch_size="auto")],
    "OnlineSensitivity": lambda: [OnlineSensitivity(noise_multiplier=1.0, seed=0)],
    "QuantileClipping": lambda: [QuantileClipping(noise_multiplier=1.0, seed=0)],
}


class DigitsMLP(L.LightningModule):
    """The new user's model: an MLP on the 8x8 digits, as one writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                       torch.nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _digits(batch_size: int) -> DataLoader:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16
    return DataLoader(TensorDataset(x, torch.tensor(digits.target)), batch_size=batch_size, shuffle=True)


def one_fit(run: str, args: argparse.Namespace) -> tuple[float, int]:
    clock = time.process_time if getattr(args, "clock", "wall") == "cpu" else time.perf_counter
    torch.manual_seed(0)
    if not getattr(args, "warm_accounting", False):
        # every fit pays its accountant's work as a user's fresh process does: the caches would otherwise hand the
        # later repeats the epsilons and privacy loss distributions of the first (the final epsilon at the PLD's
        # 1e-4 discretization costs about 0.3 s; docs/benchmarks.md, "A second CPU")
        from lightning_dp.privacy.accounting import clear_caches

        clear_caches()
    callbacks = RUNS[run]()
    mlp = args.model == "digits_mlp"
    trainer = L.Trainer(max_epochs=3 if mlp else 1, accelerator="cpu", devices=1,
                        logger=L.pytorch.loggers.CSVLogger("/tmp/bench"), log_every_n_steps=args.log_every,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    t0 = clock()
    if mlp:
        trainer.fit(DigitsMLP(), _digits(args.batch_size or 64))
    else:
        trainer.fit(ImageClassifier(MNISTConvNet(), lr=1.0), RandomImages(args.n, args.batch_size or 256))
    return clock() - t0, trainer.global_step


def time_check(num_tensors: int, repeats: int = 2000) -> float:
    """Microseconds of one last-line check (``ReleaseGuard.check``) over ``num_tensors`` parameters."""
    from lightning_dp.callbacks.release_guard import ReleaseGuard

    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(num_tensors)]
    optimizer = torch.optim.SGD(params, lr=0.1)
    guard = ReleaseGuard()
    for p in params:
        p.grad = torch.zeros(4)
        guard.mark(p)
    t0 = time.perf_counter()
    for _ in range(repeats):
        guard.check(optimizer)
    return (time.perf_counter() - t0) / repeats * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=12800)
    parser.add_argument("--model", default="mnist_cnn", choices=["mnist_cnn", "digits_mlp"])
    parser.add_argument("--batch-size", type=int, help="default: 256 (MNIST CNN), 64 (digits MLP)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--log-every", type=int, default=50, help="Trainer(log_every_n_steps=...)")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, from {list(RUNS)}")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall: time.perf_counter; cpu: the process' CPU time (time.process_time), which a shared "
                             "machine's load moves much less; meaningful with OMP_NUM_THREADS=1 (every thread's "
                             "time is summed)")
    parser.add_argument("--warm-accounting", action="store_true",
                        help="keep the accountant's caches between fits (as a process that fits the same setting "
                             "again finds them); default: cleared before every fit, which then pays its epsilons")
    parser.add_argument("--malloc", choices=("system", "keep"), default="system",
                        help="system: the C allocator as it is (what a Lightning script gets); keep: glibc keeps "
                             "freed memory for the next step, as the lightning-dp commands set it "
                             "(lightning_dp.config.allocator; docs/benchmarks.md, '... and the C allocator')")
    args = parser.parse_args(argv)
    if args.malloc == "keep":
        from lightning_dp.config.allocator import keep_freed_memory

        if not keep_freed_memory(children=True):  # the processes this one starts too
            parser.error("--malloc keep needs glibc (Linux)")
    runs = args.runs.split(",")
    if "plain" not in runs or any(r not in RUNS for r in runs):
        parser.error(f"--runs {args.runs}: pick from {list(RUNS)}, including plain (the baseline)")
    warnings.filterwarnings("ignore")
    for run in runs:  # warm-up
        one_fit(run, args)
    times: dict[str, list[float]] = {run: [] for run in runs}
    steps = {}
    for _ in range(args.repeats):
        for run in runs:
            t, s = one_fit(run, args)
            times[run].append(t / s)
            steps[run] = s
    what = ("3 epochs, the 1,797 digits, digits MLP" if args.model == "digits_mlp"
            else f"1 epoch, N={args.n}, MNIST CNN")
    print(f"Lightning fit, {what}, batch {args.batch_size or (64 if args.model == 'digits_mlp' else 256)}, "
          f"log_every_n_steps={args.log_every}, "
          f"{args.repeats} alternating repeats, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{'process CPU time' if args.clock == 'cpu' else 'wall clock'}, accountant's caches "
          f"{'kept between fits' if args.warm_accounting else 'cleared before each fit'}")
    print(f"{'run':<18} {'steps':>6} {'ms/step':>9} {'ratio':>7}")
    plain = statistics.median(times["plain"])
    for run in runs:
        per_step = statistics.median(times[run])
        print(f"{run:<18} {steps[run]:>6} {per_step * 1e3:9.2f} {per_step / plain:7.2f}")
    if "DPSGD" in runs and "DPSGD-unchecked" in runs:
        ratios = [a / b for a, b in zip(times["DPSGD"], times["DPSGD-unchecked"])]
        print(f"last line of defence: DPSGD / DPSGD-unchecked per repeat {[round(r, 3) for r in ratios]}, "
              f"median {statistics.median(ratios):.3f}")
    for n in (8, 150, 1000):  # the MNIST CNN, a GPT-2-small-sized parameter list, a large one
        print(f"one last-line check over {n} parameter tensors: {time_check(n):.1f} us")


if __name__ == "__main__":
    main()
