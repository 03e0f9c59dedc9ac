"""The round on Flower's Deployment Engine, each side a process on localhost: a SuperLink, two SuperNodes
(tests/flower/localhost.py), ``lightning-dp flower-app`` then ``flwr run``. DP-FedAvg and the d-privacy
personalized round end with the simulation's model, epsilon and ledger for the same seeds, the server records
the run in MLflow, and the server's secret appears nowhere outside the server."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.flower.localhost import LocalDeployment
from tests.flower.test_protocol import EXAMPLES, simulate

# one xdist worker runs this module (--dist loadgroup, the README's command): the deployment is built once
pytestmark = [pytest.mark.skipif(shutil.which("flower-superlink") is None, reason="Flower's CLI is not installed"),
              pytest.mark.xdist_group("flower-deployment")]

SECRET = 918273645  # distinctive: searched for in what the SuperLink and MLflow hold
CONFIGS = ["fl_deploy_fedavg.yaml", "fl_deploy_personalized.yaml"]


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    from lightning_dp.flower.app import write_app

    root = tmp_path_factory.mktemp("flower")
    nodes = [f"partition-id={p} num-partitions=2 noise-seed={SECRET}" for p in range(2)]
    results = {}
    env = {"LIGHTNING_DP_NOISE_SEED": str(SECRET), "MLFLOW_TRACKING_URI": f"sqlite:///{root}/server-mlflow.db"}
    with LocalDeployment(root, nodes, env=env) as deployment:
        for name in CONFIGS:
            app = root / name.removesuffix(".yaml")
            write_app(EXAMPLES / name, app, min_nodes=2, node_timeout=300, save_to=str(root / f"{app.name}.pt"))
            status, log = deployment.run(app, timeout=500)
            assert status == "finished:completed", log[-3000:] + deployment.log_tail()
            results[name] = torch.load(root / f"{app.name}.pt")
        superlink_log = (root / "logs" / "superlink.log").read_text()
    return root, results, superlink_log


@pytest.mark.parametrize("name", CONFIGS)
def test_the_deployment_ends_with_the_simulations_model_and_epsilon(name, deployed, tmp_path, monkeypatch):
    root, results, _ = deployed
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    simulated = simulate(EXAMPLES / name, SECRET)
    result = results[name]
    assert result["nodes"] == 2 and result["clients"] == 40 and result["rounds"] == 3
    torch.testing.assert_close(result["hypotheses"], simulated.hypotheses, rtol=1e-6, atol=1e-7)
    if simulated.server_privacy.accountable:  # DP-FedAvg: the same accountant; the ledger stays on the server
        assert result["epsilon"] == simulated.server_privacy.epsilon and result["ledger"] is None
    else:  # the personalized round: every participation's n / nu charged as in simulation
        assert result["ledger"] == pytest.approx(simulated.ledger.as_dict())


def test_the_server_records_the_run_and_its_secret_stays_on_the_server(deployed):
    import mlflow

    root, results, superlink_log = deployed
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{root}/server-mlflow.db")
    (experiment,) = [e for e in client.search_experiments() if e.name == "fl-deploy"]
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert set(runs) == {"dp-fedavg", "personalized-nu5"}
    assert runs["dp-fedavg"].data.metrics["privacy/epsilon"] > 0
    assert "privacy/client_epsilon_max" in runs["personalized-nu5"].data.metrics
    # validation on the nodes' validation clients (EVALUATE messages over real processes), logged by the server
    assert all("val/loss" in run.data.metrics for run in runs.values())
    # the server's noise seed: in no param, tag or metric of the record, nor in what the SuperLink logged
    for run in runs.values():
        assert str(SECRET) not in repr((run.data.params, run.data.tags))
    assert str(SECRET) not in superlink_log
    # the d-privacy round's releases are sanitized on the sites: each SuperNode kept its own ledger in its working
    # directory (the central-DP run before it left none), and together they hold what the server's ledger holds
    import json

    from lightning_dp.privacy.ledger import PrivacyLedger

    union: dict = {}
    for p in range(2):
        part = PrivacyLedger()
        part.load_state_dict(json.loads((root / f"lightning-dp-ledger-partition-{p}.json").read_text())["client_ledger"])
        union.update(part.as_dict())
    assert union and union == pytest.approx(results["fl_deploy_personalized.yaml"]["ledger"])
    for app in ("fl_deploy_fedavg", "fl_deploy_personalized"):
        assert str(SECRET) not in (root / app / "pyproject.toml").read_text()


def test_sites_with_their_own_data_train_together_over_processes(tmp_path_factory, monkeypatch):
    """Two SuperNodes started as a consortium's sites are (`site="..."`, each its own data through a `data.*`
    node-config entry, TOML-quoted as Flower reads it; one noise seed given to both): the run completes over the
    union of their clients with the simulation's epsilon (a function of q, z and the rounds only)."""
    import yaml

    from lightning_dp.flower.app import write_app

    root = tmp_path_factory.mktemp("flower-sites")
    text = yaml.safe_load((EXAMPLES / "fl_deploy_fedavg.yaml").read_text())
    text["data"] = {"class_path": "tests.flower.sites.SiteMixture", "init_args": {**text["data"]["init_args"]}}
    text["trainer"]["logger"] = False
    config = root / "sites.yaml"
    config.write_text(yaml.safe_dump(text))
    nodes = ['site="austin" data.site="a" noise-seed=5', 'site="boston" data.site="b" data.seed=1 noise-seed=5']
    repo = str(Path(__file__).resolve().parents[2])  # the ServerApp and ClientApps import tests.flower.sites
    env = {"LIGHTNING_DP_NOISE_SEED": str(SECRET), "PYTHONPATH": repo}
    app = root / "sites"
    with LocalDeployment(root, nodes, env=env) as deployment:
        write_app(config, app, min_nodes=2, node_timeout=300, save_to=str(root / "sites.pt"))
        status, log = deployment.run(app, timeout=500)
        assert status == "finished:completed", log[-3000:] + deployment.log_tail()
    result = torch.load(root / "sites.pt")
    assert result["nodes"] == 2 and result["clients"] == 80 and result["rounds"] == 3
    monkeypatch.chdir(root)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root}/mlflow.db")
    simulated = simulate(config, SECRET)  # site "a"'s 40 clients alone: another model, the same spend
    assert result["epsilon"] == simulated.server_privacy.epsilon
    assert not torch.allclose(result["hypotheses"], simulated.hypotheses)


def test_local_dp_sgd_trains_on_a_deployment_with_each_sites_own_ledger(tmp_path_factory, monkeypatch):
    """Record-level DP-SGD inside the clients over processes (issue 52, item 3): each site plans and trains its
    clients, charges its own ledger file (named by its node config, TOML-quoted) before its updates leave; the run
    ends with the simulation's model and record-level ledger, which the two sites' files hold between them."""
    import json

    from lightning_dp.flower.app import write_app
    from lightning_dp.privacy.ledger import RecordLedger

    root = tmp_path_factory.mktemp("flower-local-dpsgd")
    nodes = [f'partition-id={p} num-partitions=2 noise-seed={SECRET} ledger="{root}/site{p}/ledger.json"'
             for p in range(2)]
    app = root / "local-dpsgd-app"  # not "local": flwr would read the connection name as this folder
    with LocalDeployment(root, nodes, env={"LIGHTNING_DP_NOISE_SEED": str(SECRET),
                                           "MLFLOW_TRACKING_URI": f"sqlite:///{root}/mlflow.db"}) as deployment:
        write_app(EXAMPLES / "fl_deploy_local_dpsgd.yaml", app, min_nodes=2, node_timeout=300,
                  save_to=str(root / "local.pt"))
        status, log = deployment.run(app, timeout=500)
        assert status == "finished:completed", log[-3000:] + deployment.log_tail()
        node_logs = [(root / "logs" / f"supernode{p}.log").read_text() for p in range(2)]
    result = torch.load(root / "local.pt")
    monkeypatch.chdir(tmp_path_factory.mktemp("sim"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root}/sim.db")
    simulated = simulate(EXAMPLES / "fl_deploy_local_dpsgd.yaml", SECRET)
    torch.testing.assert_close(result["hypotheses"], simulated.hypotheses, rtol=1e-6, atol=1e-7)
    assert result["record_ledger"] == pytest.approx(simulated.update.ledger.as_dict())
    union: dict = {}
    for p in range(2):
        state = json.loads((root / f"site{p}" / "ledger.json").read_text())
        part = RecordLedger(simulated.update.delta, simulated.update.accountant, simulated.update.adjacency)
        part.load_state_dict(state["record_ledger"])
        assert not set(union) & set(part.as_dict())
        union.update(part.as_dict())
        assert "record-level epsilon max" in node_logs[p]  # the site reports its own account in its log
    assert union == pytest.approx(simulated.update.ledger.as_dict())
    assert not list(root.glob("lightning-dp-ledger-*.json"))  # the named files, not the default ones
