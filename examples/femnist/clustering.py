"""Would the server's k-means keep FEMNIST's writers apart under noise if it were started elsewhere? From a checkpoint.

The round's server clusters the released models with k-means started at the current hypotheses (the thesis'
Algorithm 2; ``lightning_dp.federated.kmeans``). An implementation could instead call a library's k-means with its
default start (scikit-learn's ``KMeans``: k-means++, 10 starts): docs/results_femnist_noise.md names that as one
candidate cause of the thesis' drop at nu = 10. This measures it, one round at a time, from a run's checkpoint:
each round draws m training writers (a public draw of this analysis, ``--seed``), trains them from the hypotheses
they choose (``--assigned``: from the warm-up's fixed assignment instead, as in a run's first ``warm_start_rounds``)
with the run's own local update (``FederatedRound.train_clients``), releases each update with the run's sanitizer
at every ``--noise`` nu (fresh noise per nu), and clusters the releases three ways: from the hypotheses (the
round's ``kmeans_aggregate``), scikit-learn's k-means++ and its random start. Each clustering is compared with the
writers' starts: the agreement (the share of releases in their start's cluster; for a library's clustering under
the best matching of clusters to hypotheses) and the rounds where a cluster holds releases of writers who started
from different hypotheses ("mixed").

    python examples/femnist/clustering.py --config LOGDIR/config.yaml --ckpt LOGDIR/checkpoints/X.ckpt \\
        --rounds 20 --noise 0,3,5,10,15 [-- --data.init_args.data_dir=DIR]

Without ``--ckpt`` the rounds start from the config's initial hypotheses (its model's ``seed``).

One JSON line per nu and clustering, then the geometry: the distance between the hypotheses and the writers'
update norms. A non-private diagnostic of a finished run (its clients' updates and choices): run it on the machine
that trained, never upload its output.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from typing import Any, Optional

#: how the releases are clustered: the round's own start, and two library starts an implementation could use
METHODS = ("hypotheses", "k-means++", "random")
_NOISE = 1  # the analysis' noise stream of its --seed (derive_generator's counters)


def agreement(assignment: list[int], choice: list[int], k: int, matched: bool = True) -> float:
    """The share of releases whose cluster is their writer's chosen hypothesis: cluster j is hypothesis j where
    ``matched`` is False (the round's k-means, whose cluster j replaces hypothesis j), else under the best
    one-to-one matching of clusters to hypotheses (a library's clusters are numbered arbitrarily).

    >>> agreement([1, 1, 0, 0], [0, 0, 1, 1], 2), agreement([0, 1, 0, 1], [0, 0, 1, 1], 2)
    (1.0, 0.5)
    >>> agreement([1, 1, 0, 0], [0, 0, 1, 1], 2, matched=False)
    0.0
    """
    if not matched:
        return sum(a == c for a, c in zip(assignment, choice)) / max(len(choice), 1)
    best = 0
    for perm in itertools.permutations(range(k)):
        best = max(best, sum(perm[a] == c for a, c in zip(assignment, choice)))
    return best / max(len(choice), 1)


def mixed(assignment: list[int], choice: list[int]) -> bool:
    """Whether some cluster holds releases of writers who chose different hypotheses.

    >>> mixed([0, 0, 1], [1, 1, 0]), mixed([0, 0, 0], [0, 1, 0])
    (False, True)
    """
    chosen: dict[int, set[int]] = {}
    for a, c in zip(assignment, choice):
        chosen.setdefault(a, set()).add(c)
    return any(len(s) > 1 for s in chosen.values())


def cluster(method: str, releases: Any, hypotheses: Any, seed: int) -> list[int]:
    """The releases' clusters by ``method`` (:data:`METHODS`)."""
    from lightning_dp.federated.kmeans import kmeans_aggregate

    if method == "hypotheses":
        return kmeans_aggregate(releases, hypotheses)[1].tolist()
    from sklearn.cluster import KMeans

    k = hypotheses.shape[0]
    # scikit-learn's defaults before 1.4 (n_init=10) for k-means++; the random start with as many tries
    km = KMeans(n_clusters=k, init=method, n_init=10, random_state=seed)
    return km.fit_predict(releases.double().numpy()).tolist()


def clustering_rounds(config: str, ckpt: Optional[str], extra: list[str], rounds: int, noise: list[float], seed: int,
                      clients: Optional[int] = None, assigned: bool = False) -> dict[str, Any]:
    """Cluster ``rounds`` simulated rounds' releases at every nu of ``noise`` by every method (module docstring)."""
    import importlib.util
    import os

    import torch

    from lightning_dp.datamodules.federated import client_ids
    from lightning_dp.federated.local import assigned_hypotheses, choose_hypotheses, client_losses, row_norms
    from lightning_dp.federated.parts.sanitizers import EuclideanLaplace
    from lightning_dp.privacy.noise import derive_generator

    # split.py (beside this file) builds a run's CLI from its saved config, as for its checkpoint view
    spec = importlib.util.spec_from_file_location("femnist_split", os.path.join(os.path.dirname(
        os.path.abspath(__file__)), "split.py"))
    split = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(split)
    cli = split.run_cli(config, extra)
    module, dm = cli.model, cli.datamodule
    sanitizer = module.sanitizer
    if not isinstance(sanitizer, EuclideanLaplace) or module.k < 2:
        raise SystemExit(f"this measures the d-privacy round with k >= 2 hypotheses; the config has "
                         f"{type(sanitizer).__name__} and k = {module.k}")
    first = 0  # without a checkpoint: the config's initial hypotheses, before its first round
    if ckpt is None and cli.config.get("model.init_args.seed") is None:  # the config and its overrides, parsed
        raise SystemExit("without --ckpt the rounds start from the config's initial hypotheses, which a config "
                         "without the model's seed draws afresh: give --ckpt, or the run's --model.init_args.seed")
    if ckpt is not None:
        checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False)
        module.hypotheses.copy_(checkpoint["state_dict"]["hypotheses"])
        if "federated" in checkpoint:  # the round's public seed and its round count (the local shuffles')
            module.on_load_checkpoint(checkpoint)
            first = int(module.rounds)
        else:
            first = int(checkpoint.get("epoch", -1)) + 1
    dm.setup("fit")
    module.read_clients(dm)
    hyps = module.hypotheses.detach()
    k, population = module.k, len(dm.train_clients)
    m = clients or int(round(module.selection.expected_count(population)))
    draw = torch.Generator().manual_seed(seed)
    module.sanitizer = EuclideanLaplace(0.0, per_layer=sanitizer.per_layer)  # the trained models themselves
    # the writers choose their start; with ``assigned`` they take the warm-up's fixed assignment, whatever the round
    module.warm_start_rounds = 10**9 if assigned else 0
    rows: dict[tuple[float, str], list[tuple[float, bool]]] = {(nu, meth): [] for nu in noise for meth in METHODS}
    ratios: dict[float, list[float]] = {nu: [] for nu in noise}
    norms: list[float] = []
    for i in range(rounds):
        r = first + i
        mine = sorted(torch.randperm(population, generator=draw)[:m].tolist())
        x, y, mask = dm.padded_rows("train", mine)
        if assigned:  # the round's own warm-up start (local.assigned_hypotheses)
            choice = assigned_hypotheses(module.seed, client_ids(dm.train_clients, mine), k)
        else:
            with torch.no_grad():
                choice = choose_hypotheses(client_losses(module.template, module.spec, hyps, x, y, mask,
                                                         module.loss_name, module._forward_engine()))
        trained, _, _ = module.train_clients(mine, r, x, y, mask)
        start = hyps[choice]
        update_norms = row_norms(trained - start)
        norms += update_norms.tolist()
        for j, nu in enumerate(noise):
            sanitize = EuclideanLaplace(nu, per_layer=sanitizer.per_layer, min_delta_norm=sanitizer.min_delta_norm)
            released, _, _ = sanitize.sanitize_rows(
                trained, start, layer_sizes=module.spec.sizes, references=[None] * k, choice=choice, hypotheses=hyps,
                generator_of=lambda c: derive_generator(seed, _NOISE, r, j, c))
            ratios[nu] += (row_norms(released - trained) / update_norms).tolist()  # about nu (the calibration)
            for meth in METHODS:
                assignment = cluster(meth, released, hyps, seed + r)
                rows[(nu, meth)].append((agreement(assignment, choice.tolist(), k, matched=meth != "hypotheses"),
                                         mixed(assignment, choice.tolist())))
        print(f"round {i + 1}/{rounds}: chose {torch.bincount(choice, minlength=k).tolist()}", file=sys.stderr)
    results = []
    for (nu, meth), got in rows.items():
        shares = [a for a, _ in got]
        results.append({"noise_multiplier": nu, "clustering": meth, "rounds": len(got),
                        "agreement_mean": statistics.fmean(shares),
                        "agreement_std": statistics.stdev(shares) if len(shares) > 1 else 0.0,
                        "mixed_rounds": sum(mix for _, mix in got),
                        "noise_over_update_median": statistics.median(ratios[nu])})
    distance = float(torch.linalg.vector_norm((hyps[0] - hyps[1]).double())) if k == 2 else None
    return {"results": results, "geometry": {
        "parameters": module.spec.numel, "clients_per_round": m, "hypothesis_distance": distance,
        "update_norm_median": statistics.median(norms), "update_norm_min": min(norms),
        "update_norm_max": max(norms), "first_round": first, "starts": "assigned" if assigned else "chosen"}}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the run's config (its log folder's config.yaml)")
    parser.add_argument("--ckpt", default=None,
                        help="one checkpoint file (default: the config's initial hypotheses, before any round)")
    parser.add_argument("--rounds", type=int, default=20, help="simulated rounds (each draws its own writers)")
    parser.add_argument("--noise", default="0,3,5,10,15", help="noise multipliers nu, comma separated")
    parser.add_argument("--clients", type=int, default=None, help="writers per round (default: the config's)")
    parser.add_argument("--seed", type=int, default=0, help="the analysis' draws: writers, noise, library starts")
    parser.add_argument("--assigned", action="store_true",
                        help="writers start from the warm-up's fixed assignment (warm_start_rounds), not their choice")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    stray = [a for a in extra if not a.startswith("--")]
    if stray:
        parser.error(f"unexpected arguments {stray[:3]}: give one --ckpt file, and the config's overrides as "
                     "--key=value after --")
    try:
        noise = [float(v) for v in args.noise.split(",")]
    except ValueError:
        parser.error(f"--noise {args.noise!r}: give numbers >= 0 separated by commas, e.g. 0,3,10")
    if args.rounds < 1 or any(not v >= 0 for v in noise):
        parser.error("--rounds must be >= 1 and every --noise value >= 0")
    out = clustering_rounds(args.config, args.ckpt, extra, args.rounds, noise, args.seed, args.clients,
                            args.assigned)
    for row in out["results"]:
        print(json.dumps(row))
    print(json.dumps(out["geometry"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
