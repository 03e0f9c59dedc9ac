"""The ``ServerApp``: the round's server on a Flower deployment (:mod:`lightning_dp.flower`).

``main`` builds the round and its Trainer from the app's config, asks every node for the training
clients it serves (:class:`RemoteClient`: an id and a size) and the positions of its validation
clients, and fits: each round's clients are selected from the server's secret noise seed
(``LIGHTNING_DP_NOISE_SEED`` in the server process's environment, else fresh), :class:`NodeRound`
sends the public state to the nodes of the selected clients and returns their releases in the
round's order, and the round aggregates, accounts and logs as in simulation. A validation check
sends the hypotheses to the nodes of the validation clients, which reply with sums of their
losses, choices and correct predictions (:meth:`~lightning_dp.federated.FederatedRound.evaluation_sums`).
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_dp.datamodules.federated import FederatedDataModule
from lightning_dp.federated.round import STATS
from lightning_dp.privacy.finite import drop_non_finite

__all__ = ["NodeRound", "Placement", "RemoteClient", "RemoteDataModule", "app", "main", "plan_clients"]

#: the server process's environment variable holding its secret noise seed (client selection, central noise)
NOISE_SEED_VARIABLE = "LIGHTNING_DP_NOISE_SEED"


@dataclass(frozen=True)
class RemoteClient:
    """A training client as the server knows it: its id and number of examples (reported by its node)."""

    client_id: str
    size: int

    def __len__(self) -> int:
        return self.size


class RemoteDataModule(FederatedDataModule):
    """The server's DataModule: the training, validation and test clients the nodes reported, no data."""

    def __init__(self, clients: list[RemoteClient], *, task: str, num_classes: Optional[int],
                 num_groups: Optional[int], input_shape: tuple[int, ...],
                 val: Optional[list[RemoteClient]] = None, test: Optional[list[RemoteClient]] = None) -> None:
        super().__init__()
        self.task = task  # type: ignore[assignment]  # checked by the nodes' DataModule
        self.num_classes, self.num_groups, self.input_shape = num_classes, num_groups, tuple(input_shape)
        self._remote_clients, self._remote_val, self._remote_test = clients, list(val or []), list(test or [])

    def setup(self, stage: Optional[str] = None) -> None:
        self.train_clients = self._remote_clients  # type: ignore[assignment]  # duck-typed: client_id and len
        self.val_clients = self._remote_val  # type: ignore[assignment]
        self.test_clients = self._remote_test  # type: ignore[assignment]  # evaluated on the nodes (test_every_check)

    def padded_rows(self, split: str, index: Any, *, pad_value: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
        raise RuntimeError("the server of a Flower deployment holds no client data: its clients compute on their nodes")


class NodeRound:
    """The clients' side of the round, on the nodes: what :meth:`FederatedRound._client_round` and
    :meth:`FederatedRound.evaluation_sums` return, computed remotely, for the clients placed by ``placements``
    (:func:`plan_clients`)."""

    def __init__(self, grid: Any, placements: dict[str, Placement], *, timeout: float) -> None:
        self.grid, self.placements, self.timeout = grid, placements, float(timeout)
        self.checkpoint: Any = None  # the server's round checkpoints (round_checkpoints), which a stop names
        self.shape: tuple[str, list[int]] = ("", [])  # the run's (task, input shape): a late node must match it

    def _by_node(self, split: str, index: list[int]) -> dict[int, list[int]]:
        """The clients at ``index`` grouped by their node; clients whose node has not joined yet are left out (they
        are never selected for training, :meth:`present`; an evaluation covers the clients that have a node)."""
        by_node: dict[int, list[int]] = defaultdict(list)
        for i in index:
            owner = self.placements[split].owners[i]
            if owner is not None:
                by_node[owner].append(i)
        return by_node

    def present(self, module: Any) -> Optional[Any]:
        """Before a round's selection: None when every client has its node; else ask the nodes that joined since
        (a late SuperNode: its clients take part from this round on) and return ``present(i)``, whether training
        client ``i`` has a node. A client without one declines (``FederatedRound``'s selection draws it as usual:
        under Poisson selection its inclusion probability is 0 until its node joins, q after, never more)."""
        if all(o is not None for p in self.placements.values() for o in p.owners):
            return None
        known = {o for p in self.placements.values() for o in p.owners if o is not None}
        new = sorted(set(self.grid.get_node_ids()) - known)
        if new:
            self.join(ask_nodes(self.grid, new, self.timeout), module)
        owners = self.placements["train"].owners
        return lambda i: owners[i] is not None

    def join(self, reports: dict[int, dict[str, Any]], module: Any) -> None:
        """Give late nodes the clients they serve that had none (positions of the shared client list); refuses a
        node that disagrees with the run (another config or data) or serves clients that already have a node."""
        for node, rep in sorted(reports.items()):
            if rep.get("site"):
                raise RuntimeError(f"node {node} joined the run as site {rep['site']!r}: a run of sites with their own "
                                   "clients fixes its clients when it starts (resume the run to include a new site)")
            if int(rep["numel"]) != module.spec.numel or (rep["task"], list(rep["input-shape"])) != self.shape:
                raise RuntimeError(f"node {node} joined with another model or DataModule than the run's: every node "
                                   "must run the same config")
            for split, placement in self.placements.items():
                positions, ids, sizes, total = _served(rep, split)
                if total != len(placement.owners):
                    raise RuntimeError(f"node {node} joined with {total} {split} clients, the run has "
                                       f"{len(placement.owners)}: every node must build the same client list")
                for i, cid, n in zip(positions, ids, sizes):
                    if placement.owners[i] is not None:
                        raise RuntimeError(f"node {node} joined serving {split} client {i}, which node "
                                           f"{placement.owners[i]} serves: give it a partition-id nobody serves")
                    placement.owners[i] = node
                    placement.clients[i] = RemoteClient(cid, n)  # the round's client list: the same list object
            print(f"node {node} joined: it serves {len(rep['positions'])} training clients from this round on",
                  flush=True)

    def _replies(self, messages: list[Any], what: str) -> dict[int, Any]:
        """Every node's reply, or a loud stop. A node that does not answer (killed, disconnected: Flower declares it
        unavailable after two missed heartbeats, about a minute) stops the run before the server aggregates or
        accounts anything of the round; what the sites released is in their own ledgers. The run resumes exactly
        from the server's last checkpoint (:meth:`resume_hint`)."""
        replies = {reply.metadata.src_node_id: reply
                   for reply in self.grid.send_and_receive(messages, timeout=self.timeout)}
        for message in messages:
            node = message.metadata.dst_node_id
            reply = replies.get(node)
            if reply is None:
                raise RuntimeError(f"{what}: node {node} did not reply within {self.timeout:g} s (node_timeout). "
                                   + self.resume_hint())
            if reply.has_error():
                raise RuntimeError(f"{what}: node {node} failed: {reply.error.reason}. " + self.resume_hint())
        return replies

    def resume_hint(self) -> str:
        """How to go on after a stop: the server's last checkpoint (:func:`round_checkpoints`), if it has one."""
        last = getattr(self.checkpoint, "best_model_path", "")  # monitor None, top 1: the latest round's
        where = f"its last checkpoint is {last}" if last else "it has no checkpoint yet (start the run again)"
        return (f"Nothing of this step was aggregated or accounted by the server; {where}. Restart the node and "
                "resume: lightning-dp flower-app ... --resume-from CHECKPOINT, then flwr run (docs/federated.md, "
                "\"Faults\")")

    def evaluate(self, module: Any, split: str, index: list[int], fairness: Any = None) -> Tensor:
        """The sum of the nodes' :meth:`~lightning_dp.federated.FederatedRound.evaluation_sums` over the ``split``
        clients at ``index``, for the current hypotheses; ``fairness`` (a
        :class:`~lightning_dp.metrics.GroupFairness`) gets the sum of the nodes' per-group confusion counts."""
        from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

        sums = torch.zeros(4 + module.k, dtype=torch.float64)
        by_node = self._by_node(split, index)
        if not by_node:
            return sums.to(module.hypotheses.device)
        local = self.placements[split].local
        public = ArrayRecord({"hypotheses": module.hypotheses.detach().cpu()})
        messages = [Message(RecordDict({"arrays": public, "config": ConfigRecord({
            "split": split, "clients": [local[i] for i in positions]})}),
            message_type=MessageType.EVALUATE, dst_node_id=node, group_id=f"{split}-{int(module.rounds)}")
            for node, positions in by_node.items()]
        replies = self._replies(messages, f"evaluation after round {int(module.rounds)}")
        for node, positions in by_node.items():
            part = replies[node].content["arrays"].to_torch_state_dict()["sums"].to(torch.float64)
            if part.shape != sums.shape or part[1] != len(positions) or part[4:].sum() != part[1]:
                raise RuntimeError(f"node {node} replied evaluation sums {part.tolist()} for its {len(positions)} "
                                   f"validation clients and {module.k} hypotheses")
            sums += part
            if fairness is not None:
                counts = replies[node].content["arrays"].to_torch_state_dict().get("fairness")
                if counts is None or tuple(counts.shape) != (4, fairness.num_groups):
                    raise RuntimeError(f"node {node} replied no per-group counts for the {fairness.num_groups} "
                                       "groups of its evaluation clients")
                for row, name in zip(counts.to(fairness.tp.device, torch.long), ("tp", "fp", "tn", "fn")):
                    setattr(fairness, name, getattr(fairness, name) + row)
        return sums.to(module.hypotheses.device)

    def client_round(self, module: Any, index: list[int], r: int) -> tuple[Tensor, Tensor, None]:
        from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

        hyps = module.hypotheses
        if not index:
            return hyps.new_zeros((0, module.spec.numel)), torch.zeros((0, len(STATS)), dtype=torch.float64), None
        by_node = self._by_node("train", index)
        local = self.placements["train"].local
        follows = module._sanitizer_follows_clip()
        public = ArrayRecord({"hypotheses": hyps.detach().cpu(), "previous_step": module.previous_step.detach().cpu()})
        messages = [Message(RecordDict({"arrays": public, "config": ConfigRecord({
            "round": int(r), "clients": [local[i] for i in positions], "seed": str(module.seed),
            "num-clients": len(self.placements["train"].clients),
            "clip": float(module.server_privacy.clip) if follows else -1.0})}),
            message_type=MessageType.TRAIN, dst_node_id=node, group_id=str(r)) for node, positions in by_node.items()]
        replies = self._replies(messages, f"round {r}")
        rows: dict[int, tuple[Tensor, Tensor]] = {}
        for node, positions in by_node.items():
            arrays = replies[node].content["arrays"].to_torch_state_dict()
            released, stats = arrays["releases"], arrays["stats"]
            if released.shape != (len(positions), module.spec.numel) or stats.shape != (len(positions), len(STATS)):
                raise RuntimeError(f"round {r}: node {node} replied {tuple(released.shape)} releases and "
                                   f"{tuple(stats.shape)} statistics for its {len(positions)} clients of "
                                   f"{module.spec.numel} parameters")
            for c, i in enumerate(positions):
                rows[i] = (released[c], stats[c])
        releases = torch.stack([rows[i][0] for i in index]).to(hyps.device, hyps.dtype)
        stats = torch.stack([rows[i][1] for i in index]).to(hyps.device, torch.float64)
        # a reply that is not finite (a node's fault: its own round drops a client's non-finite update before
        # sanitizing) contributes nothing: the release of a zero update from the first hypothesis (the server
        # does not know which one the client chose), counted as dropped (nonprivate/dropped_updates)
        releases, dropped = drop_non_finite(releases, hyps[0])
        stats[dropped, STATS.index("dropped")] = 1.0
        return releases, stats, None


#: what the server prints first when its SuperLink runs without TLS (what flwr run --stream and flwr log show)
INSECURE_WARNING = (
    "WARNING: this SuperLink runs with --insecure: no TLS, so whoever can reach or watch its port reads every "
    "model, release and message of this run, and (without --enable-supernode-auth) can join as a node. Use it for "
    "trials on localhost only; a consortium's deployment: docs/federated.md, \"A consortium's deployment\"")


def insecure_superlink() -> bool:
    """Whether this ServerApp talks to its SuperLink without TLS. Flower 1.42 starts the ServerApp process
    (``flwr-serverapp``) with ``--insecure`` exactly when the SuperLink runs with ``--insecure`` (its SuperExec
    passes the SuperLink's own TLS setting on, ``--root-certificates`` otherwise) and tells the app nothing else
    about it, so the process's arguments are where the app can read it."""
    import sys

    return "--insecure" in sys.argv[1:]


def check_tracking(trainer: Any, uri: str) -> None:
    """Refuse a config whose MLflow logger names another tracking URI than the app's ``tracking-uri``: one of the
    two would be silently ignored."""
    from lightning_dp import tracking

    for logger in tracking.mlflow_loggers(trainer):
        used = tracking.tracking_uri_of(logger)
        if used != uri:
            raise ValueError(f"the app's tracking-uri is {uri!r} but the config's MLflow logger records to {used!r}: "
                             "give the location once (lightning-dp flower-app --tracking-uri, or the logger's "
                             "tracking_uri in the config)")


def late_nodes(module: Any) -> Optional[str]:
    """None if clients whose node is missing when the run starts may wait for it, else why not: a client that
    declines until its node joins must leave the accounting valid. Under Poisson selection its
    inclusion probability is then 0 and later q, as accounted; a fixed-size selection would draw the other clients
    more often than accounted, and the record-level update and a weighted aggregator need every client's size
    when the run starts."""
    if module.selection.poisson_rate is None:
        return (f"a node may join late only under Poisson selection; {type(module.selection).__name__} would draw the "
                "others more often than its accounting says")
    if module.update.accountable:
        return "local_dp_sgd plans every client's noise from its size when the run starts: no node may join late"
    if module.aggregator.weights_by_counts:
        return "a weighted aggregator needs every client's size when the run starts: no node may join late"
    return None


def round_checkpoints(trainer: Any, folder: str, run_id: Any) -> Any:
    """The server's checkpoint after every round, whatever the config's checkpointing: a run stopped by a lost node
    resumes from it exactly (the round's secret state, ledgers and accountant are in it: a local file of the server's
    machine, ``<folder>/run-<Flower run id>/epoch-<e>.ckpt`` after round e + 1, the latest kept). Returns the
    callback."""
    from pathlib import Path

    from lightning.pytorch.callbacks import ModelCheckpoint

    callback = ModelCheckpoint(dirpath=Path(folder or "lightning-dp-checkpoints") / f"run-{run_id}",
                               filename="epoch-{epoch}", auto_insert_metric_name=False, save_top_k=1, every_n_epochs=1,
                               save_on_train_epoch_end=True, enable_version_counter=False)
    trainer.callbacks.append(callback)
    return callback


def wait_for_nodes(grid: Any, count: int, timeout: float) -> list[int]:
    start = time.monotonic()
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= count:
            return nodes
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"{len(nodes)} SuperNodes connected after {timeout:g} s; the app waits for min-nodes="
                               f"{count}: start more SuperNodes, or lower --min-nodes of lightning-dp flower-app")
        time.sleep(0.5)


def ask_nodes(grid: Any, nodes: list[int], timeout: float) -> dict[int, dict[str, Any]]:
    """Every node's report of the training clients it serves (a QUERY message)."""
    from flwr.app import ConfigRecord, Message, MessageType, RecordDict

    messages = [Message(RecordDict({"config": ConfigRecord({"ask": "clients"})}), message_type=MessageType.QUERY,
                        dst_node_id=node, group_id="clients") for node in nodes]
    reports = {}
    for reply in grid.send_and_receive(messages, timeout=timeout):
        node = reply.metadata.src_node_id
        if reply.has_error():
            raise RuntimeError(f"node {node} could not report its clients: {reply.error.reason}")
        reports[node] = dict(reply.content["config"])
    missing = set(nodes) - set(reports)
    if missing:
        raise RuntimeError(f"nodes {sorted(missing)} did not report their clients within {timeout:g} s")
    return reports


@dataclass(frozen=True)
class Placement:
    """Where a split's clients are: client i is served by node ``owners[i]``, at position ``local[i]`` of the
    node's own list (``clients[i]``: its id and size as the server knows them)."""

    owners: list[int]
    clients: list[RemoteClient]
    local: list[int]


def plan_clients(reports: dict[int, dict[str, Any]], numel: int, *,
                 late_refused: Optional[str] = "") -> tuple[dict[str, Placement], dict]:
    """``({"train": ..., "val": ..., "test": ...}, data)`` from the nodes' reports (the DataModule's task and shape
    in ``data``).
    Refuses reports that disagree, serve a client twice or leave clients out (``late_refused``: why, or None when
    clients without a node may wait for it: their nodes join later, :meth:`NodeRound.present`)."""
    sizes = {int(rep["numel"]) for rep in reports.values()}
    if sizes != {numel}:
        raise RuntimeError(f"the nodes' models have {sorted(sizes)} parameters, the server's {numel}: every node must "
                           "run the same config")
    named = {bool(rep.get("site", "")) for rep in reports.values()}
    if named == {True, False}:
        raise RuntimeError("some SuperNodes serve their own clients (--node-config 'site=\"NAME\"') and some positions of a "
                           "shared client list (partition-id): start every node one way")
    if named == {True}:
        placements = {split: _plan_sites(reports, split) for split in ("train", "val", "test")}
    else:
        placements = {split: _plan_partitions(reports, split, late_refused) for split in ("train", "val", "test")}
    first = next(iter(reports.values()))
    for node, rep in reports.items():
        same = (rep["task"], rep["num-classes"], rep["num-groups"], list(rep["input-shape"]))
        if same != (first["task"], first["num-classes"], first["num-groups"], list(first["input-shape"])):
            raise RuntimeError(f"node {node}'s DataModule differs from the others' (task, classes, groups or input "
                               "shape): every site must build the config's DataModule")

    def optional(value: Any) -> Optional[int]:  # -1: None in a ConfigRecord
        return None if int(value) < 0 else int(value)

    data = {"task": str(first["task"]), "num_classes": optional(first["num-classes"]),
            "num_groups": optional(first["num-groups"]),
            "input_shape": tuple(int(v) for v in first["input-shape"])}
    return placements, data


def _served(rep: dict[str, Any], split: str) -> tuple[list[int], list[str], list[int], int]:
    """``(positions, ids, sizes, total)`` of a node's report for ``split``. Validation clients are reported by
    position only, test clients too (the server evaluates through the nodes' sums): their ids here are
    placeholders."""
    if split == "train":
        return ([int(i) for i in rep["positions"]], [str(c) for c in rep["ids"]], [int(n) for n in rep["sizes"]],
                int(rep["num-training-clients"]))
    positions = [int(i) for i in rep.get(f"{split}-positions", [])]
    prefix = f"{rep['site']}/" if rep.get("site") else ""
    return (positions, [f"{prefix}{split}-{i}" for i in positions], [1] * len(positions),
            int(rep.get(f"num-{split}-clients", 0)))


def _plan_sites(reports: dict[int, dict[str, Any]], split: str) -> Placement:
    """Sites with their own clients: numbered site after site, in the order of the sites' names."""
    by_name: dict[str, int] = {}
    for node, rep in reports.items():
        name = str(rep["site"])
        if name in by_name:
            raise RuntimeError(f"nodes {by_name[name]} and {node} both call themselves site={name!r}: give every "
                               "SuperNode its own --node-config 'site=\"NAME\"'")
        by_name[name] = node
    placement = Placement([], [], [])
    seen: dict[str, str] = {}  # client id -> its site
    for name in sorted(by_name):
        node = by_name[name]
        positions, ids, sizes, _ = _served(reports[node], split)
        for position, cid, n in zip(positions, ids, sizes):
            if cid in seen:  # the ledgers and the record key clients by id
                raise RuntimeError(f"client id {cid!r} is served by sites {seen[cid]!r} and {name!r}: client ids must "
                                   "be unique across sites (the privacy ledgers are kept by id)")
            seen[cid] = name
            placement.owners.append(node)
            placement.clients.append(RemoteClient(cid, n))
            placement.local.append(position)
    return placement


def _plan_partitions(reports: dict[int, dict[str, Any]], split: str, late_refused: Optional[str] = "") -> Placement:
    """Sites that each serve positions of one shared client list (partition-id, num-partitions). Positions without a
    node are refused (``late_refused``: why), or (None) held by placeholders until their node joins."""
    what = {"train": "training", "val": "validation", "test": "test"}[split]
    totals = {_served(rep, split)[3] for rep in reports.values()}
    if len(totals) != 1:
        raise RuntimeError(f"the nodes' DataModules hold {sorted(totals)} {what} clients: every node must build the "
                           "same client list (the same config and data)")
    total = totals.pop()
    owners: list[Optional[int]] = [None] * total
    clients: list[Optional[RemoteClient]] = [None] * total
    for node, rep in sorted(reports.items()):
        for i, cid, n in zip(*_served(rep, split)[:3]):
            if owners[i] is not None:
                raise RuntimeError(f"{what} client {i} ({cid}) is served by nodes {owners[i]} and {node}: give the "
                                   "SuperNodes distinct --node-config partition-id values")
            owners[i], clients[i] = node, RemoteClient(cid, n)
    unserved = [i for i, o in enumerate(owners) if o is None]
    if unserved and late_refused is not None:
        raise RuntimeError(f"{len(unserved)} of the {total} {what} clients have no node (first: {unserved[:5]}): "
                           "start one SuperNode per partition-id 0..num-partitions-1"
                           + (f" ({late_refused})" if late_refused else ""))
    if unserved:
        print(f"{len(unserved)} of the {total} {what} clients have no node yet: they take part once their node joins "
              "(under Poisson selection a client declines until its node joins)", flush=True)
    for i in unserved:
        clients[i] = RemoteClient(f"(no node yet) {split} {i}", 1)
    return Placement(owners, clients, list(range(total)))  # type: ignore[arg-type]  # owners None: no node yet


def main(grid: Any, context: Any) -> None:
    """The ServerApp's main: build, ask the nodes, fit (module docstring)."""
    from lightning_dp.flower.build import build_from_yaml, read_secret, refuse_unsupported

    config = context.run_config
    if insecure_superlink():
        print(INSECURE_WARNING, flush=True)
    tracking = str(config.get("tracking-uri", "")).strip()
    if tracking:  # the app's choice of where the server records (lightning-dp flower-app --tracking-uri)
        os.environ["MLFLOW_TRACKING_URI"] = tracking
    # validation as the config sets it (on the nodes' validation clients, NodeRound.evaluate); no sanity check
    cli = build_from_yaml(str(config["config-yaml"]), ["--trainer.num_sanity_val_steps=0"])
    if tracking:
        check_tracking(cli.trainer, tracking)
    module, trainer = cli.model, cli.trainer
    refuse_unsupported(module)
    if trainer.world_size > 1:
        raise ValueError(f"the server of a deployment runs in one process (the config's Trainer has "
                         f"{trainer.world_size} processes, each of which would send every round to the nodes): set "
                         "trainer.devices: 1")
    secret = os.environ.get(NOISE_SEED_VARIABLE)
    if secret:
        module.set_secret_seed(read_secret(secret, f"the environment variable {NOISE_SEED_VARIABLE}"))
    timeout = float(config.get("node-timeout", 600.0))
    nodes = wait_for_nodes(grid, int(config.get("min-nodes", 1)), timeout)
    reports = ask_nodes(grid, nodes, timeout)
    if any(rep.get("site") for rep in reports.values()):
        from lightning_dp.flower.build import refuse_budgets_for_sites

        refuse_budgets_for_sites(module)
    placements, data = plan_clients(reports, module.spec.numel, late_refused=late_nodes(module))
    module.remote = NodeRound(grid, placements, timeout=timeout)
    module.remote.shape = (data["task"], list(data["input_shape"]))
    module.remote.checkpoint = round_checkpoints(trainer, str(config.get("checkpoint-dir", "")), context.run_id)
    resume = str(config.get("resume-from", "")).strip()
    if resume:
        print(f"resuming from {resume}", flush=True)
    trainer.fit(module, datamodule=RemoteDataModule(placements["train"].clients, val=placements["val"].clients,
                                                    test=placements["test"].clients, **data), ckpt_path=resume or None)
    save_to = str(config.get("save-to", ""))
    if save_to and trainer.is_global_zero:
        privacy = module.server_privacy
        # the ledgers show who took part when the selection is secret (central DP): then they stay out of the file
        ledger = None if module.selection_is_secret() else module.ledger.as_dict()
        torch.save({"hypotheses": module.hypotheses.detach().cpu().clone(), "rounds": int(module.rounds),
                    "epsilon": float(privacy.epsilon) if privacy.accountable else math.inf, "ledger": ledger,
                    "record_ledger": module.update.ledger.as_dict() if module.update.accountable else None,
                    "nodes": len(nodes), "clients": len(placements["train"].clients)}, save_to)


def _server_app() -> Any:
    try:
        from flwr.serverapp import ServerApp
    except ImportError as err:  # the deployment's extra
        raise ImportError("lightning_dp.flower needs Flower 1.42 or later: pip install 'lightning-dp[deploy]'") from err

    server = ServerApp()
    server.main()(main)
    return server


#: the ``ServerApp`` (``[tool.flwr.app.components] serverapp = "lightning_dp.flower.server:app"``)
app = _server_app()
