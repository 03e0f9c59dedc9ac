"""Does the personalized round split the FEMNIST writers by rotation? From a run's logs and from its checkpoint.

The k = 2 round of ``examples/fl_femnist.yaml`` should give upright and rotated writers different hypotheses. Two
views, both non-private diagnostics of a finished run (run them on the machine that trained, never upload them):

    # per run, from its CSVLogger or MLflow-exported metrics.csv: how often every validation writer chose one
    # hypothesis, and how often the server's k-means put all of a round's releases in one cluster
    python examples/femnist/split.py logs [--from-round 20] LOGS/*/version_*/metrics.csv

    # from a checkpoint (the run's config.yaml beside it): which hypothesis each test writer chooses, by rotation
    python examples/femnist/split.py checkpoint --config LOGDIR/config.yaml --ckpt LOGDIR/checkpoints/*.ckpt \\
        [-- --data.init_args.data_dir=DIR]

The first prints one JSON line per log and a total line; the second a rotation x choice table and each group's
accuracy with each hypothesis (docs/results_femnist_noise.md, "Starting the hypotheses apart").
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from typing import Any, Optional


def trained_rows(table: list[dict[str, str]]) -> list[dict[str, str]]:
    """A CSVLogger metrics table without a finished run's final validation and test: those rows come after its last
    round (logged at its number of rounds as epoch, the test's with ``test/`` metrics) and are not checks."""
    tests = [int(r["epoch"]) for r in table if any(r.get(k) for k in r if k and k.startswith("test/"))]
    return [r for r in table if not tests or int(r["epoch"]) < min(tests)]


def log_split(metrics_csv: str, from_round: int = 0) -> dict[str, Any]:
    """From one run's metrics.csv: validation checks (rows with ``val/chose_*``) where every evaluated writer chose
    the same hypothesis, and training rounds whose releases the server's k-means put in one cluster
    (``*cluster_size_*`` with one non-zero entry), over :func:`trained_rows` (as ``table2_4.best_check``).
    ``from_round``: count rounds (epochs) from this one on only (e.g. after a warm-up)."""
    with open(metrics_csv) as f:
        table = [r for r in trained_rows(list(csv.DictReader(f))) if int(r["epoch"]) >= from_round]
    chose = sorted(k for k in table[0] if k.startswith("val/chose_")) if table else []
    sizes = sorted(k for k in table[0] if k.rsplit("/", 1)[-1].startswith("cluster_size_")) if table else []
    checks = unanimous = rounds = one = 0
    for row in table:
        shares = [float(row[k]) for k in chose if row.get(k)]
        if shares:
            checks += 1
            unanimous += max(shares) >= 1.0 - 1e-9
        counts = [float(row[k]) for k in sizes if row.get(k)]
        if counts:
            rounds += 1
            one += sum(c > 0 for c in counts) == 1
    return {"log": metrics_csv, "checks": checks, "unanimous_checks": unanimous, "rounds": rounds,
            "one_cluster_rounds": one}


def run_cli(config: str, extra: list[str]) -> Any:
    """The run's ``LightningDPCLI``, not run, from its saved config (a fit's ``config.yaml``) and ``--key=value``
    overrides, without a logger."""
    import yaml

    from lightning_dp.commands.fit import LightningDPCLI

    with open(config) as f:  # a fit's saved config: the fit subcommand's own keys are not the model's
        settings = {key: value for key, value in yaml.safe_load(f).items() if key not in ("ckpt_path", "weights_only")}
    return LightningDPCLI(run=False, args=["--config", yaml.safe_dump(settings), "--trainer.logger=false", *extra])


def checkpoint_split(config: str, ckpt: str, extra: list[str], split: str = "test") -> dict[str, Any]:
    """Each ``split`` writer's chosen hypothesis (lowest loss on its data, as the round's evaluation chooses) from
    the checkpoint's hypotheses, counted by rotation, and each group's accuracy with each hypothesis."""
    import torch

    from lightning_dp.federated.local import client_outputs_and_losses, predictions

    cli = run_cli(config, extra)
    module, dm = cli.model, cli.datamodule
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    module.hypotheses.copy_(state["hypotheses"])
    dm.setup("test" if split == "test" else "fit")
    k = module.k
    table = {False: [0] * k, True: [0] * k}
    correct = {False: [0] * k, True: [0] * k}
    examples = {False: 0, True: 0}
    with torch.no_grad():
        for client in dm.clients(split):
            x, y = client.x[None], client.y[None]
            mask = torch.ones(y.shape, dtype=torch.bool)
            outputs, losses = client_outputs_and_losses(module.template, module.spec, module.hypotheses, x, y, mask,
                                                        module.loss_name, "loop")
            rotated = bool(dm.rotated[client.client_id])
            table[rotated][int(losses[0].argmin())] += 1
            examples[rotated] += int(y.numel())
            for j in range(k):
                correct[rotated][j] += int((predictions(outputs[0, j], module.loss_name) == y[0]).sum())
    return {"split": split, "chose": {("rotated" if r else "upright"): table[r] for r in table},
            "accuracy": {("rotated" if r else "upright"): [c / max(examples[r], 1) for c in correct[r]]
                         for r in correct}}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    lg = sub.add_parser("logs", help="metrics.csv files -> unanimous checks and one-cluster rounds")
    lg.add_argument("metrics", nargs="+")
    lg.add_argument("--from-round", type=int, default=0, help="count from this round on (e.g. after a warm-up)")
    ck = sub.add_parser("checkpoint", help="a checkpoint -> rotation x choice")
    ck.add_argument("--config", required=True, help="the run's config (its log folder's config.yaml)")
    ck.add_argument("--ckpt", required=True, help="one checkpoint file (the run's best: checkpoints/*.ckpt)")
    ck.add_argument("--split", default="test", choices=["val", "test"])
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    stray = [a for a in extra if not a.startswith("--")]
    if stray:  # e.g. a glob that matched several checkpoints
        parser.error(f"unexpected arguments {stray[:3]}: give one --ckpt file, and the config's overrides as "
                     "--key=value after --")
    if args.command == "logs":
        total = {"checks": 0, "unanimous_checks": 0, "rounds": 0, "one_cluster_rounds": 0}
        for path in args.metrics:
            row = log_split(path, args.from_round)
            print(json.dumps(row))
            for key in total:
                total[key] += row[key]
        print(json.dumps({"logs": len(args.metrics), **total}))
        return 0
    print(json.dumps(checkpoint_split(args.config, args.ckpt, extra, args.split)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
