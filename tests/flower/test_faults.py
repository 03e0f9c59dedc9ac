"""Faults on a real deployment (issue 52, item 4), over processes on localhost: a SuperNode killed mid-run (SIGKILL:
no goodbye), the server's stop, the node restarted and the run resumed from the server's checkpoint, which ends with
the model and epsilon of an uninterrupted one (the simulation's, for the same seeds); a SuperNode started after the
run, which joins at the next round. The same in one process, with the sites' own ledgers:
tests/flower/test_protocol.py (a lost node, a late node)."""

from __future__ import annotations

import re
import shutil
import time

import pytest
import torch

from tests.flower.localhost import LocalDeployment
from tests.flower.test_protocol import EXAMPLES, simulate

pytestmark = [pytest.mark.skipif(shutil.which("flower-superlink") is None, reason="Flower's CLI is not installed"),
              pytest.mark.xdist_group("flower-deployment")]

SECRET = 918273645


def test_a_killed_node_stops_the_run_and_the_resumed_run_ends_as_an_uninterrupted_one(tmp_path, monkeypatch):
    from lightning_dp.flower.app import write_app

    nodes = [f"partition-id={p} num-partitions=2 noise-seed={SECRET}" for p in range(2)]
    env = {"LIGHTNING_DP_NOISE_SEED": str(SECRET), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    with LocalDeployment(tmp_path, nodes, env=env) as deployment:
        app = tmp_path / "first"
        write_app(EXAMPLES / "fl_deploy_fedavg.yaml", app, min_nodes=2, node_timeout=300)
        run_id = deployment.start_run(app)
        log1 = tmp_path / "logs" / "supernode1.log"
        end = time.monotonic() + 300
        # node 1 received round 2's message: round 1 is complete and checkpointed (its reply is in), and node 1
        # dies before it answers round 2 (a ClientApp process takes seconds to start)
        while log1.read_text().count("Receiving: train message") < 2:
            assert time.monotonic() < end, deployment.log_tail()
            time.sleep(0.2)
        deployment.kill_node(1)
        status, log = deployment.wait(run_id, timeout=400)
        assert status == "finished:failed", log[-3000:] + deployment.log_tail()
        assert "Nothing of this step was aggregated or accounted by the server" in log, log[-3000:]
        found = re.search(r"last checkpoint is (\S+\.ckpt)\. ", log)
        assert found, log[-3000:]
        checkpoint = found.group(1)
        deployment.start_node(1, log_name="supernode1-restarted")  # the site comes back (a new node id)
        resumed = tmp_path / "resumed"
        write_app(EXAMPLES / "fl_deploy_fedavg.yaml", resumed, min_nodes=2, node_timeout=300,
                  save_to=str(tmp_path / "resumed.pt"), resume_from=checkpoint)
        status, log = deployment.run(resumed, timeout=500)
        assert status == "finished:completed", log[-3000:] + deployment.log_tail()
        assert f"resuming from {checkpoint}" in log
    result = torch.load(tmp_path / "resumed.pt")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/sim.db")
    simulated = simulate(EXAMPLES / "fl_deploy_fedavg.yaml", SECRET)
    assert result["rounds"] == 3
    torch.testing.assert_close(result["hypotheses"], simulated.hypotheses, rtol=1e-6, atol=1e-7)
    assert result["epsilon"] == simulated.server_privacy.epsilon


def test_a_node_started_late_joins_at_the_next_round(tmp_path, monkeypatch):
    """Two partitions, min-nodes 1: the run starts with SuperNode 0; SuperNode 1 is started once node 0 has
    answered a round, is asked for its clients before a later round and trains in it. DP-FedAvg's Poisson
    selection keeps the accounting valid (partition 1's clients declined until then): the simulation's epsilon."""
    from lightning_dp.flower.app import write_app

    nodes = [f"partition-id={p} num-partitions=2 noise-seed={SECRET}" for p in range(2)]
    env = {"LIGHTNING_DP_NOISE_SEED": str(SECRET), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    with LocalDeployment(tmp_path, nodes, env=env, started=[0]) as deployment:
        app = tmp_path / "late"
        write_app(EXAMPLES / "fl_deploy_fedavg.yaml", app, min_nodes=1, node_timeout=300,
                  save_to=str(tmp_path / "late.pt"))
        run_id = deployment.start_run(app)
        log0 = tmp_path / "logs" / "supernode0.log"
        end = time.monotonic() + 300
        while "Sending: train message" not in log0.read_text():
            assert time.monotonic() < end, deployment.log_tail()
            time.sleep(0.5)
        deployment.start_node(1)
        status, log = deployment.wait(run_id, timeout=500)
        assert status == "finished:completed", log[-3000:] + deployment.log_tail()
        late_log = (tmp_path / "logs" / "supernode1.log").read_text()
    assert "clients have no node yet" in log and "joined: it serves 20 training clients" in log, log[-3000:]
    assert "Receiving: train message" in late_log
    result = torch.load(tmp_path / "late.pt")
    assert result["rounds"] == 3
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/sim.db")
    assert result["epsilon"] == simulate(EXAMPLES / "fl_deploy_fedavg.yaml", SECRET).server_privacy.epsilon
