"""DPSGD under Lightning DDP with 2 CPU processes and gloo (a real `strategy="ddp"` launch)."""

import math
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import torch

from tests.helpers import blobs

# one xdist worker runs this module (--dist loadgroup, the README's command): its module fixtures are built once
pytestmark = pytest.mark.xdist_group("dp-sgd-ddp")

SCRIPT = Path(__file__).with_name("ddp_script.py")


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    uri = f"sqlite:///{out / 'mlflow.db'}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), uri], cwd=out, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    return ranks, uri


def test_noise_is_added_once_in_aggregate(ddp_run):
    """Zero per-sample gradients, so the summed gradient is the noise alone: std sigma*C/(qN) = 0.3.

    Noise added on each rank before the all-reduce would give 0.3*sqrt(2) = 0.42. With 10,100
    coordinates the sample std's relative standard error is 0.7%; 5% tolerance = 7 standard errors.
    """
    (r0, r1), _ = ddp_run
    assert r0["sample_rate"] == pytest.approx(0.1)
    assert torch.equal(r0["noise"], r1["noise"])  # every rank holds the same released gradient
    assert r0["noise"].std().item() == pytest.approx(2.0 * 3.0 / 20.0, rel=0.05)


def test_gradient_canaries_enter_the_aggregate_once_and_the_audit_runs_on_rank_zero(ddp_run):
    (r0, r1), _ = ddp_run
    grad = r0["canary_grad"]
    assert torch.equal(grad, r1["canary_grad"])
    values = grad[grad != 0]
    assert values.numel() > 0
    assert torch.allclose(values, torch.full_like(values, 3.0 / 20.0))  # added once; twice would be 0.3
    assert (r0["canary_scores"] == r1["canary_scores"]).all()
    assert r0["audit_result"] and not r1["audit_result"]


def test_accountant_and_parameters_identical_on_all_ranks(ddp_run):
    (r0, r1), _ = ddp_run
    assert r0["steps"] == r1["steps"] == 20  # 2 epochs x ceil(200 / 20)
    assert r0["history"] == r1["history"] == [(1.0, 0.1, 20)]
    assert r0["epsilon"] == r1["epsilon"] > 0
    assert torch.equal(r0["params"], r1["params"])


def test_each_rank_samples_its_own_shard(ddp_run):
    (r0, r1), _ = ddp_run
    data = blobs(200)
    index = {tuple(row.tolist()): i for i, row in enumerate(data.tensors[0])}
    seen = [set(), set()]
    for rank, r in enumerate((r0, r1)):
        for batch in r["batches"]:
            seen[rank].update(index[tuple(row.tolist())] for row in batch)
    assert all(i % 2 == 0 for i in seen[0]) and all(i % 2 == 1 for i in seen[1])
    total = sum(len(b) for r in (r0, r1) for b in r["batches"])
    # 20 steps x 200 examples x q=0.1: mean 400, sd sqrt(400 * 0.9) = 19; 6 sd tolerance
    assert abs(total - 400) < 6 * math.sqrt(400 * 0.9)


def test_one_mlflow_run_receives_each_metric_once(ddp_run):
    (r0, _), uri = ddp_run
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("ddp-test")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].info.run_id == r0["run_id"]
    history = client.get_metric_history(r0["run_id"], "privacy/epsilon")
    steps = [m.step for m in history]
    assert len(steps) == len(set(steps)) == 20
    assert history[-1].value == pytest.approx(r0["epsilon"], rel=1e-12)
    params = runs[0].data.params
    assert params["privacy/noise_multiplier"] == "1.0" and params["privacy/sample_rate"] == "0.1"


def test_adaptive_thresholds_agree_on_all_ranks(ddp_run):
    """Each rank holds half of the batch; the threshold update must use the all-reduced statistics.

    A rank that updated C from its own shard's q-sum or count would drift from the other one.
    """
    (r0, r1), _ = ddp_run
    for name in ("oso", "quantile"):
        a, b = r0["adaptive"][name], r1["adaptive"][name]
        assert len(a["trace"]) == 10 and a["trace"] == b["trace"], name
        assert len({c for _, c, _ in a["trace"]}) > 2, name  # the threshold moved
        assert a["history"] == b["history"] == [(1.0, 0.1, 10)], name
        assert torch.equal(a["params"], b["params"]), name
    assert len({lr for _, _, lr in r0["adaptive"]["oso"]["trace"]}) > 2  # OSO's learning rate moved too


def test_virtual_batches_release_the_unsplit_step_under_ddp(ddp_run):
    """accumulate_grad_batches=2 and max_physical_batch_size=3 on each of 2 ranks equal the unsplit DDP run (float64):
    each rank samples its shard's logical batch, clips its micro-batches and chunks, and the all-reduce happens once
    per logical step."""
    (r0, r1), _ = ddp_run
    for r in (r0, r1):
        unsplit, split = r["virtual"]["unsplit"], r["virtual"]["split"]
        assert split["steps"] == unsplit["steps"] == 20
        assert split["history"] == unsplit["history"] == [(1.0, 0.1, 20)]
        torch.testing.assert_close(split["params"], unsplit["params"], rtol=0, atol=1e-12)
    assert torch.equal(r0["virtual"]["split"]["params"], r1["virtual"]["split"]["params"])


def test_batches_of_one_shape_release_the_single_process_step_under_ddp(ddp_run):
    """Issue 53: max_batch_size=64 on 2 ranks (2 micro-batches of 16 rows each, chunks of 3), eager and with the
    private pass compiled. The truncated Poisson
    sample is ONE draw over the whole set, dealt out to the ranks, so the release equals a single process' with the
    same seed (float64), whatever the shards, and is accounted as the truncated event over N + 1 = 201 records with
    bound 64."""
    from dp_accounting import SelfComposedDpEvent, TruncatedSubsampledGaussianDpEvent
    from dp_accounting.pld import PLDAccountant
    import lightning as L

    from lightning_dp.callbacks import DPSGD
    from tests.helpers import Classifier

    torch.manual_seed(0)
    single = Classifier().double()
    cb = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=8, max_batch_size=64)
    x, y = blobs(200).tensors
    L.Trainer(max_epochs=2, logger=False, callbacks=[cb], accelerator="cpu", devices=1, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False).fit(
        single, train_dataloaders=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.double(), y),
                                                              batch_size=20))
    params = torch.cat([p.detach().reshape(-1) for p in single.parameters()])
    (r0, r1), _ = ddp_run
    library = PLDAccountant().compose(SelfComposedDpEvent(TruncatedSubsampledGaussianDpEvent(201, 0.1, 64, 1.0),
                                                          20)).get_epsilon(1e-5)
    for r in (r0, r1):
        static = r["virtual"]["static"]
        assert static["steps"] == 20 and static["history"] == r["virtual"]["unsplit"]["history"] == cb.accountant.history
        assert static["truncation"] == cb.accountant.truncation == (201, 64)
        torch.testing.assert_close(static["params"], params, rtol=0, atol=1e-12)
        assert static["epsilon"] == pytest.approx(library, rel=1e-9) and cb.epsilon == static["epsilon"]
        # the compiled private pass (DPSGD(compile_step=...)) releases the same steps under DDP
        compiled = r["virtual"]["compiled"]
        assert compiled["steps"] == 20 and compiled["history"] == static["history"]
        torch.testing.assert_close(compiled["params"], params, rtol=0, atol=1e-12)


def test_user_sampling_shards_users_and_releases_one_step_on_every_rank(ddp_run):
    """Issue 51: under DDP rank r samples users r, r + 2, ... with all their kept records; the users' clipped means
    are summed over ranks once and every rank applies the same release."""
    (r0, r1), _ = ddp_run
    a, b = r0["uls"], r1["uls"]
    assert torch.equal(a["params"], b["params"]) and a["history"] == b["history"]
    assert a["history"] == [(1.0, 6 / 30, a["steps"])]  # 3 users per rank x 2 ranks of 30
    assert all(u % 2 == 0 for batch in a["users"] for u in batch)
    assert all(u % 2 == 1 for batch in b["users"] for u in batch)
