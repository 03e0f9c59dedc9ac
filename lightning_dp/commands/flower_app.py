"""``lightning-dp flower-app``: the Flower app of a federated config, for a real deployment.

Writes the app directory that runs the config's round on Flower's Deployment Engine (:mod:`lightning_dp.flower`);
the config goes to every node, so it may hold no secret (a ``noise_seed`` is refused)::

    lightning-dp flower-app --config examples/fl_deploy_fedavg.yaml --out app/ --min-nodes 2
    flower-superlink --insecure --host <server> --port 8000 --disable-runtime-dependency-installation
    flower-supernode --insecure --superlink <server>:8000 --port 9094 --node-config "partition-id=0 num-partitions=2"
    flower-supernode --insecure --superlink <server>:8000 --port 9095 --node-config "partition-id=1 num-partitions=2"
    flwr run app/ deployment --stream

Flower 1.42: the SuperLink serves the nodes and flwr on one port (127.0.0.1:8000 unless --host/--port say
otherwise); "deployment" is a connection in $FLWR_HOME/config.toml (~/.flwr): [superlink.deployment] with
address = "<server>:8000" and insecure = true. The server's MLflow run goes to MLFLOW_TRACKING_URI of the SuperLink's
environment, else ./mlruns where flower-superlink started (--tracking-uri chooses); --stream prints its run id.
These commands run without TLS, for trials on one machine; between organisations use TLS and node keys
(lightning-dp flower-keys --help).
Sites with their own data, the secrets, what each side sees: docs/federated.md, "From simulation to deployment".
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    from lightning_dp.commands.errors import ShortArgumentParser

    commands = [line.strip() for line in __doc__.splitlines()
                if line.strip().startswith(("lightning-dp flower", "flower-", "flwr "))]
    notes = next(part for part in __doc__.split("\n\n") if part.startswith("Flower 1.42"))
    parser = ShortArgumentParser(prog="lightning-dp flower-app", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="example:\n" + "\n".join(commands) + "\n\n" + notes.strip())
    parser.add_argument("--config", required=True, help="a lightning-dp fit config whose model is a FederatedRound")
    parser.add_argument("--out", required=True, help="the app directory to write (flwr run <out> <connection>)")
    parser.add_argument("--min-nodes", type=int, default=1, help="SuperNodes the server waits for (default 1)")
    parser.add_argument("--node-timeout", type=float, default=600.0,
                        help="seconds the server waits for the nodes' replies in a round (default 600)")
    parser.add_argument("--save-to", default="",
                        help="a path on the server's machine for the final hypotheses and epsilon (torch.save); "
                             "relative to the SuperLink's working directory: give an absolute one")
    parser.add_argument("--tracking-uri", default="",
                        help="where the server records its MLflow run: a tracking server's URL or "
                             "sqlite:////abs/path/mlflow.db on the server's machine (default: MLFLOW_TRACKING_URI of "
                             "the SuperLink's environment, else ./mlruns where flower-superlink started); no "
                             "credentials (the app goes to every node)")
    parser.add_argument("--resume-from", default="",
                        help="a checkpoint of the server's run, on the server's machine, to resume from after a stop "
                             "(a lost node): the run then ends as an uninterrupted one would")
    parser.add_argument("--checkpoint-dir", default="",
                        help="where the server writes its checkpoint after every round, on its machine (default "
                             "lightning-dp-checkpoints/ in the SuperLink's working directory)")
    return parser


def main(argv: Sequence[str]) -> int:
    """Entry point of ``lightning-dp flower-app``; returns the exit code (2 for bad input)."""
    from pathlib import Path

    parser = build_parser()
    args = parser.parse_args(list(argv))
    if not Path(args.config).is_file():
        parser.error(f"--config {args.config}: no such file")
    from lightning_dp.flower.app import write_app

    try:
        path = write_app(args.config, args.out, min_nodes=args.min_nodes, node_timeout=args.node_timeout,
                         save_to=args.save_to, tracking_uri=args.tracking_uri,
                         resume_from=args.resume_from, checkpoint_dir=args.checkpoint_dir)
    except ValueError as err:
        parser.error(str(err))
    print(f"wrote {path}\nrun it: flwr run {Path(args.out)} <connection> --stream  (a SuperLink connection of "
          "$FLWR_HOME/config.toml; docs/federated.md, \"From simulation to deployment\")")
    return 0
