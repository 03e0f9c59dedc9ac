"""A client whose data is broken (issue 49): one NaN or +inf feature in one example of client 0.

Before, DP-FedAvg averaged the client's NaN update into the released model (NaN from the client's first round on:
the release told D' from D with certainty) and the personalized round stopped with a ValueError (the stop told the
same). Now the update is dropped (its contribution is zero; lightning_dp/privacy/finite.py), the round is released
and accounted as planned, and the count is ``nonprivate/dropped_updates``. Under record-level DP (local DP-SGD) the
unit is the example: only its gradient is dropped, the client still trains. The same on every preset through the
CLI: tests/test_neighbouring_records.py; a Flower node replying NaN: tests/flower/test_protocol.py.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from lightning_dp.datamodules import SyntheticLinearMixtureDataModule
from lightning_dp.federated import FederatedRound
from lightning_dp.federated.parts import (
    CentralGaussian,
    ClipSanitizer,
    EuclideanLaplace,
    FedAvg,
    GaussianLocalDP,
    KMeans,
    LocalDPSGD,
    LocalSGD,
    PoissonSelection,
    UniformSelection,
)
from lightning_dp.models import LinearRegression
from tests.helpers import RecordingLogger


class Broken(SyntheticLinearMixtureDataModule):
    """The synthetic mixture with client 0's example 0's first feature set to ``value`` (None: unchanged)."""

    def __init__(self, value=None, **kwargs):
        super().__init__(num_clients=20, seed=0, **kwargs)
        self.value = value

    def setup(self, stage=None):
        super().setup(stage)
        if self.value is not None:
            self.train_clients[0].x[0, 0] = self.value


def dp_fedavg(engine="auto"):
    return dict(selection=PoissonSelection(0.9), update=LocalSGD(epochs=1, lr=0.1, batch_size=10, engine=engine),
                sanitizer=ClipSanitizer(1.0), aggregator=FedAvg(),
                server_privacy=CentralGaussian(noise_multiplier=1.0, clip=1.0))


PRESETS = {
    "dp-fedavg-dense": lambda: dp_fedavg("dense"),
    "dp-fedavg-vmap": lambda: dp_fedavg("vmap"),
    "dp-fedavg-loop": lambda: dp_fedavg("loop"),
    "d-privacy-ifca": lambda: dict(num_hypotheses=2, selection=UniformSelection(18), sanitizer=EuclideanLaplace(1.0),
                                   update=LocalSGD(epochs=1, lr=0.1, batch_size=10), aggregator=KMeans()),
    "local-dp-gaussian": lambda: dict(selection=UniformSelection(18), sanitizer=GaussianLocalDP(1.0, clip=1.0),
                                      update=LocalSGD(epochs=1, lr=0.1, batch_size=10), aggregator=FedAvg()),
    "no-sanitizer": lambda: dict(selection=UniformSelection(18), update=LocalSGD(epochs=1, lr=0.1, batch_size=10)),
}


def fit(parts, value, rounds=4, nonprivate=True):
    module = FederatedRound(LinearRegression(), seed=0, noise_seed=1, log_nonprivate_metrics=nonprivate, **parts)
    logger = RecordingLogger()
    L.Trainer(logger=logger, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              accelerator="cpu", devices=1, max_epochs=rounds, num_sanity_val_steps=0, limit_val_batches=0,
              log_every_n_steps=1).fit(module, Broken(value))
    return module, logger


@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_broken_client_contributes_a_zero_update_and_the_run_goes_on(preset):
    clean, clean_log = fit(PRESETS[preset](), None)
    nan, nan_log = fit(PRESETS[preset](), math.nan)
    inf, _ = fit(PRESETS[preset](), math.inf)
    assert int(nan.rounds) == int(inf.rounds) == 4
    assert bool(torch.isfinite(nan.hypotheses).all())
    # NaN and inf both drop the client's update: the same zero update, so the same releases to the bit
    torch.testing.assert_close(nan.hypotheses, inf.hypotheses, rtol=0, atol=0)
    assert not torch.equal(nan.hypotheses, clean.hypotheses)  # the client took part: its update is gone
    # released and accounted as planned: the same ledger, the same client-level epsilon
    assert nan.ledger.as_dict() == clean.ledger.as_dict()
    if clean.server_privacy.accountable:
        assert nan.server_privacy.epsilon == clean.server_privacy.epsilon
    assert all(math.isfinite(float(v)) for _, m in nan_log.calls for v in m.values())
    # how many were dropped is an exact statistic of the data: nonprivate/ only, and there only when it happened
    assert sum(nan_log.series("nonprivate/dropped_updates")) >= 1
    assert not clean_log.series("nonprivate/dropped_updates")
    _, quiet = fit(PRESETS[preset](), math.nan, nonprivate=False)
    assert not [name for name in quiet.names() if name.startswith("nonprivate/")]


def test_under_record_level_dp_only_the_example_is_dropped():
    """Local DP-SGD: the unit of privacy is a record, so the broken example's gradient becomes zero (as DPSGD drops
    a non-finite example) and the client still releases its noisy training: a release equal to its start would tell
    D' from D."""
    def parts():
        return dict(selection=UniformSelection(20), aggregator=FedAvg(),
                    update=LocalDPSGD(epochs=2, lr=0.1, batch_size=5, max_grad_norm=1.0, noise_multiplier=1.0))

    clean, _ = fit(parts(), None, rounds=2)
    nan, nan_log = fit(parts(), math.nan, rounds=2)
    inf, _ = fit(parts(), math.inf, rounds=2)
    assert bool(torch.isfinite(nan.hypotheses).all())
    torch.testing.assert_close(nan.hypotheses, inf.hypotheses, rtol=0, atol=0)
    assert not torch.equal(nan.hypotheses, clean.hypotheses)
    assert not nan_log.series("nonprivate/dropped_updates")  # no client update was dropped


def test_the_examples_gradient_is_dropped_inside_local_dp_sgd():
    from lightning_dp.federated.local import FlatParams
    from lightning_dp.federated.local_dp_sgd import ClientPlan, local_dp_sgd
    from lightning_dp.privacy.noise import derive_secret_generator

    model = LinearRegression()
    spec = FlatParams.of(model)
    x, y = torch.randn(2, 6, 2), torch.randn(2, 6)
    mask = torch.ones(2, 6, dtype=torch.bool)
    start = spec.flatten(model).expand(2, -1).clone()

    def run(value, engine):
        xs = x.clone()
        if value is not None:
            xs[0, 0, 0] = value
        return local_dp_sgd(model, spec, start, xs, y, mask, plans=[ClientPlan(3, 1.0, 1.0)] * 2,
                            generators=[derive_secret_generator(5, 1, c) for c in range(2)], batch_size=6,
                            max_grad_norm=1.0, lr=0.1, loss="rmse", engine=engine)

    for engine in ("vmap", "loop"):
        nan, inf = run(math.nan, engine), run(math.inf, engine)
        assert bool(torch.isfinite(nan).all())
        torch.testing.assert_close(nan, inf, rtol=0, atol=0)
        torch.testing.assert_close(nan[1], run(None, engine)[1], rtol=0, atol=0)  # the other client: unchanged
    torch.testing.assert_close(run(math.nan, "vmap"), run(math.nan, "loop"))
