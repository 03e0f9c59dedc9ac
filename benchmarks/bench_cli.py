"""Times what a user waits for before anything runs: ``lightning-dp --version``, ``--help`` and argument errors.

Each command runs in a fresh process (as the console script does), ``--repeats`` times, interleaved with a
baseline of ``python -c pass`` (the interpreter's own start-up on this machine); the table gives the median
wall time of each, its ratio to the baseline, and whether it imported torch. The machine's load
(``os.getloadavg``) is printed before and after: on a shared machine the times scale with it.

Usage:
    python benchmarks/bench_cli.py                 # 5 repeats
    python benchmarks/bench_cli.py --repeats 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = [
    ["--version"],
    ["--help"],
    ["fit", "--help"],
    ["fit", "--config", "examples/dpsgd_digits.yaml", "--help"],
    ["epsilon", "--help"],
    ["epsilon", "--sigma", "1.1"],
    ["epsilon", "--dataset-size", "60000", "--batch-size", "256", "--epochs", "15", "--target-epsilon", "-3"],
    ["grid", "--config", "examples/dpsgd_digits.yaml", "--sett", "x=1"],
    ["fitt"],
    ["fit", "--config", "examples/dpsgd_digit.yaml"],
    # for comparison: errors that need the config's classes (their signatures) import Lightning
    ["fit", "--config", "examples/dpsgd_digits.yaml", "--trainer.max_epoks=1"],
    ["audit", "--bogus", "1"],
]

PROBE = ("import sys, runpy; sys.argv = ['lightning-dp', *sys.argv[1:]]\n"
         "from lightning_dp.cli import main\n"
         "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
         "sys.stderr.write('TORCH=%d\\n' % ('torch' in sys.modules))\n")


def _time(argv: list[str]) -> tuple[float, bool]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True)
    return time.perf_counter() - start, "TORCH=1" in done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    times: dict[int, list[float]] = {i: [] for i in range(len(COMMANDS))}
    torch_seen: dict[int, bool] = {}
    base: list[float] = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        base.append(time.perf_counter() - start)
        for i, argv in enumerate(COMMANDS):
            seconds, used_torch = _time(argv)
            times[i].append(seconds)
            torch_seen[i] = used_torch
    b = statistics.median(base)
    print(f"load average after: {os.getloadavg()}")
    print(f"\nmedian of {args.repeats} fresh processes; baseline `python -c pass` = {b:.3f} s\n")
    print("| command | median (s) | / baseline | imports torch |\n|---|---|---|---|")
    for i, argv in enumerate(COMMANDS):
        m = statistics.median(times[i])
        print(f"| `lightning-dp {' '.join(argv)}` | {m:.3f} | {m / b:.1f}x | {'yes' if torch_seen[i] else 'no'} |")


if __name__ == "__main__":
    main()
