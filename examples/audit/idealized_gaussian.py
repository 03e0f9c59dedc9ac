"""The one-run bounds on the idealized Gaussian mechanism (Mahloujifar, Melis & Chaudhuri 2024, Table 1).

Each of m canaries is included with probability 1/2; the auditor observes one score per canary,
``S_i / sigma + N(0, 1)`` (a Gaussian mechanism with sensitivity 1 and noise sigma, i.e. mu-GDP with
mu = 1/sigma, per canary). The bounds of :func:`lightning_dp.audit.one_run.one_run_audit` (Steinke et al.
and f-DP against mu-GDP) are compared with the mechanism's true epsilon at delta = 1e-5, over a few seeds:

    python examples/audit/idealized_gaussian.py [--canaries 100000] [--seeds 3]

The paper reports, for 10^5 canaries (10^6 at sigma 4) and the mean number of correct guesses over 100
simulations: sigma 0.5: theory 9.99, Steinke 4.99, f-DP 8.16; sigma 1: 4.37, 2.61, 3.61; sigma 2: 1.99,
1.33, 1.59; sigma 4: 0.92, 0.61, 0.82. Here the guess counts are a fixed list, Bonferroni-corrected.
Each bound is printed beside its ceiling (:func:`lightning_dp.audit.one_run.epsilon_ceiling`: every guess
correct), the largest value it can take with these canaries and guess counts whatever sigma is.
"""

from __future__ import annotations

import argparse

import numpy as np

from lightning_dp.audit.one_run import gdp_epsilon, one_run_audit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--canaries", type=int, default=100_000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--sigmas", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    args = parser.parse_args()
    m = args.canaries
    candidates = [(k, 0) for k in (m // 1000, m // 300, m // 100, m // 30)]
    print("| sigma | canaries | true eps | Steinke bound | Steinke ceiling | f-DP bound (mu-GDP) | f-DP ceiling "
          "| seeds |")
    print("|---|---|---|---|---|---|---|---|")
    for sigma in args.sigmas:
        steinke, fdp = [], []
        ceiling = None
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            included = rng.random(m) < 0.5
            scores = included / sigma + rng.standard_normal(m)
            result = one_run_audit(scores, included, delta=1e-5, candidates=candidates,
                                   methods=("steinke", "fdp_gaussian"))
            steinke.append(result.epsilon["steinke"])
            fdp.append(result.epsilon["fdp_gaussian"])
            ceiling = result.ceiling  # the same for every seed and sigma: it depends on m and the candidates only
        assert ceiling is not None
        print(f"| {sigma:g} | {m} | {gdp_epsilon(1 / sigma, 1e-5):.2f} | {np.mean(steinke):.2f} ± "
              f"{np.std(steinke, ddof=1) if len(steinke) > 1 else 0:.2f} | {ceiling.epsilon['steinke']:.2f} | "
              f"{np.mean(fdp):.2f} ± {np.std(fdp, ddof=1) if len(fdp) > 1 else 0:.2f} | "
              f"{ceiling.epsilon['fdp_gaussian']:.2f} | {args.seeds} |", flush=True)


if __name__ == "__main__":
    main()
