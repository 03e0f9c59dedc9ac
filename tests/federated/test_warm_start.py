"""IFCA's trained initialization (``warm_start_rounds``): the first rounds' clients start from a publicly assigned
hypothesis, then choose on their data."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from scipy import stats

from lightning_dp.datamodules import SyntheticLinearMixtureDataModule
from lightning_dp.datamodules.federated import client_ids
from lightning_dp.federated import FederatedRound, PersonalizedFederatedModule
from lightning_dp.federated.local import assigned_hypotheses, client_losses
from lightning_dp.models import LinearRegression
from tests.federated.test_module import module as base_module
from tests.helpers import trainer

THETAS = [[5.0, 6.0], [4.0, -4.5]]  # SyntheticLinearMixtureDataModule's default


def module(**kwargs):
    """test_module's round on the synthetic mixture, with 3 warm-up rounds unless told otherwise."""
    return base_module(**{"warm_start_rounds": 3, **kwargs})


def test_the_assignment_is_a_uniform_pure_function_of_the_seed_and_the_client_id():
    """A client's hypothesis depends on its id and the seed only: not on which other clients are asked with it, in
    which order, nor on its position (the sites of a Flower deployment number their clients from 0 each); over
    30,000 ids the k = 3 counts pass a chi-square test of uniformity (alpha 0.001), and so do the pairs of
    consecutive ids, so neighbouring ids are not tied together."""
    ids = [f"writer-{i:05d}" for i in range(30_000)]
    every = assigned_hypotheses(7, ids, 3)
    some = [29_999, 5, 17, 5]
    assert torch.equal(assigned_hypotheses(7, [ids[i] for i in some], 3), every[some])
    assert not torch.equal(assigned_hypotheses(8, ids, 3), every)
    # two sites, each numbering its clients from 0: the ids decide
    site_a, site_b = ["a-0", "a-1", "a-2", "a-3"], ["b-0", "b-1", "b-2", "b-3"]
    assert not torch.equal(assigned_hypotheses(7, site_a * 8, 3), assigned_hypotheses(7, site_b * 8, 3))
    assert stats.chisquare(torch.bincount(every, minlength=3).numpy()).pvalue > 1e-3
    pairs = torch.bincount(every[:-1] * 3 + every[1:], minlength=9).numpy()
    assert stats.chisquare(pairs).pvalue > 1e-3
    assert assigned_hypotheses(7, [], 3).shape == (0,)
    assert set(assigned_hypotheses(7, ids[:50], 1).tolist()) == {0}
    with pytest.raises(ValueError, match="k"):
        assigned_hypotheses(7, ids[:1], 0)
    with pytest.raises((ValueError, TypeError), match="k"):
        assigned_hypotheses(7, ids[:1], 2.5)


class StartSpy(L.Callback):
    """Records each round's hypotheses before the round, and its clients' starting vectors and data."""

    def __init__(self):
        self.rounds = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        update, spy = pl_module.update, self
        original = type(update).train
        before = pl_module.hypotheses.detach().clone()
        r = int(pl_module.rounds)

        def train(self_, template, spec, start, x, y, mask, **kwargs):
            spy.rounds.append({"round": r, "hypotheses": before, "clients": list(kwargs["clients"]),
                               "start": start.detach().clone(), "data": (x, y, mask)})
            return original(self_, template, spec, start, x, y, mask, **kwargs)

        update.train = train.__get__(update)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        del pl_module.update.train  # back to the class's method


def test_warm_up_rounds_start_from_the_assignment_and_later_rounds_from_the_best_hypothesis():
    spy = StartSpy()
    m = module(warm_start_rounds=3)
    trainer(max_epochs=6, callbacks=[spy]).fit(m, SyntheticLinearMixtureDataModule(seed=0))
    assert [row["round"] for row in spy.rounds] == list(range(6))
    warm_choices = []
    for row in spy.rounds:
        hyps, clients = row["hypotheses"], row["clients"]
        if row["round"] < 3:
            choice = assigned_hypotheses(m.seed, client_ids(m.clients.splits["train"], clients), 2)
            warm_choices.append(choice)
        else:
            x, y, mask = row["data"]
            choice = client_losses(m.template, m.spec, hyps, x, y, mask, "rmse").argmin(dim=1)
        assert torch.equal(row["start"], hyps[choice]), row["round"]
    # the assignment does start clients from both hypotheses (7 clients a round for 3 rounds)
    assert set(torch.cat(warm_choices).tolist()) == {0, 1}
    # and, from these independent random starts, the data's choice differs from the assignment somewhere
    late = spy.rounds[3]
    x, y, mask = late["data"]
    best = client_losses(m.template, m.spec, late["hypotheses"], x, y, mask, "rmse").argmin(dim=1)
    assert not torch.equal(best, assigned_hypotheses(m.seed, client_ids(m.clients.splits["train"], late["clients"]), 2))


def test_warm_up_does_not_read_the_clients_data():
    """During the warm-up a client's start is the same whatever its data: the same clients on a mixture of other
    true models start round 0 from the same hypotheses (without the warm-up, their choice on the data differs: the
    test can fail). What the warm-up charges: tests/federated/test_local_dp_round.py (local DP charges the choice in
    it too); the d-privacy sanitizer's n/nu does not depend on the start."""
    def starts(warm: int, thetas: list[list[float]]) -> tuple[StartSpy, PersonalizedFederatedModule]:
        spy = StartSpy()
        m = module(warm_start_rounds=warm)
        trainer(max_epochs=2, callbacks=[spy]).fit(m, SyntheticLinearMixtureDataModule(seed=0, thetas=thetas))
        return spy, m

    mirrored = [[-5.0, -6.0], [-4.0, 4.5]]
    (a, _), (b, _) = starts(2, THETAS), starts(2, mirrored)
    assert a.rounds[0]["clients"] == b.rounds[0]["clients"]
    assert not torch.equal(a.rounds[0]["data"][1], b.rounds[0]["data"][1])
    assert torch.equal(a.rounds[0]["start"], b.rounds[0]["start"])
    (c, _), (d, _) = starts(0, THETAS), starts(0, mirrored)
    assert not torch.equal(c.rounds[0]["start"], d.rounds[0]["start"])


def test_resume_across_the_end_of_the_warm_up_equals_the_uninterrupted_run(tmp_path):
    full = module(warm_start_rounds=4)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    trainer(max_epochs=8, callbacks=[ckpt], enable_checkpointing=True).fit(
        full, SyntheticLinearMixtureDataModule(seed=0))
    resumed = module(warm_start_rounds=4)  # from round 2, inside the warm-up
    trainer(max_epochs=8).fit(resumed, SyntheticLinearMixtureDataModule(seed=0),
                              ckpt_path=str(tmp_path / "epoch=1.ckpt"))
    assert int(resumed.rounds) == 8
    assert torch.equal(resumed.hypotheses, full.hypotheses)
    assert resumed.ledger.as_dict() == full.ledger.as_dict()


def test_zero_warm_up_rounds_is_the_round_without_it():
    a = module(warm_start_rounds=0)
    trainer(max_epochs=4).fit(a, SyntheticLinearMixtureDataModule(seed=0))
    c = base_module()  # the round without the argument
    trainer(max_epochs=4).fit(c, SyntheticLinearMixtureDataModule(seed=0))
    assert torch.equal(a.hypotheses, c.hypotheses)


def test_the_warm_up_is_public_configuration_in_the_logged_parameters():
    assert module(warm_start_rounds=20).hparams["warm_start_rounds"] == 20
    r = FederatedRound(LinearRegression(), num_hypotheses=3, warm_start_rounds=5, seed=0)
    assert r.hparams["warm_start_rounds"] == 5


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(num_hypotheses=1, warm_start_rounds=5), r"warm_start_rounds=5 needs num_hypotheses > 1"),
    (dict(warm_start_rounds=-1), "warm_start_rounds"),
    (dict(warm_start_rounds=2.5), "warm_start_rounds"),
])
def test_refused_warm_ups(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        module(**kwargs)
