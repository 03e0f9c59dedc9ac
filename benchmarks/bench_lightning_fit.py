"""Times whole Lightning epochs with and without the DPSGD callback, in one process.

Where ``bench_dp_step.py`` times the step alone, this includes everything a user pays for:
the Poisson DataLoader, the hooks, the all-reduce-free single-process path, epsilon
computed by the PLD accountant whenever Lightning writes logs, and the logging itself.
Runs alternate (plain, DP, plain, DP, ...) and the median epoch time is reported.

Usage:
    python benchmarks/bench_lightning_fit.py                   # MNIST CNN, 12,800 random images, batch 256
    python benchmarks/bench_lightning_fit.py --repeats 5 --log-every 10
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

from lightning_dp.callbacks import DPSGD  # noqa: E402
from lightning_dp.models import ImageClassifier, MNISTConvNet  # noqa: E402


class RandomImages(L.LightningDataModule):
    def __init__(self, n: int, batch_size: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)


def one_fit(private: bool, args: argparse.Namespace) -> tuple[float, int]:
    torch.manual_seed(0)
    model = ImageClassifier(MNISTConvNet(), lr=1.0)
    callbacks = [DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)] if private else []
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=L.pytorch.loggers.CSVLogger("/tmp/bench"),
                        log_every_n_steps=args.log_every, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks)
    t0 = time.perf_counter()
    trainer.fit(model, RandomImages(args.n, args.batch_size))
    return time.perf_counter() - t0, trainer.global_step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=12800)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--log-every", type=int, default=50, help="Trainer(log_every_n_steps=...)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    one_fit(False, args)  # warm-up
    one_fit(True, args)
    times: dict[bool, list[float]] = {False: [], True: []}
    steps = {}
    for _ in range(args.repeats):
        for private in (False, True):
            t, s = one_fit(private, args)
            times[private].append(t)
            steps[private] = s
    plain, dp = statistics.median(times[False]), statistics.median(times[True])
    print(f"Lightning fit, 1 epoch, N={args.n}, batch {args.batch_size}, MNIST CNN, log_every_n_steps={args.log_every}, "
          f"{args.repeats} alternating repeats, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'run':<12} {'steps':>6} {'s/epoch':>9} {'ms/step':>9} {'ratio':>7}")
    print(f"{'plain':<12} {steps[False]:>6} {plain:9.2f} {plain / steps[False] * 1e3:9.2f} {1.0:7.2f}")
    print(f"{'DPSGD':<12} {steps[True]:>6} {dp:9.2f} {dp / steps[True] * 1e3:9.2f} "
          f"{(dp / steps[True]) / (plain / steps[False]):7.2f}")


if __name__ == "__main__":
    main()
