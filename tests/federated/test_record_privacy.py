"""Issue 24's federated reproductions, as an attacker with the MLflow record would try them.

1. Client selection drawn from the public ``seed`` let anyone with the record recompute every round's
   participants (no amplification by sampling held; epsilon under-reported about 4x).
2. (the grid, tests/commands/test_grid.py and tests/privacy/test_spend.py)
3. Under central DP the round logged norms of the raw updates and the exact participant counts outside
   ``nonprivate/``, even with ``log_nonprivate_metrics=False``.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_dp.datamodules import SyntheticLinearMixtureDataModule
from lightning_dp.federated import FederatedRound
from lightning_dp.federated.parts import (
    CentralGaussian,
    ClientSelection,
    EuclideanLaplace,
    FedAvg,
    LocalSGD,
    PoissonSelection,
    UniformSelection,
)
from lightning_dp.models import LinearRegression
from lightning_dp.privacy.noise import derive_generator, derive_secret_generator
from tests.helpers import RecordingLogger

CLIENTS_STREAM = 11  # the round's stream of client selection (lightning_dp.federated.round._CLIENTS)


class _Spy(PoissonSelection):
    """PoissonSelection that keeps what it drew, as the round drew it."""

    def __init__(self, sample_rate):
        super().__init__(sample_rate)
        self.drawn = []

    def select(self, num_clients, generator, eligible=None):
        chosen = super().select(num_clients, generator, eligible)
        self.drawn.append(chosen[0])
        return chosen


def _trainer(rounds, logger=False, **kwargs):
    settings = dict(logger=logger, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    accelerator="cpu", devices=1, max_epochs=rounds, num_sanity_val_steps=0, limit_val_batches=0,
                    log_every_n_steps=1)
    return L.Trainer(**{**settings, **kwargs})


def _dp_fedavg(selection, *, seed=0, noise_seed=1, **kwargs):
    return FederatedRound(LinearRegression(), selection=selection, update=LocalSGD(epochs=1, lr=0.1, batch_size=10),
                          aggregator=FedAvg(), server_privacy=CentralGaussian(noise_multiplier=1.0, clip=0.5),
                          seed=seed, noise_seed=noise_seed, **kwargs)


def test_the_public_seed_does_not_recompute_who_took_part():
    """Reproduction 1: the attacker knows the logged ``seed`` (params, the uploaded checkpoint) and the selection's
    code. Before the fix, PoissonSelection drew from derive_generator(seed, 11, r) and the attacker recomputed every
    round exactly; now the round draws from the secret noise seed and the public seed predicts nothing."""
    spy = _Spy(0.25)
    rounds, num_clients = 8, 40
    _trainer(rounds).fit(_dp_fedavg(spy, seed=0, noise_seed=12345),
                         SyntheticLinearMixtureDataModule(num_clients=num_clients, seed=0))
    assert len(spy.drawn) == rounds
    attacker = [PoissonSelection(0.25).select(num_clients, derive_generator(0, CLIENTS_STREAM, r))[0]
                for r in range(rounds)]
    assert sum(a == d for a, d in zip(attacker, spy.drawn)) == 0  # not one round recomputed (chance: ~1e-9 each)
    # ... while the draws are exactly those of the secret seed's stream (so resume and DDP stay exact)
    secret = [PoissonSelection(0.25).select(num_clients, derive_secret_generator(12345, CLIENTS_STREAM, r))[0]
              for r in range(rounds)]
    assert secret == spy.drawn


def test_participants_follow_the_secret_seed_not_the_public_one():
    def drawn(seed, noise_seed):
        spy = _Spy(0.3)
        _trainer(4).fit(_dp_fedavg(spy, seed=seed, noise_seed=noise_seed), SyntheticLinearMixtureDataModule(num_clients=30, seed=0))
        return spy.drawn

    assert drawn(0, 7) == drawn(1, 7)  # a new public seed (initialization) selects the same clients
    assert drawn(0, 7) != drawn(0, 8)


@pytest.mark.parametrize("selection", [PoissonSelection(0.5), UniformSelection(3)])
def test_every_selection_refuses_a_public_generator(selection):
    with pytest.raises(TypeError, match="SECRET seed"):
        selection.draw(10, derive_generator(0, CLIENTS_STREAM, 0))
    with pytest.raises(TypeError, match="SECRET seed"):
        selection.draw(10, torch.Generator().manual_seed(0))
    chosen, declined = selection.draw(10, derive_secret_generator(0, CLIENTS_STREAM, 0))
    assert declined == 0 and all(0 <= i < 10 for i in chosen)


def test_a_new_selection_inherits_the_check():
    """A user's selection implements select(); the round calls draw(), which checks the generator first."""

    class EveryOther(ClientSelection):
        poisson_rate = 0.5

        def select(self, num_clients, generator, eligible=None):
            offset = int(torch.randint(2, (), generator=generator))
            return list(range(offset, num_clients, 2)), 0

        def expected_count(self, num_clients):
            return num_clients / 2

    with pytest.raises(TypeError, match="client selection \\(EveryOther\\)"):
        EveryOther().draw(10, torch.Generator())


class _Amplified(SyntheticLinearMixtureDataModule):
    """One training client's inputs multiplied by ``factor``: a neighbouring federation (reproduction 3)."""

    def __init__(self, factor=1.0, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def setup(self, stage=None):
        super().setup(stage)
        self.train_clients[0].x.mul_(self.factor)


def _central_run(factor, log_nonprivate_metrics, rounds=5):
    recorder = RecordingLogger()
    module = _dp_fedavg(PoissonSelection(0.5), log_nonprivate_metrics=log_nonprivate_metrics)
    _trainer(rounds, logger=recorder).fit(module, _Amplified(factor, num_clients=20, seed=0))
    return recorder


def test_central_dp_keeps_raw_update_norms_and_exact_counts_off_the_record():
    """Reproduction 3: two neighbouring federations (one client's inputs x1000), same seeds. Under central DP the
    norms of the raw updates, the exact participant counts and the cluster size are nonprivate/ statistics: off
    the record with log_nonprivate_metrics=False, where every logged value of the two runs is a declared release
    (epsilon, the same in both) or identical."""
    for name in ("update_norm_mean", "update_norm_std", "participants", "declined", "cluster_size_0"):
        for flag in (True, False):
            assert f"round/{name}" not in _central_run(1.0, flag).names()
    on = _central_run(1.0, True)
    assert {"nonprivate/update_norm_mean", "nonprivate/participants", "nonprivate/cluster_size_0"} <= on.names()
    near, far = _central_run(1.0, False), _central_run(1000.0, False)
    assert near.names() == far.names()
    assert not any(n.startswith("nonprivate/") for n in near.names())
    assert near.series("privacy/epsilon") == far.series("privacy/epsilon")
    # what remains of the record is epsilon (equal) and Lightning's epoch counter
    assert near.names() <= {"privacy/epsilon", "epoch"}
    # with the statistics on, the raw norms differ by orders of magnitude: that is why they are nonprivate
    on_far = _central_run(1000.0, True)
    assert max(on_far.series("nonprivate/update_norm_mean")) > 10 * max(on.series("nonprivate/update_norm_mean"))


def test_sanitized_releases_keep_their_statistics_public():
    """Under local d-privacy the releases are themselves private: their norms and the server's clusters are
    post-processing, logged under round/ (and the uniform selection claims no amplification)."""
    recorder = RecordingLogger()
    module = FederatedRound(LinearRegression(), selection=UniformSelection(4),
                            update=LocalSGD(epochs=1, lr=0.1, batch_size=10),
                            sanitizer=EuclideanLaplace(noise_multiplier=5.0), aggregator=FedAvg(weighted=False),
                            seed=0, noise_seed=1, log_nonprivate_metrics=False)
    _trainer(3, logger=recorder).fit(module, SyntheticLinearMixtureDataModule(num_clients=20, seed=0))
    assert {"round/update_norm_mean", "round/participants", "round/cluster_size_0",
            "privacy/client_epsilon_max"} <= recorder.names()
    assert not any(n.startswith("nonprivate/") for n in recorder.names())


def test_the_uploaded_checkpoint_does_not_show_who_took_part(tmp_path):
    """Under central DP the per-client ledgers (participations) and the update's state are kept under the secret key:
    the public checkpoint (what RunArtifacts uploads) has the model, the rounds and the server's accountant, no
    client's spend; resuming from it is refused (it would restart the ledgers at zero)."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_dp.federated.parts import GaussianLocalDP
    from lightning_dp.tracking import public_checkpoint

    def module():
        return FederatedRound(LinearRegression(), selection=PoissonSelection(0.5),
                              update=LocalSGD(epochs=1, lr=0.1, batch_size=10), sanitizer=GaussianLocalDP(5.0, 1.0),
                              aggregator=FedAvg(weighted=False),
                              server_privacy=CentralGaussian(noise_multiplier=1.0, clip=1.0), seed=0, noise_seed=1)

    first = module()
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _trainer(2, callbacks=[ckpt], enable_checkpointing=True).fit(first, SyntheticLinearMixtureDataModule(num_clients=20, seed=0))
    local = torch.load(ckpt.last_model_path, weights_only=False)
    assert len(first.ledger) > 0 and local["federated"]["secret"]["ledger"]["clients"]
    public = public_checkpoint(local)
    assert "ledger" not in public["federated"] and set(public["federated"]["parts"]) == {"server_privacy"}
    data = SyntheticLinearMixtureDataModule(num_clients=20, seed=0)
    data.setup("fit")
    assert not any(repr(c.client_id) in repr(public["federated"]) for c in data.train_clients)
    torch.save(public, tmp_path / "public.ckpt")
    with pytest.raises(MisconfigurationException, match="holds no per-client ledger"):
        _trainer(3).fit(module(), SyntheticLinearMixtureDataModule(num_clients=20, seed=0), ckpt_path=tmp_path / "public.ckpt")
    loaded = type(first).load_from_checkpoint(tmp_path / "public.ckpt", model=LinearRegression(),
                                              selection=PoissonSelection(0.5), update=LocalSGD(epochs=1, lr=0.1,
                                                                                               batch_size=10),
                                              sanitizer=GaussianLocalDP(5.0, 1.0), aggregator=FedAvg(weighted=False),
                                              server_privacy=CentralGaussian(noise_multiplier=1.0, clip=1.0))
    with pytest.raises(MisconfigurationException, match="holds no per-client ledger"):  # loaded, then trained on
        _trainer(3).fit(loaded, SyntheticLinearMixtureDataModule(num_clients=20, seed=0))
    resumed = module()  # the local checkpoint resumes exactly
    _trainer(2).fit(resumed, SyntheticLinearMixtureDataModule(num_clients=20, seed=0), ckpt_path=ckpt.last_model_path)
    assert resumed.ledger.as_dict() == first.ledger.as_dict()


@pytest.mark.parametrize("nonprivate", [True, False])
def test_the_printed_summary_shows_only_what_the_gate_admits(nonprivate, capsys):
    """Under central DP the exact participations and the clients' ledgers are nonprivate: the end-of-run summary
    prints them only with log_nonprivate_metrics=True (else the expected count, and the client-level epsilon)."""
    from lightning_dp.federated.parts import GaussianLocalDP

    module = FederatedRound(LinearRegression(), selection=PoissonSelection(0.5),
                            update=LocalSGD(epochs=1, lr=0.1, batch_size=10), sanitizer=GaussianLocalDP(5.0, 1.0),
                            aggregator=FedAvg(weighted=False), server_privacy=CentralGaussian(noise_multiplier=1.0),
                            seed=0, noise_seed=1, log_nonprivate_metrics=nonprivate)
    _trainer(2, logger=RecordingLogger()).fit(module, SyntheticLinearMixtureDataModule(num_clients=20, seed=0))
    out = capsys.readouterr().out
    assert "epsilon" in out and "client-level, CentralGaussian" in out
    assert ("participations this fit" in out) == nonprivate and ("10 expected per round" in out) != nonprivate
    assert ("client epsilon" in out) == nonprivate
