"""One DP-FedAvg round: lightning-dp's FederatedRound against Flower, same clients, model and local steps.

Both sides train the same 100 clients (NIID(2) partitions of MNIST-shaped data by
flwr-datasets' PathologicalPartitioner, or CIFAR-10-shaped data for the CNN) from the same
global model, E local epochs of mini-batch SGD, then clip every update at C, average, and add
Gaussian noise of std z C / 100:

- lightning-dp: ``FederatedRound`` with ``PoissonSelection(1.0)`` (every client), ``LocalSGD``
  (``engine="auto"``: vectorized over clients below 100,000 parameters, a loop above) and
  ``CentralGaussian`` (fixed clipping, PLD accountant), run by a Lightning ``Trainer``;
  one training step is one round (timed from batch start to batch end, so Lightning's
  per-round bookkeeping and the accountant are inside).
- Flower: ``DifferentialPrivacyServerSideFixedClipping(FedAvg(fraction_fit=1.0))``, the
  strategy's ``configure_fit`` / ``aggregate_fit``, and one ``NumPyClient`` per client
  whose ``fit`` loads the parameters into a torch model, trains with ``torch.optim.SGD`` on
  a ``DataLoader`` and returns the parameters. The clients are called in-process, one after
  the other: this is the work of Flower's simulation engine without its Ray actors (Ray is
  not installed here), i.e. a lower bound on a Flower simulation's time per round. Flower
  computes no epsilon; lightning-dp's time includes its PLD accounting.

Rounds alternate (ours, Flower, ours, ...) after one warm-up round each; the median time
per round is reported with the ratio. Pixels are random unless ``--data-dir`` holds the
official MNIST t10k files (the time does not depend on the pixel values).

Usage:
    python benchmarks/bench_fedavg_flower.py                         # logistic regression, 100 clients
    python benchmarks/bench_fedavg_flower.py --model cifar_cnn --rounds 3
    python benchmarks/bench_fedavg_flower.py --data-dir ../shared/data/mnist
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_dp.datamodules.federated import ClientDataset, FederatedDataModule  # noqa: E402
from lightning_dp.datamodules.federated_vision import partition_labels  # noqa: E402
from lightning_dp.federated import FederatedRound  # noqa: E402
from lightning_dp.federated.parts import CentralGaussian, LocalSGD, PoissonSelection  # noqa: E402
from lightning_dp.models import CIFARConvNet, LogisticRegression  # noqa: E402


class Clients(FederatedDataModule):
    """Fixed, already partitioned clients (the benchmark's; one validation client as the base class requires)."""

    task = "classification"
    num_classes = 10

    def __init__(self, clients: list[ClientDataset]) -> None:
        super().__init__()
        self._given = clients
        self.input_shape = tuple(clients[0].x.shape[1:])

    def _build_clients(self):
        first = self._given[0]
        return self._given, [ClientDataset("val", first.x, first.y)], []


def make_clients(model: str, num_clients: int, per_client: int, data_dir: str | None) -> list[ClientDataset]:
    n = num_clients * per_client
    g = torch.Generator().manual_seed(0)
    if model == "cifar_cnn":
        x = torch.randn(n, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (n,), generator=g)
    elif data_dir:
        from lightning_dp.datamodules.idx import read_idx

        root = Path(data_dir)
        images = read_idx(next(root.glob("t10k-images-idx3-ubyte*")))[:n]
        y = read_idx(next(root.glob("t10k-labels-idx1-ubyte*"))).long()[:n]
        x = images.float().div(255).unsqueeze(1)
    else:
        x = torch.randn(n, 1, 28, 28, generator=g)
        y = torch.randint(0, 10, (n,), generator=g)
    parts = partition_labels(y, num_clients, "pathological", seed=0, classes_per_client=2)
    return [ClientDataset(f"c{i}", x[torch.from_numpy(p)], y[torch.from_numpy(p)]) for i, p in enumerate(parts)]


def network(model: str) -> torch.nn.Module:
    return CIFARConvNet() if model == "cifar_cnn" else LogisticRegression()


class Alternate(L.Callback):
    """Times each of our rounds (batch start to batch end), then runs one Flower round outside that interval."""

    def __init__(self, other) -> None:
        self.other = other
        self.times: dict[str, list[float]] = {"lightning-dp": [], "flower": []}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times["lightning-dp"].append(time.perf_counter() - self._start)
        self.times["flower"].append(self.other())


def ours(clients, model, rounds, other, epochs, batch_size, lr, z, clip):
    """Fit ``rounds + 1`` rounds of lightning-dp, one Flower round after each; per-round times of both."""
    timer = Alternate(other)
    module = FederatedRound(network(model), selection=PoissonSelection(1.0),
                            update=LocalSGD(epochs=epochs, lr=lr, batch_size=batch_size),
                            server_privacy=CentralGaussian(noise_multiplier=z, clip=clip), loss="cross_entropy",
                            seed=0, noise_seed=1, log_nonprivate_metrics=False)
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1, max_epochs=rounds + 1,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer])
    trainer.fit(module, Clients(clients))
    return {k: v[1:] for k, v in timer.times.items()}, module  # the first round of each is the warm-up


def flower(clients, model, epochs, batch_size, lr, z, clip):
    import flwr
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

    logging.getLogger("flwr").setLevel(logging.ERROR)
    torch.manual_seed(0)
    net = network(model)

    def get_weights() -> list[np.ndarray]:
        return [v.detach().cpu().numpy().copy() for v in net.state_dict().values()]

    def set_weights(weights: list[np.ndarray]) -> None:
        net.load_state_dict({k: torch.from_numpy(np.asarray(w)) for k, w in zip(net.state_dict(), weights)})

    class Client(flwr.client.NumPyClient):
        def __init__(self, data: ClientDataset) -> None:
            self.loader = DataLoader(TensorDataset(data.x, data.y), batch_size=batch_size, shuffle=True)
            self.n = len(data)

        def fit(self, parameters, config):
            set_weights(parameters)
            optimizer = torch.optim.SGD(net.parameters(), lr=lr)
            for _ in range(epochs):
                for xb, yb in self.loader:
                    optimizer.zero_grad()
                    torch.nn.functional.cross_entropy(net(xb), yb).backward()
                    optimizer.step()
            return get_weights(), self.n, {}

    fl_clients = [Client(c) for c in clients]
    strategy = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=len(clients),
               min_available_clients=len(clients)), noise_multiplier=z, clipping_norm=clip,
        num_sampled_clients=len(clients))
    state = {"parameters": ndarrays_to_parameters(get_weights()), "round": 0}

    class Proxy:  # what aggregate_fit receives beside each result; the strategies here do not read it
        cid = "local"

    def one() -> float:
        start = time.perf_counter()
        state["round"] += 1
        strategy.current_round_params = parameters_to_ndarrays(state["parameters"])  # as configure_fit does
        results = []
        for client in fl_clients:
            weights, n, _ = client.fit(parameters_to_ndarrays(state["parameters"]), {})
            results.append((Proxy(), FitRes(Status(Code.OK, ""), ndarrays_to_parameters(weights), n, {})))
        new, _ = strategy.aggregate_fit(state["round"], results, [])
        state["parameters"] = new
        return time.perf_counter() - start

    return one


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["logreg", "cifar_cnn"], default="logreg")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--per-client", type=int, default=60, help="examples per client before partitioning")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per side")
    parser.add_argument("--data-dir", default=None, help="official MNIST t10k files (logreg only)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(torch.get_num_threads())
    clients = make_clients(args.model, args.clients, args.per_client, args.data_dir)
    settings = dict(epochs=args.epochs, batch_size=args.batch_size, lr=0.05, z=1.0, clip=1.0)
    times, module = ours(clients, args.model, args.rounds, flower(clients, args.model, **settings), **settings)
    a, b = statistics.median(times["lightning-dp"]), statistics.median(times["flower"])
    sizes = [len(c) for c in clients]
    print(f"model={args.model} ({sum(p.numel() for p in network(args.model).parameters()):,} params) "
          f"clients={len(clients)} examples/client={min(sizes)}-{max(sizes)} epochs={args.epochs} "
          f"batch={args.batch_size} engine={module.update.resolved_engine(module.spec.numel)} threads={torch.get_num_threads()}")
    print(f"lightning-dp: {a * 1000:.1f} ms/round (median of {args.rounds}; epsilon accounted: "
          f"{module.server_privacy.epsilon:.3f} after {len(module.server_privacy.accountant)} rounds)")
    print(f"flower      : {b * 1000:.1f} ms/round (median of {args.rounds}; no accountant)")
    print(f"flower / lightning-dp = {b / a:.2f}x")


if __name__ == "__main__":
    main()
