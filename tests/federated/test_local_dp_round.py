"""Local DP in the federated round: clip, Gaussian and Laplace local DP, and the sector sanitizer
(upper, lower and angular clipping) with per-client ledgers."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dp.datamodules import SyntheticLinearMixtureDataModule
from lightning_dp.federated import FederatedRound
from lightning_dp.federated.parts import (
    ClipSanitizer,
    GaussianLocalDP,
    LaplaceLocalDP,
    LocalSGD,
    SectorSanitizer,
    UniformSelection,
)
from lightning_dp.models import LinearRegression
from lightning_dp.privacy.ledger import GaussianLedger, PrivacyLedger
from lightning_dp.privacy.local_dp import gaussian_epsilon, sector_diameter
from tests.helpers import ACCELERATORS, DEVICE

CLIENTS = 100  # SyntheticLinearMixtureDataModule's training clients


def round_with(sanitizer, *, clients_per_round=CLIENTS, **kwargs):
    return FederatedRound(LinearRegression(), selection=UniformSelection(clients_per_round),
                          update=LocalSGD(epochs=1, lr=0.1, batch_size=10), sanitizer=sanitizer, aggregator="fedavg",
                          seed=0, noise_seed=1, **kwargs)


def trainer(**kwargs):
    defaults = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    accelerator="cpu", devices=1, max_epochs=3, num_sanity_val_steps=0, limit_val_batches=0)
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def _large_update(dim=40_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    start = torch.randn(dim, generator=g)
    return start, start + torch.randn(dim, generator=g) * 0.1


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_gaussian_local_dp_adds_noise_of_std_z_c_to_the_clipped_update(accelerator):
    """std of (release - start - clipped update) over 40 000 coordinates: within 2% of z C (the sample std's
    relative error is about 0.35% here, so 2% is over five standard errors); on a GPU from its own generator."""
    device = DEVICE[accelerator]
    sanitizer = GaussianLocalDP(noise_multiplier=1.5, clip=0.2)
    start, trained = (t.to(device) for t in _large_update())
    out = sanitizer.sanitize(trained, start, generator=torch.Generator(device).manual_seed(1),
                             layer_sizes=[start.numel()])
    assert out.released.device.type == device
    delta = trained - start
    clipped = delta * min(1.0, 0.2 / float(delta.norm()))
    noise = out.released - start - clipped
    assert float(noise.std()) == pytest.approx(1.5 * 0.2, rel=0.02)
    assert abs(float(noise.mean())) < 5 * 0.3 / math.sqrt(start.numel())
    assert out.cost == pytest.approx(4 / 1.5**2)  # multiplier z C / (2C) = z / 2
    assert out.epsilon == pytest.approx(gaussian_epsilon(0.75, 1e-5))


def test_a_tiny_noise_multiplier_releases_and_reports_a_huge_epsilon_instead_of_exhausting_memory():
    """z = 0.001: the release's single Gaussian has multiplier 5e-4, whose PLD asked for 301 GB; the analytic
    epsilon (about 2e6) is reported instead, and the ledger composes the same way."""
    sanitizer = GaussianLocalDP(noise_multiplier=0.001, clip=0.2)
    start, trained = _large_update()
    out = sanitizer.sanitize(trained, start, generator=torch.Generator().manual_seed(1), layer_sizes=[start.numel()])
    assert 1e6 < out.epsilon < math.inf
    ledger = sanitizer.make_ledger()
    ledger.charge("a", out.cost)
    assert ledger.spent("a") == pytest.approx(out.epsilon, rel=1e-9)


def test_laplace_local_dp_adds_laplace_noise_to_the_l1_clipped_update():
    sanitizer = LaplaceLocalDP(noise_multiplier=4.0, clip=0.5)
    start, trained = _large_update()
    out = sanitizer.sanitize(trained, start, generator=torch.Generator().manual_seed(1), layer_sizes=[start.numel()])
    delta = trained - start
    clipped = delta * min(1.0, 0.5 * (1 - 1e-6) / float(delta.abs().sum()))
    noise = out.released - start - clipped
    assert float(noise.abs().mean()) == pytest.approx(4.0 * 0.5, rel=0.02)  # E|Laplace(b)| = b
    assert out.cost == out.epsilon == 0.5  # 2 / lambda, pure


def test_every_participation_is_charged_and_the_ledger_is_the_exact_gaussian_composition():
    sanitizer = GaussianLocalDP(noise_multiplier=2.0, clip=0.5)
    m = round_with(sanitizer)
    t = trainer(max_epochs=3, log_every_n_steps=1)
    t.fit(m, SyntheticLinearMixtureDataModule(seed=0))
    assert isinstance(m.ledger, GaussianLedger) and len(m.ledger) == CLIENTS
    expected = gaussian_epsilon((2.0 / 2) / math.sqrt(3), 1e-5)  # three releases at multiplier z / 2
    assert all(eps == pytest.approx(expected, rel=1e-12) for eps in m.ledger.as_dict().values())
    assert float(t.callback_metrics["privacy/client_epsilon_max"]) == pytest.approx(expected, rel=1e-9)


def test_laplace_participations_add_up():
    m = round_with(LaplaceLocalDP(noise_multiplier=4.0, clip=0.5), clients_per_round=30)
    trainer(max_epochs=4).fit(m, SyntheticLinearMixtureDataModule(seed=0))
    assert isinstance(m.ledger, PrivacyLedger) and not isinstance(m.ledger, GaussianLedger)
    for cid, spent in m.ledger.as_dict().items():
        assert spent == pytest.approx(0.5 * m.ledger.participations(cid))


def test_the_sector_is_accounted_with_its_diameter_once_a_reference_exists():
    """Round 1 has no released change yet: no angular clipping, sensitivity 2C. Later rounds use the previous
    round's released change of the model as the reference and the sector's diameter."""
    clip, lower, angle, z = 0.5, 0.2, 0.3, 2.0
    sanitizer = SectorSanitizer(clip=clip, lower_clip=lower, angle=angle, noise_multiplier=z)
    m = round_with(sanitizer)
    trainer(max_epochs=3).fit(m, SyntheticLinearMixtureDataModule(seed=0))
    d = sector_diameter(clip, lower, angle)
    assert d < 2 * clip
    precision = (2 * clip / (z * clip)) ** 2 + 2 * (d / (z * clip)) ** 2
    for cid in m.ledger.as_dict():
        assert m.ledger.precision(cid) == pytest.approx(precision, rel=1e-12)
    assert float(m.previous_step.norm()) > 0


def test_sector_releases_lie_in_the_sector_around_the_previous_released_change():
    m = round_with(SectorSanitizer(clip=0.5, lower_clip=0.2, angle=0.3), clients_per_round=20)
    captured = []
    original = m.sanitizer.sanitize

    def spy(trained, start, **kwargs):
        out = original(trained, start, **kwargs)
        captured.append((out.released - start, kwargs["reference"]))
        return out

    m.sanitizer.sanitize = spy
    trainer(max_epochs=3).fit(m, SyntheticLinearMixtureDataModule(seed=0))
    assert captured[0][1] is None and all(ref is not None for _, ref in captured[20:])
    for delta, ref in captured:
        assert 0.2 <= float(delta.norm()) <= 0.5
        if ref is not None:
            cos = float(delta @ ref / (delta.norm() * ref.norm()))
            assert math.acos(min(1.0, cos)) <= 0.3 + 1e-5
    assert isinstance(m.ledger, PrivacyLedger) and len(m.ledger) == 0  # no local noise: nothing charged


def test_a_client_privacy_cap_on_the_gaussian_ledger_is_never_exceeded():
    sanitizer = GaussianLocalDP(noise_multiplier=2.0, clip=0.5)
    cap = gaussian_epsilon(1.0 / math.sqrt(2), 1e-5) * (1 + 1e-9)  # exactly two participations fit
    m = round_with(sanitizer, clients_per_round=40, client_privacy_cap=cap)
    t = trainer(max_epochs=8, log_every_n_steps=1)
    t.fit(m, SyntheticLinearMixtureDataModule(seed=0))
    assert m.ledger.max() <= cap
    assert max(m.ledger.participations(cid) for cid in m.ledger.as_dict()) == 2


def test_clip_sanitizer_bounds_updates_and_charges_nothing():
    start, trained = _large_update()
    out = ClipSanitizer(0.3).sanitize(trained, start, generator=torch.Generator(), layer_sizes=[start.numel()])
    assert float((out.released - start).norm()) <= 0.3 * (1 + 1e-6)  # float32 rounding of start + clipped
    m = round_with(ClipSanitizer(0.3), clients_per_round=10)
    trainer(max_epochs=2).fit(m, SyntheticLinearMixtureDataModule(seed=0))
    assert len(m.ledger) == 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(noise_multiplier=0.0), r"noise_multiplier=0.0 is not allowed"),
    (dict(clip=-1.0), r"clip=-1.0 is not allowed"),
    (dict(target_delta=1.0), r"target_delta must be a number in \(0, 1\), got 1.0"),
    (dict(accountant="nope"), r"nope"),
])
def test_gaussian_local_dp_refuses_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GaussianLocalDP(**kwargs)


def test_sector_resume_equals_the_uninterrupted_run(tmp_path):
    """The previous round's released change (the reference direction) and the Gaussian ledger are restored."""
    def fit(epochs, ckpt=None, callbacks=()):
        m = round_with(SectorSanitizer(clip=0.5, lower_clip=0.1, angle=0.5, noise_multiplier=3.0),
                       clients_per_round=30)
        trainer(max_epochs=epochs, callbacks=list(callbacks), enable_checkpointing=bool(callbacks)).fit(
            m, SyntheticLinearMixtureDataModule(seed=0), ckpt_path=ckpt)
        return m

    full = fit(5, callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1, filename="{epoch}")])
    resumed = fit(5, ckpt=str(tmp_path / "epoch=1.ckpt"))
    assert torch.equal(resumed.hypotheses, full.hypotheses)
    assert torch.equal(resumed.previous_step, full.previous_step)
    assert resumed.ledger.state_dict() == full.ledger.state_dict()


# ----------------------------------------------------------- the choice among k > 1 hypotheses
def test_choice_spread_is_the_largest_pairwise_distance():
    from lightning_dp.federated.parts import choice_spread

    h = torch.randn(5, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    brute2 = max(float((h[i] - h[j]).norm()) for i in range(5) for j in range(5))
    brute1 = max(float((h[i] - h[j]).abs().sum()) for i in range(5) for j in range(5))
    assert choice_spread(h) == pytest.approx(brute2, rel=1e-12)
    assert choice_spread(h, p=1.0) == pytest.approx(brute1, rel=1e-12)
    assert choice_spread(h[:1]) == choice_spread(None) == 0.0


def test_a_release_from_a_chosen_hypothesis_moves_by_more_than_2c_between_neighbouring_datasets():
    """Why the choice is accounted: two datasets of a client that pick different hypotheses release means
    ||h_0 - h_1|| + 2C apart at most, and this pair reaches it; the sensitivity the sanitizer charges covers it."""
    C = 0.5
    h = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    s = GaussianLocalDP(noise_multiplier=1.0, clip=C)
    away = -h[1] / h[1].norm()  # each dataset's update points away from the other hypothesis
    mean_a = h[0] + clip_like(away * 10, C)
    mean_b = h[1] + clip_like(-away * 10, C)
    assert float((mean_a - mean_b).norm()) == pytest.approx(5.0 + 2 * C)
    assert s.sensitivity(True, h) == pytest.approx(5.0 + 2 * C)
    assert s.sensitivity(True, None) == 2 * C
    assert s.participation_cost(2, h) == pytest.approx(((5.0 + 2 * C) / C) ** 2)
    out = s.sanitize(h[0] + away, h[0], generator=torch.Generator().manual_seed(0), layer_sizes=[2], hypotheses=h)
    assert out.cost == pytest.approx(((5.0 + 2 * C) / C) ** 2)
    laplace = LaplaceLocalDP(noise_multiplier=2.0, clip=C)
    assert laplace.participation_cost(2, h) == pytest.approx((7.0 + 2 * C) / (2.0 * C))  # L1 spread 3 + 4


def clip_like(v, c):
    return v * min(1.0, c / float(v.norm()))


@pytest.mark.parametrize("sanitizer", [GaussianLocalDP(noise_multiplier=2.0, clip=0.5),
                                       SectorSanitizer(clip=0.5, lower_clip=0.2, angle=0.3, noise_multiplier=2.0),
                                       LaplaceLocalDP(noise_multiplier=4.0, clip=0.5)], ids=["gaussian", "sector", "laplace"])
@pytest.mark.parametrize("warm", [0, 2], ids=["choice", "warm-start"])
def test_with_two_hypotheses_every_release_is_charged_for_the_choice(sanitizer, warm):
    """k = 2, clustered: each release costs what the sanitizer charges for the spread of the hypotheses the
    clients chose from in that round (recomputed here from the hypotheses before each round); in the rounds of a
    warm-up (``warm_start_rounds``), where the start is a public assignment, the same (never less)."""
    m = FederatedRound(LinearRegression(), num_hypotheses=2, selection=UniformSelection(30),
                       update=LocalSGD(epochs=1, lr=0.1, batch_size=10), sanitizer=sanitizer, aggregator="kmeans",
                       seed=0, noise_seed=1, warm_start_rounds=warm)
    expected, charged = [], []
    original = m.sanitizer.sanitize
    seen_round = []

    def spy(trained, start, **kwargs):
        h = kwargs["hypotheses"]
        assert h is not None and h.shape[0] == 2
        if not seen_round or not torch.equal(seen_round[-1], h):
            seen_round.append(h.clone())
        out = original(trained, start, **kwargs)
        expected.append(sanitizer.participation_cost(2, h) if not isinstance(sanitizer, SectorSanitizer)
                        else (max(sanitizer.diameter(True), choice_spread_of(h) + 2 * 0.5) / (2.0 * 0.5)) ** 2)
        charged.append(out.cost)
        return out

    m.sanitizer.sanitize = spy
    t = trainer(max_epochs=3, log_every_n_steps=1)
    t.fit(m, SyntheticLinearMixtureDataModule(seed=0))
    assert len(seen_round) == 3 and choice_spread_of(seen_round[-1]) > 0
    assert charged == pytest.approx(expected, rel=1e-12)
    if isinstance(sanitizer, LaplaceLocalDP):
        spread = [choice_spread_of(h, 1.0) for h in seen_round]
        assert all(c >= 2 * 0.5 / (4.0 * 0.5) + s / (4.0 * 0.5) - 1e-12 for c, s in zip(charged[::30], spread))
    else:
        assert min(charged) > (2 * 0.5 / (2.0 * 0.5)) ** 2  # more than a fixed start's 2C: the choice is charged
    assert "privacy/cost_per_participation" in t.callback_metrics


def choice_spread_of(h, p=2.0):
    from lightning_dp.federated.parts import choice_spread

    return choice_spread(h, p)


def test_weighted_fedavg_is_refused_with_a_local_dp_sanitizer():
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_dp.federated.parts import FedAvg

    m = FederatedRound(LinearRegression(), selection=UniformSelection(10),
                       sanitizer=GaussianLocalDP(noise_multiplier=2.0, clip=0.5), aggregator=FedAvg(weighted=True))
    with pytest.raises(MisconfigurationException, match="example counts"):
        trainer(max_epochs=1).fit(m, SyntheticLinearMixtureDataModule(seed=0))


def test_local_dp_sgd_warns_once_for_the_clients_whose_records_are_too_many_for_its_delta():
    """Each client's record-level epsilon is stated at one delta; delta >= 1/n_c for the clients with
    n_c >= 1/delta. ONE warning (the shared function's, lightning_dp.privacy.delta) names how many and the
    largest n_c, not one per client; clients below stay silent."""
    import warnings

    from lightning_dp.federated.parts import FedAvg, LocalDPSGD
    from lightning_dp.privacy.delta import LargeDeltaWarning, check_delta_for_size

    update = LocalDPSGD(batch_size=5, noise_multiplier=1.0, delta=1e-3)
    sizes = [5000, 40, 1200, 12, 2000]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        update.plan([f"c{i}" for i in range(5)], sizes, planned_rounds=1, inclusion_rate=1.0)
    ours = [str(w.message) for w in caught if issubclass(w.category, LargeDeltaWarning)]
    assert ours == [str(check_delta_for_size(1e-3, sizes, unit="records", who="LocalDPSGD", name="delta"))]
    assert ours[0].startswith("LocalDPSGD: delta=0.001 is not below 1/N for 3 of 5 clients, those with N >= 1200 "
                              "(N = records of a client; the largest has N = 5000")

    # in a federated run: 10 clients of 10 records at delta 0.1 (= 1/n_c): one warning when the round plans
    update = LocalDPSGD(epochs=1, lr=0.05, batch_size=5, noise_multiplier=1.0, delta=0.1)
    m = FederatedRound(LinearRegression(), selection=UniformSelection(10), update=update, aggregator=FedAvg(),
                       seed=0, noise_seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(max_epochs=1).fit(m, SyntheticLinearMixtureDataModule(num_clients=10, samples_per_client=10, seed=0))
    ours = [str(w.message) for w in caught if issubclass(w.category, LargeDeltaWarning)]
    assert len(ours) == 1 and "for 10 of 10 clients" in ours[0] and len(update.ledger) == 10


def test_local_dp_sgd_below_one_over_every_n_c_and_local_dp_ledgers_are_silent():
    """delta < 1/n_c for every client: no warning. A local DP ledger (GaussianLocalDP) protects the client's
    whole data, one unit: its delta has no 1/N to be below, and it never warns."""
    import warnings

    from lightning_dp.federated.parts import LocalDPSGD
    from lightning_dp.privacy.delta import LargeDeltaWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", LargeDeltaWarning)
        LocalDPSGD(batch_size=5, noise_multiplier=1.0, delta=1e-3).plan(
            ["a", "b"], [999, 12], planned_rounds=1, inclusion_rate=1.0)
        trainer(max_epochs=1).fit(round_with(GaussianLocalDP(noise_multiplier=2.0, clip=0.5, target_delta=0.5),
                                             clients_per_round=10),
                                  SyntheticLinearMixtureDataModule(num_clients=10, seed=0))
