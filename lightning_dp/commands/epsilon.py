"""``lightning-dp epsilon``: the epsilon of a DP-SGD or DP-FedAvg run, or the noise multiplier for a target epsilon.

Answered with the SAME functions the training uses (docs/getting_started.md, "Choosing epsilon"). An epoch is
``ceil(N / B)`` steps, as DPSGD trains it; Opacus counts ``int(1 / q)``, a step fewer when B does not divide N
(``--epoch-steps floor`` counts as Opacus does). The example lines and the DP-FedAvg paragraph below are also the
command's ``--help``::

    lightning-dp epsilon --dataset-size 60000 --batch-size 256 --epochs 15 --noise-multiplier 1.1
    lightning-dp epsilon --dataset-size 60000 --batch-size 256 --epochs 15 --target-epsilon 3
    lightning-dp epsilon --sample-rate 0.01 --steps 1000 --noise-multiplier 1.0 --accountant rdp
    lightning-dp epsilon ... --adjacency replace          # bounded DP (PLD only when q < 1)
    lightning-dp epsilon --dataset-size 20000 --batch-size 200 --epochs 5 --noise-multiplier 1.5 --max-examples-per-user 8
    lightning-dp epsilon --dataset-size 2500 --batch-size 25 --epochs 5 --noise-multiplier 1.5 --max-examples-per-user 8 --sampling user
    lightning-dp epsilon --clients 1000 --clients-per-round 50 --rounds 100 --noise-multiplier 1.0
    lightning-dp epsilon --clients 100 --clients-per-round 20 --rounds 100 --target-epsilon 4 --delta 1e-3
    lightning-dp epsilon --client-sample-rate 0.2 --rounds 100 --noise-multiplier 1.83 --adjacency replace

What the training does and this assumes: every training client (validation and test clients are held
out) takes part in a round independently with probability q = clients per round / clients (Poisson,
``PoissonSelection(sample_rate=q)``: the number of participants is random, qN on average). The server
clips each participant's update at C, sums, adds N(0, (z C)^2 I) once and divides by qN; z, the noise
multiplier, is relative to the sensitivity C of that sum. One round is one Poisson-subsampled Gaussian
mechanism (z, q) and rounds compose. Adjacency: one client's whole data added or removed (default), or
replaced by another's (``--adjacency replace``: the sum moves by up to 2C; dp-accounting's replace-one
analysis, PLD only when q < 1). Exactly U clients per round (``UniformSelection``, sampling without
replacement) is NOT accounted: CentralGaussian refuses it. Adaptive clipping is accounted with the
same z (the count and update releases compose to one Gaussian with multiplier z). Under replacement a
sanitizer that bounds the updates more tightly than the ball of radius C (the sector) can make the
training report less: the calculator gives the ball's bound.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_dp.federated.parts.server_privacy import CentralGaussian
    from lightning_dp.privacy.delta import LargeDeltaWarning

__all__ = ["build_parser", "client_epsilon_table", "client_level_privacy", "epsilon_table", "main"]


def build_parser() -> argparse.ArgumentParser:
    from lightning_dp.commands.errors import ShortArgumentParser

    parser = ShortArgumentParser(
        prog="lightning-dp epsilon", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n" + "\n".join(line.strip() for line in __doc__.splitlines() if "lightning-dp epsilon " in
                                         line)
        + "\n\nDP-FedAvg. " + next(p for p in __doc__.split("\n\n") if p.startswith("What the training does")))
    size = parser.add_argument_group("sampling (give --sample-rate, or --dataset-size with --batch-size)")
    size.add_argument("--dataset-size", type=int, metavar="N", help="N, the number of training examples")
    size.add_argument("--batch-size", type=int, metavar="B", help="the expected batch size B (Poisson: q = B / N)")
    size.add_argument("--sample-rate", type=float, metavar="Q", help="q, the Poisson sampling rate in (0, 1]")
    size.add_argument("--max-batch-size", metavar="BOUND",
                      help="batches of one shape (DPSGD(max_batch_size=BOUND)): Poisson batches truncated to at "
                           "most BOUND examples, accounted as dp-accounting's truncated event over N + 1 records; 'auto' for the "
                           "bound a batch exceeds with probability 1e-6 per step (needs --dataset-size/--batch-size)")
    length = parser.add_argument_group("length (give --epochs or --steps)")
    length.add_argument("--epochs", type=int, help="epochs: an epoch is ceil(N / B) = ceil(1 / q) steps, as DPSGD "
                        "trains it (Opacus counts int(1 / q): --epoch-steps floor)")
    length.add_argument("--steps", type=int, help="optimizer steps")
    length.add_argument("--epoch-steps", choices=["ceil", "floor"], default="ceil",
                        help="steps in an epoch: ceil(1 / q), the training's (default), or floor: int(1 / q), "
                        "Opacus' count (N = 60000, B = 256, 60 epochs, sigma 1.1: PLD epsilon 2.3852 with ceil, "
                        "2.3796 with floor)")
    fed = parser.add_argument_group(
        "DP-FedAvg, client-level (instead of the two groups above: --rounds with --clients and --clients-per-round, "
        "or with --client-sample-rate)")
    fed.add_argument("--clients", type=int, help="N, the number of training clients (held-out ones excluded)")
    fed.add_argument("--clients-per-round", type=float,
                     help="U, the EXPECTED number of clients per round (Poisson: q = U / N; not a fixed-size draw)")
    fed.add_argument("--client-sample-rate", type=float, help="q, the client-level Poisson sampling rate in (0, 1]")
    fed.add_argument("--rounds", type=int, help="rounds (the Trainer's max_epochs)")
    users = parser.add_argument_group(
        "user-level DP-SGD (DPSGD(privacy_unit='user'): at most K records per user, example-level sampling; "
        "--dataset-size counts the records kept)")
    users.add_argument("--max-examples-per-user", type=int, metavar="K",
                       help="K: epsilon per user (every record of one user added or removed), not per example")
    users.add_argument("--user-accounting", choices=["mixture", "group"], default="mixture",
                       help="mixture: dp-accounting's mixture of Gaussians over how many of a user's K records a "
                       "batch holds (tight, default); group: group privacy of the example-level spend (looser)")
    users.add_argument("--sampling", choices=["example", "user"], default="example",
                       help="example: records are sampled (ELS, default); user: users are sampled with their records "
                       "and clipped as one (ULS, DPSGD(sampling='user')): --dataset-size counts USERS and --batch-size "
                       "the expected users per step, and the spend is the sampled Gaussian at the users' rate")
    noise = parser.add_argument_group("noise (give --noise-multiplier, or --target-epsilon to calibrate it)")
    noise.add_argument("--noise-multiplier", type=float, metavar="SIGMA", help="sigma (DP-FedAvg: z), the noise std over the clipping norm")
    noise.add_argument("--target-epsilon", type=float, metavar="EPSILON", help="the budget: prints the smallest sigma that fits it")
    parser.add_argument("--delta", type=float, default=1e-5, metavar="DELTA", help="delta (default 1e-5)")
    parser.add_argument("--print_config", action="store_true",
                        help="print the settings (given and default) as YAML and exit")
    parser.add_argument("--accountant", choices=["pld", "rdp"], default="pld", help="default pld")
    parser.add_argument("--adjacency", choices=["add_remove", "replace"], default="add_remove",
                        help="neighbouring datasets: one example (DP-FedAvg: one client) added/removed (default) or "
                        "replaced (PLD only when q < 1)")
    return parser


_DPSGD_OPTIONS = ("dataset_size", "batch_size", "sample_rate", "epochs", "steps")
_FEDAVG_OPTIONS = ("clients", "clients_per_round", "client_sample_rate", "rounds")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_fedavg(args: argparse.Namespace) -> bool:
    """DP-FedAvg mode: any of its options is given."""
    return any(getattr(args, name) is not None for name in _FEDAVG_OPTIONS)


def _sample_rate(args: argparse.Namespace) -> float | None:
    """q of either mode (given, or the ratio of its two counts), or None when the input does not define one."""
    if _is_fedavg(args):
        rate, part, whole = args.client_sample_rate, args.clients_per_round, args.clients
    else:
        rate, part, whole = args.sample_rate, args.batch_size, args.dataset_size
    if rate is not None:
        return rate
    return part / whole if part is not None and whole and whole > 0 else None


def _fedavg_problems(args: argparse.Namespace) -> list[str]:
    out = []
    mixed = [_flag(name) for name in _DPSGD_OPTIONS if getattr(args, name) is not None]
    if mixed:
        out.append(f"{', '.join(mixed)}: DP-SGD options do not mix with the DP-FedAvg options (--clients, "
                   "--clients-per-round, --client-sample-rate, --rounds); give one kind")
    if args.client_sample_rate is None and (args.clients is None or args.clients_per_round is None):
        out.append("give --client-sample-rate Q, or --clients N with --clients-per-round U (then q = U / N)")
    if args.client_sample_rate is not None and args.clients_per_round is not None:
        out.append("give --client-sample-rate OR --clients-per-round, not both")
    if args.clients is not None and args.clients < 1:
        out.append(f"--clients={args.clients}: must be >= 1 (the training clients, held-out clients excluded)")
    if args.clients_per_round is not None and not args.clients_per_round > 0:
        out.append(f"--clients-per-round={args.clients_per_round:g}: must be > 0")
    if args.clients_per_round and args.clients and args.clients_per_round > args.clients >= 1:
        out.append(f"--clients-per-round={args.clients_per_round:g} exceeds --clients={args.clients}; lower it")
    if args.client_sample_rate is not None and not 0 < args.client_sample_rate <= 1:
        out.append(f"--client-sample-rate={args.client_sample_rate}: must be in (0, 1], e.g. 0.05")
    if args.rounds is None:
        out.append("give --rounds R, the number of rounds (the Trainer's max_epochs)")
    elif args.rounds < 1:
        out.append(f"--rounds={args.rounds}: must be >= 1")
    return out


def _problems(args: argparse.Namespace) -> list[str]:
    out = _fedavg_problems(args) if _is_fedavg(args) else _dpsgd_problems(args)
    if (args.noise_multiplier is None) == (args.target_epsilon is None):
        out.append("give exactly one of --noise-multiplier SIGMA (prints epsilon) and --target-epsilon EPS (prints "
                   "the noise multiplier)")
    if args.noise_multiplier is not None and not args.noise_multiplier > 0:
        out.append(f"--noise-multiplier={args.noise_multiplier}: must be > 0")
    if args.target_epsilon is not None and not args.target_epsilon > 0:
        out.append(f"--target-epsilon={args.target_epsilon}: must be > 0")
    if not 0 < args.delta < 1:
        out.append(f"--delta={args.delta}: must be in (0, 1), e.g. 1e-5 (below 1/N)")
    if args.sampling == "user" and args.max_examples_per_user is None:
        out.append("--sampling user needs --max-examples-per-user K (the records each sampled user brings, as "
                   "DPSGD(privacy_unit='user', sampling='user') needs)")
    if args.sampling == "user" and args.user_accounting != "mixture":
        out.append("--user-accounting states example-level sampling (ELS); --sampling user is accounted at the "
                   "users' rate: drop --user-accounting")
    if args.max_examples_per_user is not None:
        if _is_fedavg(args):
            out.append("--max-examples-per-user is for user-level DP-SGD; DP-FedAvg's clients are its users already")
        if args.max_examples_per_user < 1:
            out.append(f"--max-examples-per-user={args.max_examples_per_user}: must be >= 1")
        if args.accountant != "pld" or args.adjacency != "add_remove":
            out.append("--max-examples-per-user needs --accountant pld and --adjacency add_remove (a user added or "
                       "removed with all their records)")
    if args.max_batch_size is not None:
        if _is_fedavg(args) or args.dataset_size is None or args.batch_size is None:
            out.append("--max-batch-size needs --dataset-size N and --batch-size B (the truncated event is stated over "
                       "the N + 1 records a batch is drawn from)")
        if args.max_examples_per_user is not None or args.accountant != "pld" or args.adjacency != "add_remove":
            out.append("--max-batch-size needs --accountant pld and --adjacency add_remove, per example (the "
                       "truncated event dp-accounting has)")
        if args.max_batch_size != "auto" and not (args.max_batch_size.isdigit() and int(args.max_batch_size) >= 1):
            out.append(f"--max-batch-size={args.max_batch_size}: a whole number >= 1 or 'auto'")
        elif (args.max_batch_size != "auto" and args.batch_size is not None
              and int(args.max_batch_size) < args.batch_size):
            out.append(f"--max-batch-size={args.max_batch_size} is below --batch-size={args.batch_size}, as DPSGD "
                       "refuses (most steps would be truncated)")
    if args.adjacency == "replace" and args.accountant == "rdp" and _sample_rate(args) != 1:
        out.append("--adjacency replace needs --accountant pld when q < 1 (dp-accounting has no RDP bound for the "
                   "Poisson-subsampled Gaussian under replacement)")
    return out


def _dpsgd_problems(args: argparse.Namespace) -> list[str]:
    out = []
    if args.sample_rate is None and (args.dataset_size is None or args.batch_size is None):
        out.append("give --sample-rate Q, or --dataset-size N with --batch-size B (then q = B / N)")
    if args.sample_rate is not None and (args.dataset_size is not None or args.batch_size is not None):
        out.append("give --sample-rate OR --dataset-size/--batch-size, not both")
    if args.dataset_size is not None and args.dataset_size < 1:
        out.append(f"--dataset-size={args.dataset_size}: must be >= 1")
    if args.batch_size is not None and args.batch_size < 1:
        out.append(f"--batch-size={args.batch_size}: must be >= 1")
    if args.batch_size and args.dataset_size and args.batch_size > args.dataset_size:
        out.append(f"--batch-size={args.batch_size} exceeds --dataset-size={args.dataset_size}; lower it")
    if args.sample_rate is not None and not 0 < args.sample_rate <= 1:
        out.append(f"--sample-rate={args.sample_rate}: must be in (0, 1], e.g. 0.01")
    if (args.epochs is None) == (args.steps is None):
        out.append("give exactly one of --epochs E and --steps T")
    for name in ("epochs", "steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            out.append(f"--{name}={value}: must be >= 1")
    return out


def epsilon_table(*, noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "pld",
                  adjacency: str = "add_remove", fractions: Sequence[float] = (0.25, 0.5, 0.75, 1.0),
                  accountant_kwargs: dict | None = None) -> list[tuple[int, float]]:
    """``(steps, epsilon)`` after each fraction of the run, from the training's accountant (``accountant_kwargs``:
    its further arguments, e.g. ``examples_per_user`` for a user-level spend).

    Example:
        >>> rows = epsilon_table(noise_multiplier=1.0, sample_rate=0.01, steps=1000, delta=1e-5)
        >>> [s for s, _ in rows], rows[-1][1] > rows[0][1]
        ([250, 500, 750, 1000], True)
    """
    from lightning_dp.privacy.accounting import get_accountant

    rows = []
    for k in _points(steps, fractions):
        acc = get_accountant(accountant, **({"adjacency": adjacency} if adjacency != "add_remove" else {}),
                             **(accountant_kwargs or {}))
        rows.append((k, float(acc.epsilon_after(delta, noise_multiplier=noise_multiplier, sample_rate=sample_rate,
                                                num_steps=k))))
    return rows


def _points(total: int, fractions: Sequence[float]) -> list[int]:
    """The step (or round) counts of the table: each fraction of ``total``, at least 1."""
    return [max(1, int(round(fraction * total))) for fraction in fractions]


def client_level_privacy(*, client_sample_rate: float, rounds: int, delta: float, noise_multiplier: float | None = None,
                         target_epsilon: float | None = None, accountant: str = "pld", adjacency: str = "add_remove",
                         num_clients: int | None = None) -> CentralGaussian:
    """The DP-FedAvg server part the training would build, planned as the training plans it.

    :class:`~lightning_dp.federated.parts.CentralGaussian` with these settings, after the
    :meth:`~lightning_dp.federated.parts.CentralGaussian.plan` that
    :class:`~lightning_dp.federated.FederatedRound` calls before the first round (Poisson client sampling
    with rate ``client_sample_rate``, ``rounds`` planned rounds): its ``z`` is the training's noise
    multiplier, calibrated when ``target_epsilon`` is given (exactly the value the run would use). Raises
    ValueError with the part's message for settings it refuses.

    Example:
        >>> privacy = client_level_privacy(client_sample_rate=0.05, rounds=100, delta=1e-5, target_epsilon=2.0)
        >>> privacy.planned_epsilon(privacy.z, 100, None, None) <= 2.0
        True
    """
    from lightning_dp.federated.parts.server_privacy import CentralGaussian

    privacy = CentralGaussian(noise_multiplier=noise_multiplier, target_epsilon=target_epsilon, target_delta=delta,
                              accountant=accountant, rounds=rounds, adjacency=adjacency)
    n = num_clients or 0  # only adaptive clipping (not modelled here) reads the expected count q N
    privacy.plan(sample_rate=client_sample_rate, num_clients=n, expected_count=client_sample_rate * n,
                 planned_rounds=rounds)
    return privacy


def client_epsilon_table(privacy: CentralGaussian, *, rounds: int, fractions: Sequence[float] = (0.25, 0.5, 0.75, 1.0)
                         ) -> list[tuple[int, float]]:
    """``(rounds, client-level epsilon)`` after each fraction of the run, as the training's ledger reports it.

    ``privacy`` is a planned :class:`~lightning_dp.federated.parts.CentralGaussian`
    (:func:`client_level_privacy`); each row is its
    :meth:`~lightning_dp.federated.parts.CentralGaussian.planned_epsilon` with no known update set (the ball
    of radius C), which is the spend of the run's accountant after that many rounds: the ``privacy/epsilon`` it
    logs at its last round (its writes before that come from the accountant's coarser variant,
    :meth:`~lightning_dp.privacy.accounting.Accountant.interim_epsilon`, a slightly larger upper bound).

    Example:
        >>> privacy = client_level_privacy(client_sample_rate=0.05, rounds=100, delta=1e-5, noise_multiplier=1.0)
        >>> [r for r, _ in client_epsilon_table(privacy, rounds=100)]
        [25, 50, 75, 100]
    """
    z = privacy.z
    if z is None:
        raise ValueError("client_epsilon_table needs a planned CentralGaussian (its noise multiplier z is None): "
                         "build it with client_level_privacy(...), or call its plan(...) first")
    return [(k, float(privacy.planned_epsilon(z, k, None, None))) for k in _points(rounds, fractions)]


def main(argv: Sequence[str]) -> int:
    """Entry point of ``lightning-dp epsilon``; returns the exit code (2 for bad input)."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    if args.print_config:  # the settings as the command read them, like --print_config of the other commands
        import yaml

        settings = {k: v for k, v in vars(args).items() if k != "print_config"}
        print(yaml.safe_dump(settings, sort_keys=False), end="")
        return 0
    problems = _problems(args)
    if problems:
        parser.error("; ".join(problems))
    if _is_fedavg(args):
        return _main_fedavg(parser, args)
    from lightning_dp.privacy.calibration import calibrate_noise_multiplier, steps_for_epochs  # imports torch

    q = args.sample_rate if args.sample_rate is not None else args.batch_size / args.dataset_size
    per_epoch = steps_for_epochs(epochs=1, sample_rate=q, rounding=args.epoch_steps)  # the training's ceil(1 / q)
    steps = args.steps if args.steps is not None else args.epochs * per_epoch
    kwargs = {"adjacency": args.adjacency} if args.adjacency != "add_remove" else {}
    uls = args.sampling == "user"
    unit = {} if args.max_examples_per_user is None else {
        "examples_per_user": args.max_examples_per_user, "user_accounting": "users" if uls else args.user_accounting}
    kwargs.update(unit)
    if args.max_batch_size is not None:  # the truncated event, as DPSGD(max_batch_size=...) on one process states it
        from lightning_dp.privacy.sampling import suggest_max_batch_size

        bound = (suggest_max_batch_size(args.dataset_size, q) if args.max_batch_size == "auto"
                 else int(args.max_batch_size))
        unit = {"truncated_batch_size": bound, "dataset_size": args.dataset_size + 1}
        kwargs.update(unit)
    where = (f"q = {q:.6g}" + (f" (B = {args.batch_size}, N = {args.dataset_size})" if args.sample_rate is None else "")
             + f", {steps} steps" + (f" ({args.epochs} epochs of {per_epoch}"
                                     + (", Opacus' int(1 / q)" if args.epoch_steps == "floor" else "") + ")"
                                     if args.epochs else "")
             + f", delta = {args.delta:g}, {args.accountant.upper()} accountant, {args.adjacency} adjacency"
             + (f"; per user, at most {args.max_examples_per_user} records each ("
                + ("users sampled and clipped as units, N and B count users" if uls else
                   "mixture of Gaussians" if args.user_accounting == "mixture" else "group privacy") + ")"
                if args.max_examples_per_user is not None else "")
             + (f"; batches of one shape, at most {unit['truncated_batch_size']} examples (truncated event over "
                f"{unit['dataset_size']} records)" if args.max_batch_size is not None else ""))
    if args.target_epsilon is not None:
        try:
            sigma = calibrate_noise_multiplier(target_epsilon=args.target_epsilon, target_delta=args.delta,
                                               sample_rate=q, steps=steps, accountant=args.accountant,
                                               accountant_kwargs=kwargs)
        except ValueError as err:  # a target the search range cannot reach
            parser.error(str(err))
        print(f"noise_multiplier = {_shown(sigma)} for epsilon <= {args.target_epsilon:g}; {where}")
    else:
        sigma = args.noise_multiplier
    rows = epsilon_table(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=args.delta,
                         accountant=args.accountant, adjacency=args.adjacency, accountant_kwargs=unit)
    if args.target_epsilon is None:
        print(f"epsilon = {rows[-1][1]:.4f} for noise_multiplier = {sigma:g}; {where}")
    if args.dataset_size is not None:  # DPSGD's own check when training starts
        from lightning_dp.privacy.delta import check_delta_for_size

        if args.max_examples_per_user is None:
            _note(check_delta_for_size(args.delta, args.dataset_size, unit="examples", who="DPSGD"))
        elif uls:  # N counts users (under ELS it counts records: the users are not given there)
            _note(check_delta_for_size(args.delta, args.dataset_size, unit="users", who="DPSGD"))
    print("\n| steps | epochs | epsilon |\n|---|---|---|")
    for k, eps in rows:
        print(f"| {k} | {k / per_epoch:.3g} | {eps:.4f} |")
    return 0


def _note(warning: LargeDeltaWarning | None) -> None:
    """Prints the warning the training would give for this delta (:mod:`lightning_dp.privacy.delta`), if any."""
    if warning is not None:
        print(f"note: the training would warn: {warning}")


def _shown(sigma: float) -> str:
    """A calibrated noise multiplier as printed: 4 decimals, rounded UP, so that a run given the printed value
    spends no more than the table says."""
    return f"{math.ceil(sigma * 1e4) / 1e4:.4f}"


def _main_fedavg(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``lightning-dp epsilon`` for client-level DP-FedAvg (module docstring): CentralGaussian's own plan and ledger."""
    q = _sample_rate(args)
    assert q is not None  # _problems made sure
    from lightning_dp.privacy.delta import LargeDeltaWarning

    try:
        with warnings.catch_warnings():  # printed below as a note, with the same text (_note)
            warnings.simplefilter("ignore", LargeDeltaWarning)
            privacy = client_level_privacy(client_sample_rate=q, rounds=args.rounds, delta=args.delta,
                                           noise_multiplier=args.noise_multiplier, target_epsilon=args.target_epsilon,
                                           accountant=args.accountant, adjacency=args.adjacency,
                                           num_clients=args.clients)
    except ValueError as err:  # what CentralGaussian refuses, e.g. a target the calibration cannot reach
        parser.error(str(err))
    rows = client_epsilon_table(privacy, rounds=args.rounds)
    z = privacy.z
    if z is None:  # client_level_privacy planned it (client_epsilon_table would have raised)
        raise RuntimeError("CentralGaussian has no noise multiplier after plan() (internal)")
    per_round = (f" (U = {args.clients_per_round:g} expected of N = {args.clients} clients)"
                 if args.client_sample_rate is None else "")
    neighbours = ("one client's data added or removed" if args.adjacency == "add_remove" else
                  "one client's data replaced by another's, the clipped sum moves by up to 2C")
    where = (f"q = {q:.6g}{per_round}, {args.rounds} rounds, delta = {args.delta:g}, {args.accountant.upper()} "
             f"accountant, {args.adjacency} adjacency ({neighbours})")
    if args.target_epsilon is not None:
        print(f"noise_multiplier = {_shown(z)} for client-level epsilon <= {args.target_epsilon:g}; {where}")
    else:
        print(f"client-level epsilon = {rows[-1][1]:.4f} for noise_multiplier = {z:g}; {where}")
    expected = f"{q * args.clients:.4g}" if args.clients else "q N"
    noise = (f"noise_multiplier: {args.noise_multiplier!r}" if args.target_epsilon is None
             else f"target_epsilon: {args.target_epsilon!r}")
    print(f"""
Assumed, as FederatedRound with PoissonSelection and CentralGaussian trains it: every training client takes
part in a round independently with probability q (Poisson: {expected} clients a round on average, a random
number); the server clips each update at C, sums, adds N(0, (z C)^2 I) once and divides by q N. One round is
one Poisson-subsampled Gaussian mechanism (z, q). Exactly U clients a round (UniformSelection) is not accounted.
The training's config:
  model.init_args.selection: {{class_path: lightning_dp.federated.parts.PoissonSelection, init_args: {{sample_rate: {q!r}}}}}
  model.init_args.server_privacy.init_args: {{{noise}, target_delta: {args.delta!r}, accountant: {args.accountant}, \
adjacency: {args.adjacency}}}
  trainer.max_epochs: {args.rounds}""")
    _note(privacy.large_delta(args.clients or 0))
    print("\n| rounds | participations per client (expected) | client-level epsilon |\n|---|---|---|")
    for k, eps in rows:
        print(f"| {k} | {q * k:.3g} | {eps:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
