"""Times federated rounds: the whole round at population scale (``--whole``), or the client part, vectorized
(torch.func) vs. a per-client loop (default).

``--whole``: DP-FedAvg (Poisson selection at rate U / N, local SGD, the server's clipping and
Gaussian noise with its PLD accountant, MLflow logging to SQLite) on a population of N generated
clients (:class:`~lightning_dp.datamodules.population.SyntheticPopulationDataModule`: 8 bytes per
client held, the round's clients built when drawn), one ``Trainer.fit`` per (model, U) in its own
process (its peak memory is its own). Per round: the median time of the rounds after the first,
the share of it spent generating the clients' data (what reading real data would replace), the
accounting (``privacy/epsilon`` is composed when Lightning writes metrics, every
``--log-every`` rounds, and at the end) and the process's peak resident memory.

The client part: all run in one process on the same clients, starting points and shuffles
(``lightning_dp.federated.local_sgd`` with the dense engine's hand-written gradients where the model is a chain of
Linear layers, with ``vmap(grad)``, and ``local_sgd_loop``, which trains one client at a time with
``torch.optim.SGD``), alternating repetitions; the median is reported.

Usage:
    python benchmarks/bench_federated_round.py                          # hospital MLP (11 params), U = 100
    python benchmarks/bench_federated_round.py --model femnist --clients 10 --samples 20,200
    python benchmarks/bench_federated_round.py --model logreg --samples 45,82 --batch-size 16   # dense vs vmap
    python benchmarks/bench_federated_round.py --model cifar --samples 47,81 --batch-size 16 --device cuda
    python benchmarks/bench_federated_round.py --whole                  # U = 1k, 10k, 100k of N = 1M, 3 models
    python benchmarks/bench_federated_round.py --whole --models hospital --per-round 100000 --rounds 60
    python benchmarks/bench_federated_round.py --whole --models logreg --per-round 100000 --malloc keep
    python benchmarks/bench_federated_round.py --accounting             # one epsilon write, q = 0.001 .. 0.1
    python benchmarks/bench_federated_round.py --whole --models hospital --devices 2   # clients over 2 DDP ranks
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_dp.federated import FlatParams, local_sgd, local_sgd_loop  # noqa: E402
from lightning_dp.federated.dense import dense_chain  # noqa: E402
from lightning_dp.privacy.noise import derive_generator  # noqa: E402


def module_keys(clients: int, width: int, device: str = "cpu"):
    """The shuffle keys as PersonalizedFederatedModule draws them: one (clients x width) table per epoch."""
    def keys(epoch: int) -> torch.Tensor:
        return torch.rand((clients, width), generator=derive_generator(0, 12, 0, epoch)).to(device)
    return keys


def make_model(name: str) -> tuple[nn.Module, tuple[int, ...], str]:
    if name == "hospital":  # the seed's 11-parameter MLP, 3 -> 2 -> 1
        return nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 1)), (3,), "rmse"
    if name == "femnist":  # the seed's CNN (conv 32 2x2, conv 64 2x2, max-pool 2x2, FC 128, FC 62)
        net = nn.Sequential(nn.Conv2d(1, 32, 2), nn.ReLU(), nn.Conv2d(32, 64, 2), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Flatten(), nn.Linear(64 * 13 * 13, 128), nn.ReLU(), nn.Linear(128, 62))
        return net, (1, 28, 28), "cross_entropy"
    if name == "logreg":  # the project's multinomial logistic regression on MNIST-shaped images, 10 classes
        from lightning_dp.models import LogisticRegression

        return LogisticRegression(), (1, 28, 28), "cross_entropy"
    if name == "cifar":  # the federated CIFAR-10 CNN (the Flower comparison's)
        from lightning_dp.models.federated import CIFARConvNet

        return CIFARConvNet(), (3, 32, 32), "cross_entropy"
    raise ValueError(f"unknown model {name!r}; choose hospital, logreg, femnist or cifar")


#: the whole-round models: (network, SyntheticPopulation task and input shape, loss, local lr)
WHOLE_MODELS = ("hospital", "logreg", "cifar")


def whole_setting(name: str):
    from lightning_dp.models import CIFARConvNet, HospitalMLP, LogisticRegression

    if name == "hospital":  # the CMS hospital MLP (3 -> 2 -> 1, 11 parameters), regression
        return HospitalMLP(), dict(task="regression", input_shape=[3]), "rmse", 0.05
    if name == "logreg":  # the project's multinomial logistic regression on MNIST-shaped images (7,850 parameters)
        return LogisticRegression(), dict(task="image", input_shape=[1, 28, 28]), "cross_entropy", 0.05
    if name == "cifar":  # McMahan et al.'s CIFAR CNN (the Flower comparison's)
        return CIFARConvNet(), dict(task="image", input_shape=[3, 32, 32]), "cross_entropy", 0.05
    raise ValueError(f"unknown model {name!r}; choose one of {WHOLE_MODELS}")


def whole_one(model_name: str, per_round: int, population: int, rounds: int, log_every: int,
              devices: int = 1) -> dict:
    """One fit of ``rounds`` DP-FedAvg rounds; what the module docstring says, as a dict. ``devices`` > 1: DDP
    over that many CPU processes (each its share of the round's clients, one thread each)."""
    import lightning as L
    from lightning.pytorch.loggers import MLFlowLogger

    from lightning_dp.datamodules.population import SyntheticPopulationDataModule
    from lightning_dp.federated import FederatedRound
    from lightning_dp.federated.parts import CentralGaussian, LocalSGD, PoissonSelection

    net, data, loss, lr = whole_setting(model_name)
    dm = SyntheticPopulationDataModule(population, 100, samples=(1, 4), seed=0, **data)
    privacy = CentralGaussian(noise_multiplier=1.0, clip=1.0, target_delta=0.1 / population)
    module = FederatedRound(net, selection=PoissonSelection(per_round / population),
                            update=LocalSGD(lr=lr, epochs=1, batch_size=10), server_privacy=privacy, loss=loss,
                            seed=0, noise_seed=1, log_nonprivate_metrics=False)
    spent = {"data": 0.0, "accounting": 0.0, "writes": 0, "interim": 0.0, "interim_writes": 0}
    rows_of = dm.padded_rows

    def timed_rows(*a, **k):
        t0 = time.perf_counter()
        out = rows_of(*a, **k)
        spent["data"] += time.perf_counter() - t0
        return out

    dm.padded_rows = timed_rows  # type: ignore[method-assign]
    eps_of = privacy.epsilon_metrics

    def timed_epsilon(*, interim: bool = False):
        t0 = time.perf_counter()
        out = eps_of(interim=interim)
        took = time.perf_counter() - t0
        spent["accounting"] += took
        spent["writes"] += 1
        if interim:  # the writes before the last, from the coarser PLD
            spent["interim"] += took
            spent["interim_writes"] += 1
        return out

    privacy.epsilon_metrics = timed_epsilon  # type: ignore[method-assign]
    times: list[dict] = []

    class Clock(L.Callback):
        def on_train_batch_start(self, *args) -> None:
            self.t0, self.d0, self.a0 = time.perf_counter(), spent["data"], spent["accounting"]

        def on_train_batch_end(self, *args) -> None:
            times.append({"round": time.perf_counter() - self.t0, "data": spent["data"] - self.d0,
                          "accounting": spent["accounting"] - self.a0})

    with tempfile.TemporaryDirectory() as tmp:
        logger = MLFlowLogger(experiment_name="bench-round", tracking_uri=f"sqlite:///{tmp}/mlruns.db")
        parallel = dict(strategy="ddp", devices=devices, accelerator="cpu") if devices > 1 else {}
        if devices > 1:
            torch.set_num_threads(1)
        trainer = L.Trainer(max_epochs=rounds, logger=logger, callbacks=[Clock()], log_every_n_steps=log_every,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, num_sanity_val_steps=0, **parallel)
        t0 = time.perf_counter()
        trainer.fit(module, datamodule=dm)
        fit = time.perf_counter() - t0
    later = times[1:] or times
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"model": model_name, "params": module.spec.numel, "U": per_round, "N": population,
            "rounds": len(times), "round_s": statistics.median(t["round"] for t in later),
            "data_s": statistics.median(t["data"] for t in later),
            "accounting_s": spent["accounting"], "epsilon_writes": spent["writes"],
            "accounting_share": spent["accounting"] / sum(t["round"] for t in times),
            "interim_s": spent["interim"], "interim_writes": spent["interim_writes"],
            "interim_share": spent["interim"] / sum(t["round"] for t in times),
            "fit_s": fit, "peak_rss_mib": rss, "epsilon": float(privacy.epsilon), "threads": torch.get_num_threads(),
            "devices": devices, "rank": trainer.global_rank}


def whole(args: argparse.Namespace) -> None:
    """Each (model, U) in a fresh process: a markdown table of the results."""
    where = "one process" if args.devices == 1 else f"DDP over {args.devices} CPU processes of one thread"
    print(f"N = {args.population} clients, DP-FedAvg, {args.rounds} rounds per fit (median of rounds 2..), epsilon "
          f"written every {args.log_every} rounds, {where}; torch {torch.__version__}; allocator {args.malloc}; "
          f"load {os.getloadavg()[0]:.2f}")
    print("| model | params | U | round (median) | of which data generation | accounting, share of the fit "
          "(writes) | of which interim writes (coarse PLD) | peak memory |")
    print("|---|---|---|---|---|---|---|---|")
    for model_name in args.models.split(","):
        for per_round in (int(u) for u in args.per_round.split(",")):
            rounds = args.rounds if model_name == "hospital" else max(2, min(args.rounds, args.big_rounds))
            out = subprocess.run([sys.executable, __file__, "--whole-one", model_name, str(per_round),
                                  str(args.population), str(rounds), str(args.log_every), str(args.devices)],
                                 capture_output=True, text=True)
            line = [row for row in out.stdout.splitlines() if row.startswith("{")]
            if out.returncode or not line:
                print(f"| {model_name} | | {per_round:,} | failed: {(out.stderr.strip().splitlines() or ['?'])[-1]} |")
                continue
            r = json.loads(line[-1])
            print(f"| {r['model']} | {r['params']:,} | {r['U']:,} | {r['round_s'] * 1e3:,.0f} ms | "
                  f"{r['data_s'] * 1e3:,.0f} ms | {r['accounting_s']:.2f} s, {100 * r['accounting_share']:.1f} % "
                  f"({r['epsilon_writes']}) | {r['interim_s']:.2f} s, {100 * r['interim_share']:.1f} % "
                  f"({r['interim_writes']}) | {r['peak_rss_mib']:,.0f} MiB |", flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")


def accounting_costs() -> None:
    """What one ``privacy/epsilon`` write costs: the PLD of n DP-FedAvg rounds (z = 1) at client rate q, first (the
    single-round PLD built, then cached) and later (the n-fold composition only)."""
    from lightning_dp.privacy.accounting import clear_caches, get_accountant

    print(f"PLD epsilon at delta 1e-7, z = 1; load {os.getloadavg()[0]:.2f}")
    print("| q | write | first write (n = 50) | n = 100 | n = 1,000 | epsilon at n = 1,000 |")
    print("|---|---|---|---|---|---|")
    for q in (0.001, 0.01, 0.1):
        for kind in ("final", "interim"):  # get_epsilon (1e-4) and interim_epsilon (1e-3), each from a cold cache
            clear_caches()
            accountant, costs = get_accountant("pld"), []
            epsilon_of = accountant.get_epsilon if kind == "final" else accountant.interim_epsilon
            for steps in (50, 50, 900):
                accountant.step(noise_multiplier=1.0, sample_rate=q, num_steps=steps)
                t0 = time.perf_counter()
                epsilon = epsilon_of(1e-7)
                costs.append(time.perf_counter() - t0)
            print(f"| {q:g} | {kind} | " + " | ".join(f"{c:.3f} s" for c in costs) + f" | {epsilon:.6f} |")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--whole-one"]:  # the child process of --whole (and, under DDP, every rank Lightning starts)
        model_name, per_round, population, rounds, log_every, devices = argv[1], *(int(v) for v in argv[2:7])
        out = whole_one(model_name, per_round, population, rounds, log_every, devices)
        if out["rank"] == 0:
            print(json.dumps(out))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--whole", action="store_true", help="time whole rounds at population scale")
    parser.add_argument("--accounting", action="store_true", help="time one privacy/epsilon write of DP-FedAvg")
    parser.add_argument("--models", default=",".join(WHOLE_MODELS), help="--whole: models")
    parser.add_argument("--per-round", default="1000,10000,100000", help="--whole: expected clients per round U")
    parser.add_argument("--population", type=int, default=1_000_000, help="--whole: N")
    parser.add_argument("--rounds", type=int, default=12, help="--whole: rounds per fit (the hospital MLP)")
    parser.add_argument("--big-rounds", type=int, default=3, help="--whole: rounds per fit of the other models")
    parser.add_argument("--log-every", type=int, default=50, help="--whole: Trainer(log_every_n_steps)")
    parser.add_argument("--devices", type=int, default=1, help="--whole: DDP processes (1: one process)")
    parser.add_argument("--model", default="hospital")
    parser.add_argument("--clients", type=int, default=100, help="U, clients per round")
    parser.add_argument("--samples", default="1,4", help="min,max examples per client (uniform)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="the client part: cpu or cuda")
    parser.add_argument("--malloc", choices=("system", "keep"), default="system",
                        help="system: the C allocator as it is (what a Lightning script gets); keep: glibc keeps "
                             "freed memory for the next block, as the lightning-dp commands set it "
                             "(lightning_dp.config.allocator; docs/benchmarks.md, '... and the C allocator')")
    args = parser.parse_args(argv)
    if args.malloc == "keep":
        from lightning_dp.config.allocator import keep_freed_memory

        if not keep_freed_memory(children=True):  # --whole's fits, which run in processes this one starts, too
            parser.error("--malloc keep needs glibc (Linux)")
    if args.whole:
        whole(args)
        return
    if args.accounting:
        accounting_costs()
        return
    torch.manual_seed(0)
    model, shape, loss = make_model(args.model)
    device = torch.device(args.device)
    model = model.to(device)
    spec = FlatParams.of(model)
    lo, hi = (int(v) for v in args.samples.split(","))
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(lo, hi + 1, (args.clients,), generator=g)
    nmax = int(sizes.max())
    x = torch.randn(args.clients, nmax, *shape, generator=g)
    classes = 62 if args.model == "femnist" else 10
    y = torch.randint(0, classes, (args.clients, nmax), generator=g) if loss == "cross_entropy" else \
        torch.randn(args.clients, nmax, generator=g)
    mask = torch.arange(nmax).unsqueeze(0) < sizes.unsqueeze(1)
    x, y, mask = x.to(device), y.to(device), mask.to(device)
    start = spec.flatten(model).unsqueeze(0).repeat(args.clients, 1)
    kwargs = dict(epochs=args.epochs, lr=0.01, batch_size=args.batch_size, loss=loss)
    fns = {"vectorized": local_sgd, "per-client loop": local_sgd_loop}
    chain, why = dense_chain(model, spec)
    if chain is not None:  # the dense engine's hand-written gradients, as client_engine="auto" picks them
        fns = {"dense": functools.partial(local_sgd, chain=chain), **fns}
    else:
        print(f"no dense engine for this model: {why}")
    times: dict[str, list[float]] = {k: [] for k in fns}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for k, fn in fns.items():  # warm-up
        fn(model, spec, start, x, y, mask, generator=module_keys(args.clients, nmax, args.device), **kwargs)
    for _ in range(args.repeats):
        for k, fn in fns.items():
            keys = module_keys(args.clients, nmax, args.device)
            sync()
            t0 = time.perf_counter()
            fn(model, spec, start, x, y, mask, generator=keys, **kwargs)
            sync()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model {args.model} ({spec.numel} parameters), U={args.clients} clients, {lo}-{hi} examples each, "
          f"E={args.epochs}, B_s={args.batch_size}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, median of {args.repeats}")
    for k, t in med.items():
        print(f"{k:<16} {t * 1e3:10.2f} ms/round")
    print(f"speed-up        {med['per-client loop'] / med['vectorized']:10.1f} x (vmap vs loop)")
    if "dense" in med:
        print(f"speed-up        {med['per-client loop'] / med['dense']:10.1f} x (dense vs loop), "
              f"{med['vectorized'] / med['dense']:.2f} x (dense vs vmap)")


if __name__ == "__main__":
    main()
