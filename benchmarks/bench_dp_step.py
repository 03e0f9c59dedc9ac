"""Times one training step: non-private, lightning-dp's DP step, Opacus (hooks, ghost), torch.func.

All methods run in ONE process on the same model shape and the same batch, interleaved
round by round so that machine noise hits every method alike; the report gives the
median step time and its ratio to the non-private step measured in the same process.
Peak memory is measured separately, one fresh subprocess per method: the peak resident
set size over 5 steps above the resident size after set-up (CPU, Linux ``VmHWM`` reset
through ``/proc/self/clear_refs``), or ``max_memory_allocated`` above the allocation after
set-up (CUDA).

Usage:
    python benchmarks/bench_dp_step.py                      # MNIST CNN (thesis Table 3.5), batch 256
    python benchmarks/bench_dp_step.py --batch-size 64 --rounds 10 --methods nonprivate,lightning_dp
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_dp.models import MNISTConvNet  # noqa: E402
from lightning_dp.privacy import GradSampleEngine, clip_factors, derive_generator, noisy_mean  # noqa: E402

SIGMA, C = 1.0, 1.0
METHODS = ["nonprivate", "lightning_dp", "opacus_hooks", "opacus_ghost", "torch_func"]


def make_batch(batch_size: int, device: str):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, 1, 28, 28, generator=g).to(device)
    y = torch.randint(0, 10, (batch_size,), generator=g).to(device)
    return x, y


def build(method: str, batch_size: int, device: str):
    """Returns a zero-argument function running one full training step of ``method``."""
    torch.manual_seed(0)
    model = MNISTConvNet().to(device)
    x, y = make_batch(batch_size, device)
    if method == "nonprivate":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step():
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return step

    if method == "lightning_dp":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = GradSampleEngine(model)
        engine.probe(lambda n: model(x[:n]))  # where the batch is (DPSGD probes once, when training starts)
        params = engine.parameters
        counter = iter(range(10**9))

        def step():
            opt.zero_grad(set_to_none=True)
            with engine.record():
                F.cross_entropy(model(x), y).backward()
            norms = engine.per_sample_norms()
            sums = engine.clipped_sum(clip_factors(norms, C))
            engine.clear()
            grads = noisy_mean(sums, noise_multiplier=SIGMA, max_grad_norm=C, expected_batch_size=batch_size,
                               generator=derive_generator(0, 2, next(counter), device=device))
            for p, gr in zip(params, grads):
                p.grad = gr
            opt.step()
        return step

    if method in ("opacus_hooks", "opacus_ghost"):
        import warnings

        from opacus import PrivacyEngine
        from torch.utils.data import DataLoader, TensorDataset

        warnings.filterwarnings("ignore")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(TensorDataset(x.cpu(), y.cpu()), batch_size=batch_size)
        engine = PrivacyEngine()
        mode = "ghost" if method == "opacus_ghost" else "hooks"
        if mode == "ghost":
            model, opt, criterion, _ = engine.make_private(
                module=model, optimizer=opt, data_loader=loader, criterion=torch.nn.CrossEntropyLoss(),
                noise_multiplier=SIGMA, max_grad_norm=C, poisson_sampling=False, grad_sample_mode="ghost")

            def step():
                opt.zero_grad(set_to_none=True)
                criterion(model(x), y).backward()
                opt.step()
        else:
            model, opt, _ = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                                noise_multiplier=SIGMA, max_grad_norm=C, poisson_sampling=False)

            def step():
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                opt.step()
        return step

    if method == "torch_func":
        from torch.func import functional_call, grad, vmap

        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        names = [n for n, _ in model.named_parameters()]
        gen = torch.Generator(device=device).manual_seed(0)

        def loss_one(params, xi, yi):
            return F.cross_entropy(functional_call(model, params, (xi[None],)), yi[None])

        per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))

        def step():
            params = {n: p.detach() for n, p in model.named_parameters()}
            gs = per_sample(params, x, y)
            norms = torch.stack([gs[n].reshape(batch_size, -1).norm(dim=1) for n in names]).norm(dim=0)
            f = clip_factors(norms, C)
            for n, p in model.named_parameters():
                s = torch.einsum("b,b...->...", f, gs[n])
                p.grad = (s + torch.randn(s.shape, generator=gen, device=device) * SIGMA * C) / batch_size
            opt.step()
        return step
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def time_all(methods: list[str], batch_size: int, rounds: int, steps: int, device: str) -> dict[str, float]:
    fns = {m: build(m, batch_size, device) for m in methods}
    for fn in fns.values():  # warm-up
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(rounds):
        for m, fn in fns.items():
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times[m].append((time.perf_counter() - t0) / steps)
    return {m: statistics.median(v) for m, v in times.items()}


def _rss_peak_mib() -> float:
    """This process' peak resident set size (MiB) since the last :func:`_reset_rss_peak`."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_now_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _reset_rss_peak() -> None:
    # Linux: writing 5 to clear_refs resets VmHWM to the current RSS. (ru_maxrss is useless
    # here: a child inherits its parent's high-water mark through fork.)
    Path("/proc/self/clear_refs").write_text("5")


def measure_memory(method: str, batch_size: int, device: str) -> float:
    """MiB of peak memory above the state after set-up, over 5 steps (run in a fresh process)."""
    fn = build(method, batch_size, device)
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    base = _rss_now_mib()
    _reset_rss_peak()
    for _ in range(5):
        fn()
    return _rss_peak_mib() - base


def peak_memory(method: str, batch_size: int, device: str) -> float:
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); import bench_dp_step as b; "
            f"print(b.measure_memory({method!r}, {batch_size}, {device!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (median is reported)")
    parser.add_argument("--steps", type=int, default=3, help="steps per method per round")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    if "nonprivate" not in methods:
        methods.insert(0, "nonprivate")
    times = time_all(methods, args.batch_size, args.rounds, args.steps, args.device)
    memory = {} if args.no_memory else {m: peak_memory(m, args.batch_size, args.device) for m in methods}
    base = times["nonprivate"]
    print(f"MNIST CNN (Table 3.5 shape), batch {args.batch_size}, device {args.device}, "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.rounds} rounds x {args.steps} steps")
    print(f"{'method':<14} {'ms/step':>9} {'x non-private':>14} {'peak MiB':>9}")
    for m in methods:
        mem = f"{memory[m]:9.1f}" if m in memory else f"{'-':>9}"
        print(f"{m:<14} {times[m] * 1e3:9.2f} {times[m] / base:14.2f} {mem}")
    if args.json:
        args.json.write_text(json.dumps({"times_s": times, "ratio": {m: t / base for m, t in times.items()},
                                         "peak_mib": memory, "batch_size": args.batch_size}, indent=2))


if __name__ == "__main__":
    main()
