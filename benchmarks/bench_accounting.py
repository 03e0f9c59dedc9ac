"""Times the accountant's privacy loss distributions: dp-accounting's builders against lightning-dp's array forms
(``lightning_dp/privacy/pld_arrays.py``), in one process, and checks that they are the same distribution.

Each case builds the single step's distribution with the library's function and with ours, alternating, ``--repeats``
times (median reported), then composes it ``steps`` times and finds epsilon at delta 1e-5 with the library's
``get_epsilon_for_delta`` and with ``epsilon_for_delta``. Every field of the two distributions and the two epsilons
must be equal (the script exits with an error otherwise). Then the accountant's final epsilon of a fit, caches
cleared (what a user's fresh process pays once at the end of a fit).

Usage:
    python benchmarks/bench_accounting.py                      # the cases of docs/benchmarks.md, 1e-4
    python benchmarks/bench_accounting.py --interval 1e-3 --repeats 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from dp_accounting.pld import privacy_loss_distribution as library

from lightning_dp.privacy import pld_arrays as ours
from lightning_dp.privacy.accounting import PLDAccountant, binomial_sensitivities, clear_caches


def _fields(pld) -> dict:
    out = {}
    for name, value in vars(pld).items():
        if hasattr(value, "__dict__"):
            for inner, item in vars(value).items():
                out[f"{name}.{inner}"] = item.tobytes() if isinstance(item, np.ndarray) else item
        else:
            out[name] = value
    return out


def _cases(interval: float) -> list[tuple[str, dict, callable, callable]]:
    mnist, digits = 256 / 60_000, 64 / 1_797
    sensitivities, probabilities = binomial_sensitivities(2, mnist)
    return [
        ("Gaussian, q = 256/60,000, sigma 1.0, 235 steps", {"steps": 235},
         lambda: library.from_gaussian_mechanism(1.0, sampling_prob=mnist, value_discretization_interval=interval),
         lambda: ours.gaussian_pld(1.0, sampling_prob=mnist, value_discretization_interval=interval)),
        ("Gaussian, q = 64/1,797, sigma 1.0, 87 steps", {"steps": 87},
         lambda: library.from_gaussian_mechanism(1.0, sampling_prob=digits, value_discretization_interval=interval),
         lambda: ours.gaussian_pld(1.0, sampling_prob=digits, value_discretization_interval=interval)),
        ("truncated at 335 of 60,000, q = 256/60,000, 235 steps", {"steps": 235},
         lambda: library.from_truncated_subsampled_gaussian_mechanism(
             60_000, mnist, 335, 1.0, value_discretization_interval=interval),
         lambda: ours.truncated_gaussian_pld(dataset_size=60_000, sampling_probability=mnist, truncated_batch_size=335,
                                             noise_multiplier=1.0, value_discretization_interval=interval)),
        ("users of 2 records, q = 256/60,000, 235 steps", {"steps": 235},
         lambda: library.from_mixture_gaussian_mechanism(1.0, sensitivities, probabilities,
                                                         value_discretization_interval=interval),
         lambda: ours.mixture_gaussian_pld(1.0, sensitivities, probabilities, value_discretization_interval=interval)),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=1e-4, help="value_discretization_interval")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-fits", action="store_true", help="skip the accountant's final epsilon of the fits")
    args = parser.parse_args(argv)
    print(f"dp-accounting's builders against lightning-dp's array forms, discretization {args.interval:g}, median of "
          f"{args.repeats} (alternating)")
    print(f"{'case':56s} {'library':>9s} {'ours':>9s} {'ratio':>6s}   epsilon scan: library / ours")
    for name, extra, build_library, build_ours in _cases(args.interval):
        times: dict[str, list[float]] = {"library": [], "ours": []}
        for _ in range(args.repeats):
            for who, build in (("library", build_library), ("ours", build_ours)):
                start = time.perf_counter()
                pld = build()
                times[who].append(time.perf_counter() - start)
                if who == "library":
                    reference = pld
        if _fields(pld) != _fields(reference):
            raise SystemExit(f"{name}: the distributions differ")
        composed = pld.self_compose(extra["steps"])
        start = time.perf_counter()
        expected = composed.get_epsilon_for_delta(1e-5)
        middle = time.perf_counter()
        got = ours.epsilon_for_delta(composed, 1e-5)
        end = time.perf_counter()
        if got != expected:
            raise SystemExit(f"{name}: epsilon {got!r} against the library's {expected!r}")
        lib, mine = statistics.median(times["library"]), statistics.median(times["ours"])
        print(f"{name:56s} {lib:8.3f}s {mine:8.3f}s {lib / mine:5.1f}x   {middle - start:.3f} / {end - middle:.3f} s "
              f"(epsilon {got:.5f}, equal)")
    if args.no_fits:
        return
    print("\nthe accountant's epsilons of a fit, caches cleared (interim at 1e-3, final at the accountant's 1e-4)")
    for name, kwargs, q, steps in [
        ("MNIST CNN shape: q = 256/60,000, 235 steps", {}, 256 / 60_000, 235),
        ("  batches of one shape (335)", {"truncated_batch_size": 335, "dataset_size": 60_000}, 256 / 60_000, 235),
        ("  users of 2 records", {"examples_per_user": 2}, 256 / 60_000, 235),
        ("digits MLP shape: q = 64/1,797, 87 steps", {}, 64 / 1_797, 87),
    ]:
        clear_caches()
        accountant = PLDAccountant(**kwargs)
        accountant.step(noise_multiplier=1.0, sample_rate=q, num_steps=steps)
        start = time.perf_counter()
        accountant.interim_epsilon(1e-5)
        middle = time.perf_counter()
        epsilon = accountant.get_epsilon(1e-5)
        end = time.perf_counter()
        print(f"{name:56s} interim {middle - start:.3f} s, final {end - middle:.3f} s (epsilon {epsilon:.4f})")


if __name__ == "__main__":
    main()
