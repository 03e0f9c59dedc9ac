"""Times the client part of a federated round: vectorized (torch.func) vs. a per-client loop.

Both run in one process on the same clients, starting points and shuffles
(``lightning_dp.federated.local_sgd`` vs. ``local_sgd_loop``, which trains one client at a
time with ``torch.optim.SGD``), alternating repetitions; the median is reported.

Usage:
    python benchmarks/bench_federated_round.py                          # hospital MLP (11 params), U = 100
    python benchmarks/bench_federated_round.py --model femnist --clients 10 --samples 20,200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_dp.federated import FlatParams, local_sgd, local_sgd_loop  # noqa: E402
from lightning_dp.privacy.noise import derive_generator  # noqa: E402


def module_keys(clients: int, width: int):
    """The shuffle keys as PersonalizedFederatedModule draws them: one (clients x width) table per epoch."""
    def keys(epoch: int) -> torch.Tensor:
        return torch.rand((clients, width), generator=derive_generator(0, 12, 0, epoch))
    return keys


def make_model(name: str) -> tuple[nn.Module, tuple[int, ...], str]:
    if name == "hospital":  # the seed's 11-parameter MLP, 3 -> 2 -> 1
        return nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 1)), (3,), "rmse"
    if name == "femnist":  # the seed's CNN (conv 32 2x2, conv 64 2x2, max-pool 2x2, FC 128, FC 62)
        net = nn.Sequential(nn.Conv2d(1, 32, 2), nn.ReLU(), nn.Conv2d(32, 64, 2), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Flatten(), nn.Linear(64 * 13 * 13, 128), nn.ReLU(), nn.Linear(128, 62))
        return net, (1, 28, 28), "cross_entropy"
    raise ValueError(f"unknown model {name!r}; choose hospital or femnist")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="hospital")
    parser.add_argument("--clients", type=int, default=100, help="U, clients per round")
    parser.add_argument("--samples", default="1,4", help="min,max examples per client (uniform)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model, shape, loss = make_model(args.model)
    spec = FlatParams.of(model)
    lo, hi = (int(v) for v in args.samples.split(","))
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(lo, hi + 1, (args.clients,), generator=g)
    nmax = int(sizes.max())
    x = torch.randn(args.clients, nmax, *shape, generator=g)
    y = torch.randint(0, 62, (args.clients, nmax), generator=g) if loss == "cross_entropy" else \
        torch.randn(args.clients, nmax, generator=g)
    mask = torch.arange(nmax).unsqueeze(0) < sizes.unsqueeze(1)
    start = spec.flatten(model).unsqueeze(0).repeat(args.clients, 1)
    kwargs = dict(epochs=args.epochs, lr=0.01, batch_size=args.batch_size, loss=loss)
    fns = {"vectorized": local_sgd, "per-client loop": local_sgd_loop}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for k, fn in fns.items():  # warm-up
        fn(model, spec, start, x, y, mask, generator=module_keys(args.clients, nmax), **kwargs)
    for _ in range(args.repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn(model, spec, start, x, y, mask, generator=module_keys(args.clients, nmax), **kwargs)
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model {args.model} ({spec.numel} parameters), U={args.clients} clients, {lo}-{hi} examples each, "
          f"E={args.epochs}, B_s={args.batch_size}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}")
    for k, t in med.items():
        print(f"{k:<16} {t * 1e3:10.2f} ms/round")
    print(f"speed-up        {med['per-client loop'] / med['vectorized']:10.1f} x")


if __name__ == "__main__":
    main()
