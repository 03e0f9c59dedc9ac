"""The ``ClientApp``: one site's clients on a Flower deployment (:mod:`lightning_dp.flower`).

The SuperNode's ``--node-config`` chooses the clients: ``"partition-id=P num-partitions=K"`` (positions ``P, P + K,
...`` of the shared list) or ``'site="NAME"'`` (every client of the site's own data); ``noise-seed=S`` is the
site's secret noise seed (combined with the name under ``site``). Each TRAIN message is answered with
:meth:`~lightning_dp.federated.FederatedRound.train_clients`. docs/federated.md, "From simulation to deployment".
"""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Any

import torch

from lightning_dp.privacy.seeds import derive_seed

__all__ = ["app", "data_overrides", "evaluate_clients", "serve_clients", "site", "site_seed"]

_SITES: dict[Any, Any] = {}  # (run id, node config) -> the built site, while this process lives
_SITE_STREAM = 31  # derive_seed's counter of a named site's noise seed


class _Site:
    """A node's round and data, built once per run in this process."""

    def __init__(self, text: str, node_config: Any) -> None:
        from lightning_dp.flower.build import build_from_yaml, read_secret, refuse_unsupported

        self.name = str(node_config["site"]).strip() if "site" in node_config else ""
        if "site" in node_config and not self.name:
            raise ValueError('--node-config site="": give the site a name (site="NAME"), or leave site out to serve '
                             "positions of a shared client list (partition-id, num-partitions)")
        if self.name and ({"partition-id", "num-partitions"} & set(node_config)):
            raise ValueError(f"--node-config site={self.name!r} serves the site's own clients; partition-id and "
                             "num-partitions split one shared client list: give one or the other")
        overrides = data_overrides(node_config)
        cli = build_from_yaml(text, ["--trainer.logger=false", "--trainer.enable_checkpointing=false", *overrides])
        self.module, self.data = cli.model, cli.datamodule
        refuse_unsupported(self.module)
        self.data.prepare_data()
        self.data.setup("fit")
        self.module.read_clients(self.data)
        total, val = len(self.data.train_clients), len(self.data.val_clients or [])
        if self.name:
            self.positions, self.val_positions = list(range(total)), list(range(val))
        else:
            part, parts = int(node_config.get("partition-id", 0)), int(node_config.get("num-partitions", 1))
            if not 0 <= part < parts:
                raise ValueError(f"--node-config partition-id={part} num-partitions={parts}: need 0 <= partition-id "
                                 "< num-partitions")
            self.positions, self.val_positions = list(range(part, total, parts)), list(range(part, val, parts))
        secret = node_config.get("noise-seed")
        self.given_seed: int | None = None  # the seed as given (the secret one is derived from it with a site name)
        if secret not in (None, ""):  # else the fresh secret the round drew when it was built
            self.given_seed = read_secret(secret, "--node-config noise-seed")
            if self.given_seed == self.module.seed:  # before any derivation: a name is no secret
                raise ValueError("--node-config noise-seed equals the config's public seed: the noise of this site's "
                                 "releases would be public. Give the site another noise seed (or none: a fresh "
                                 "secret one).")
            self.module.set_secret_seed(site_seed(self.given_seed, self.name) if self.name else self.given_seed)

    def report(self) -> dict[str, Any]:
        from lightning_dp.datamodules.federated import client_ids, client_sizes

        train, data = self.data.train_clients, self.data
        # the example counts only where the aggregator weights by them (FedAvg weighted=True), else 1
        sizes = client_sizes(train) if self.module.aggregator.weights_by_counts else torch.ones(len(train))
        return {"site": self.name, "positions": self.positions, "ids": [str(i) for i in client_ids(train, self.positions)],
                "sizes": [int(sizes[i]) for i in self.positions], "num-training-clients": len(train),
                # validation clients: their positions only (the server evaluates through the nodes' sums)
                "val-positions": self.val_positions, "num-val-clients": len(data.val_clients or []),
                "numel": int(self.module.spec.numel), "task": str(data.task),
                "num-classes": -1 if data.num_classes is None else int(data.num_classes),
                "num-groups": -1 if data.num_groups is None else int(data.num_groups),
                "input-shape": [int(v) for v in data.input_shape]}


def site_seed(seed: int, name: str) -> int:
    """The secret seed of site ``name`` given ``seed``: sites number their clients from 0, so two sites given one
    seed must still draw different noise. The name enters through its SHA-256 (a fixed length: NumPy's SeedSequence
    would read ``"a"`` and ``"a\\x00"`` alike)."""
    digest = hashlib.sha256(name.encode()).digest()
    return derive_seed(seed, _SITE_STREAM, *struct.unpack(">8I", digest))


#: what a node config may not override: the DataModule's class or all of its arguments at once
_NOT_ARGUMENTS = {"class_path", "init_args", "dict_kwargs", "__path__"}


def data_overrides(node_config: Any) -> list[str]:
    """The node config's ``data.ARG=VALUE`` entries as overrides of single arguments of the config's DataModule (this
    node's files: ``data.data_dir="PATH"``); nothing else of the config can be changed on a node."""
    out = []
    for key, value in sorted((str(k), v) for k, v in node_config.items()):
        if key.startswith("data."):
            name = key[len("data."):]
            if not name.isidentifier() or name in _NOT_ARGUMENTS:
                raise ValueError(f"--node-config {key}=...: {name!r} is not an argument of the config's DataModule "
                                 "(a node may set single arguments, e.g. data.data_dir, not the class or all of them)")
            out.append(f"--data.init_args.{name}={value}")
    return out


def site(context: Any) -> _Site:
    """This node's site for the context's run (built on first use)."""
    key = (context.run_id, tuple(sorted((str(k), str(v)) for k, v in context.node_config.items())))
    if key not in _SITES:
        _SITES[key] = _Site(str(context.run_config["config-yaml"]), context.node_config)
    return _SITES[key]


def _check_served(positions: list[int], served: list[int], what: str) -> None:
    foreign = sorted(set(positions) - set(served))
    if foreign:
        raise ValueError(f"the server asked for {what} {foreign[:5]}, which this node does not serve")


def serve_clients(node: _Site, positions: list[int], r: int, *, hypotheses: torch.Tensor, previous_step: torch.Tensor,
                  seed: int, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(releases, stats)`` of this site's clients at ``positions`` in round ``r`` from the server's public state."""
    module = node.module
    _check_served(positions, node.positions, "clients")
    if int(seed) in (module._noise_seed, node.given_seed):
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
    # what leaves the site beside the release (docs/federated.md, "What each side sees"): its exact loss and whether
    # it dropped a client's non-finite update only to a trusted server (the releases unsanitized, central DP) that
    # logs nonprivate metrics; its example count only to an aggregator that weights by it; its unclipped bit only
    # when it clipped at the server's adaptive threshold
    if module.releases_are_sanitized() or not module.log_nonprivate_metrics:
        stats[:, 0] = math.nan
        stats[:, 4] = math.nan
    if not module.aggregator.weights_by_counts:
        stats[:, 2] = 1.0
    if not clip > 0:
        stats[:, 3] = math.nan
    return released.detach(), stats


def evaluate_clients(node: _Site, split: str, positions: list[int], *, hypotheses: torch.Tensor) -> torch.Tensor:
    """The sums of an evaluation of the public ``hypotheses`` on this site's ``split`` clients at ``positions``
    (:meth:`~lightning_dp.federated.FederatedRound.evaluation_sums`: losses, choices, correct predictions)."""
    if split != "val":
        raise ValueError(f"the server asked for an evaluation on {split!r} clients; a deployment evaluates 'val' only")
    _check_served(positions, node.val_positions, "validation clients")
    with torch.no_grad():
        node.module.hypotheses.copy_(hypotheses)
        return node.module.evaluation_sums(split, list(positions)).detach().cpu()


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

    @client.evaluate()
    def evaluate(msg: Any, context: Any) -> Any:
        config = msg.content["config"]
        sums = evaluate_clients(site(context), str(config["split"]), [int(i) for i in config["clients"]],
                                hypotheses=msg.content["arrays"].to_torch_state_dict()["hypotheses"])
        return Message(RecordDict({"arrays": ArrayRecord({"sums": sums})}), reply_to=msg)

    return client


#: the ``ClientApp`` (``[tool.flwr.app.components] clientapp = "lightning_dp.flower.client:app"``)
app = _app()
