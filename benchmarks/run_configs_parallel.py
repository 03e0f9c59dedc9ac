"""Run several ``lightning-dp fit`` + test points of one config at once, one process each, on a machine without MLflow.

The GPU machines lent to this project have no MLflow (docs/gpu.md), so ``lightning-dp grid`` cannot run there. This
runs the same points the same way as the grid does (every point ``LightningDPCLI`` on the config with its
overrides, its own fresh secret noise seed as in ``lightning-dp grid``, ``trainer.test`` after ``fit``), logs each
to a CSVLogger instead of MLflow, and writes one JSON line per point (its values, final metrics, privacy summary,
wall time) to ``--out``. Used for the FEMNIST table at convergence (docs/results_femnist_noise.md):

    python benchmarks/run_configs_parallel.py --config examples/fl_femnist.yaml \\
        --config examples/femnist/convergence.yaml --set model.init_args.noise_multiplier=0,10 \\
        --set seed_everything=0,1,2 --threads 2 --out femnist.jsonl -- --data.init_args.data_dir=../shared/data/femnist

Where MLflow is installed, ``lightning-dp grid`` with the same ``--set`` and extra arguments is the command to use
(one run after the other, tracked, with ``--mean-over``); this script exists only to spread the points over the
cores and the GPU of a lent machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from typing import Any


def _values(text: str) -> tuple[str, list[str]]:
    key, _, values = text.partition("=")
    if not key or not values:
        raise argparse.ArgumentTypeError(f"--set takes KEY=V1,V2,...; got {text!r}")
    return key, values.split(",")


def run_point(config: list[str], values: dict[str, str], extra: list[str], threads: int,
              log_dir: str) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from lightning_dp.commands.fit import LightningDPCLI
    from lightning_dp.grid.privacy import privacy_of, reseed
    from lightning_dp.grid.run import final_metrics

    name = ",".join(f"{k.split('.')[-1]}={v}" for k, v in values.items())

    class _CLI(LightningDPCLI):
        def before_fit(self) -> None:
            reseed(self.trainer, self.model, 0, None)  # a fresh secret noise seed, as lightning-dp grid without --seed
            super().before_fit()

    args = ["fit", *[a for c in config for a in ("--config", c)], *[f"--{k}={v}" for k, v in values.items()], *extra,
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={log_dir}",
            f"--trainer.logger.name={name}", "--trainer.logger.flush_logs_every_n_steps=10"]
    start = time.perf_counter()
    cli = _CLI(args=args)
    fit_s = time.perf_counter() - start
    metrics = final_metrics(cli.trainer, cli.model)
    # the restored (best) weights on the validation clients: the metric of a table that reports validation accuracy
    cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    restored = final_metrics(cli.trainer, cli.model)
    metrics.update({f"restored {k}": v for k, v in restored.items() if k.startswith("val/")})
    cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)
    metrics.update(final_metrics(cli.trainer, cli.model))
    return {"values": values, "epochs": cli.trainer.current_epoch, "fit_s": round(fit_s, 1),
            "total_s": round(time.perf_counter() - start, 1), "metrics": metrics,
            "privacy": {k: v for k, v in privacy_of(cli.trainer, cli.model).items() if isinstance(v, (int, float))},
            "device": str(cli.trainer.strategy.root_device)}


def _worker(job: tuple[list[str], dict[str, str], list[str], int, str, str]) -> None:
    config, values, extra, threads, log_dir, out = job
    try:
        row = run_point(config, values, extra, threads, log_dir)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - one failed point must not lose the others' rows
        # SystemExit too: LightningCLI exits on a refused argument, and a pool worker that exits never returns
        # its task (Pool.map would wait forever)
        row = {"values": values, "error": f"{type(exc).__name__}: {exc}"}
    with open(out, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
    print(json.dumps(row, default=str), flush=True)


def _stop(*_: Any) -> None:
    """SIGTERM (e.g. from ``timeout``): kill the workers, then exit. Pool.terminate() is not enough: it sends
    SIGTERM, which Lightning's trainer turns into an exception that the worker records as the point's error before
    taking the next point, and workers of a killed parent would otherwise train on as orphans."""
    for child in mp.active_children():
        child.kill()
    sys.exit(143)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", required=True, help="config file(s), composed in order")
    parser.add_argument("--set", type=_values, action="append", default=[], dest="sets")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per point")
    parser.add_argument("--processes", type=int, default=0, help="points at once (default: all of them)")
    parser.add_argument("--log-dir", default="csv_logs")
    parser.add_argument("--out", required=True, help="JSON lines, one per point (appended)")
    args = parser.parse_args(argv)
    keys = [k for k, _ in args.sets]
    combos = [dict(zip(keys, vs)) for vs in itertools.product(*[v for _, v in args.sets])] or [{}]
    jobs = [(args.config, c, extra, args.threads, args.log_dir, args.out) for c in combos]
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    signal.signal(signal.SIGTERM, _stop)
    with mp.get_context("spawn").Pool(args.processes or len(jobs)) as pool:
        pool.map(_worker, jobs, chunksize=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
