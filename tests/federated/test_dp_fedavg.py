"""Client-level DP-FedAvg: FederatedRound with PoissonSelection, FedAvg and CentralGaussian (fixed or adaptive clipping)."""

from __future__ import annotations

import importlib.util
import math

import dp_accounting as dpa
import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_dp.datamodules import SyntheticLinearMixtureDataModule
from lightning_dp.federated import FederatedRound
from lightning_dp.federated.parts import (
    CentralGaussian,
    FedAvg,
    LocalSGD,
    PoissonSelection,
    RoundReleases,
    UniformSelection,
)
from lightning_dp.models import LinearRegression
from lightning_dp.privacy.noise import SecretGenerator
from tests.helpers import ACCELERATORS, DeviceProbe, RecordingLogger


def fedavg(server_privacy, *, q=0.25, k=1, aggregator=None, selection=None, **kwargs):
    return FederatedRound(LinearRegression(), num_hypotheses=k, selection=selection or PoissonSelection(q),
                          update=LocalSGD(epochs=1, lr=0.1, batch_size=10), aggregator=aggregator or FedAvg(),
                          server_privacy=server_privacy, seed=0, noise_seed=1, **kwargs)


def trainer(**kwargs):
    defaults = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    accelerator="cpu", devices=1, max_epochs=5, num_sanity_val_steps=0, limit_val_batches=0)
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def library_epsilon(z, q, rounds, delta=1e-5, interval=1e-4):
    acc = dpa.pld.PLDAccountant(value_discretization_interval=interval)
    acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), rounds))
    return acc.get_epsilon(delta)


def test_epsilon_per_round_equals_the_library_value():
    privacy = CentralGaussian(noise_multiplier=1.3, clip=0.5)
    epsilons = []

    class Capture(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            epsilons.append(float(trainer.callback_metrics["privacy/epsilon"]))

    m = fedavg(privacy, q=0.2)
    trainer(max_epochs=6, callbacks=[Capture()], log_every_n_steps=1).fit(m, SyntheticLinearMixtureDataModule(seed=0))
    assert privacy.accountant.history == [(1.3, 0.2, 6)]
    # the writes before the last from the PLD at 1e-3 (an upper bound too), the last at the accountant's own 1e-4
    assert epsilons[:-1] == pytest.approx([library_epsilon(1.3, 0.2, r, interval=1e-3) for r in range(1, 6)],
                                          rel=1e-9)
    assert epsilons[-1] == pytest.approx(library_epsilon(1.3, 0.2, 6), rel=1e-9)
    for r, interim in enumerate(epsilons[:-1], start=1):  # above the optimistic estimate, a lower bound of the truth
        optimistic = dpa.pld.privacy_loss_distribution.from_gaussian_mechanism(
            1.3, pessimistic_estimate=False, sampling_prob=0.2).self_compose(r)
        assert interim >= optimistic.get_epsilon_for_delta(1e-5)


def test_a_run_stopped_after_an_interim_write_ends_with_the_final_spend():
    """A callback's stop after a round written from the cheaper accountant: on_train_end writes the accountant's
    own spend at that round's step, after the interim one."""
    privacy = CentralGaussian(noise_multiplier=1.3, clip=0.5)
    recorder = RecordingLogger()

    class StopAfterThree(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 3:
                trainer.should_stop = True

    recorder_trainer = trainer(max_epochs=10, logger=recorder, log_every_n_steps=1, callbacks=[StopAfterThree()])
    recorder_trainer.fit(fedavg(privacy, q=0.2), SyntheticLinearMixtureDataModule(seed=0))
    writes = [(step, m["privacy/epsilon"]) for step, m in recorder.calls if "privacy/epsilon" in m]
    assert [step for step, _ in writes] == [0, 1, 2, 2]
    assert writes[2][1] == pytest.approx(library_epsilon(1.3, 0.2, 3, interval=1e-3), rel=1e-9)
    assert writes[-1][1] == pytest.approx(library_epsilon(1.3, 0.2, 3), rel=1e-9) == privacy.epsilon
    # and the run's summary (RunArtifacts' tags read callback_metrics) sees the final value, not the interim one
    assert float(recorder_trainer.callback_metrics["privacy/epsilon"]) == privacy.epsilon


def test_calibrated_noise_meets_the_target_and_the_budget_stops_the_run():
    calibrated = CentralGaussian(target_epsilon=2.0, clip=1.0)
    t = trainer(max_epochs=8)
    t.fit(fedavg(calibrated, q=0.3), SyntheticLinearMixtureDataModule(seed=0))
    assert t.global_step == 8 and 1.9 < calibrated.epsilon <= 2.0  # calibrated, not wastefully below
    assert calibrated.epsilon == pytest.approx(library_epsilon(calibrated.z, 0.3, 8), rel=1e-9)

    budget = CentralGaussian(noise_multiplier=2.0, target_epsilon=2.0, clip=1.0)  # about 6 rounds fit
    t = trainer(max_epochs=200)
    t.fit(fedavg(budget, q=0.3), SyntheticLinearMixtureDataModule(seed=0))
    rounds = t.global_step
    assert 0 < rounds < 200 and budget.epsilon <= 2.0
    assert library_epsilon(2.0, 0.3, rounds) <= 2.0 < library_epsilon(2.0, 0.3, rounds + 1)


def test_the_update_is_the_clipped_sum_over_the_expected_number_of_clients():
    """With negligible noise: new = global + sum_i clip_C(release_i - global) / (q N)."""
    torch.manual_seed(0)
    privacy = CentralGaussian(noise_multiplier=1e-4, clip=0.05, accountant="rdp")  # noise std 2.5e-7
    m = fedavg(privacy, q=0.5)
    releases = torch.randn(6, 2)
    glob = torch.zeros(1, 2)
    g = SecretGenerator().manual_seed(0)
    privacy.plan(sample_rate=0.5, num_clients=40, expected_count=20.0, planned_rounds=1)
    new, assignment, metrics = privacy.aggregate(RoundReleases(releases, glob, weights=None, expected_count=20.0),
                                                 m.aggregator, noise_generator=g, count_generator=g)
    factors = (0.05 / (releases.double().norm(dim=1) + 1e-6)).clamp(max=1).float()
    expected = (factors[:, None] * releases).sum(0) / 20.0
    torch.testing.assert_close(new[0], expected, rtol=0, atol=1e-6)
    assert metrics["nonprivate/clipped_fraction"] == 1.0 and assignment.tolist() == [0] * 6


@pytest.mark.parametrize("adaptive", [False, True])
def test_noise_std_is_flowers_for_the_same_settings(adaptive):
    """All clients send the global model back: the update is pure noise of std z C / m (m = expected clients);
    Flower's DifferentialPrivacyServerSide{Fixed,Adaptive}Clipping compute the same std for m sampled clients."""
    z, clip, m_clients = 0.9, 0.7, 20.0
    privacy = CentralGaussian(noise_multiplier=z, clip=clip, adaptive=adaptive)
    privacy.plan(sample_rate=0.5, num_clients=40, expected_count=m_clients, planned_rounds=1)
    glob = torch.zeros(1, 20_000, dtype=torch.float64)
    g = SecretGenerator().manual_seed(3)
    new, _, _ = privacy.aggregate(RoundReleases(glob.repeat(20, 1), glob, weights=None, expected_count=m_clients),
                                  FedAvg(), noise_generator=g, count_generator=SecretGenerator().manual_seed(4))
    z_used = privacy.update_noise_multiplier
    expected_std = z_used * clip / m_clients
    # 20,000 coordinates: the sample std is within 3% of the true std with probability > 1 - 1e-5
    assert float(new.std()) == pytest.approx(expected_std, rel=0.03)
    if importlib.util.find_spec("flwr") is None:
        pytest.skip("Flower is not installed: the comparison with its formula is skipped")
    from flwr.supercore.differential_privacy import compute_adaptive_noise_params, compute_stdv

    z_flower = compute_adaptive_noise_params(z, m_clients, None)[1] if adaptive else z
    assert z_used == pytest.approx(z_flower, rel=1e-12)
    assert expected_std == pytest.approx(compute_stdv(z_flower, clip, int(m_clients)), rel=1e-12)


def test_adaptive_clipping_tracks_the_target_quantile_of_update_norms():
    privacy = CentralGaussian(noise_multiplier=0.5, clip=0.01, adaptive=True, target_quantile=0.5, clip_lr=0.3)
    m = fedavg(privacy, q=0.8)
    trainer(max_epochs=40).fit(m, SyntheticLinearMixtureDataModule(num_clients=60, seed=0))
    # started far below the update norms (0.01), moved up by ~exp(0.15) a round to the median update norm, about 0.1
    # (measured over noise seeds 0-5: 0.095 to 0.102)
    assert 0.05 < privacy.clip < 0.2
    assert privacy.accountant.history == [(0.5, 0.8, 40)]  # accounted with z; the update noise used z_Delta


def test_resume_equals_the_uninterrupted_run(tmp_path):
    def fit(epochs, ckpt=None, callbacks=()):
        privacy = CentralGaussian(noise_multiplier=1.0, clip=0.5, adaptive=True)
        m = fedavg(privacy, q=0.3)
        trainer(max_epochs=epochs, callbacks=list(callbacks), enable_checkpointing=bool(callbacks)).fit(
            m, SyntheticLinearMixtureDataModule(seed=0), ckpt_path=ckpt)
        return m, privacy

    full, full_privacy = fit(6, callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1,
                                                           filename="{epoch}")])
    resumed, privacy = fit(6, ckpt=str(tmp_path / "epoch=2.ckpt"))
    assert torch.equal(resumed.hypotheses, full.hypotheses)
    assert privacy.accountant.history == full_privacy.accountant.history == [(1.0, 0.3, 6)]
    assert privacy.clip == full_privacy.clip


def test_resume_with_an_adaptive_sector_equals_the_uninterrupted_run(tmp_path):
    """The sector's followed thresholds and both accountants come back from the checkpoint."""
    from lightning_dp.federated.parts import SectorSanitizer

    def fit(epochs, ckpt=None, callbacks=()):
        privacy = CentralGaussian(noise_multiplier=1.0, clip=0.5, adaptive=True, adjacency="replace",
                                  count_noise_std=5.0)
        sector = SectorSanitizer(clip=0.5, lower_clip=0.1, angle=0.6)
        m = fedavg(privacy, q=0.3, sanitizer=sector)
        trainer(max_epochs=epochs, callbacks=list(callbacks), enable_checkpointing=bool(callbacks)).fit(
            m, SyntheticLinearMixtureDataModule(seed=0), ckpt_path=ckpt)
        return m, privacy, sector

    full, full_privacy, full_sector = fit(5, callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1,
                                                                         save_top_k=-1, filename="{epoch}")])
    resumed, privacy, sector = fit(5, ckpt=str(tmp_path / "epoch=1.ckpt"))
    assert torch.equal(resumed.hypotheses, full.hypotheses)
    assert privacy.state_dict() == full_privacy.state_dict()
    assert (sector.clip, sector.lower_clip) == (full_sector.clip, full_sector.lower_clip) == (privacy.clip,
                                                                                              privacy.clip / 5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(k=2, aggregator=None), "num_hypotheses=2"),
    (dict(aggregator=FedAvg(weighted=True)), "weighted=False"),
    (dict(selection=UniformSelection(5)), "client selection must be poisson"),
])
def test_combinations_whose_claims_would_not_hold_are_refused(kwargs, match):
    m = fedavg(CentralGaussian(noise_multiplier=1.0), **kwargs)
    with pytest.raises(MisconfigurationException, match=match):
        trainer(max_epochs=1).fit(m, SyntheticLinearMixtureDataModule(seed=0))


def test_every_part_checks_its_combination_and_the_round_reports_all_problems_together():
    """Each part says what is wrong with the combination it is in (Part.problems, Flower's wrappers validating
    themselves); the round raises one error with all of them, before any client trains."""
    from lightning_dp.federated.parts import Combination, LocalDPSGD, ServerPrivacy

    m = FederatedRound(LinearRegression(), num_hypotheses=2, selection=UniformSelection(5),
                       update=LocalDPSGD(batch_size=5, noise_multiplier=1.0), aggregator=FedAvg(weighted=True),
                       server_privacy=CentralGaussian(noise_multiplier=1.0), seed=0, noise_seed=1)
    with pytest.raises(MisconfigurationException) as info:
        trainer(max_epochs=1).fit(m, SyntheticLinearMixtureDataModule(seed=0))
    message = str(info.value)
    assert message.startswith("3 problems with these parts:")
    assert "update 'local_dp_sgd' with num_hypotheses=2" in message and "exact record counts" in message
    assert "CentralGaussian: num_hypotheses=2" in message and "client selection must be poisson" in message
    parts = Combination(m.selection, m.update, m.sanitizer, m.aggregator, m.server_privacy, 1)
    assert m.sanitizer.problems(parts) == [] and m.selection.problems(parts) == []
    with pytest.raises(TypeError, match="'accounted', which is now 'accountable'"):
        type("OldStyle", (ServerPrivacy,), {"accounted": True})


def test_parts_by_name_and_unknown_names():
    m = FederatedRound(LinearRegression(), selection="poisson", aggregator="fedavg", server_privacy="none")
    assert type(m.selection).__name__ == "PoissonSelection" and m.hparams["aggregator"] == "fedavg"
    with pytest.raises(ValueError, match="Did you mean 'kmeans'"):
        FederatedRound(LinearRegression(), aggregator="kmean")
    with pytest.raises(ValueError, match="needs noise_multiplier=<z> or target_epsilon"):
        CentralGaussian()
    assert math.isinf(FederatedRound(LinearRegression()).participation_cost())


def test_parts_are_abstract_bases_of_one_kind_each():
    """A kind's base class declares its kind and abstract methods: an incomplete part is refused when it is built,
    a part of another kind when it is registered or passed."""
    from lightning_dp.federated.parts import Aggregator, ClientSanitizer, NoSanitizer, register_part

    with pytest.raises(TypeError, match="abstract method sanitize"):
        type("Incomplete", (ClientSanitizer,), {})()
    with pytest.raises(TypeError, match="is not a aggregator part"):
        register_part("aggregator", "wrong_kind_test")(type("Wrong", (NoSanitizer,), {}))
    with pytest.raises(ValueError, match="is not a Aggregator"):
        FederatedRound(LinearRegression(), aggregator=NoSanitizer())
    assert Aggregator.kind == "aggregator" and NoSanitizer.kind == "sanitizer"


def test_replacement_adjacency_is_accounted_with_the_library_replace_one_analysis():
    privacy = CentralGaussian(noise_multiplier=1.3, clip=0.5, adjacency="replace")
    trainer(max_epochs=4).fit(fedavg(privacy, q=0.2), SyntheticLinearMixtureDataModule(seed=0))
    acc = dpa.pld.PLDAccountant(dpa.NeighboringRelation.REPLACE_ONE)
    acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.2, dpa.GaussianDpEvent(1.3)), 4))
    assert privacy.epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    assert privacy.epsilon > library_epsilon(1.3, 0.2, 4)
    assert privacy.hparams()["privacy/adjacency"] == "replacement"

    calibrated = CentralGaussian(target_epsilon=2.0, clip=1.0, adjacency="replace")
    add_remove = CentralGaussian(target_epsilon=2.0, clip=1.0)
    for part in (calibrated, add_remove):
        trainer(max_epochs=5).fit(fedavg(part, q=0.3), SyntheticLinearMixtureDataModule(seed=0))
    assert 1.9 < calibrated.epsilon <= 2.0 and calibrated.z > add_remove.z


def test_rdp_under_replacement_with_client_sampling_is_refused_before_any_client_trains():
    privacy = CentralGaussian(noise_multiplier=1.0, accountant="rdp", adjacency="replace")
    t = trainer(max_epochs=2)
    with pytest.raises(MisconfigurationException, match=r"RDP accountant cannot analyse Poisson sampling.*'pld'"):
        t.fit(fedavg(privacy, q=0.2), SyntheticLinearMixtureDataModule(seed=0))
    assert t.global_step == 0 and len(privacy.accountant) == 0


def test_sector_bounded_updates_under_replacement_report_the_smaller_of_two_valid_bounds():
    """Sector sanitizer without local noise + central Gaussian noise, replacement adjacency: round 1 has no
    reference direction (diameter 2C), later rounds the sector's diameter D; epsilon is min(replace-one bound
    with radius C, disjoint-pair bound with the diameters)."""
    from lightning_dp.federated.parts import SectorSanitizer
    from lightning_dp.privacy.accounting import DisjointPairPLDAccountant, get_accountant
    from lightning_dp.privacy.local_dp import sector_diameter

    clip, z, q, rounds = 0.5, 1.0, 0.5, 4
    privacy = CentralGaussian(noise_multiplier=z, clip=clip, adjacency="replace")
    m = fedavg(privacy, q=q, sanitizer=SectorSanitizer(clip=clip, lower_clip=0.45, angle=0.05))
    trainer(max_epochs=rounds).fit(m, SyntheticLinearMixtureDataModule(seed=0))
    pad = 1 + 1e-4
    d = sector_diameter(clip, 0.45, 0.05) * pad
    ball = get_accountant("pld", adjacency="replace")
    ball.step(noise_multiplier=z, sample_rate=q, num_steps=rounds)  # radius min(C, C * pad) = C
    disjoint = DisjointPairPLDAccountant()
    disjoint.step(noise_multiplier=z * clip / (2 * clip), sample_rate=q)
    disjoint.step(noise_multiplier=z * clip / d, sample_rate=q, num_steps=rounds - 1)
    assert privacy.accountant.history == ball.history
    got = privacy.set_accountant.history  # multipliers from the diameter in units of C, rounded up at 2^-40
    assert [n for *_, n in got] == [n for *_, n in disjoint.history]
    assert [v for e in got for v in e[:2]] == pytest.approx([v for e in disjoint.history for v in e[:2]], rel=1e-11)
    assert all(a[0] <= b[0] for a, b in zip(got, disjoint.history))  # never a larger multiplier (smaller set)
    expected = min(ball.get_epsilon(1e-5), disjoint.get_epsilon(1e-5))
    assert privacy.epsilon == pytest.approx(expected, rel=1e-9)

    plain = CentralGaussian(noise_multiplier=z, clip=clip)  # add/remove: the set does not enter
    trainer(max_epochs=2).fit(fedavg(plain, q=q, sanitizer=SectorSanitizer(clip=clip, lower_clip=0.45, angle=0.05)),
                              SyntheticLinearMixtureDataModule(seed=0))
    assert plain.accountant.history == [(z, q, 2)] and plain.set_accountant is None


def test_the_budget_stop_under_replacement_follows_the_smaller_bound():
    """q = 1, z = 3, sector with D = C: the replace-one bound passes target 10 after 9 rounds, the disjoint-pair
    bound allows more. The run goes on while the smaller bound fits, stops before it would not, and never
    reports more than the target."""
    from lightning_dp.federated.parts import SectorSanitizer
    from lightning_dp.privacy.accounting import DisjointPairPLDAccountant

    clip, z, target = 1.0, 3.0, 10.0
    privacy = CentralGaussian(noise_multiplier=z, clip=clip, adjacency="replace", target_epsilon=target)
    m = fedavg(privacy, q=1.0, sanitizer=SectorSanitizer(clip=clip, angle=0.5))
    trainer(max_epochs=40).fit(m, SyntheticLinearMixtureDataModule(seed=0))
    rounds = int(m.rounds)
    assert 9 < rounds < 40
    assert privacy.accountant.get_epsilon(1e-5) > target >= privacy.epsilon
    assert privacy.epsilon == privacy.set_accountant.get_epsilon(1e-5)
    d = 1.0 * (1 + 1e-4)  # the sector's diameter (C for a <= pi/6, c = 0), padded
    one_more = DisjointPairPLDAccountant()
    for entry in privacy.set_accountant.history:
        one_more.step(noise_multiplier=entry[0], sample_rate=entry[1], num_steps=entry[2])
    one_more.step(noise_multiplier=z * clip / d, sample_rate=1.0)
    assert one_more.get_epsilon(1e-5) > target  # the stop was needed


def test_calibration_under_replacement_with_a_sector_meets_the_budget_with_the_smaller_bound():
    """q = 1, sector with D = C from round 2: the calibrated z is the smallest whose reported spend (the smaller
    bound) meets the target over the planned rounds, about half the replace-one z; the run takes every planned
    round and ends within 1.5% of the target."""
    from lightning_dp.federated.parts import SectorSanitizer

    rounds, target = 12, 10.0
    sector = SectorSanitizer(clip=1.0, angle=0.5)
    privacy = CentralGaussian(target_epsilon=target, clip=1.0, adjacency="replace")
    m = fedavg(privacy, q=1.0, sanitizer=sector)
    trainer(max_epochs=rounds).fit(m, SyntheticLinearMixtureDataModule(seed=0))
    ball_only = CentralGaussian(target_epsilon=target, clip=1.0, adjacency="replace")
    ball_only.plan(sample_rate=1.0, num_clients=100, expected_count=100.0, planned_rounds=rounds)
    sets = (sector.update_set(False), sector.update_set(True))
    assert privacy.z < 0.75 * ball_only.z
    assert privacy.planned_epsilon(privacy.z, rounds, *sets) <= target < privacy.planned_epsilon(
        privacy.z / 1.01, rounds, *sets)
    assert int(m.rounds) == rounds
    assert target / 1.015 <= privacy.epsilon <= target
    assert privacy.epsilon == pytest.approx(privacy.planned_epsilon(privacy.z, rounds, *sets), rel=1e-12)


def test_adaptive_multipliers_bound_the_joint_release_of_sector_updates_and_bits():
    """Adaptive clipping under replacement releases (clipped sum + N(0, (z_Delta C)^2), count + N(0, sigma_b^2)):
    one Gaussian mechanism on (u / (z_Delta C), b / sigma_b). Brute force over sampled sector updates and bits:
    the largest distance of a client's vector from an absent one (centred bit) is 1 / replace-one multiplier,
    the largest distance between two clients' vectors is 1 / disjoint-pair multiplier (both reached to 1%)."""
    from lightning_dp.privacy.adaptive import quantile_noise_split
    from lightning_dp.privacy.local_dp import project_to_sector, sector_diameter

    clip, lower, angle, z, sigma_b = 0.5, 0.3, 0.4, 1.2, 2.0
    privacy = CentralGaussian(noise_multiplier=z, clip=clip, adaptive=True, adjacency="replace",
                              count_noise_std=sigma_b)
    privacy.count_std = sigma_b
    update_set = (clip, sector_diameter(clip, lower, angle))
    one, pair = privacy._multipliers(z, update_set, clip)
    z_u = quantile_noise_split(z, count_noise_std=sigma_b)
    g = torch.Generator().manual_seed(0)
    reference = torch.randn(6, generator=g)
    sector = torch.stack([project_to_sector(torch.randn(6, generator=g) * 3, reference, clip, lower, angle)
                          for _ in range(3000)]).double()
    bits = torch.randint(2, (3000,), generator=g).double()
    vectors = torch.cat([sector / (z_u * clip), (bits - 0.5)[:, None] / sigma_b], dim=1)
    radius = float(vectors.norm(dim=1).max())
    assert radius <= 1 / one * (1 + 1e-9) and radius >= 1 / one * 0.99
    assert one == pytest.approx(z, rel=1e-12)  # s = C: Andrew et al.'s split composes to z
    # two clients: the farthest sector pair (the diameter) with opposite bits
    far = torch.cdist(sector, sector).max()
    diameter = math.hypot(float(far) / (z_u * clip), 1 / sigma_b)
    assert diameter <= 1 / pair * (1 + 1e-9) and diameter >= 1 / pair * 0.99


def test_a_sector_under_adaptive_clipping_follows_the_servers_threshold_and_reports_raw_bits():
    """Sector sanitizer (c / C = 0.5, a = 0.4) under CentralGaussian(adaptive=True), replacement: every round the
    clients clip at the server's threshold and report whether their RAW update was within it. Starting far below
    the update norms (C = 0.01) the threshold grows (with the server reading the norms of already clipped
    releases it would see every update within and shrink); every round is accounted with the joint multipliers."""
    from lightning_dp.federated.parts import SectorSanitizer
    from lightning_dp.privacy.local_dp import sector_diameter

    sector = SectorSanitizer(clip=1.0, lower_clip=0.5, angle=0.4)
    privacy = CentralGaussian(noise_multiplier=0.5, clip=0.01, adaptive=True, target_quantile=0.5, clip_lr=0.3,
                              adjacency="replace", count_noise_std=5.0)
    m = fedavg(privacy, q=0.8, sanitizer=sector)
    trainer(max_epochs=20).fit(m, SyntheticLinearMixtureDataModule(num_clients=60, seed=0))
    assert 0.05 < privacy.clip < 0.2  # from 0.01 up to about the median raw update norm (0.1), as above
    assert sector.clip == privacy.clip and sector.lower_clip == pytest.approx(0.5 * privacy.clip, rel=1e-12)
    pad = 1 + 1e-4
    ball = CentralGaussian(noise_multiplier=0.5, clip=1.0, adaptive=True, adjacency="replace", count_noise_std=5.0)
    ball.count_std = 5.0
    first = ball._multipliers(0.5, (pad, 2 * pad), 1.0)
    later = ball._multipliers(0.5, (pad, sector_diameter(1.0, 0.5, 0.4) * pad), 1.0)  # scale-free in C
    assert first[0] == later[0]  # the radius is C in both: one replace-one entry for the run
    assert privacy.accountant.history == [(first[0], 0.8, 20)]
    assert privacy.set_accountant.history == [(first[1], 0.8, 1), (later[1], 0.8, 19)]


def test_calibration_with_adaptive_sector_clipping_meets_the_budget():
    from lightning_dp.federated.parts import SectorSanitizer

    sector = SectorSanitizer(clip=1.0, angle=0.5)
    privacy = CentralGaussian(target_epsilon=10.0, clip=1.0, adaptive=True, adjacency="replace", count_noise_std=20.0)
    m = fedavg(privacy, q=1.0, sanitizer=sector)
    trainer(max_epochs=8).fit(m, SyntheticLinearMixtureDataModule(seed=0))
    assert int(m.rounds) == 8
    assert 10.0 / 1.02 <= privacy.epsilon <= 10.0


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_calibrated_run_logs_its_noise_multiplier_to_mlflow_once(tmp_path, adaptive):
    """z and q are decided when training starts: the logged parameters hold them (MLflow refuses a parameter
    logged first as None and then changed)."""
    import mlflow

    from lightning_dp.tracking import MLFlowLogger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = MLFlowLogger(experiment_name="calibrated", tracking_uri=uri, artifact_location=str(tmp_path / "art"))
    privacy = CentralGaussian(target_epsilon=4.0, clip=0.5, adaptive=adaptive, count_noise_std=3.0)
    trainer(max_epochs=2, logger=logger).fit(fedavg(privacy, q=0.5), SyntheticLinearMixtureDataModule(seed=0))
    params = mlflow.MlflowClient(tracking_uri=uri).get_run(logger.run_id).data.params
    assert float(params["privacy/noise_multiplier"]) == pytest.approx(privacy.z)
    assert float(params["privacy/client_sample_rate"]) == 0.5


@pytest.mark.parametrize("every,rounds", [(3, 7), (1, 4), (50, 5)])
def test_epsilon_is_in_every_metrics_write_and_the_final_spend_is_written(every, rounds):
    """epsilon is computed only for the rounds whose metrics Lightning writes (a PLD composition can cost more
    than a round), and the last round's spend is always written."""
    privacy = CentralGaussian(noise_multiplier=1.0, clip=0.5)
    recorder = RecordingLogger()
    trainer(max_epochs=rounds, logger=recorder, log_every_n_steps=every).fit(fedavg(privacy),
                                                                            SyntheticLinearMixtureDataModule(seed=0))
    writes = [m for _, m in recorder.calls if "nonprivate/participants" in m]  # exact counts: nonprivate under central DP
    assert len(writes) == rounds // every and all("privacy/epsilon" in m for m in writes)
    finals = [m["privacy/epsilon"] for _, m in recorder.calls if "privacy/epsilon" in m]
    assert finals[-1] == pytest.approx(privacy.epsilon, rel=1e-12)
    assert privacy.epsilon == pytest.approx(library_epsilon(1.0, 0.25, rounds), rel=1e-9)


def test_delta_not_below_one_over_the_number_of_clients_warns_when_planned():
    """Issue 24's reproduction: 10 training clients at delta 0.3 trained and reported epsilon 0.0 with no
    warning. The warning is the shared one (lightning_dp.privacy.delta), given once when the round plans."""
    import warnings

    from lightning_dp.privacy.delta import LargeDeltaWarning, check_delta_for_size

    privacy = CentralGaussian(noise_multiplier=1.0, target_delta=0.3, clip=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(max_epochs=2).fit(fedavg(privacy, q=0.5), SyntheticLinearMixtureDataModule(num_clients=10, seed=0))
    ours = [str(w.message) for w in caught if issubclass(w.category, LargeDeltaWarning)]
    assert ours == [str(check_delta_for_size(0.3, 10, unit="clients", who="CentralGaussian"))]
    assert ours[0].startswith("CentralGaussian: target_delta=0.3 is not below 1/N = 0.1 (N = 10 training clients)")
    assert len(privacy.accountant) == 2  # a warning, not a refusal: the run trained (its epsilon is still stated)
    with pytest.warns(LargeDeltaWarning, match=r"target_delta=0.1 is not below 1/N = 0.1"):  # delta = 1/N exactly
        CentralGaussian(noise_multiplier=1.0, target_delta=0.1).plan(sample_rate=0.5, num_clients=10,
                                                                      expected_count=5.0, planned_rounds=1)


def test_delta_below_one_over_the_number_of_clients_is_silent():
    import warnings

    from lightning_dp.privacy.delta import LargeDeltaWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", LargeDeltaWarning)
        CentralGaussian(noise_multiplier=1.0, target_delta=0.099).plan(sample_rate=0.5, num_clients=10,
                                                                        expected_count=5.0, planned_rounds=1)
        trainer(max_epochs=1).fit(fedavg(CentralGaussian(noise_multiplier=1.0), q=0.5),
                                  SyntheticLinearMixtureDataModule(num_clients=10, seed=0))


def test_the_server_refuses_noise_from_a_public_generator():
    privacy = CentralGaussian(noise_multiplier=1.0, clip=1.0)
    privacy.plan(sample_rate=0.5, num_clients=40, expected_count=20.0, planned_rounds=1)
    glob = torch.zeros(1, 3)
    for noise, count in ((torch.Generator(), SecretGenerator()), (SecretGenerator(), torch.Generator())):
        with pytest.raises(TypeError, match="SECRET seed"):
            privacy.aggregate(RoundReleases(glob.repeat(4, 1), glob, weights=None, expected_count=20.0), FedAvg(),
                              noise_generator=noise, count_generator=count)


def _summed_and_held(monkeypatch, entries, **privacy):
    """The same DP-FedAvg fit twice: the round summing its releases a block of ``entries`` at a time, and holding
    them (the server reading the (U, P) releases, as before the sums and as for every other server). Both make the
    releases: the fused one-step path, which never makes them, is compared with these in
    tests/federated/test_fused_round.py."""
    import lightning_dp.federated.clients as clients_module

    out = []
    for sums in (True, False):
        with monkeypatch.context() as patch:
            patch.setattr(clients_module, "SUM_BLOCK_ENTRIES", entries)
            patch.setattr(clients_module.RoundClients, "fused_block", lambda self, *args: None)
            server = CentralGaussian(noise_multiplier=1.0, clip=0.3, **privacy)
            module = fedavg(server, q=0.5, log_nonprivate_metrics=True)
            if not sums:
                patch.setattr(module.private_step, "sums_releases", lambda: False)
            assert module.private_step.sums_releases() is sums
            recorder = RecordingLogger()
            trainer(max_epochs=4, logger=recorder, log_every_n_steps=1).fit(module,
                                                                           SyntheticLinearMixtureDataModule(seed=0))
            out.append((module.hypotheses.detach().clone(), recorder, server))
    return out


def test_a_round_summing_its_releases_equals_one_holding_them(monkeypatch):
    """One block (the default: the releases fit in 2^22 entries): the same additions, the same bits."""
    (summed, rec_s, server_s), (held, rec_h, server_h) = _summed_and_held(monkeypatch, 2**22)
    assert torch.equal(summed, held)
    assert rec_s.calls == rec_h.calls  # every metric, update norms and clipped fraction included
    assert server_s.accountant.history == server_h.accountant.history


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_round_summing_its_releases_in_blocks_equals_one_holding_them(monkeypatch, adaptive):
    """Blocks of one to three clients: the sums add up in another order (float rounding), every client trained
    as alone (its shuffles and noise are its own), the norms and so the adaptive threshold's count the same."""
    privacy = {"adaptive": True, "count_noise_std": 2.0} if adaptive else {}
    (summed, rec_s, server_s), (held, rec_h, server_h) = _summed_and_held(monkeypatch, 8, **privacy)
    torch.testing.assert_close(summed, held, rtol=1e-6, atol=1e-7)
    for name in ("nonprivate/update_norm_mean", "nonprivate/clipped_fraction", "privacy/epsilon"):
        assert rec_s.series(name) == pytest.approx(rec_h.series(name), rel=1e-6), name
    assert server_s.clip == pytest.approx(server_h.clip, rel=1e-6)


@pytest.mark.skipif("gpu" not in ACCELERATORS, reason="needs a CUDA GPU")
@pytest.mark.parametrize("engine", ["dense", "vmap", "loop"])
def test_on_a_gpu_a_round_selects_the_same_clients_spends_the_same_and_trains_the_same_model(engine):
    """DP-FedAvg on the GPU and on the CPU with the same seeds: client selection is drawn on the CPU (the same
    clients), the noise on the GPU by its own generator (negligible here: std 1e-4 C / (q N)), and so are the local
    shuffles (full batches here, so the order does not matter), so the global models agree within rounding (stated
    tolerance 1e-4 of their norm) and the accounting is the same."""
    runs = []
    for accelerator in ("cpu", "gpu"):
        privacy = CentralGaussian(noise_multiplier=1e-4, clip=0.5, accountant="rdp")
        m = FederatedRound(LinearRegression(), selection=PoissonSelection(0.3),
                           update=LocalSGD(epochs=2, lr=0.1, batch_size=1000, engine=engine), aggregator=FedAvg(),
                           server_privacy=privacy, seed=0, noise_seed=1)
        start, probe = m.hypotheses.clone(), DeviceProbe()
        trainer(max_epochs=6, accelerator=accelerator, callbacks=[probe]).fit(m, SyntheticLinearMixtureDataModule(seed=0))
        runs.append((m, privacy))
    (cpu, cpu_privacy), (gpu, gpu_privacy) = runs
    assert probe.devices == {"cuda"} and gpu.update.engine_used == engine
    assert gpu_privacy.accountant.history == cpu_privacy.accountant.history == [(1e-4, 0.3, 6)]
    assert int(gpu.rounds) == int(cpu.rounds) == 6
    assert torch.linalg.vector_norm(cpu.hypotheses - start) > 0.1  # the models trained
    assert torch.linalg.vector_norm(gpu.hypotheses.cpu() - cpu.hypotheses) <= 1e-4 * torch.linalg.vector_norm(
        cpu.hypotheses)


class _DropoutNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.drop, self.b = torch.nn.Linear(2, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.b(self.drop(torch.relu(self.a(x)))).squeeze(-1)


@pytest.mark.parametrize("update", ["vmap", "loop", "local_dp_sgd"])
def test_a_model_with_dropout_trains_on_every_engine(update):
    """vmap draws the dropout masks per client (and per example under local DP-SGD), as the loop does: torch.func's
    default refuses random operations (the review of the GPU change found it: auto vmaps any model on a GPU)."""
    from lightning_dp.federated.parts import LocalDPSGD

    part = (LocalDPSGD(epochs=1, lr=0.05, batch_size=5, noise_multiplier=1.0, delta=1e-3) if update == "local_dp_sgd"
            else LocalSGD(epochs=1, lr=0.1, batch_size=5, engine=update))
    m = FederatedRound(_DropoutNet(), selection=UniformSelection(10), update=part, aggregator=FedAvg(), loss="rmse",
                       seed=0, noise_seed=1)
    start = m.hypotheses.clone()
    t = trainer(max_epochs=2, limit_val_batches=None, num_sanity_val_steps=0)
    t.fit(m, SyntheticLinearMixtureDataModule(seed=0))
    assert int(m.rounds) == 2 and torch.isfinite(m.hypotheses).all() and not torch.equal(m.hypotheses, start)
    assert math.isfinite(float(t.callback_metrics["val/loss"]))


def test_a_householder_orthogonal_model_is_refused_where_the_round_adds_noise():
    """The server's noise reaches the Householder original's diagonal (each column's sign, no gradient), and torch
    then zeroes or scales columns (lightning_dp.privacy.validators.find_noise_broken_parametrizations): refused with
    the map to use; without noise (nothing accounted) the round keeps it."""
    from torch import nn
    from torch.nn.utils import parametrizations

    def model(kind):
        return nn.Sequential(parametrizations.orthogonal(nn.Linear(3, 2), orthogonal_map=kind), nn.Linear(2, 1))

    with pytest.raises(ValueError, match=r"0\.weight is parametrized by orthogonal\(\) with the Householder map"
                                         r".*orthogonal_map='matrix_exp'"):
        FederatedRound(model("householder"), selection=PoissonSelection(0.25), server_privacy=CentralGaussian(
            noise_multiplier=1.0, clip=0.5), seed=0, noise_seed=1)
    FederatedRound(model("matrix_exp"), selection=PoissonSelection(0.25),
                   server_privacy=CentralGaussian(noise_multiplier=1.0, clip=0.5), seed=0, noise_seed=1)
    FederatedRound(model("householder"), seed=0)
