"""Run several ``lightning-dp fit`` + test points of one config at once, one process each, on a machine without MLflow.

The GPU machines lent to this project have no MLflow (docs/gpu.md), so ``lightning-dp grid`` cannot run there. This
runs a grid's points as the grid does, spread over processes: the same ``--set`` axes (``lightning_dp.grid.axes``:
lists, ``logspace:``/``linspace:``), the same refusal of points whose privacy the grid could not compose
(``check_points``, before any point trains), every point ``LightningDPCLI`` on the configs with its overrides and its
own noise seed (``reseed``: a fresh secret one, or with ``--seed S`` derived from S and the point's index, as
``lightning-dp grid --seed S``, so that a point can be replayed), ``trainer.test`` after ``fit``.
Differences: no budget planning (``--budget``) and no MLflow (each point logs to a CSVLogger under ``--log-dir``);
after ``fit`` the restored weights are validated once more (``restored val/*``: the validation metrics of the
model that is tested, which a table of validation accuracy needs). One JSON line per point goes to ``--out``: its
values, rounds or steps, metrics, privacy summary (numbers only), wall time, device and log folder; a point that
fails writes its error instead, and the command then exits with 1. Each line also has the point's ``index`` and
the ``--seed`` it ran with (``null``: a fresh secret seed), with which ``--seed S`` replays it. Used for the FEMNIST
table at convergence (docs/results_femnist_noise.md):

    python benchmarks/run_configs_parallel.py --config examples/fl_femnist.yaml \\
        --config examples/femnist/convergence.yaml --set model.init_args.noise_multiplier=0,10 \\
        --set seed_everything=0,1,2 --threads 2 --out femnist.jsonl -- --data.init_args.data_dir=../shared/data/femnist

The log folder also holds the runs' local checkpoints (``ModelCheckpoint`` in the config): they carry the secret
noise seed, as every local checkpoint does (docs/privacy.md); copy the logs elsewhere without the ``*.ckpt`` files.
Where MLflow is installed, ``lightning-dp grid`` with the same ``--set`` and extra arguments is the command to use.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Any


def point_name(values: dict[str, Any]) -> str:
    """The point's log folder name: ``key=value`` joined by commas, keys shortened unless two would coincide."""
    from lightning_dp.grid.axes import cli_value, short_name

    shorts = [short_name(k) for k in values]
    keys = shorts if len(set(shorts)) == len(shorts) else list(values)
    return ",".join(f"{k}={cli_value(v)}" for k, v in zip(keys, values.values())) or "point"


def csv_logger(log_dir: str, name: str = "point") -> list[str]:
    """The arguments that replace the config's logger (MLflow's, by default) by a CSVLogger."""
    return ["--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={log_dir}",
            f"--trainer.logger.name={name}", "--trainer.logger.flush_logs_every_n_steps=10"]


def run_point(config: list[str], values: dict[str, Any], extra: list[str], threads: int, log_dir: str,
              index: int = 0, seed: int | None = None) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from lightning_dp.commands.fit import LightningDPCLI
    from lightning_dp.grid.axes import run_args
    from lightning_dp.grid.privacy import privacy_of, reseed
    from lightning_dp.grid.run import final_metrics

    class _CLI(LightningDPCLI):
        def before_fit(self) -> None:
            # the point's own noise seed, as lightning-dp grid gives run `index`: fresh and secret when seed is None
            reseed(self.trainer, self.model, index, seed)
            super().before_fit()

    args = ["fit", *run_args(config, values, [*extra, *csv_logger(log_dir, point_name(values))])]
    start = time.perf_counter()
    cli = _CLI(args=args)
    if cli.trainer.interrupted:  # Lightning returns from an interrupted fit; its model is not the run's
        raise RuntimeError("fit was interrupted")
    fit_s = time.perf_counter() - start
    metrics = final_metrics(cli.trainer, cli.model)
    cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    restored = final_metrics(cli.trainer, cli.model)
    metrics.update({f"restored {k}": v for k, v in restored.items() if k.startswith("val/")})
    cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)
    metrics.update(final_metrics(cli.trainer, cli.model))
    privacy = {k: v for k, v in privacy_of(cli.trainer, cli.model).items() if isinstance(v, (int, float))}
    return {"values": values, "epochs": cli.trainer.current_epoch, "fit_s": round(fit_s, 1),
            "total_s": round(time.perf_counter() - start, 1), "metrics": metrics, "privacy": privacy,
            "device": str(cli.trainer.strategy.root_device), "log_dir": os.path.abspath(cli.trainer.logger.log_dir)}


def _worker_init() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which stops the workers


def _worker(config: list[str], values: dict[str, Any], extra: list[str], threads: int, log_dir: str, index: int,
            seed: int | None) -> dict:
    # the point's index and the public --seed (None: fresh secret seeds) replay it: run_point(..., index, seed)
    origin = {"index": index, "seed": seed}
    try:
        return {**run_point(config, values, extra, threads, log_dir, index, seed), **origin}
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - one failed point must not lose the others' rows
        # SystemExit too: LightningCLI exits on a refused argument
        return {"values": values, "error": f"{type(exc).__name__}: {exc}", **origin}


def _stop(*_: Any) -> None:
    """SIGTERM, SIGINT, SIGHUP: kill the workers, then exit. Without this a killed parent's workers would train on
    as orphans; and a worker's own SIGTERM becomes an exception in Lightning, recorded as the point's error."""
    for child in mp.active_children():
        child.kill()
    sys.exit(143)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:  # as lightning-dp grid --seed
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    from lightning_dp.grid.axes import grid_points, parse_set
    from lightning_dp.grid.privacy import check_points

    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--config", action="append", required=True, help="config file(s), composed in order")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=V1,V2,...",
                        help="a grid axis, as in lightning-dp grid (lists, logspace:A:B:K, linspace:A:B:K)")
    parser.add_argument("--threads", type=_positive, default=1, help="torch threads per point")
    parser.add_argument("--processes", type=_positive, default=None, help="points at once (default: all)")
    parser.add_argument("--log-dir", default="csv_logs", help="CSVLogger folder; one subfolder per point")
    parser.add_argument("--out", required=True, help="JSON lines, one per point (appended)")
    parser.add_argument("--seed", type=_seed, metavar="S",
                        help="derive every point's noise seed from (S, point index) as lightning-dp grid --seed does, "
                             "to replay a point (default: a fresh secret seed per point); public, like this command")
    args = parser.parse_args(argv)
    missing = [c for c in args.config if not os.path.isfile(c)]
    if missing:
        parser.error(f"config file not found: {', '.join(missing)}")
    try:
        combos = grid_points([parse_set(s) for s in args.set])
        # refused before any point trains, as in lightning-dp grid (with the logger the points will have)
        check_points(args.config, combos, [*extra, *csv_logger(args.log_dir)])
    except ValueError as err:
        parser.error(str(err))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _stop)
    print("every point draws its own noise: "
          + (f"seeds derived from --seed {args.seed}" if args.seed is not None else "a fresh secret seed per point"),
          flush=True)
    failed = 0
    with ProcessPoolExecutor(args.processes or len(combos), mp_context=mp.get_context("spawn"),
                             initializer=_worker_init) as pool:
        futures = {pool.submit(_worker, args.config, values, extra, args.threads, args.log_dir, i, args.seed): values
                   for i, values in enumerate(combos)}
        for future in as_completed(futures):
            try:
                row = future.result()
            except BrokenProcessPool as exc:  # a worker killed from outside (e.g. out of memory)
                row = {"values": futures[future], "error": f"BrokenProcessPool: {exc}"}
            failed += "error" in row
            with open(args.out, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")
            print(json.dumps(row, default=str), flush=True)
    if failed:
        print(f"{failed} of {len(combos)} points failed (their lines in {args.out} say why)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
