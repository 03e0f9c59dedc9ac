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
from pathlib import Path
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
        if self.name:
            from lightning_dp.flower.build import refuse_budgets_for_sites

            refuse_budgets_for_sites(self.module)
        max_epochs = cli.trainer.max_epochs
        self.planned_rounds = max_epochs if max_epochs and max_epochs > 0 else None  # as FederatedRound plans
        # the site's own ledger, where its releases are private by themselves (local DP, local DP-SGD): no server
        # to trust (lightning_dp.flower.site_ledger); under central DP the server is trusted with the releases
        self.keeps_ledger = self.module.releases_are_sanitized() or self.module.update.accountable
        from lightning_dp.flower.site_ledger import default_path

        given = str(node_config.get("ledger", "")).strip() if "ledger" in node_config else ""
        self.ledger_path = Path(given) if given else default_path(node_config)
        self._planned = False
        self.data.prepare_data()
        self.data.setup("fit")
        self.module.read_clients(self.data)
        total, val = len(self.data.train_clients), len(self.data.val_clients or [])
        test = len(self.data.test_clients or [])
        if self.name:
            self.positions, self.val_positions = list(range(total)), list(range(val))
            self.test_positions = list(range(test))
        else:
            part, parts = int(node_config.get("partition-id", 0)), int(node_config.get("num-partitions", 1))
            if not 0 <= part < parts:
                raise ValueError(f"--node-config partition-id={part} num-partitions={parts}: need 0 <= partition-id "
                                 "< num-partitions")
            self.positions, self.val_positions = list(range(part, total, parts)), list(range(part, val, parts))
            self.test_positions = list(range(part, test, parts))
        secret = node_config.get("noise-seed")
        self.given_seed: int | None = None  # the seed as given (the secret one is derived from it with a site name)
        if secret not in (None, ""):  # else the fresh secret the round drew when it was built
            self.given_seed = read_secret(secret, "--node-config noise-seed")
            if self.given_seed == self.module.seed:  # before any derivation: a name is no secret
                raise ValueError("--node-config noise-seed equals the config's public seed: the noise of this site's "
                                 "releases would be public. Give the site another noise seed (or none: a fresh "
                                 "secret one).")
            self.module.set_secret_seed(site_seed(self.given_seed, self.name) if self.name else self.given_seed)
        # which noise stream this site's releases come from, for its ledger's record of what it answered (never the
        # seed, nor anything computed from it): a pinned seed is named by the operator's public label (a new seed, a
        # new label), a fresh one (drawn when this process built the round) by a random id of this process
        import uuid

        label = str(node_config.get("noise-seed-label", "")).strip() if "noise-seed-label" in node_config else ""
        if label and self.given_seed is None:
            raise ValueError("--node-config noise-seed-label names a pinned noise seed: give noise-seed too, or "
                             "neither (fresh noise)")
        self.noise_stream = f"pinned:{label}" if self.given_seed is not None else f"fresh:{uuid.uuid4().hex}"

    def report(self) -> dict[str, Any]:
        from lightning_dp.datamodules.federated import client_ids, client_sizes

        train, data = self.data.train_clients, self.data
        # the example counts only where the aggregator weights by them (FedAvg weighted=True) or the record-level
        # update plans each client's noise from them (local_dp_sgd: its accountant takes them as public, as the
        # simulation's does), else 1
        counts = self.module.aggregator.weights_by_counts or self.module.update.accountable
        sizes = client_sizes(train) if counts else torch.ones(len(train))
        return {"site": self.name, "positions": self.positions, "ids": [str(i) for i in client_ids(train, self.positions)],
                "sizes": [int(sizes[i]) for i in self.positions], "num-training-clients": len(train),
                # validation clients: their positions only (the server evaluates through the nodes' sums)
                "val-positions": self.val_positions, "num-val-clients": len(data.val_clients or []),
                "test-positions": self.test_positions, "num-test-clients": len(data.test_clients or []),
                "numel": int(self.module.spec.numel), "task": str(data.task),
                "num-classes": -1 if data.num_classes is None else int(data.num_classes),
                "num-groups": -1 if data.num_groups is None else int(data.num_groups),
                "input-shape": [int(v) for v in data.input_shape]}

    def plan(self, num_clients: int) -> None:
        """Plan the record-level update of this site's clients as the simulation plans every client's
        (:meth:`~lightning_dp.federated.step.PrivateStep.plan_update`): their sizes, the config's rounds and the
        selection's inclusion rate over the ``num_clients`` training clients of the deployment (the server's
        count; a server that misstates it changes the noise, never the budget, which the site enforces)."""
        if self._planned:
            return
        from lightning_dp.datamodules.federated import client_ids, client_sizes

        train = self.data.train_clients
        if not self.name and int(num_clients) != len(train):
            raise ValueError(f"the server counts {num_clients} training clients, this node's shared client list "
                             f"{len(train)}: every node must build the same client list")
        if int(num_clients) < len(train):
            raise ValueError(f"the server counts {num_clients} training clients, fewer than this site's {len(train)}")
        module = self.module
        module.update.plan(client_ids(train, range(len(train))), client_sizes(train).tolist(),
                           planned_rounds=self.planned_rounds,
                           inclusion_rate=module.selection.expected_count(int(num_clients)) / int(num_clients))
        self._planned = True


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
                  seed: int, clip: float, num_clients: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(releases, stats)`` of this site's clients at ``positions`` in round ``r`` from the server's public state.
    Where the releases are private by themselves, the site's own ledger is charged before they leave and its
    budgets are enforced here (:mod:`lightning_dp.flower.site_ledger`)."""
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
    if node.keeps_ledger:
        from lightning_dp.flower.site_ledger import SiteLedger, input_digest

        digest = input_digest(hypotheses=hypotheses, previous_step=previous_step, seed=seed, clip=clip, round=r,
                              num_clients=num_clients)
        with SiteLedger(node.ledger_path, module, node.noise_stream).open() as ledger:
            released, stats = _release(node, ledger, positions, int(r), digest, num_clients)
        print(ledger.summary(node.name), flush=True)  # the SuperNode's log: the site's own account
    else:
        released, stats = _train(node, positions, int(r))
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


def _train(node: _Site, positions: list[int], r: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y, mask = node.data.padded_rows("train", positions)
    released, stats, _ = node.module.train_clients(list(positions), r, x, y, mask)
    return released, stats.detach().clone()


def _release(node: _Site, ledger: Any, positions: list[int], r: int, digest: str,
             num_clients: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and release the clients at ``positions`` under the site's ledger: budgets checked first, costs charged
    before the release leaves (the caller writes the ledger back when this returns)."""
    from lightning_dp.datamodules.federated import client_ids

    module = node.module
    ids = client_ids(node.data.train_clients, positions)
    repeat = ledger.repeats(ids, r, digest)
    if module.update.accountable:
        if num_clients is None:
            raise ValueError("the server sent no count of training clients: local_dp_sgd plans its noise from it")
        node.plan(num_clients)
    if not repeat:  # the site's budgets, whatever the server asks (a repeat releases nothing new)
        cap = module.client_privacy_cap
        cost = module.participation_cost() if cap is not None else 0.0
        for i, cid in zip(positions, ids):
            if cap is not None and module.ledger.would_exceed(cid, cost, cap):
                raise ValueError(f"round {r}: client {cid!r}'s release would take it past client_privacy_cap={cap:g} "
                                 "in this site's ledger: not trained, nothing released")
            if module.update.accountable and not module.update.eligible(i):
                raise ValueError(f"round {r}: client {cid!r} has spent its record-level budget in this site's ledger: "
                                 "not trained, nothing released")
    released, stats = _train(node, positions, r)
    if not repeat:
        if module.sanitizer.accountable:
            for cid, cost in zip(ids, stats[:, 1].tolist()):
                module.ledger.charge(cid, cost)
        module.update.charge(positions)
        ledger.note(ids, r, digest)
    return released, stats


def evaluate_clients(node: _Site, split: str, positions: list[int], *,
                     hypotheses: torch.Tensor) -> dict[str, torch.Tensor]:
    """The sums of an evaluation of the public ``hypotheses`` on this site's ``split`` clients at ``positions``
    (:meth:`~lightning_dp.federated.FederatedRound.evaluation_sums`: losses, choices, correct predictions) under
    ``"sums"``, and, where the clients carry sensitive groups, their per-group confusion counts (tp, fp, tn, fn rows:
    what the server's group-fairness metrics add up) under ``"fairness"``."""
    if split not in ("val", "test"):
        raise ValueError(f"the server asked for an evaluation on {split!r} clients; a deployment evaluates 'val' and "
                         "'test' clients only")
    _check_served(positions, node.val_positions if split == "val" else node.test_positions, f"{split} clients")
    module = node.module
    fairness = None
    if module.clients.num_groups is not None:
        from lightning_dp.metrics import GroupFairness

        fairness = GroupFairness(module.clients.num_groups)
    with torch.no_grad():
        module.hypotheses.copy_(hypotheses)
        out = {"sums": module.evaluation_sums(split, list(positions), fairness).detach().cpu()}
    if fairness is not None:
        out["fairness"] = torch.stack([fairness.tp, fairness.fp, fairness.tn, fairness.fn]).cpu()
    return out


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
                                        seed=int(config["seed"]), clip=float(config["clip"]),
                                        num_clients=int(config["num-clients"]) if "num-clients" in config else None)
        return Message(RecordDict({"arrays": ArrayRecord({"releases": released, "stats": stats})}), reply_to=msg)

    @client.evaluate()
    def evaluate(msg: Any, context: Any) -> Any:
        config = msg.content["config"]
        evaluated = evaluate_clients(site(context), str(config["split"]), [int(i) for i in config["clients"]],
                                     hypotheses=msg.content["arrays"].to_torch_state_dict()["hypotheses"])
        return Message(RecordDict({"arrays": ArrayRecord(evaluated)}), reply_to=msg)

    return client


#: the ``ClientApp`` (``[tool.flwr.app.components] clientapp = "lightning_dp.flower.client:app"``)
app = _app()
