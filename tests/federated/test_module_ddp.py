"""The federated round sharded across 2 DDP processes (gloo) equals the same run in one process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# one xdist worker runs this module (--dist loadgroup, the README's command): its module fixtures are built once
pytestmark = pytest.mark.xdist_group("module-ddp")

SCRIPT = Path(__file__).with_name("ddp_script.py")


def run(out: Path, devices: int, *mode: str) -> list[dict]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), str(devices), *mode], cwd=out, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(devices)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ddp"), 2), run(tmp_path_factory.mktemp("single"), 1)[0]


def test_two_processes_equal_one(runs):
    """Clients sharded 4 + 3 per round, releases gathered: hypotheses, losses and ledger as in one process.

    Every client's shuffles and noise come from its own (seed, round, client) streams, so the
    shard a client lands in changes nothing; the tolerance only covers float summation order.
    """
    (r0, r1), single = runs
    assert r0["rounds"] == r1["rounds"] == single["rounds"] == 6
    torch.testing.assert_close(r0["hypotheses"], single["hypotheses"], rtol=1e-6, atol=1e-6)
    assert r0["train"] == pytest.approx(single["train"], rel=1e-6)
    assert r0["val"] == pytest.approx(single["val"], rel=1e-6) and len(r0["val"]) == 2
    assert r0["ledger"] == single["ledger"]


def test_all_processes_hold_the_same_state(runs):
    (r0, r1), _ = runs
    assert torch.equal(r0["hypotheses"], r1["hypotheses"])
    assert r0["ledger"] == r1["ledger"] and r0["val"] == r1["val"] and r0["train"] == r1["train"]


def test_fairness_metrics_of_two_processes_equal_one(tmp_path_factory):
    """Test clients sharded 4 + 3: accuracy and every group-fairness output (per-group counts summed by
    GroupFairness's DDP sync) equal the single-process run's, on both ranks."""
    r0, r1 = run(tmp_path_factory.mktemp("ddp_fair"), 2, "fairness")
    single = run(tmp_path_factory.mktemp("single_fair"), 1, "fairness")[0]
    names = single["test"]
    assert "test/acc" in names and "test/fairness/equalized_odds_difference" in names
    assert "test/fairness/count/group_1" in names
    for r in (r0, r1):
        assert r["test"].keys() == names.keys()
        for name, value in names.items():
            assert r["test"][name] == pytest.approx(value, rel=1e-6, abs=1e-9), name


def test_default_secret_seeds_are_shared_by_all_processes(tmp_path_factory):
    """seed and noise_seed left to their defaults are drawn in each process: rank 0's must win everywhere,
    or the processes would sample different clients and disagree on the hypotheses."""
    r0, r1 = run(tmp_path_factory.mktemp("ddp_secret"), 2, "secret")
    assert torch.equal(r0["hypotheses"], r1["hypotheses"]) and r0["ledger"] == r1["ledger"]


def test_dp_fedavg_on_two_processes_equals_one(tmp_path_factory):
    """Poisson-selected clients sharded over 2 processes, clipped and noised once after the gather (the noise from
    the secret seed, the same on both ranks): the global model, the threshold and the accountant of one process."""
    r0, r1 = run(tmp_path_factory.mktemp("ddp_fedavg"), 2, "fedavg")
    single = run(tmp_path_factory.mktemp("single_fedavg"), 1, "fedavg")[0]
    torch.testing.assert_close(r0["hypotheses"], single["hypotheses"], rtol=1e-6, atol=1e-7)
    assert torch.equal(r0["hypotheses"], r1["hypotheses"])
    assert r0["server"]["accountant"] == single["server"]["accountant"] == r1["server"]["accountant"]
    assert r0["server"]["clip"] == pytest.approx(single["server"]["clip"], rel=1e-9)


def test_dp_fedavg_over_a_population_on_two_processes_equals_one(tmp_path_factory):
    """A population's clients are built where they train (each process its shard's rows) and shuffled by hashed
    keys of (seed, round, epoch, client, position): the run of one process, as for client lists."""
    r0, r1 = run(tmp_path_factory.mktemp("ddp_population"), 2, "population")
    single = run(tmp_path_factory.mktemp("single_population"), 1, "population")[0]
    torch.testing.assert_close(r0["hypotheses"], single["hypotheses"], rtol=1e-6, atol=1e-7)
    assert torch.equal(r0["hypotheses"], r1["hypotheses"]) and r0["train"] == pytest.approx(single["train"])
    assert r0["server"]["accountant"] == single["server"]["accountant"]


def test_local_dp_sgd_on_two_processes_equals_one(tmp_path_factory):
    """Record-level DP-SGD: every client draws its batches and noise from its own secret generator, so sharding the
    clients over 2 processes changes nothing; both processes charge the same per-client ledger."""
    r0, r1 = run(tmp_path_factory.mktemp("ddp_local_dp"), 2, "local_dp_sgd")
    single = run(tmp_path_factory.mktemp("single_local_dp"), 1, "local_dp_sgd")[0]
    torch.testing.assert_close(r0["hypotheses"], single["hypotheses"], rtol=1e-6, atol=1e-7)
    assert torch.equal(r0["hypotheses"], r1["hypotheses"])
    assert r0["update"] == r1["update"] == single["update"]


def test_pfa_with_per_client_budgets_on_two_processes_equals_one(tmp_path_factory):
    """Personal budgets, local DP-SGD and PFA+ (centred, indirect split): the split, the subspace and the model of two
    processes equal one process's."""
    r0, r1 = run(tmp_path_factory.mktemp("ddp_pfa"), 2, "pfa")
    single = run(tmp_path_factory.mktemp("single_pfa"), 1, "pfa")[0]
    torch.testing.assert_close(r0["hypotheses"], single["hypotheses"], rtol=1e-6, atol=1e-7)
    assert torch.equal(r0["hypotheses"], r1["hypotheses"])
    assert r0["update"] == r1["update"] == single["update"]
    assert r0["aggregator"]["split"] == single["aggregator"]["split"]


def test_a_process_that_fails_in_validation_stops_the_others(tmp_path):
    """Rank 1 raises inside its validation sums: rank 0 does not wait in the all-reduce forever, it fails too (gloo
    closes the dead peer's connection; training fails alike, checked by hand with ``fail_train``)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "2", "fail_eval"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "planted failure in eval on rank 1" in proc.stderr
    assert "[rank0]" in proc.stderr and "Connection closed by peer" in proc.stderr
