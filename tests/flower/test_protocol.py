"""The deployment's protocol in one process (lightning_dp/flower): the ServerApp's NodeRound talking to the real
ClientApp through a grid that delivers messages in memory. Equal to the simulation, refusals before any data,
what goes into the app directory. The same over real processes: tests/flower/test_deployment.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightning_dp.flower import client as client_side
from lightning_dp.flower import server as server_side
from lightning_dp.flower.app import write_app

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class MemoryGrid:
    """Flower's Grid, delivered in memory: each node's ClientApp called with its node config (the messages carry
    only what the real ones do: they are built by the same code)."""

    def __init__(self, run_config: dict, node_configs: dict[int, dict]) -> None:
        from flwr.app import Context, RecordDict

        self.contexts = {node: Context(run_id=7, node_id=node, node_config=cfg, state=RecordDict(),
                                       run_config=run_config) for node, cfg in node_configs.items()}
        self.sent: list = []
        self.replies: list = []

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for message in messages:
            self.sent.append(message)
            node = message.metadata.dst_node_id
            reply = client_side.app(message, self.contexts[node])
            assert reply.metadata.src_node_id == node  # a reply comes from the node the message went to
            replies.append(reply)
            self.replies.append(reply)
        return replies


def simulate(config: Path, noise_seed: int):
    from lightning_dp.cli import LightningDPCLI

    cli = LightningDPCLI(run=False, args=["--config", str(config), "--trainer.logger=false",
                                          f"--model.init_args.noise_seed={noise_seed}",
                                          "--trainer.enable_checkpointing=false"])
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cli.model


def deploy_in_memory(config: Path, noise_seed: int, nodes: int = 2, node_configs: dict | None = None, *,
                     grid_class: type = MemoryGrid, resume_from: str = "", min_nodes: int = 0):
    if node_configs is None:
        node_configs = {100 + p: {"partition-id": p, "num-partitions": nodes, "noise-seed": noise_seed}
                        for p in range(nodes)}
    run_config = {"config-yaml": config.read_text(), "min-nodes": min_nodes or len(node_configs), "node-timeout": 60.0,
                  "save-to": "", "resume-from": resume_from}
    grid = grid_class(run_config, node_configs)
    client_side._SITES.clear()
    from flwr.app import Context, RecordDict

    context = Context(run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    captured = {}
    fit = server_side.RemoteDataModule  # capture the server's module through the DataModule it is fitted with

    class Capturing(fit):
        def setup(self, stage=None):
            captured["module"] = self.trainer.lightning_module
            super().setup(stage)

    from flwr.supercore.task_identity import TaskIdentity

    identity = {name: getattr(TaskIdentity, f"_{name}", None) for name in ("run_id", "node_id", "task_id")}
    server_side.RemoteDataModule = Capturing
    try:
        import os

        # what a ServerApp process of Flower has set before its main runs (messages are stamped with it)
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 0, 1
        os.environ[server_side.NOISE_SEED_VARIABLE] = str(noise_seed)
        server_side.main(grid, context)
    finally:
        server_side.RemoteDataModule = fit
        os.environ.pop(server_side.NOISE_SEED_VARIABLE, None)
        for name, value in identity.items():
            setattr(TaskIdentity, f"_{name}", value)
    return captured["module"], grid


def assert_the_ledgers_are_the_simulations(deployed, simulated, sites: Path) -> None:
    """The deployment's record-level ledger (local_dp_sgd: planned from the reported sizes) is the simulation's and,
    where the releases are private by themselves, the two sites' own ledger files in ``sites`` hold the simulation's
    ledger between them (every client in one of them, no seed in either); under central DP the sites keep none."""
    if simulated.update.accountable:
        assert deployed.update.ledger.as_dict() == pytest.approx(simulated.update.ledger.as_dict())
    site_files = sorted(sites.glob("lightning-dp-ledger-*.json"))
    if not (simulated.releases_are_sanitized() or simulated.update.accountable):
        assert site_files == []
        return
    import copy
    import json

    assert [f.name for f in site_files] == ["lightning-dp-ledger-partition-0.json", "lightning-dp-ledger-partition-1.json"]
    key = "record_ledger" if simulated.update.accountable else "client_ledger"
    ledger = simulated.update.ledger if simulated.update.accountable else simulated.ledger
    union: dict = {}
    for f in site_files:
        part = copy.copy(ledger)  # the same kind and settings; load_state_dict replaces its content
        part.load_state_dict(json.loads(f.read_text())[key])
        assert not set(union) & set(part.as_dict())  # every client in one site's ledger
        union.update(part.as_dict())
    assert union == pytest.approx(ledger.as_dict())
    assert all("918273645" not in f.read_text() for f in site_files)  # no seed in a ledger file


@pytest.mark.parametrize(("name", "warm"), [("fl_deploy_fedavg.yaml", 0), ("fl_deploy_personalized.yaml", 0),
                                            ("fl_deploy_personalized.yaml", 2), ("fl_deploy_local_dp.yaml", 0),
                                            ("fl_deploy_local_dpsgd.yaml", 0)],
                         ids=["fedavg", "personalized", "personalized-warm-start", "local-dp", "local-dp-sgd"])
def test_the_deployment_protocol_ends_with_the_simulations_model_epsilon_and_ledger(name, warm, tmp_path,
                                                                                   monkeypatch):
    """Deployed (nodes run FederatedRound.train_clients) equals simulated; with warm_start_rounds, the nodes start
    the warm-up's clients from the same public assignment as the simulation."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    config = tmp_path / name
    text = yaml.safe_load((EXAMPLES / name).read_text())
    text["trainer"]["logger"] = False  # the deployment's MLflow record: tests/flower/test_deployment.py
    if warm:
        text["model"]["init_args"]["warm_start_rounds"] = warm
    config.write_text(yaml.safe_dump(text))
    simulated = simulate(config, 918273645)
    deployed, grid = deploy_in_memory(config, 918273645)
    torch.testing.assert_close(deployed.hypotheses, simulated.hypotheses, rtol=1e-6, atol=1e-7)
    assert int(deployed.rounds) == int(simulated.rounds) == 3
    assert deployed.ledger.as_dict() == pytest.approx(simulated.ledger.as_dict())
    assert_the_ledgers_are_the_simulations(deployed, simulated, tmp_path)
    if simulated.server_privacy.accountable:
        assert deployed.server_privacy.epsilon == simulated.server_privacy.epsilon
        assert deployed.server_privacy.accountant.history == simulated.server_privacy.accountant.history
    # validation on the nodes' validation clients: the simulation's metrics from the nodes' sums
    evaluated = {k: float(v) for k, v in deployed.trainer.callback_metrics.items() if k.startswith("val/")}
    expected = {k: float(v) for k, v in simulated.trainer.callback_metrics.items() if k.startswith("val/")}
    assert evaluated.keys() == expected.keys() and "val/loss" in evaluated
    assert evaluated == pytest.approx(expected, rel=1e-9)
    evaluations = [m for m in grid.sent if m.metadata.message_type == "evaluate"]
    assert evaluations and all(set(m.content["arrays"].keys()) == {"hypotheses"} for m in evaluations)
    # what the server received beside the releases: costs; no loss from sanitized releases, no counts for an
    # unweighted aggregator, no bit unless clipping at the server's adaptive threshold (docs/federated.md)
    for reply in grid.replies:
        if reply.metadata.message_type == "evaluate":  # sums over the node's validation clients, nothing per client
            assert set(reply.content["arrays"].keys()) == {"sums"}
        elif "arrays" in reply.content:
            stats = reply.content["arrays"].to_torch_state_dict()["stats"]
            assert stats[:, 2].eq(1).all() and stats[:, 3].isnan().all()
            assert stats[:, 0].isnan().all() == simulated.releases_are_sanitized()
    # what the nodes received: public state only (the server's secret seed is in no message)
    for message in grid.sent:
        content = message.content
        assert "918273645" not in repr(dict(content["config"]))
        if "arrays" in content and message.metadata.message_type == "train":
            assert set(content["arrays"].keys()) == {"hypotheses", "previous_step"}


def test_nodes_that_disagree_or_leave_clients_out_are_refused_before_training():
    def report(positions, total=4, numel=2):
        return {"positions": positions, "ids": [f"c{i}" for i in positions], "sizes": [3] * len(positions),
                "num-training-clients": total, "numel": numel, "task": "regression", "num-classes": -1,
                "num-groups": -1, "input-shape": [2]}

    placements, data = server_side.plan_clients({1: report([0, 2]), 2: report([1, 3])}, 2)
    train = placements["train"]
    assert train.owners == [1, 2, 1, 2] and [c.client_id for c in train.clients] == ["c0", "c1", "c2", "c3"]
    assert train.local == [0, 1, 2, 3] and placements["val"].clients == []
    with_val = {1: {**report([0, 2]), "val-positions": [0], "num-val-clients": 2},
                2: {**report([1, 3]), "val-positions": [1], "num-val-clients": 2}}
    assert server_side.plan_clients(with_val, 2)[0]["val"].owners == [1, 2]
    with pytest.raises(RuntimeError, match="validation clients have no node"):
        server_side.plan_clients({**with_val, 2: {**with_val[2], "val-positions": []}}, 2)
    assert data == {"task": "regression", "num_classes": None, "num_groups": None, "input_shape": (2,)}
    with pytest.raises(RuntimeError, match="distinct --node-config partition-id"):
        server_side.plan_clients({1: report([0, 2]), 2: report([0, 1, 3])}, 2)
    with pytest.raises(RuntimeError, match="no node"):
        server_side.plan_clients({1: report([0, 2])}, 2)
    with pytest.raises(RuntimeError, match="same config"):
        server_side.plan_clients({1: report([0, 2], numel=3), 2: report([1, 3])}, 2)
    with pytest.raises(RuntimeError, match="same client list"):
        server_side.plan_clients({1: report([0, 2]), 2: report([1, 3], total=5)}, 2)


@pytest.mark.parametrize("leak", [
    "    seed: 0\n    noise_seed: 77\n",                      # the round's secret, where a config sets it
    "    seed: 0\nmodel.init_args.noise_seed: 4242\n",        # the same as a dotted key after the block
    "    seed: 0\n    noise_seed: 0x10\n",                    # any spelling YAML reads as an integer
])
def test_a_config_that_sets_a_secret_however_spelled_is_refused(leak, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    leaky = tmp_path / "leaky.yaml"
    leaky.write_text((EXAMPLES / "fl_deploy_fedavg.yaml").read_text().replace("    seed: 0\n", leak, 1))
    with pytest.raises(ValueError, match="noise_seed, secret.*LIGHTNING_DP_NOISE_SEED") as err:
        write_app(leaky, tmp_path / "app")
    assert "77" not in str(err.value) and "4242" not in str(err.value)  # named, never shown
    assert not (tmp_path / "app").exists()


def test_a_dpsgd_seed_in_the_config_is_a_secret_too(tmp_path, monkeypatch):
    from lightning_dp.flower.build import build_from_yaml

    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    text = yaml.safe_load((EXAMPLES / "fl_deploy_fedavg.yaml").read_text())
    text["trainer"]["logger"] = False
    text["trainer"]["callbacks"] = [{"class_path": "lightning_dp.callbacks.DPSGD",
                                     "init_args": {"noise_multiplier": 1.0, "seed": 5}}]
    with pytest.raises(ValueError, match=r"trainer\.callbacks\.0\.init_args\.seed, secret"):
        build_from_yaml(yaml.safe_dump(text))


def test_the_app_carries_the_config_verbatim_and_refuses_a_directory_with_other_files(tmp_path, monkeypatch):
    import tomllib

    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    path = write_app(EXAMPLES / "fl_deploy_personalized.yaml", tmp_path / "app", min_nodes=3, save_to="/x/final.pt")
    app = tomllib.loads(path.read_text())["tool"]["flwr"]["app"]
    assert app["components"] == {"serverapp": "lightning_dp.flower.server:app",
                                 "clientapp": "lightning_dp.flower.client:app"}
    assert app["config"]["config-yaml"] == (EXAMPLES / "fl_deploy_personalized.yaml").read_text()
    assert app["config"]["min-nodes"] == 3 and app["config"]["save-to"] == "/x/final.pt"
    write_app(EXAMPLES / "fl_deploy_fedavg.yaml", tmp_path / "app")  # its own app: rewritten
    (tmp_path / "app" / "other.yaml").write_text("model: {}\n")  # Flower would ship it to every node
    with pytest.raises(ValueError, match="holds other files"):
        write_app(EXAMPLES / "fl_deploy_fedavg.yaml", tmp_path / "app")


def test_secrets_given_as_text_are_checked_without_being_shown():
    from lightning_dp.federated import FederatedRound
    from lightning_dp.federated.parts import EuclideanLaplace
    from lightning_dp.flower.build import read_secret
    from lightning_dp.models import LinearRegression

    assert read_secret(" 42 ", "x") == 42
    for bad in ("0x2a", "-3", "abc123"):
        with pytest.raises(ValueError, match="not shown") as err:
            read_secret(bad, "--node-config noise-seed")
        assert bad not in str(err.value)
    module = FederatedRound(LinearRegression(), sanitizer=EuclideanLaplace(2.0), seed=9)
    with pytest.raises(ValueError, match="public seed"):
        module.set_secret_seed(9)


def test_the_flower_app_command_writes_the_app_and_refuses_bad_input(tmp_path, capsys):
    from lightning_dp.cli import main

    assert main(["flower-app", "--config", str(EXAMPLES / "fl_deploy_fedavg.yaml"), "--out", str(tmp_path / "a"),
                 "--min-nodes", "2"]) == 0
    assert (tmp_path / "a" / "pyproject.toml").is_file() and "flwr run" in capsys.readouterr().out
    with pytest.raises(SystemExit) as err:
        main(["flower-app", "--config", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "b")])
    assert err.value.code == 2 and "no such file" in capsys.readouterr().err


def test_what_the_deployment_cannot_run_is_refused_with_the_reason():
    from lightning_dp.federated import FederatedRound
    from lightning_dp.federated.budgets import FixedBudgets
    from lightning_dp.federated.parts import LocalDPSGD
    from lightning_dp.flower.build import refuse_budgets_for_sites, refuse_unsupported
    from lightning_dp.models import LinearRegression

    with pytest.raises(ValueError, match="unsanitized updates, which never leave their nodes"):
        refuse_unsupported(FederatedRound(LinearRegression(), diagnostics=True))
    budgets = FederatedRound(LinearRegression(), update=LocalDPSGD(budgets=FixedBudgets([1.0, 2.0])))
    refuse_unsupported(budgets)  # runs on partitions of one client list (issue 52, item 5)
    refuse_unsupported(FederatedRound(LinearRegression(), update=LocalDPSGD(target_epsilon=2.0)))
    with pytest.raises(ValueError, match="whole client list"):
        refuse_budgets_for_sites(budgets)


def test_pfa_with_personal_budgets_runs_on_partitions_as_in_simulation(tmp_path, monkeypatch):
    """local_dp_sgd with per-client budgets and PFA's projected averaging (issue 52, item 5): every node holds the
    shared client list and assigns the budgets as the server does; the deployment ends with the simulation's model,
    record-level ledger and the sites' ledgers between them."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    config = tmp_path / "pfa.yaml"
    text = yaml.safe_load((EXAMPLES / "fl_deploy_local_dpsgd.yaml").read_text())
    text["trainer"]["logger"] = False
    update = text["model"]["init_args"]["update"]["init_args"]
    del update["target_epsilon"]
    update["budgets"] = {"class_path": "lightning_dp.federated.budgets.DistributionBudgets",
                         "init_args": {"distribution": "MixGauss1", "seed": 0}}
    text["model"]["init_args"]["aggregator"] = {
        "class_path": "lightning_dp.federated.parts.PFA",
        "init_args": {"partition": "direct", "rule": "top_fraction", "public_fraction": 0.2, "components": 1}}
    config.write_text(yaml.safe_dump(text))
    simulated = simulate(config, 918273645)
    deployed, _ = deploy_in_memory(config, 918273645)
    torch.testing.assert_close(deployed.hypotheses, simulated.hypotheses, rtol=1e-6, atol=1e-7)
    assert deployed.update.client_budgets() == simulated.update.client_budgets()
    assert deployed.update.ledger.as_dict() == pytest.approx(simulated.update.ledger.as_dict())
    assert len(set(simulated.update.client_budgets())) > 1  # personal budgets indeed


def _site_report(site, ids, numel=2):
    return {"site": site, "positions": list(range(len(ids))), "ids": ids, "sizes": [1] * len(ids),
            "num-training-clients": len(ids), "numel": numel, "task": "regression", "num-classes": -1,
            "num-groups": -1, "input-shape": [2]}


def test_sites_with_their_own_clients_are_numbered_in_the_order_of_their_names():
    placements, _ = server_side.plan_clients(
        {7: {**_site_report("zurich", ["z1", "z2"]), "val-positions": [0]},
         3: {**_site_report("boston", ["b1", "b2", "b3"]), "val-positions": [0, 1]}}, 2)
    train, val = placements["train"], placements["val"]
    assert [c.client_id for c in train.clients] == ["b1", "b2", "b3", "z1", "z2"]
    assert train.owners == [3, 3, 3, 7, 7] and train.local == [0, 1, 2, 0, 1]
    assert val.owners == [3, 3, 7] and val.local == [0, 1, 0]
    with pytest.raises(RuntimeError, match="unique across sites"):
        server_side.plan_clients({1: _site_report("a", ["x", "y"]), 2: _site_report("b", ["y"])}, 2)
    with pytest.raises(RuntimeError, match="both call themselves site='a'"):
        server_side.plan_clients({1: _site_report("a", ["x"]), 2: _site_report("a", ["y"])}, 2)
    with pytest.raises(RuntimeError, match="start every node one way"):
        server_side.plan_clients({1: _site_report("a", ["x"]), 2: {**_site_report("", ["y"]), "positions": [0]}}, 2)
    with pytest.raises(RuntimeError, match="differs from the others"):
        server_side.plan_clients({1: _site_report("a", ["x"]), 2: {**_site_report("b", ["y"]), "input-shape": [3]}},
                                 2)


def test_sites_with_their_own_data_train_together_and_draw_their_own_noise(tmp_path, monkeypatch):
    """Two SuperNodes, each its own clients (a DataModule argument set by its node config), one seed given to both:
    the server trains the union, each site is asked only for positions of its own list, the sites' noise seeds
    differ, and the spend is the one the simulation of the same config accounts."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    text = yaml.safe_load((EXAMPLES / "fl_deploy_fedavg.yaml").read_text())
    text["trainer"]["logger"] = False
    text["data"] = {"class_path": "tests.flower.sites.SiteMixture",
                    "init_args": {**text["data"]["init_args"], "site": "a"}}
    config = tmp_path / "sites.yaml"
    config.write_text(yaml.safe_dump(text))
    nodes = {101: {"site": "boston", "data.site": "b", "data.seed": 1, "noise-seed": 5},
             102: {"site": "austin", "data.site": "a", "noise-seed": 5}}
    deployed, grid = deploy_in_memory(config, 918273645, node_configs=nodes)
    ids = [c.client_id for c in deployed.trainer.datamodule.train_clients]
    assert ids[:40] == [f"a-{i}" for i in _mixture_ids(text)] and ids[40:] == [f"b-{i}" for i in _mixture_ids(text)]
    for message in grid.sent:
        if "arrays" in message.content:
            assert all(0 <= i < 40 for i in message.content["config"]["clients"])
    sites = {key[1]: value for key, value in client_side._SITES.items()}
    seeds = {dict(config_items)["site"]: s.module._noise_seed for config_items, s in sites.items()}
    assert seeds["austin"] != seeds["boston"]  # one given seed, two sites: derived per site
    b = next(s for items, s in sites.items() if dict(items)["site"] == "boston")
    a = next(s for items, s in sites.items() if dict(items)["site"] == "austin")
    assert not torch.equal(a.data.train_clients[0].x, b.data.train_clients[0].x)  # data.seed=1 on boston only
    simulated = simulate(config, 918273645)
    assert deployed.server_privacy.epsilon == simulated.server_privacy.epsilon
    assert int(deployed.rounds) == 3 and not torch.equal(deployed.hypotheses, simulated.hypotheses)


def _mixture_ids(text):
    from lightning_dp.datamodules import SyntheticLinearMixtureDataModule

    dm = SyntheticLinearMixtureDataModule(**{k: v for k, v in text["data"]["init_args"].items() if k != "site"})
    dm.setup("fit")
    return [c.client_id for c in dm.train_clients]


def test_a_node_config_may_set_only_the_datamodules_arguments():
    assert client_side.data_overrides({"data.data_dir": "/site/files", "noise-seed": 3, "site": "x"}) == [
        "--data.init_args.data_dir=/site/files"]
    with pytest.raises(ValueError, match="not an argument of the config's DataModule"):
        client_side.data_overrides({"data.init_args.x": 1})


def test_a_site_refuses_the_public_seed_as_its_noise_seed_before_deriving_its_own(tmp_path, monkeypatch):
    """A site name is no secret: noise-seed equal to the config's public seed is refused in site mode too, and
    the server's public seed is compared with the given seed as well as the derived one."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    text = (EXAMPLES / "fl_deploy_fedavg.yaml").read_text()  # public seed: 0
    with pytest.raises(ValueError, match="equals the config's public seed"):
        client_side._Site(text, {"site": "a", "noise-seed": 0})
    node = client_side._Site(text, {"site": "a", "noise-seed": 5})
    assert node.module._noise_seed == client_side.site_seed(5, "a") != 5
    with pytest.raises(ValueError, match="public seed equals this site's noise seed"):
        client_side.serve_clients(node, [0], 0, hypotheses=node.module.hypotheses.detach().clone(),
                                  previous_step=node.module.previous_step.detach().clone(), seed=5, clip=-1.0)
    with pytest.raises(ValueError, match="give the site a name"):
        client_side._Site(text, {"site": " "})


def test_site_seeds_differ_by_name_even_where_seed_sequences_would_not():
    assert client_side.site_seed(5, "a") != client_side.site_seed(5, "a\x00") != client_side.site_seed(5, "b")
    assert client_side.site_seed(5, "a") == client_side.site_seed(5, "a") != client_side.site_seed(6, "a")


@pytest.mark.parametrize("key", ["data.class_path", "data.init_args", "data.dict_kwargs", "data.init_args.x"])
def test_a_node_config_may_not_replace_the_datamodule(key):
    with pytest.raises(ValueError, match="not an argument of the config's DataModule"):
        client_side.data_overrides({key: "lightning_dp.datamodules.MNISTDataModule"})


def test_evaluation_sums_that_do_not_add_up_are_refused(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    from lightning_dp.flower.server import NodeRound, Placement, RemoteClient

    for name, value in (("run_id", 7), ("node_id", 0), ("task_id", 1)):  # as a ServerApp process has them
        monkeypatch.setattr(TaskIdentity, f"_{name}", value, raising=False)

    class Reply:
        def __init__(self, node, sums):
            from flwr.app import ArrayRecord, RecordDict

            self.metadata = type("M", (), {"src_node_id": node})()
            self.content = RecordDict({"arrays": ArrayRecord({"sums": sums})})

        def has_error(self):
            return False

    class Grid:
        def __init__(self, sums):
            self.sums = sums

        def send_and_receive(self, messages, timeout=None):
            return [Reply(m.metadata.dst_node_id, self.sums) for m in messages]

    module = type("Module", (), {"k": 2, "rounds": 0, "hypotheses": torch.zeros(2, 3)})()
    placements = {"val": Placement([9, 9], [RemoteClient("v0", 1), RemoteClient("v1", 1)], [0, 1])}
    good = torch.tensor([1.0, 2, 0, 0, 1, 1], dtype=torch.float64)
    assert torch.equal(NodeRound(Grid(good), placements, timeout=1).evaluate(module, "val", [0, 1]), good)
    for bad in (torch.tensor([1.0, 3, 0, 0, 2, 1]), torch.tensor([1.0, 2, 0, 0, 2, 1]), torch.zeros(5)):
        with pytest.raises(RuntimeError, match="evaluation sums"):
            NodeRound(Grid(bad.double()), placements, timeout=1).evaluate(module, "val", [0, 1])


class CorruptingGrid(MemoryGrid):
    """A node whose training replies carry one NaN entry in its first client's release (a broken node: its own round
    drops a client's non-finite update before sanitizing it, tests/federated/test_non_finite.py)."""

    def __init__(self, *args, bad_node: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.bad_node, self.corrupted = bad_node, 0

    def send_and_receive(self, messages, timeout=None):
        from flwr.app import ArrayRecord

        replies = super().send_and_receive(messages, timeout)
        for reply in replies:
            if reply.metadata.src_node_id == self.bad_node and reply.metadata.message_type == "train":
                arrays = reply.content["arrays"].to_torch_state_dict()
                arrays["releases"][0, 0] = float("nan")
                reply.content["arrays"] = ArrayRecord(arrays)
                self.corrupted += 1
        return replies


@pytest.mark.parametrize("name", ["fl_deploy_fedavg.yaml", "fl_deploy_personalized.yaml"],
                         ids=["fedavg", "personalized"])
def test_a_node_replying_nan_is_dropped_and_the_run_ends_finite(name, tmp_path, monkeypatch):
    """Issue 49: before, one NaN entry in a node's reply made DP-FedAvg's global model NaN from that round on,
    silently. Now the server drops the non-finite release (a zero update), still adds its noise and accounts the
    round as planned: the run ends with finite hypotheses and the simulation's epsilon."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    config = tmp_path / name
    text = yaml.safe_load((EXAMPLES / name).read_text())
    text["trainer"]["logger"] = False
    config.write_text(yaml.safe_dump(text))
    simulated = simulate(config, 918273645)
    real = MemoryGrid.__init__

    def corrupting(self, run_config, node_configs):  # deploy_in_memory builds a MemoryGrid: the corrupting one
        self.__class__ = CorruptingGrid
        real(self, run_config, node_configs)
        self.bad_node, self.corrupted = 100, 0

    monkeypatch.setattr(MemoryGrid, "__init__", corrupting)
    deployed, grid = deploy_in_memory(config, 918273645)
    assert grid.corrupted > 0  # the bad node took part
    assert int(deployed.rounds) == int(simulated.rounds) == 3
    assert bool(torch.isfinite(deployed.hypotheses).all())
    assert not torch.equal(deployed.hypotheses, simulated.hypotheses)  # its client's update was dropped
    if simulated.server_privacy.accountable:
        assert deployed.server_privacy.epsilon == simulated.server_privacy.epsilon
    assert deployed.ledger.as_dict() == pytest.approx(simulated.ledger.as_dict())
    assert_the_ledgers_are_the_simulations(deployed, simulated, tmp_path)


def test_test_clients_are_evaluated_on_the_nodes_at_every_check(tmp_path, monkeypatch):
    """test_every_check on a deployment (issue 52, item 5): the nodes evaluate their test clients and reply with
    sums; the server logs the simulation's test/* metrics."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    config = tmp_path / "test_every_check.yaml"
    text = yaml.safe_load((EXAMPLES / "fl_deploy_personalized.yaml").read_text())
    text["trainer"]["logger"] = False
    text["model"]["init_args"]["test_every_check"] = True
    text["data"]["init_args"]["num_test_clients"] = 5
    config.write_text(yaml.safe_dump(text))
    simulated = simulate(config, 918273645)
    deployed, grid = deploy_in_memory(config, 918273645)
    tested = {k: float(v) for k, v in deployed.trainer.callback_metrics.items() if k.startswith("test/")}
    expected = {k: float(v) for k, v in simulated.trainer.callback_metrics.items() if k.startswith("test/")}
    assert "test/loss" in expected and tested == pytest.approx(expected, rel=1e-9)
    asked = [m for m in grid.sent if m.metadata.message_type == "evaluate" and m.content["config"]["split"] == "test"]
    assert sorted(i for m in asked for i in m.content["config"]["clients"]) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="'val' and 'test' clients only"):
        client_side.evaluate_clients(client_side._SITES[next(iter(client_side._SITES))], "train", [0],
                                     hypotheses=deployed.hypotheses.detach())


def test_group_fairness_of_an_evaluation_adds_up_over_the_nodes(tmp_path, monkeypatch):
    """The journal paper's synthetic fairness clients (binary labels, two sensitive groups) on a deployment: the nodes
    reply with per-group confusion counts beside their sums, and the server logs the simulation's val/fairness/*."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    config = tmp_path / "fairness.yaml"
    text = yaml.safe_load((EXAMPLES / "fairness" / "synthetic.yaml").read_text())
    text["trainer"].update({"logger": False, "max_epochs": 2, "check_val_every_n_epoch": 2, "callbacks": []})
    text["data"]["init_args"].update({"num_clients": 60, "num_val_clients": 10, "num_test_clients": 4})
    text["model"]["init_args"]["clients_per_round"] = 10
    config.write_text(yaml.safe_dump(text))
    simulated = simulate(config, 918273645)
    deployed, grid = deploy_in_memory(config, 918273645)
    expected = {k: float(v) for k, v in simulated.trainer.callback_metrics.items() if k.startswith("val/")}
    logged = {k: float(v) for k, v in deployed.trainer.callback_metrics.items() if k.startswith("val/")}
    assert any(k.startswith("val/fairness/") for k in expected)
    assert logged == pytest.approx(expected, rel=1e-9)
    replies = [r for r in grid.replies if r.metadata.message_type == "evaluate"]
    assert replies and all(set(r.content["arrays"].keys()) == {"sums", "fairness"} for r in replies)


# ----------------------------------------------------------------------------- no server to trust (issue 52, item 3)
def _local_site(tmp_path, monkeypatch, name="fl_deploy_local_dp.yaml", **node):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    client_side._SITES.clear()
    config = {"partition-id": 0, "num-partitions": 1, "noise-seed": 918273645, **node}
    site = client_side._Site((EXAMPLES / name).read_text(), config)
    return site, site.module.hypotheses.detach().clone(), site.module.previous_step.detach().clone()


def _ledger(path):
    import json

    return json.loads(path.read_text())


def test_a_site_charges_its_own_ledger_and_never_reuses_noise_for_other_inputs(tmp_path, monkeypatch):
    """A server that sends a round again with other hypotheses would get two releases with the same noise (the
    site's fixed seed): refused. The same inputs again are the same release: nothing new is charged."""
    site, hyps, prev = _local_site(tmp_path, monkeypatch)
    path = tmp_path / "lightning-dp-ledger-partition-0.json"
    first, _ = client_side.serve_clients(site, [0, 1], 1, hypotheses=hyps, previous_step=prev, seed=0, clip=-1.0)
    charged = _ledger(path)["client_ledger"]
    from lightning_dp.datamodules.federated import client_ids

    ids = client_ids(site.data.train_clients, [0, 1])
    assert [c[0] for c in charged["clients"]] == ids and [c[2] for c in charged["clients"]] == [1, 1]
    again, _ = client_side.serve_clients(site, [0, 1], 1, hypotheses=hyps, previous_step=prev, seed=0, clip=-1.0)
    torch.testing.assert_close(again, first, rtol=0, atol=0)  # the same release
    assert _ledger(path)["client_ledger"] == charged  # not charged twice
    with pytest.raises(ValueError, match="share their noise"):
        client_side.serve_clients(site, [0, 1], 1, hypotheses=hyps + 1.0, previous_step=prev, seed=0, clip=-1.0)
    with pytest.raises(ValueError, match="some of the requested clients"):
        client_side.serve_clients(site, [1, 2], 1, hypotheses=hyps, previous_step=prev, seed=0, clip=-1.0)
    assert _ledger(path)["client_ledger"] == charged
    # a new run of the site (a new process) reads the same file: its clients' spend goes on from there
    site2, _, _ = _local_site(tmp_path, monkeypatch)
    client_side.serve_clients(site2, [0], 2, hypotheses=hyps, previous_step=prev, seed=0, clip=-1.0)
    assert {c[0]: c[2] for c in _ledger(path)["client_ledger"]["clients"]} == {ids[0]: 2, ids[1]: 1}


def test_noise_streams_are_told_apart_without_the_seed(tmp_path, monkeypatch):
    """A fresh seed (none given) is one process's stream: its own repeats with other inputs are refused, another
    process's release of the same round is new noise, charged. A pinned seed under a new public label is a new
    stream. The file names streams by label or random id, never by anything computed from a seed."""
    from lightning_dp.datamodules.federated import client_ids

    site, hyps, prev = _local_site(tmp_path, monkeypatch, **{"noise-seed": ""})
    path = tmp_path / "lightning-dp-ledger-partition-0.json"
    cid = client_ids(site.data.train_clients, [0])[0]
    client_side.serve_clients(site, [0], 1, hypotheses=hyps, previous_step=prev, seed=0, clip=-1.0)
    with pytest.raises(ValueError, match="share their noise"):  # the same process: the same noise
        client_side.serve_clients(site, [0], 1, hypotheses=hyps + 1.0, previous_step=prev, seed=0, clip=-1.0)
    other, _, _ = _local_site(tmp_path, monkeypatch, **{"noise-seed": ""})  # a new process: fresh noise
    client_side.serve_clients(other, [0], 1, hypotheses=hyps + 1.0, previous_step=prev, seed=0, clip=-1.0)
    state = _ledger(path)
    assert {c[0]: c[2] for c in state["client_ledger"]["clients"]} == {cid: 2}
    assert all(k.startswith(other.noise_stream + "/") for k in state["released"])  # the dead process's are dropped
    pinned, _, _ = _local_site(tmp_path, monkeypatch)  # noise-seed 918273645, label ""
    client_side.serve_clients(pinned, [0], 1, hypotheses=hyps, previous_step=prev, seed=0, clip=-1.0)
    with pytest.raises(ValueError, match="share their noise"):
        client_side.serve_clients(pinned, [0], 1, hypotheses=hyps + 1.0, previous_step=prev, seed=0, clip=-1.0)
    relabelled, _, _ = _local_site(tmp_path, monkeypatch, **{"noise-seed": 918273646, "noise-seed-label": "second"})
    client_side.serve_clients(relabelled, [0], 1, hypotheses=hyps + 1.0, previous_step=prev, seed=0, clip=-1.0)
    state = _ledger(path)
    assert {c[0]: c[2] for c in state["client_ledger"]["clients"]} == {cid: 4}
    assert "918273645" not in path.read_text() and "918273646" not in path.read_text()
    with pytest.raises(ValueError, match="noise-seed-label names a pinned"):
        _local_site(tmp_path, monkeypatch, **{"noise-seed": "", "noise-seed-label": "x"})


def test_a_site_enforces_the_cap_whatever_the_server_asks(tmp_path, monkeypatch):
    """client_privacy_cap = 8 (epsilon at delta 1e-5 of the composed Gaussians): a server that selects one client
    round after round is refused by the site at the release that would pass the cap, before training, and the
    site's ledger is left as it was."""
    site, hyps, prev = _local_site(tmp_path, monkeypatch)
    path = tmp_path / "lightning-dp-ledger-partition-0.json"
    before, r = None, 0
    with pytest.raises(ValueError, match="client_privacy_cap"):
        for r in range(1, 30):
            before = _ledger(path) if path.exists() else None
            client_side.serve_clients(site, [3], r, hypotheses=hyps, previous_step=prev, seed=0, clip=-1.0)
    assert r > 2 and _ledger(path) == before
    assert before["client_ledger"]["clients"][0][2] == r - 1
    assert 0 < site.module.ledger.max() <= 8.0


def test_a_site_plans_local_dp_sgd_itself_and_refuses_a_spent_client(tmp_path, monkeypatch):
    """local_dp_sgd, epsilon 3 per record planned for ceil(3 rounds x 10/40) = 1 participation: a second
    participation of one client is refused by the site, its record-level ledger at the planned epsilon."""
    site, hyps, prev = _local_site(tmp_path, monkeypatch, "fl_deploy_local_dpsgd.yaml")
    path = tmp_path / "lightning-dp-ledger-partition-0.json"
    with pytest.raises(ValueError, match="count of training clients"):
        client_side.serve_clients(site, [5], 1, hypotheses=hyps, previous_step=prev, seed=0, clip=-1.0)
    with pytest.raises(ValueError, match="same client list"):
        client_side.serve_clients(site, [5], 1, hypotheses=hyps, previous_step=prev, seed=0, clip=-1.0,
                                  num_clients=41)
    client_side.serve_clients(site, [5], 1, hypotheses=hyps, previous_step=prev, seed=0, clip=-1.0, num_clients=40)
    record = _ledger(path)["record_ledger"]
    # a server that asks the round again with another client count (another noise scale over the same draws) is
    # refused: the count is part of the inputs the ledger remembers (a site of its own clients, in a new process)
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    client_side._SITES.clear()
    named = {"site": "a", "noise-seed": 918273645, "ledger": str(tmp_path / "named.json")}
    client_side.serve_clients(client_side._Site((EXAMPLES / "fl_deploy_local_dpsgd.yaml").read_text(), named), [5], 1,
                              hypotheses=hyps, previous_step=prev, seed=0, clip=-1.0, num_clients=40)
    again = client_side._Site((EXAMPLES / "fl_deploy_local_dpsgd.yaml").read_text(), named)
    with pytest.raises(ValueError, match="share their noise"):
        client_side.serve_clients(again, [5], 1, hypotheses=hyps, previous_step=prev, seed=0, clip=-1.0,
                                  num_clients=80)
    assert len(record["clients"]) == 1 and site.module.update.ledger.max() <= 3.0 + 1e-9
    with pytest.raises(ValueError, match="record-level budget"):
        client_side.serve_clients(site, [5], 2, hypotheses=hyps, previous_step=prev, seed=0, clip=-1.0,
                                  num_clients=40)
    assert _ledger(path)["record_ledger"] == record


def test_a_ledger_file_of_another_kind_or_unreadable_is_refused_before_training(tmp_path, monkeypatch):
    site, hyps, prev = _local_site(tmp_path, monkeypatch)
    client_side.serve_clients(site, [0], 1, hypotheses=hyps, previous_step=prev, seed=0, clip=-1.0)
    other, h2, p2 = _local_site(tmp_path, monkeypatch, "fl_deploy_local_dpsgd.yaml")  # the same default file
    with pytest.raises(ValueError, match="a ledger adds up one kind of cost"):
        client_side.serve_clients(other, [0], 1, hypotheses=h2, previous_step=p2, seed=0, clip=-1.0, num_clients=40)
    (tmp_path / "broken.json").write_text("{not json")
    broken, h3, p3 = _local_site(tmp_path, monkeypatch, ledger=str(tmp_path / "broken.json"))
    with pytest.raises(ValueError, match="cannot be read"):
        client_side.serve_clients(broken, [0], 1, hypotheses=h3, previous_step=p3, seed=0, clip=-1.0)



# ------------------------------------------------------------------------------------------ faults (issue 52, item 4)
class LosingGrid(MemoryGrid):
    """Node 101 stops answering in round 2 (killed): its TRAIN message of that round gets no reply; node 100's
    reply of the same round arrives (and its site charges its own ledger)."""

    def send_and_receive(self, messages, timeout=None):
        lost = [m for m in messages if m.metadata.dst_node_id == 101 and m.metadata.message_type == "train"
                and int(m.content["config"]["round"]) >= 2]
        return super().send_and_receive([m for m in messages if m not in lost], timeout)


@pytest.mark.parametrize("name", ["fl_deploy_fedavg.yaml", "fl_deploy_local_dp.yaml"])
def test_a_lost_node_stops_the_run_loudly_and_the_resumed_run_ends_as_an_uninterrupted_one(name, tmp_path,
                                                                                           monkeypatch):
    """A node lost in round 2: the server stops before aggregating or accounting that round and names its last
    checkpoint; resumed from it (the node back), the run ends with the uninterrupted run's model, epsilon and
    ledgers, and the sites' own ledgers are charged once per release (the round asked again with the same inputs
    is the same release under the sites' fixed noise seeds)."""
    import json

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    config = tmp_path / name
    text = yaml.safe_load((EXAMPLES / name).read_text())
    text["trainer"]["logger"] = False
    config.write_text(yaml.safe_dump(text))
    with pytest.raises(RuntimeError, match=r"(?s)round 2: node 101 did not reply.*Nothing of this step was "
                                           r"aggregated.*last checkpoint is (\S+\.ckpt)") as err:
        deploy_in_memory(config, 918273645, grid_class=LosingGrid)
    import re

    checkpoint = re.search(r"last checkpoint is (\S+\.ckpt)\. ", str(err.value)).group(1)
    assert Path(checkpoint).is_file() and checkpoint.endswith("run-7/epoch-1.ckpt")  # after round 2 (epoch 1)
    resumed, _ = deploy_in_memory(config, 918273645, resume_from=checkpoint)
    sites_after_resume = {f.name: json.loads(f.read_text()) for f in tmp_path.glob("lightning-dp-ledger-*.json")}
    simulated = simulate(config, 918273645)
    torch.testing.assert_close(resumed.hypotheses, simulated.hypotheses, rtol=1e-6, atol=1e-7)
    assert int(resumed.rounds) == 3
    assert resumed.ledger.as_dict() == pytest.approx(simulated.ledger.as_dict())
    if simulated.server_privacy.accountable:
        assert resumed.server_privacy.epsilon == simulated.server_privacy.epsilon
        assert resumed.server_privacy.accountant.history == simulated.server_privacy.accountant.history
    if simulated.releases_are_sanitized():  # the sites' ledgers: every client charged once per release
        spent: dict = {}
        for state in sites_after_resume.values():
            spent.update({c[0]: c[2] for c in state["client_ledger"]["clients"]})
        counted = {cid: simulated.ledger.participations(cid) for cid in simulated.ledger.as_dict()}
        assert spent == counted
    else:
        assert sites_after_resume == {}



class LateGrid(MemoryGrid):
    """Node 101 connects only after round 1's TRAIN messages went out (a SuperNode started late)."""

    def get_node_ids(self):
        started = any(m.metadata.message_type == "train" for m in self.sent)
        return [100, 101] if started else [100]


def test_a_late_node_joins_at_the_next_round_under_poisson_selection(tmp_path, monkeypatch):
    """min-nodes 1 of 2 partitions: the run starts with node 100; partition 1's clients decline (Poisson selection:
    inclusion probability 0, then q) until node 101 connects, which is asked for its clients before the next round's
    selection and trains from then on. The accountant's epsilon does not depend on who took part: the
    simulation's."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    config = tmp_path / "fedavg.yaml"
    text = yaml.safe_load((EXAMPLES / "fl_deploy_fedavg.yaml").read_text())
    text["trainer"]["logger"] = False
    config.write_text(yaml.safe_dump(text))
    deployed, grid = deploy_in_memory(config, 918273645, grid_class=LateGrid, min_nodes=1)
    trains = [(int(m.content["config"]["round"]), m.metadata.dst_node_id) for m in grid.sent
              if m.metadata.message_type == "train"]
    first = min(r for r, _ in trains)
    assert {n for r, n in trains if r == first} == {100}  # round 1: only the node that was there
    assert 101 in {n for r, n in trains if r > first}  # it trains from a later round on
    queries = [m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == "query"]
    assert queries == [100, 101]  # each asked for its clients once
    assert int(deployed.rounds) == 3
    ids = [c.client_id for c in deployed.clients.splits["train"]]
    assert not any(str(i).startswith("(no node yet)") for i in ids)  # the late node's ids replaced the placeholders
    simulated = simulate(config, 918273645)
    assert deployed.server_privacy.epsilon == simulated.server_privacy.epsilon


def test_a_late_node_is_refused_where_the_accounting_would_not_hold():
    from lightning_dp.federated import FederatedRound
    from lightning_dp.federated.parts import LocalDPSGD, PoissonSelection, UniformSelection
    from lightning_dp.models import LinearRegression

    assert server_side.late_nodes(FederatedRound(LinearRegression(), selection=PoissonSelection(0.2))) is None
    for module, why in ((FederatedRound(LinearRegression(), selection=UniformSelection(3)), "Poisson selection"),
                        (FederatedRound(LinearRegression(), selection=PoissonSelection(0.2),
                                        update=LocalDPSGD(target_epsilon=2.0)), "local_dp_sgd")):
        reason = server_side.late_nodes(module)
        assert why in reason
        report = {"positions": [0], "ids": ["c0"], "sizes": [3], "num-training-clients": 2, "numel": 2,
                  "task": "regression", "num-classes": -1, "num-groups": -1, "input-shape": [2]}
        with pytest.raises(RuntimeError, match=why):
            server_side.plan_clients({1: report}, 2, late_refused=reason)
