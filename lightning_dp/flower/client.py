"""The ``ClientApp``: one site's clients on a Flower deployment (:mod:`lightning_dp.flower`).

A SuperNode started with ``--node-config "partition-id=P num-partitions=K"`` builds the app's config
(its DataModule from this site's own files) and serves the training clients at positions
``P, P + K, P + 2K, ...`` of the DataModule's client list. ``noise-seed=S`` in the node config
is this site's secret noise seed (its sanitizers' noise); without it, a fresh one from the
operating system. Each TRAIN message carries the public state of a round and the positions of
this site's selected clients; the reply holds their releases and statistics
(:meth:`~lightning_dp.federated.FederatedRound.train_clients`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["app", "serve_clients", "site"]

_SITES: dict[Any, Any] = {}  # (run id, node config) -> the built site, while this process lives


class _Site:
    """A node's round and data, built once per run in this process."""

    def __init__(self, text: str, node_config: Any) -> None:
        from lightning_dp.flower.build import build_from_yaml, read_secret, refuse_unsupported

        cli = build_from_yaml(text, ["--trainer.logger=false", "--trainer.enable_checkpointing=false"])
        self.module, self.data = cli.model, cli.datamodule
        refuse_unsupported(self.module)
        self.data.prepare_data()
        self.data.setup("fit")
        self.module.read_clients(self.data)
        part, parts = int(node_config.get("partition-id", 0)), int(node_config.get("num-partitions", 1))
        if not 0 <= part < parts:
            raise ValueError(f"--node-config partition-id={part} num-partitions={parts}: need 0 <= partition-id < "
                             "num-partitions")
        total = len(self.data.train_clients)
        self.positions = list(range(part, total, parts))
        secret = node_config.get("noise-seed")
        if secret not in (None, ""):  # else the fresh secret the round drew when it was built
            self.module.set_secret_seed(read_secret(secret, "--node-config noise-seed"))

    def report(self) -> dict[str, Any]:
        from lightning_dp.datamodules.federated import client_ids, client_sizes

        train, data = self.data.train_clients, self.data
        # the example counts only where the aggregator weights by them (FedAvg weighted=True), else 1
        sizes = client_sizes(train) if self.module.aggregator.weights_by_counts else torch.ones(len(train))
        return {"positions": self.positions, "ids": [str(i) for i in client_ids(train, self.positions)],
                "sizes": [int(sizes[i]) for i in self.positions], "num-training-clients": len(train),
                "numel": int(self.module.spec.numel), "task": str(data.task),
                "num-classes": -1 if data.num_classes is None else int(data.num_classes),
                "num-groups": -1 if data.num_groups is None else int(data.num_groups),
                "input-shape": [int(v) for v in data.input_shape]}


def site(context: Any) -> _Site:
    """This node's site for the context's run (built on first use)."""
    key = (context.run_id, tuple(sorted((str(k), str(v)) for k, v in context.node_config.items())))
    if key not in _SITES:
        _SITES[key] = _Site(str(context.run_config["config-yaml"]), context.node_config)
    return _SITES[key]


def serve_clients(node: _Site, positions: list[int], r: int, *, hypotheses: torch.Tensor, previous_step: torch.Tensor,
                  seed: int, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(releases, stats)`` of this site's clients at ``positions`` in round ``r`` from the server's public state."""
    module = node.module
    foreign = sorted(set(positions) - set(node.positions))
    if foreign:
        raise ValueError(f"the server asked for clients {foreign[:5]}, which this node does not serve")
    if int(seed) == module._noise_seed:
        raise ValueError("the server's public seed equals this site's noise seed: the noise of its releases would be "
                         "public. Give the site another --node-config noise-seed (or none: a fresh secret one).")
    with torch.no_grad():
        module.hypotheses.copy_(hypotheses)
        module.previous_step.copy_(previous_step)
    module.seed = int(seed)
    if clip > 0 and module.sanitizer.follows_clip:
        module.sanitizer.follow_clip(clip)
    x, y, mask = node.data.padded_rows("train", positions)
    released, stats, _ = module.train_clients(list(positions), int(r), x, y, mask)
    stats = stats.detach().clone()
    # what leaves the site beside the release (docs/federated.md, "What each side sees"): its exact loss only to a
    # trusted server (the releases unsanitized, central DP) that logs nonprivate metrics; its example count only to
    # an aggregator that weights by it; its unclipped bit only when it clipped at the server's adaptive threshold
    if module.releases_are_sanitized() or not module.log_nonprivate_metrics:
        stats[:, 0] = math.nan
    if not module.aggregator.weights_by_counts:
        stats[:, 2] = 1.0
    if not clip > 0:
        stats[:, 3] = math.nan
    return released.detach(), stats


def _app() -> Any:
    try:
        from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
        from flwr.clientapp import ClientApp
    except ImportError as err:  # the deployment's extra
        raise ImportError("lightning_dp.flower needs Flower 1.42 or later: pip install 'lightning-dp[deploy]'") from err

    client = ClientApp()

    @client.query()
    def query(msg: Any, context: Any) -> Any:
        return Message(RecordDict({"config": ConfigRecord(site(context).report())}), reply_to=msg)

    @client.train()
    def train(msg: Any, context: Any) -> Any:
        arrays = msg.content["arrays"].to_torch_state_dict()
        config = msg.content["config"]
        released, stats = serve_clients(site(context), [int(i) for i in config["clients"]], int(config["round"]),
                                        hypotheses=arrays["hypotheses"], previous_step=arrays["previous_step"],
                                        seed=int(config["seed"]), clip=float(config["clip"]))
        return Message(RecordDict({"arrays": ArrayRecord({"releases": released, "stats": stats})}), reply_to=msg)

    return client


#: the ``ClientApp`` (``[tool.flwr.app.components] clientapp = "lightning_dp.flower.client:app"``)
app = _app()
