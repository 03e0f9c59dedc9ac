"""One DP-FedAvg round: lightning-dp's FederatedRound against Flower, same clients, model and local steps.

Both sides train the same 100 clients (NIID(2) partitions of MNIST-shaped data by
flwr-datasets' PathologicalPartitioner, or CIFAR-10-shaped data for the CNN) from the same
global model, E local epochs of mini-batch SGD, then clip every update at C, average, and add
Gaussian noise of std z C / 100:

- lightning-dp: ``FederatedRound`` with ``PoissonSelection(1.0)`` (every client), ``LocalSGD``
  (``engine="auto"``: all clients at once below 100,000 parameters, with hand-written gradients for the
  logistic regression, a chain of dense layers; a loop above) and
  ``CentralGaussian`` (fixed clipping, PLD accountant), run by a Lightning ``Trainer``;
  one training step is one round (timed from batch start to batch end, so Lightning's
  per-round bookkeeping and the accountant are inside).
- Flower in-process (``--engine inprocess``, the default):
  ``DifferentialPrivacyServerSideFixedClipping(FedAvg(fraction_fit=1.0))`` of ``flwr.server.strategy``, the
  strategy's ``configure_fit`` / ``aggregate_fit``, and one ``NumPyClient`` per client whose ``fit`` loads the
  parameters into a torch model, trains with ``torch.optim.SGD`` on a ``DataLoader`` and returns the
  parameters. The clients are called in-process, one after the other: the work of Flower's simulation
  engine without its Ray actors, messages or polling, i.e. a lower bound on a Flower simulation's time per
  round. Rounds alternate (ours, Flower, ours, ...) after one warm-up round each.
- Flower simulation (``--engine simulation``): Flower's simulation engine itself,
  ``flwr.simulation.run_simulation`` with ``num_supernodes`` = the number of clients, a Message-API
  ``ServerApp`` running ``flwr.serverapp.strategy.DifferentialPrivacyServerSideFixedClipping(FedAvg(
  fraction_train=1.0))`` (clip each update at C, weighted average, N(0, (z C / m)^2) noise) and a
  ``ClientApp`` whose ``train`` function runs the same local SGD as the in-process client, on the client
  named by ``context.node_config["partition-id"]``, inside Ray actors (``--client-cpus`` CPUs each, 1 by
  default: two actors on two cores). Each actor rebuilds the clients once, deterministically, with the
  same ``make_clients`` call, and caches them (nothing but the message travels per round). The ServerApp
  times each round (send to all nodes, wait for the replies, aggregate) with ``time.perf_counter`` and
  writes the times to a JSON file that the benchmark reads after ``run_simulation`` returns; the first
  round (Ray start-up, actor imports) is the warm-up. Since Flower's rounds cannot interleave with ours,
  a block of our rounds runs before the simulation and another after it, and the load average is
  printed at start and end. ``--engine both`` runs the alternating in-process block, the simulation,
  then a block of ours.

Flower computes no epsilon; lightning-dp's time includes its PLD accounting. The median time per round
is reported with the ratio. Pixels are random unless ``--data-dir`` holds the official MNIST t10k files
(the time does not depend on the pixel values).

``--target-accuracy A`` (MNIST only: needs ``--data-dir``) trains each selected side instead until the
global model's accuracy on 1,000 held-out t10k examples (the ones after the clients' examples) reaches A,
or ``--max-rounds``; the global model is evaluated centrally after every round by the same code for every
side, and that time is reported apart, not counted as training. ``--seeds 0,1,2`` repeats the whole
comparison per seed and reports the rounds and seconds as mean and sample std.

``--flower-channels-last`` makes Flower's clients train image models channels-last, as our loop engine does
where it computes the same (PyTorch's CPU pooling is vectorized only channels-last): what a Flower user can
write by hand, to separate Flower's overhead from the layout.

Usage:
    python benchmarks/bench_fedavg_flower.py                         # logistic regression, 100 clients
    python benchmarks/bench_fedavg_flower.py --model cifar_cnn --rounds 3
    python benchmarks/bench_fedavg_flower.py --data-dir ../shared/data/mnist
    python benchmarks/bench_fedavg_flower.py --engine simulation     # Flower's Ray simulation engine
    python benchmarks/bench_fedavg_flower.py --engine both --client-cpus default
    python benchmarks/bench_fedavg_flower.py --engine both --target-accuracy 0.8 --data-dir ../shared/data/mnist
    python benchmarks/bench_fedavg_flower.py --model cifar_cnn --engine simulation --devices 2  # ours on 2 DDP ranks
    python benchmarks/bench_fedavg_flower.py --engine both --target-accuracy 0.7 --data-dir ../shared/data/mnist \
        --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import logging
import os
import statistics
import sys
import tempfile
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


def ours(clients, model, rounds, other, epochs, batch_size, lr, z, clip, devices=1):
    """Fit ``rounds + 1`` rounds of lightning-dp, one Flower round after each; per-round times of both.
    ``devices`` > 1: Lightning DDP over that many CPU processes of one torch thread each (the clients sharded over
    them, the clipped sum all-reduced); run through :func:`ours_ddp`, which starts them."""
    timer = Alternate(other)
    module = FederatedRound(network(model), selection=PoissonSelection(1.0),
                            update=LocalSGD(epochs=epochs, lr=lr, batch_size=batch_size),
                            server_privacy=CentralGaussian(noise_multiplier=z, clip=clip), loss="cross_entropy",
                            seed=0, noise_seed=1, log_nonprivate_metrics=False)
    parallel = dict(strategy="ddp", devices=devices) if devices > 1 else dict(devices=1)
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", max_epochs=rounds + 1,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer], **parallel)
    trainer.fit(module, Clients(clients))
    return {k: v[1:] for k, v in timer.times.items()}, module  # the first round of each is the warm-up


def ours_ddp(args, settings) -> dict:
    """Our rounds over ``args.devices`` DDP processes: a worker process of this script (``--ours-worker``) whose
    Trainer starts the other ranks (Lightning re-runs the worker's command line for them); rank 0 prints its times."""
    import subprocess

    command = [sys.executable, __file__, "--ours-worker", "--model", args.model, "--clients", str(args.clients),
               "--per-client", str(args.per_client), "--epochs", str(args.epochs), "--batch-size",
               str(args.batch_size), "--rounds", str(args.rounds), "--devices", str(args.devices)]
    if args.data_dir:
        command += ["--data-dir", args.data_dir]
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"the DDP worker failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def ours_worker(args, clients, settings) -> None:
    torch.set_num_threads(1)
    times, module = ours(clients, args.model, args.rounds, lambda: 0.0, **settings, devices=args.devices)
    if module.trainer.global_rank == 0:
        print(json.dumps({"times": times["lightning-dp"], "epsilon": module.server_privacy.epsilon,
                          "rounds": len(module.server_privacy.accountant)}), flush=True)


def flower(clients, model, epochs, batch_size, lr, z, clip, channels_last=False, seed=0):
    import flwr
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

    logging.getLogger("flwr").setLevel(logging.ERROR)
    torch.manual_seed(seed)
    net = layout(network(model), channels_last)

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
                    torch.nn.functional.cross_entropy(net(layout(xb, channels_last)), yb).backward()
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

    one.state_dict = lambda: {k: torch.from_numpy(np.asarray(w)).clone()  # the global model (--target-accuracy)
                              for k, w in zip(net.state_dict(), parameters_to_ndarrays(state["parameters"]))}
    return one


# ------------------------------------------------------------------ Flower's simulation engine (Ray actors)
_SIM_CACHE: dict[tuple, tuple[list[ClientDataset], torch.nn.Module]] = {}  # per process: per Ray actor


def layout(value, channels_last: bool):
    """``value`` (a model or a batch of images) channels-last where asked (``--flower-channels-last``: what a
    Flower user can write by hand in a client, as our loop engine does for image models), else as it is."""
    if not channels_last:
        return value
    if isinstance(value, torch.nn.Module):
        return value.to(memory_format=torch.channels_last)
    return value.contiguous(memory_format=torch.channels_last) if value.dim() == 4 else value


def local_sgd(net: torch.nn.Module, data: ClientDataset, epochs: int, batch_size: int, lr: float,
              channels_last: bool = False) -> None:
    """The in-process ``Client.fit``'s local training, for the ClientApp."""
    loader = DataLoader(TensorDataset(data.x, data.y), batch_size=batch_size, shuffle=True)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    for _ in range(epochs):
        for xb, yb in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(net(layout(xb, channels_last)), yb).backward()
            optimizer.step()


def sim_train(source: tuple, training: tuple, msg, context):
    """The ClientApp's ``train``: rebuild (once per actor) the clients, train the one named by partition-id.

    ``source`` is ``make_clients``' arguments and ``training`` (epochs, batch size, lr, channels-last): both
    travel in the
    pickled ClientApp; the data do not.
    """
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    if source not in _SIM_CACHE:
        _SIM_CACHE[source] = make_clients(*source), layout(network(source[0]), training[3])
    clients, net = _SIM_CACHE[source]
    pid = int(context.node_config["partition-id"])
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    local_sgd(net, clients[pid], *training)
    metrics = MetricRecord({"num-examples": len(clients[pid]), "partition-id": pid,
                            "threads": torch.get_num_threads(), "pid": os.getpid()})
    return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics}), reply_to=msg)


def _importable():
    """This module under a name Ray's workers can import (so that ``sim_train`` is pickled by reference)."""
    if __name__ != "__main__":
        return sys.modules[__name__]
    spec = globals().get("__spec__")
    return importlib.import_module(spec.name if spec is not None else Path(__file__).stem)


def flower_simulation(source: tuple, rounds: int, epochs: int, batch_size: int, lr: float, z: float, clip: float,
                      *, client_cpus: str = "1", evaluate=None, target: float | None = None,
                      channels_last: bool = False, seed: int = 0) -> dict:
    """Run ``rounds`` rounds (or until ``evaluate`` reaches ``target``) with ``flwr.simulation.run_simulation``.

    Returns the ServerApp's JSON record (per-round times, evaluations, actor facts) and the wall time of the
    whole ``run_simulation`` call (Ray start-up and shut-down included).
    """
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
    from flwr.simulation import run_simulation

    logging.getLogger("flwr").setLevel(logging.ERROR)
    model, num_clients = source[0], source[1]
    torch.manual_seed(seed)  # the in-process Flower side's initial model
    initial = network(model).state_dict()
    client_app = ClientApp()
    client_app.train()(functools.partial(_importable().sim_train, source, (epochs, batch_size, lr, channels_last)))
    fd, out_path = tempfile.mkstemp(prefix="bench_fedavg_flower_sim_", suffix=".json")
    os.close(fd)
    server_app = ServerApp()

    @server_app.main()
    def _main(grid, context) -> None:
        strategy = DifferentialPrivacyServerSideFixedClipping(
            FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=num_clients,
                   min_available_nodes=num_clients), noise_multiplier=z, clipping_norm=clip,
            num_sampled_clients=num_clients)
        arrays = ArrayRecord(initial)
        record: dict = {"round_times": [], "evals": [], "sizes": None, "actor_pids": [], "actor_threads": []}
        for r in range(1, rounds + 1):
            start = time.perf_counter()
            replies = list(grid.send_and_receive(strategy.configure_train(r, arrays, ConfigRecord(), grid),
                                                 timeout=3600))
            new, _ = strategy.aggregate_train(r, replies)
            record["round_times"].append(time.perf_counter() - start)
            errors = [m.error.reason for m in replies if m.has_error()]
            if new is None or errors:
                raise RuntimeError(f"round {r}: {len(replies)} replies, errors: {errors[:3]}")
            arrays = new
            facts = [m.content["metrics"] for m in replies]
            record["sizes"] = {int(f["partition-id"]): int(f["num-examples"]) for f in facts}
            record["actor_pids"] = sorted({int(f["pid"]) for f in facts} | set(record["actor_pids"]))
            record["actor_threads"] = sorted({int(f["threads"]) for f in facts} | set(record["actor_threads"]))
            if evaluate is not None:
                record["evals"].append(evaluate(arrays.to_torch_state_dict()))
                if record["evals"][-1][0] >= target:
                    break
        with open(out_path, "w") as f:
            json.dump(record, f)

    backend_config: dict = {"init_args": {"logging_level": "ERROR", "log_to_driver": False}}
    if client_cpus != "default":
        backend_config["client_resources"] = {"num_cpus": float(client_cpus), "num_gpus": 0.0}
    start = time.perf_counter()
    try:
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=num_clients,
                       backend_config=backend_config)
        wall = time.perf_counter() - start
        with open(out_path) as f:
            record = json.load(f)
    finally:
        os.unlink(out_path)
    record["wall"] = wall
    return record


# ------------------------------------------------------------------ time (and rounds) to a target accuracy
def make_test(num_clients: int, per_client: int, data_dir: str, size: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``size`` MNIST t10k examples after the clients' ones, prepared as ``make_clients`` prepares them."""
    from lightning_dp.datamodules.idx import read_idx

    n = num_clients * per_client
    root = Path(data_dir)
    images = read_idx(next(root.glob("t10k-images-idx3-ubyte*")))
    if n + size > len(images):
        raise SystemExit(f"--target-accuracy holds out {size} of the {len(images)} t10k examples after the "
                         f"clients' {n}: use fewer --clients or --per-client")
    y = read_idx(next(root.glob("t10k-labels-idx1-ubyte*"))).long()[n:n + size]
    return images[n:n + size].float().div(255).unsqueeze(1), y


def make_evaluate(model: str, x: torch.Tensor, y: torch.Tensor):
    """The central evaluation every side uses: ``state_dict -> (accuracy, seconds)``."""
    net = network(model).eval()

    def evaluate(state: dict) -> tuple[float, float]:
        start = time.perf_counter()
        net.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
        with torch.no_grad():
            accuracy = (net(x).argmax(1) == y).float().mean().item()
        return accuracy, time.perf_counter() - start

    return evaluate


class ToTarget(L.Callback):
    """Times each of our rounds, then evaluates the global model outside that interval; stops at the target."""

    def __init__(self, evaluate, target: float) -> None:
        self.evaluate, self.target = evaluate, target
        self.times: list[float] = []
        self.evals: list[tuple[float, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self._start)
        self.evals.append(self.evaluate(pl_module.spec.unflatten(pl_module.hypotheses[0].detach().clone())))
        if self.evals[-1][0] >= self.target:
            trainer.should_stop = True


def ours_to_target(clients, model, max_rounds, evaluate, target, epochs, batch_size, lr, z, clip, seed=0) -> dict:
    timer = ToTarget(evaluate, target)
    module = FederatedRound(network(model), selection=PoissonSelection(1.0),
                            update=LocalSGD(epochs=epochs, lr=lr, batch_size=batch_size),
                            server_privacy=CentralGaussian(noise_multiplier=z, clip=clip), loss="cross_entropy",
                            seed=seed, noise_seed=1000 + seed, log_nonprivate_metrics=False)
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1, max_epochs=max_rounds,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer])
    start = time.perf_counter()
    trainer.fit(module, Clients(clients))
    return {"round_times": timer.times, "evals": timer.evals, "wall": time.perf_counter() - start}


def flower_inprocess_to_target(clients, model, max_rounds, evaluate, target, seed=0, **settings) -> dict:
    start = time.perf_counter()
    one = flower(clients, model, **settings, seed=seed)
    record: dict = {"round_times": [], "evals": []}
    for _ in range(max_rounds):
        record["round_times"].append(one())
        record["evals"].append(evaluate(one.state_dict()))
        if record["evals"][-1][0] >= target:
            break
    record["wall"] = time.perf_counter() - start
    return record


def report_target(name: str, record: dict, target: float, note: str = "") -> None:
    accuracies = [a for a, _ in record["evals"]]
    rounds, evals = len(accuracies), sum(t for _, t in record["evals"])
    reached = next((i + 1 for i, a in enumerate(accuracies) if a >= target), None)
    what = (f"reached {accuracies[reached - 1]:.3f} in {reached} rounds" if reached else
            f"NOT reached in {rounds} rounds (best {max(accuracies):.3f}, last {accuracies[-1]:.3f})")
    print(f"{name:<18}: {what}; training {sum(record['round_times']):.2f} s (sum of rounds, the first "
          f"{record['round_times'][0]:.2f} s), wall "
          f"{record['wall'] - evals:.2f} s (set-up included{note}); evaluation {evals:.3f} s excluded")


def describe(args, clients, module) -> str:
    sizes = [len(c) for c in clients]
    return (f"model={args.model} ({sum(p.numel() for p in network(args.model).parameters()):,} params) "
            f"clients={len(clients)} examples/client={min(sizes)}-{max(sizes)} epochs={args.epochs} "
            f"batch={args.batch_size} engine={module.update.engine_used} "
            f"threads={torch.get_num_threads()}"
            + ("; Flower's clients channels-last" if args.flower_channels_last else ""))


def loadavg() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def sim_facts(record: dict, clients, client_cpus: str) -> str:
    if record["sizes"] is not None and [record["sizes"].get(str(i)) for i in range(len(clients))] != \
            [len(c) for c in clients]:
        raise RuntimeError("the ClientApps' client sizes differ from the driver's: make_clients is not deterministic")
    return (f"{len(record['actor_pids'])} Ray actor(s) with {record['actor_threads']} torch thread(s), "
            f"client num_cpus={'2 (Flower default)' if client_cpus == 'default' else client_cpus}")


def run_target(args, clients, settings) -> None:
    """Each seed: our fit, then Flower's in-process clients and/or its simulation, each until the target; then the
    rounds and seconds of training over the seeds (mean and sample std). A seed sets our model's initialization
    and shuffles (and our secret noise seed to 1000 + seed) and Flower's initial model and in-process shuffles;
    Flower's server noise and its simulation's shuffles are unseeded."""
    test_x, test_y = make_test(args.clients, args.per_client, args.data_dir)
    evaluate = make_evaluate(args.model, test_x, test_y)
    source = (args.model, args.clients, args.per_client, args.data_dir)
    print(f"load average at start: {loadavg()}")
    seeds = [int(v) for v in args.seeds.split(",")]
    runs: dict[str, list[dict]] = {}
    for seed in seeds:
        records = {"lightning-dp": ours_to_target(clients, args.model, args.max_rounds, evaluate,
                                                  args.target_accuracy, **settings, seed=seed)}
        if args.engine in ("inprocess", "both"):
            records["flower-inprocess"] = flower_inprocess_to_target(clients, args.model, args.max_rounds, evaluate,
                                                                     args.target_accuracy, seed=seed, **settings)
        if args.engine in ("simulation", "both"):
            records["flower-simulation"] = flower_simulation(source, args.max_rounds, **settings,
                                                             channels_last=args.flower_channels_last,
                                                             client_cpus=args.client_cpus, evaluate=evaluate,
                                                             target=args.target_accuracy, seed=seed)
        for name, record in records.items():
            runs.setdefault(name, []).append(record)
    print(f"load average at end  : {loadavg()}")
    sizes = [len(c) for c in clients]
    print(f"target accuracy {args.target_accuracy} on {len(test_y)} held-out MNIST t10k examples; model={args.model} "
          f"clients={len(clients)} examples/client={min(sizes)}-{max(sizes)} epochs={args.epochs} "
          f"batch={args.batch_size} z={settings['z']} C={settings['clip']} lr={settings['lr']} "
          f"max rounds={args.max_rounds} seeds={seeds}")
    for name, records_of in runs.items():
        for seed, record in zip(seeds, records_of):
            note = ""
            if name == "flower-simulation":
                note = f", Ray start-up and shut-down; {sim_facts(record, clients, args.client_cpus)}"
            report_target(f"{name} seed {seed}", record, args.target_accuracy, note)
    if len(seeds) > 1:
        for name, records_of in runs.items():
            reached = [next((i + 1 for i, (a, _) in enumerate(r["evals"]) if a >= args.target_accuracy), None)
                       for r in records_of]
            seconds = [sum(r["round_times"]) for r in records_of]
            walls = [r["wall"] - sum(t for _, t in r["evals"]) for r in records_of]
            counted = [n for n in reached if n is not None]
            print(f"{name:<18}: reached in {len(counted)} of {len(seeds)} seeds; rounds "
                  f"{_spread(counted)}; training {_spread(seconds, '.2f')} s; wall {_spread(walls, '.2f')} s")


def _spread(values: list, fmt: str = ".1f") -> str:
    """``mean +- sample std (n)`` of ``values``."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:{fmt}} (n = 1)"
    return f"{statistics.mean(values):{fmt}} +- {statistics.stdev(values):{fmt}} (n = {len(values)})"


def run_timed(args, clients, settings) -> None:
    source = (args.model, args.clients, args.per_client, args.data_dir)
    print(f"load average at start: {loadavg()}")
    if args.devices > 1:
        return run_timed_ddp(args, clients, settings, source)
    if args.engine == "both":
        other = flower(clients, args.model, **settings, channels_last=args.flower_channels_last)
        before, _ = ours(clients, args.model, args.rounds, other, **settings)
        inprocess = before["flower"]
    else:
        before, _ = ours(clients, args.model, args.rounds, lambda: 0.0, **settings)
    sim = flower_simulation(source, args.rounds + 1, **settings, client_cpus=args.client_cpus,
                            channels_last=args.flower_channels_last)
    after, module = ours(clients, args.model, args.rounds, lambda: 0.0, **settings)
    print(f"load average at end  : {loadavg()}")
    mine = before["lightning-dp"] + after["lightning-dp"]
    a, s = statistics.median(mine), statistics.median(sim["round_times"][1:])
    print(describe(args, clients, module))
    print(f"lightning-dp     : {a * 1000:.1f} ms/round (median of {len(mine)}: "
          f"{statistics.median(before['lightning-dp']) * 1000:.1f} before the simulation, "
          f"{statistics.median(after['lightning-dp']) * 1000:.1f} after; epsilon accounted: "
          f"{module.server_privacy.epsilon:.3f} after {len(module.server_privacy.accountant)} rounds)")
    if args.engine == "both":
        b = statistics.median(inprocess)
        print(f"flower-inprocess : {b * 1000:.1f} ms/round (median of {len(inprocess)}, alternating with the "
              f"'before' block; no accountant)")
    print(f"flower-simulation: {s * 1000:.1f} ms/round (median of {args.rounds}; warm-up round "
          f"{sim['round_times'][0]:.2f} s; run_simulation wall {sim['wall']:.1f} s; "
          f"{sim_facts(sim, clients, args.client_cpus)}; no accountant)")
    if args.engine == "both":
        print(f"flower-inprocess / lightning-dp = {b / a:.2f}x")
    print(f"flower-simulation / lightning-dp = {s / a:.2f}x")


def run_timed_ddp(args, clients, settings, source) -> None:
    """Ours in one process, ours over DDP processes, Flower's simulation, ours over DDP again, ours in one process
    again (no in-process Flower: it cannot alternate with rounds in other processes)."""
    single_before, module = ours(clients, args.model, args.rounds, lambda: 0.0, **settings)
    before = ours_ddp(args, settings)
    sim = flower_simulation(source, args.rounds + 1, **settings, client_cpus=args.client_cpus,
                            channels_last=args.flower_channels_last)
    after = ours_ddp(args, settings)
    single_after, _ = ours(clients, args.model, args.rounds, lambda: 0.0, **settings)
    print(f"load average at end  : {loadavg()}")
    single = single_before["lightning-dp"] + single_after["lightning-dp"]
    mine = before["times"] + after["times"]
    a, s = statistics.median(mine), statistics.median(sim["round_times"][1:])
    print(f"{describe(args, clients, module)}; ours: DDP over {args.devices} processes of one thread")
    print(f"lightning-dp     : {a * 1000:.1f} ms/round (median of {len(mine)}: "
          f"{statistics.median(before['times']) * 1000:.1f} before the simulation, "
          f"{statistics.median(after['times']) * 1000:.1f} after; epsilon accounted: {after['epsilon']:.3f} after "
          f"{after['rounds']} rounds)")
    one = statistics.median(single)
    print(f"lightning-dp, one process of {torch.get_num_threads()} threads: {one * 1000:.1f} ms/round (median of "
          f"{len(single)}: {statistics.median(single_before['lightning-dp']) * 1000:.1f} first, "
          f"{statistics.median(single_after['lightning-dp']) * 1000:.1f} last)")
    print(f"flower-simulation: {s * 1000:.1f} ms/round (median of {args.rounds}; warm-up round "
          f"{sim['round_times'][0]:.2f} s; run_simulation wall {sim['wall']:.1f} s; "
          f"{sim_facts(sim, clients, args.client_cpus)}; no accountant)")
    print(f"flower-simulation / lightning-dp (DDP) = {s / a:.2f}x; flower-simulation / lightning-dp (one process) = "
          f"{s / one:.2f}x; one process / DDP = {one / a:.2f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["logreg", "cifar_cnn"], default="logreg")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--per-client", type=int, default=60, help="examples per client before partitioning")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per side")
    parser.add_argument("--data-dir", default=None, help="official MNIST t10k files (logreg only)")
    parser.add_argument("--engine", choices=["inprocess", "simulation", "both"], default="inprocess",
                        help="Flower in-process clients, Flower's Ray simulation engine (run_simulation), or both")
    parser.add_argument("--client-cpus", default="1",
                        help="Ray num_cpus per ClientApp actor (simulation); 'default': Flower's default (2)")
    parser.add_argument("--target-accuracy", type=float, default=None,
                        help="train each side until this held-out accuracy instead of timing rounds (MNIST only)")
    parser.add_argument("--max-rounds", type=int, default=100, help="rounds at most with --target-accuracy")
    parser.add_argument("--seeds", default="0", help="--target-accuracy: comma-separated seeds, each a whole run")
    parser.add_argument("--flower-channels-last", action="store_true",
                        help="Flower's clients train image models channels-last too (as our loop engine does)")
    parser.add_argument("--devices", type=int, default=1,
                        help="our rounds over this many DDP processes of one thread (with --engine simulation)")
    parser.add_argument("--ours-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.devices > 1 and not args.ours_worker and (args.engine != "simulation" or args.target_accuracy):
        parser.error("--devices > 1 runs with --engine simulation (Flower's in-process clients cannot alternate with "
                     "rounds in other processes) and without --target-accuracy")
    if args.target_accuracy is not None and (args.model != "logreg" or not args.data_dir):
        parser.error("--target-accuracy needs real MNIST (--model logreg --data-dir with the t10k files): random "
                     "pixels hold no signal to learn")
    if args.client_cpus != "default" and not float(args.client_cpus) > 0:
        parser.error("--client-cpus is a positive number or 'default'")
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(torch.get_num_threads())
    clients = make_clients(args.model, args.clients, args.per_client, args.data_dir)
    settings = dict(epochs=args.epochs, batch_size=args.batch_size, lr=0.05, z=1.0, clip=1.0)
    if args.ours_worker:
        return ours_worker(args, clients, settings)
    if args.target_accuracy is not None:
        return run_target(args, clients, settings)
    if args.engine != "inprocess":
        return run_timed(args, clients, settings)
    other = flower(clients, args.model, **settings, channels_last=args.flower_channels_last)
    times, module = ours(clients, args.model, args.rounds, other, **settings)
    a, b = statistics.median(times["lightning-dp"]), statistics.median(times["flower"])
    sizes = [len(c) for c in clients]
    print(f"model={args.model} ({sum(p.numel() for p in network(args.model).parameters()):,} params) "
          f"clients={len(clients)} examples/client={min(sizes)}-{max(sizes)} epochs={args.epochs} "
          f"batch={args.batch_size} engine={module.update.engine_used} threads={torch.get_num_threads()}")
    print(f"lightning-dp: {a * 1000:.1f} ms/round (median of {args.rounds}; epsilon accounted: "
          f"{module.server_privacy.epsilon:.3f} after {len(module.server_privacy.accountant)} rounds)")
    print(f"flower      : {b * 1000:.1f} ms/round (median of {args.rounds}; no accountant)")
    print(f"flower / lightning-dp = {b / a:.2f}x")


if __name__ == "__main__":
    main()
