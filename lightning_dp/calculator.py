"""``lightning-dp epsilon``: the epsilon of a DP-SGD run, or the noise multiplier for a target epsilon.

The first question of every DP user, answered with the SAME functions the training uses
(:func:`lightning_dp.privacy.accounting.get_accountant`,
:func:`lightning_dp.privacy.calibration.calibrate_noise_multiplier`,
:func:`lightning_dp.privacy.calibration.steps_for_epochs`), for Poisson-sampled DP-SGD as
:class:`~lightning_dp.callbacks.DPSGD` runs it::

    lightning-dp epsilon --dataset-size 60000 --batch-size 256 --epochs 15 --noise-multiplier 1.1
    lightning-dp epsilon --dataset-size 60000 --batch-size 256 --epochs 15 --target-epsilon 3
    lightning-dp epsilon --sample-rate 0.01 --steps 1000 --noise-multiplier 1.0 --accountant rdp
    lightning-dp epsilon ... --adjacency replace          # bounded DP (PLD only)

It prints epsilon (or sigma) and a table of epsilon after a few fractions of the run. The dataset size
is treated as public, as Opacus and DPSGD do; q = batch size / dataset size.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "epsilon_table", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-dp epsilon", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n" + "\n".join(line.strip() for line in __doc__.splitlines() if "lightning-dp epsilon " in
                                         line))
    size = parser.add_argument_group("sampling (give --sample-rate, or --dataset-size with --batch-size)")
    size.add_argument("--dataset-size", type=int, help="N, the number of training examples")
    size.add_argument("--batch-size", type=int, help="the expected batch size B (Poisson: q = B / N)")
    size.add_argument("--sample-rate", type=float, help="q, the Poisson sampling rate in (0, 1]")
    length = parser.add_argument_group("length (give --epochs or --steps)")
    length.add_argument("--epochs", type=int, help="epochs (an epoch is ceil(1 / q) steps)")
    length.add_argument("--steps", type=int, help="optimizer steps")
    noise = parser.add_argument_group("noise (give --noise-multiplier, or --target-epsilon to calibrate it)")
    noise.add_argument("--noise-multiplier", type=float, help="sigma, the noise std over the clipping norm")
    noise.add_argument("--target-epsilon", type=float, help="the budget: prints the smallest sigma that fits it")
    parser.add_argument("--delta", type=float, default=1e-5, help="delta (default 1e-5)")
    parser.add_argument("--accountant", choices=["pld", "rdp"], default="pld", help="default pld")
    parser.add_argument("--adjacency", choices=["add_remove", "replace"], default="add_remove",
                        help="neighbouring datasets: one example added/removed (default) or replaced (PLD only)")
    return parser


def _problems(args: argparse.Namespace) -> list[str]:
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
    if (args.noise_multiplier is None) == (args.target_epsilon is None):
        out.append("give exactly one of --noise-multiplier SIGMA (prints epsilon) and --target-epsilon EPS (prints "
                   "the noise multiplier)")
    if args.noise_multiplier is not None and not args.noise_multiplier > 0:
        out.append(f"--noise-multiplier={args.noise_multiplier}: must be > 0")
    if args.target_epsilon is not None and not args.target_epsilon > 0:
        out.append(f"--target-epsilon={args.target_epsilon}: must be > 0")
    if not 0 < args.delta < 1:
        out.append(f"--delta={args.delta}: must be in (0, 1), e.g. 1e-5 (below 1/N)")
    if args.adjacency == "replace" and args.accountant == "rdp":
        out.append("--adjacency replace needs --accountant pld (dp-accounting has no RDP bound for the "
                   "Poisson-subsampled Gaussian under replacement)")
    return out


def epsilon_table(*, noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "pld",
                  adjacency: str = "add_remove", fractions: Sequence[float] = (0.25, 0.5, 0.75, 1.0)
                  ) -> list[tuple[int, float]]:
    """``(steps, epsilon)`` after each fraction of the run, from the training's accountant.

    Example:
        >>> rows = epsilon_table(noise_multiplier=1.0, sample_rate=0.01, steps=1000, delta=1e-5)
        >>> [s for s, _ in rows], rows[-1][1] > rows[0][1]
        ([250, 500, 750, 1000], True)
    """
    from lightning_dp.privacy.accounting import get_accountant

    rows = []
    for fraction in fractions:
        k = max(1, int(round(fraction * steps)))
        acc = get_accountant(accountant, **({"adjacency": adjacency} if adjacency != "add_remove" else {}))
        rows.append((k, float(acc.epsilon_after(delta, noise_multiplier=noise_multiplier, sample_rate=sample_rate,
                                                num_steps=k))))
    return rows


def main(argv: Sequence[str]) -> int:
    """Entry point of ``lightning-dp epsilon``; returns the exit code (2 for bad input)."""
    from lightning_dp.privacy.calibration import calibrate_noise_multiplier, steps_for_epochs

    parser = build_parser()
    args = parser.parse_args(list(argv))
    problems = _problems(args)
    if problems:
        parser.error("\n  " + "\n  ".join(problems))
    q = args.sample_rate if args.sample_rate is not None else args.batch_size / args.dataset_size
    per_epoch = steps_for_epochs(epochs=1, sample_rate=q)  # the training's ceil(1 / q), float-safe
    steps = args.steps if args.steps is not None else args.epochs * per_epoch
    kwargs = {"adjacency": args.adjacency} if args.adjacency != "add_remove" else {}
    where = (f"q = {q:.6g}" + (f" (B = {args.batch_size}, N = {args.dataset_size})" if args.sample_rate is None else "")
             + f", {steps} steps" + (f" ({args.epochs} epochs of {per_epoch})"
                                     if args.epochs else "")
             + f", delta = {args.delta:g}, {args.accountant.upper()} accountant, {args.adjacency} adjacency")
    if args.target_epsilon is not None:
        sigma = calibrate_noise_multiplier(target_epsilon=args.target_epsilon, target_delta=args.delta,
                                           sample_rate=q, steps=steps, accountant=args.accountant,
                                           accountant_kwargs=kwargs)
        print(f"noise_multiplier = {sigma:.4f} for epsilon <= {args.target_epsilon:g}; {where}")
    else:
        sigma = args.noise_multiplier
    rows = epsilon_table(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=args.delta,
                         accountant=args.accountant, adjacency=args.adjacency)
    if args.target_epsilon is None:
        print(f"epsilon = {rows[-1][1]:.4f} for noise_multiplier = {sigma:g}; {where}")
    print("\n| steps | epochs | epsilon |\n|---|---|---|")
    for k, eps in rows:
        print(f"| {k} | {k / per_epoch:.3g} | {eps:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
