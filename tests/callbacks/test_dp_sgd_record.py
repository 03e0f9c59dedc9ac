"""What DPSGD writes to the record (lightning_dp/callbacks/dp_sgd_record.py), as pure functions."""

import math

from lightning_dp.callbacks import dp_sgd_record
from lightning_dp.callbacks.clipping import FixedClip, QuantileClip
from lightning_dp.privacy.planning import DataFacts

DATA = DataFacts.of(dataset_size=1000, batch_size=50, world_size=1, parts=2, poisson_sampling=True)


def _params(clipping, **kw):
    args = dict(sigma=1.1, clipping=clipping, target_epsilon=3.0, target_delta=1e-5, accountant="pld",
                poisson_sampling=True, adjacency="add_remove", data=DATA, planned=100, max_physical_batch_size=None,
                strategy_params={})
    args.update(kw)
    return dp_sgd_record.hyperparams(**args)


def test_hyperparams_are_the_public_configuration():
    params = _params(FixedClip(0.7))
    assert params["privacy/noise_multiplier"] == 1.1 and params["privacy/max_grad_norm"] == 0.7
    assert params["privacy/sample_rate"] == 0.1 and params["privacy/expected_batch_size"] == 100
    assert params["privacy/accumulate_grad_batches"] == 2 and params["privacy/adjacency"] == "add/remove"


def test_an_adaptive_threshold_is_not_a_param():
    params = _params(QuantileClip(), adjacency="replace", strategy_params={"privacy/initial_clip": 1.0})
    assert "privacy/max_grad_norm" not in params and params["privacy/initial_clip"] == 1.0
    assert params["privacy/adjacency"] == "replacement"


def test_summary_rows_say_how_the_run_ended():
    args = dict(epsilon=2.5, target_epsilon=3.0, target_delta=1e-5, accountant="pld", adjacency="add_remove",
                poisson_sampling=True, data=DATA, rate_varies=True, sigma=1.1, sigma_source="given",
                clipping=FixedClip(0.7), max_physical_batch_size=64, budget_stop=40, plan_done=False)
    rows = dict(dp_sgd_record.summary_rows(**args))
    assert rows["epsilon"] == "2.5 of target_epsilon 3 at delta 1e-05 (pld, add/remove adjacency)"
    assert rows["sample rate q"].endswith("; changed during the run)")
    assert rows["virtual batches"].startswith("2 micro-batch(es) per step, at most 64 examples per pass")
    assert rows["stopped"] == "after step 40: by the budget (the next step would exceed target_epsilon)"
    args.update(target_epsilon=None, poisson_sampling=False, budget_stop=None, max_physical_batch_size=None,
                data=DataFacts.of(dataset_size=1000, batch_size=50, world_size=1, parts=1, poisson_sampling=False,
                                  batches_per_epoch=20))
    rows = dict(dp_sgd_record.summary_rows(**args))
    assert rows["epsilon"].endswith("(no target_epsilon) (pld, add/remove adjacency)")
    assert rows["batches"].startswith("shuffled, 50 of N = 1000") and "stopped" not in rows
    assert "virtual batches" not in rows


def test_figures_of_the_spend_and_of_an_adaptive_threshold():
    assert dp_sgd_record.figures([], target_delta=1e-5, sigma=1.0, clipping=FixedClip(1.0)) == []
    (fixed,) = dp_sgd_record.figures([(1, 0.1), (2, 0.2)], target_delta=1e-5, sigma=1.0, clipping=FixedClip(1.0))
    assert fixed[1] == "privacy/epsilon.png"
    clip = QuantileClip()
    clip.trace = [(1, 1.0, math.nan), (2, 0.5, math.nan)]
    names = [name for _, name in dp_sgd_record.figures([(1, 0.1)], target_delta=1e-5, sigma=1.0, clipping=clip)]
    assert names == ["privacy/epsilon.png", "privacy/max_grad_norm.png"]
