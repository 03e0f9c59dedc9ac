"""Record-level DP-SGD inside federated clients (``update: local_dp_sgd``): the vectorized step against a naive
per-example autograd loop, the noise scale, Poisson batches, the per-client ledger against dp-accounting, calibration,
budget enforcement, refusals and resume."""

from __future__ import annotations

import logging
import math

import lightning as L
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.privacy_accountant import NeighboringRelation
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_dp.datamodules import SyntheticLinearMixtureDataModule
from lightning_dp.federated import FederatedRound
from lightning_dp.federated.local import FlatParams
from lightning_dp.federated.local_dp_sgd import ClientPlan, _draw_batch, local_dp_sgd, steps_per_participation
from lightning_dp.federated.parts import FedAvg, LocalDPSGD, UniformSelection
from lightning_dp.models import LinearRegression
from lightning_dp.privacy.ledger import RecordLedger
from lightning_dp.privacy.noise import SecretGenerator
from tests.helpers import ACCELERATORS
from tests.privacy.reference import per_example_gradients

logging.getLogger("absl").setLevel(logging.ERROR)


def _clients(sizes, features=5, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    nmax = max(sizes)
    x = torch.randn(len(sizes), nmax, features, generator=g)
    y = torch.randint(classes, (len(sizes), nmax), generator=g)
    mask = torch.arange(nmax)[None] < torch.tensor(sizes)[:, None]
    return x, y, mask


def _model(features=5, classes=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, 4), nn.Tanh(), nn.Linear(4, classes))


def _reference(template, spec, start, x, y, mask, plans, seeds, *, batch_size, clip, lr, sampling):
    """One client at a time, per-example gradients by autograd (tests/privacy/reference.py), the same draws."""
    out = []
    for c, (plan, seed) in enumerate(zip(plans, seeds)):
        g = torch.Generator().manual_seed(seed)
        model = _model()
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in spec.unflatten(start[c]).items():
                params[name].copy_(value)
        n = int(mask[c].sum())
        per_epoch = max(1, n // batch_size)
        order = None
        for step in range(plan.steps):
            if sampling == "poisson":
                idx = (torch.rand(n, generator=g) < plan.sample_rate).nonzero().flatten()
            else:
                if step % per_epoch == 0:
                    order = torch.randperm(n, generator=g)
                idx = order[(step % per_epoch) * batch_size:(step % per_epoch + 1) * batch_size]
            total = torch.zeros(spec.numel)
            if idx.numel():
                losses = nn.functional.cross_entropy(model(x[c, idx]), y[c, idx], reduction="none")
                _, grads = per_example_gradients(model, losses)
                for row in grads:
                    total += row * min(1.0, clip / (float(row.double().norm()) + 1e-6))
            noise = torch.randn(spec.numel, generator=g) * plan.noise_multiplier * clip
            with torch.no_grad():
                flat = spec.flatten(model) - lr * (total + noise) / batch_size
                for name, value in spec.unflatten(flat).items():
                    params[name].copy_(value)
        out.append(spec.flatten(model))
    return torch.stack(out)


@pytest.mark.parametrize("sampling", ["poisson", "shuffle"])
@pytest.mark.parametrize("engine", ["vmap", "loop"])
def test_local_dp_sgd_equals_a_per_example_autograd_loop_with_the_same_draws(engine, sampling):
    sizes = [13, 7, 20]
    x, y, mask = _clients(sizes)
    template = _model()
    spec = FlatParams.of(template)
    start = torch.randn(3, spec.numel, generator=torch.Generator().manual_seed(3)) * 0.3
    plans = [ClientPlan(steps_per_participation(n, 4, 2), min(1.0, 4 / n), s) for n, s in zip(sizes, (0.5, 1.0, 2.0))]
    seeds = [11, 12, 13]
    got = local_dp_sgd(template, spec, start, x, y, mask, plans=plans,
                       generators=[SecretGenerator().manual_seed(s) for s in seeds], batch_size=4, max_grad_norm=0.3,
                       lr=0.5, loss="cross_entropy", sampling=sampling, engine=engine)
    want = _reference(template, spec, start, x, y, mask, plans, seeds, batch_size=4, clip=0.3, lr=0.5,
                      sampling=sampling)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_clients_training_does_not_depend_on_its_companions():
    """The same client, alone or beside others (a DDP shard, a different vmap call): the same model."""
    x, y, mask = _clients([13, 7, 20])
    template = _model()
    spec = FlatParams.of(template)
    start = torch.zeros(3, spec.numel)
    plans = [ClientPlan(3, 0.3, 1.0)] * 3
    together = local_dp_sgd(template, spec, start, x, y, mask, plans=plans,
                            generators=[SecretGenerator().manual_seed(s) for s in (1, 2, 3)], batch_size=4,
                            max_grad_norm=1.0, lr=0.1, loss="cross_entropy")
    alone = local_dp_sgd(template, spec, start[1:2], x[1:2, :7], y[1:2, :7], mask[1:2, :7], plans=plans[1:2],
                         generators=[SecretGenerator().manual_seed(2)], batch_size=4, max_grad_norm=1.0, lr=0.1,
                         loss="cross_entropy")
    torch.testing.assert_close(together[1:2], alone, rtol=1e-6, atol=1e-7)


def test_the_noise_has_std_sigma_c_over_b_per_coordinate():
    """One step of a 7 850-parameter logistic regression on all-zero inputs: every per-example gradient of the
    weights is 0, so the 7 840 weight coordinates of the update carry only the noise, std lr sigma C / B. The sample
    std's relative error is ~0.8%; 4% is five of them."""
    model = nn.Linear(784, 10)
    spec = FlatParams.of(model)
    x = torch.zeros(1, 50, 784)
    y = torch.randint(10, (1, 50), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(1, 50, dtype=torch.bool)
    start = torch.zeros(1, spec.numel)
    out = local_dp_sgd(model, spec, start, x, y, mask, plans=[ClientPlan(1, 0.2, 3.0)],
                       generators=[SecretGenerator().manual_seed(5)], batch_size=10, max_grad_norm=1.0, lr=2.0,
                       loss="cross_entropy")
    weights = out[0, : 784 * 10]
    assert float(weights.std()) == pytest.approx(2.0 * 3.0 * 1.0 / 10, rel=0.04)
    assert abs(float(weights.mean())) < 5 * 0.6 / math.sqrt(weights.numel())


def test_poisson_batches_have_the_expected_size():
    """2 000 draws at q = 0.25 of 40 records: mean size 10 within 5 standard errors (sd sqrt(40 q (1 - q)) / sqrt(2000))."""
    g = torch.Generator().manual_seed(0)
    plan = ClientPlan(1, 0.25, 1.0)
    sizes = torch.tensor([_draw_batch(40, plan, 10, 0, None, g, torch.device("cpu")).numel() for _ in range(2000)],
                         dtype=torch.float64)
    assert abs(float(sizes.mean()) - 10) < 5 * math.sqrt(40 * 0.25 * 0.75 / 2000)


def test_every_draw_comes_from_the_client_generator():
    """Two clients trained with the same data and generators seeded alike agree; another seed disagrees."""
    x, y, mask = _clients([10, 10])
    x[1], y[1] = x[0], y[0]
    template = _model()
    spec = FlatParams.of(template)
    kwargs = dict(plans=[ClientPlan(2, 0.5, 1.0)] * 2, batch_size=5, max_grad_norm=1.0, lr=0.1, loss="cross_entropy")
    same = local_dp_sgd(template, spec, torch.zeros(2, spec.numel), x, y, mask,
                        generators=[SecretGenerator().manual_seed(4), SecretGenerator().manual_seed(4)], **kwargs)
    assert torch.equal(same[0], same[1])
    other = local_dp_sgd(template, spec, torch.zeros(2, spec.numel), x, y, mask,
                         generators=[SecretGenerator().manual_seed(4), SecretGenerator().manual_seed(5)], **kwargs)
    assert not torch.equal(other[0], other[1])


# ------------------------------------------------------------------------------------------------ the ledger
def _library_epsilon(history, delta, relation=NeighboringRelation.ADD_OR_REMOVE_ONE):
    """dp-accounting's own PLD accountant on the composed event (independent of lightning_dp's caching)."""
    accountant = pld_privacy_accountant.PLDAccountant(relation, value_discretization_interval=1e-4)
    for sigma, q, n in history:
        inner = dp_event.GaussianDpEvent(sigma)
        event = inner if q == 1.0 else dp_event.PoissonSampledDpEvent(q, inner)
        accountant.compose(dp_event.SelfComposedDpEvent(event, n))
    return accountant.get_epsilon(delta)


def test_the_record_ledger_is_the_library_composition_of_each_clients_steps():
    ledger = RecordLedger(delta=1e-5)
    for _ in range(3):
        ledger.charge("a", noise_multiplier=1.1, sample_rate=0.1, num_steps=9)
    ledger.charge("b", noise_multiplier=1.1, sample_rate=0.1, num_steps=9)
    ledger.charge("b", noise_multiplier=2.0, sample_rate=0.2, num_steps=4)
    assert ledger.spent("a") == pytest.approx(_library_epsilon([(1.1, 0.1, 27)], 1e-5), rel=1e-9)
    assert ledger.spent("b") == pytest.approx(_library_epsilon([(1.1, 0.1, 9), (2.0, 0.2, 4)], 1e-5), rel=1e-9)
    assert ledger.participations("a") == 3 and ledger.max() == ledger.spent("a")
    restored = RecordLedger(delta=1e-5)
    restored.load_state_dict(ledger.state_dict())
    assert restored.as_dict() == ledger.as_dict() and restored.participations("b") == 2
    with pytest.raises(ValueError, match="'delta': 1e-05"):
        RecordLedger(delta=1e-3).load_state_dict(ledger.state_dict())


def test_a_shuffled_epoch_is_one_gaussian_under_replacement():
    """Replacement moves a clipped sum by 2C: the Gaussian at sigma with sensitivity 2, i.e. add/remove at sigma / 2
    (the DPSGD callback's shuffled accounting)."""
    ledger = RecordLedger(delta=1e-5, adjacency="replace")
    ledger.charge("a", noise_multiplier=3.0, sample_rate=1.0, num_steps=4)
    assert ledger.spent("a") == pytest.approx(_library_epsilon([(1.5, 1.0, 4)], 1e-5), rel=1e-6)


# ------------------------------------------------------------------------------------------------ in the round
def _round(update, clients_per_round=100, **kwargs):
    return FederatedRound(LinearRegression(), selection=UniformSelection(clients_per_round), update=update,
                          aggregator=FedAvg(), seed=0, noise_seed=1, **kwargs)


def _trainer(**kwargs):
    defaults = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    accelerator="cpu", devices=1, max_epochs=3, num_sanity_val_steps=0, limit_val_batches=0,
                    log_every_n_steps=1)
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def test_every_participation_is_charged_at_its_clients_rate_and_steps(monkeypatch):
    from lightning_dp import tracking

    texts = {}
    monkeypatch.setattr(tracking, "log_text", lambda trainer, text, name: texts.__setitem__(name, text))
    update = LocalDPSGD(epochs=2, lr=0.05, batch_size=4, noise_multiplier=1.5, delta=1e-3)
    m = _round(update)
    dm = SyntheticLinearMixtureDataModule(seed=0)
    t = _trainer(max_epochs=3)
    t.fit(m, dm)
    # the record ledger's table: one row per training client, its spend, plan and participations
    header, *rows = texts["privacy/record_epsilon.tsv"].splitlines()
    assert header.split("\t")[:2] == ["client", "epsilon"] and len(rows) == len(dm.train_clients)
    first_row = rows[0].split("\t")
    assert first_row[0] == str(dm.train_clients[0].client_id) and first_row[2] == "inf" and first_row[6] == "3"
    assert float(first_row[1]) == pytest.approx(update.ledger.spent(dm.train_clients[0].client_id), rel=1e-5)
    sizes = [len(c) for c in dm.train_clients]
    for client, n in zip(dm.train_clients, sizes):
        steps = steps_per_participation(n, 4, 2)
        assert update.ledger.history(client.client_id) == [(1.5, min(1.0, 4 / n), 3 * steps)]
    first = dm.train_clients[0]
    assert update.ledger.spent(first.client_id) == pytest.approx(
        _library_epsilon(update.ledger.history(first.client_id), 1e-3), rel=1e-9)
    assert float(t.logged_metrics["privacy/record_epsilon_max"]) == pytest.approx(update.ledger.max(), rel=1e-12)


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_a_calibrated_client_spends_its_budget_and_no_more(accelerator):
    """target 2 over 3 full-participation rounds: every client ends within [2 / 1.1, 2] (calibration precision 1%);
    on a GPU too (the clients' batches and noise drawn there from their secret generators)."""
    update = LocalDPSGD(epochs=1, lr=0.05, batch_size=5, target_epsilon=2.0, delta=1e-3, accountant="rdp")
    t = _trainer(max_epochs=3, accelerator=accelerator)
    t.fit(_round(update), SyntheticLinearMixtureDataModule(seed=0))
    spend = update.ledger.as_dict()
    assert len(spend) == 100 and update.participations_planned == 3
    assert all(2 / 1.1 <= eps <= 2.0 for eps in spend.values())


def test_a_client_whose_budget_is_spent_declines():
    """sigma 1 at a budget that admits two participations: over five rounds nobody takes a third."""
    probe = RecordLedger(delta=1e-3, accountant="rdp")
    dm = SyntheticLinearMixtureDataModule(seed=0)
    dm.setup("fit")
    n = len(dm.train_clients[0])
    steps, q = steps_per_participation(n, 5, 1), 5 / n
    for _ in range(2):
        probe.charge("x", noise_multiplier=1.0, sample_rate=q, num_steps=steps)
    target = probe.spent("x") * 1.0001
    update = LocalDPSGD(epochs=1, lr=0.05, batch_size=5, noise_multiplier=1.0, target_epsilon=target, delta=1e-3,
                        accountant="rdp")
    t = _trainer(max_epochs=5)
    m = _round(update, clients_per_round=50)
    t.fit(m, dm)
    assert max(update.ledger.participations(c.client_id) for c in dm.train_clients) == 2
    assert update.ledger.max() <= target
    assert float(t.logged_metrics["round/declined"]) > 0


@pytest.mark.parametrize("bad", [
    dict(num_hypotheses=2),
    dict(aggregator=FedAvg(weighted=True)),
])
def test_choices_and_weights_that_leak_records_are_refused(bad):
    update = LocalDPSGD(batch_size=5, noise_multiplier=1.0)
    kwargs = dict(selection=UniformSelection(10), update=update, seed=0, noise_seed=1)
    kwargs.update(bad)
    with pytest.raises(MisconfigurationException, match="local_dp_sgd"):
        _trainer().fit(FederatedRound(LinearRegression(), **kwargs), SyntheticLinearMixtureDataModule(seed=0))


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "noise_multiplier .*, target_epsilon or budgets"),
    (dict(noise_multiplier=1.0, sampling="shuffle", adjacency="add_remove"), "adjacency='replace'"),
    (dict(noise_multiplier=1.0, adjacency="replace", accountant="rdp"), "needs accountant='pld'"),
    (dict(noise_multiplier=1.0, target_epsilon=-1.0), "target_epsilon must be a number > 0, got -1.0"),
    (dict(noise_multiplier=1.0, participations=0), "participations=0"),
    (dict(noise_multiplier=1.0, max_grad_norm=0.0), "max_grad_norm"),
])
def test_bad_settings_are_refused_with_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LocalDPSGD(**kwargs)


def test_calibration_needs_a_planned_number_of_rounds():
    update = LocalDPSGD(batch_size=5, target_epsilon=1.0)
    with pytest.raises(MisconfigurationException, match="max_epochs"):
        _trainer(max_epochs=-1, max_steps=2).fit(_round(update, clients_per_round=10), SyntheticLinearMixtureDataModule(seed=0))


def test_resume_equals_the_uninterrupted_run(tmp_path):
    def fit(epochs, ckpt=None, callbacks=()):
        update = LocalDPSGD(epochs=1, lr=0.05, batch_size=5, target_epsilon=3.0, delta=1e-3, accountant="rdp")
        m = _round(update, clients_per_round=30)
        _trainer(max_epochs=epochs, enable_checkpointing=bool(callbacks), callbacks=list(callbacks)).fit(
            m, SyntheticLinearMixtureDataModule(seed=0), ckpt_path=ckpt)
        return m, update

    full, full_update = fit(4, callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1,
                                                           filename="{epoch}")])
    resumed, resumed_update = fit(4, ckpt=str(tmp_path / "epoch=1.ckpt"))
    assert torch.equal(full.hypotheses, resumed.hypotheses)
    assert full_update.ledger.state_dict() == resumed_update.ledger.state_dict()
    assert full_update.noise_multipliers() == resumed_update.noise_multipliers()


def test_the_noise_comes_from_the_secret_seed():
    def run(noise_seed):
        update = LocalDPSGD(epochs=1, lr=0.05, batch_size=5, noise_multiplier=1.0)
        m = FederatedRound(LinearRegression(), selection=UniformSelection(10), update=update, seed=0,
                           noise_seed=noise_seed)
        _trainer(max_epochs=1).fit(m, SyntheticLinearMixtureDataModule(seed=0))
        return m.hypotheses.clone()

    assert torch.equal(run(3), run(3))
    assert not torch.equal(run(3), run(4))


def test_a_public_generator_is_refused():
    """The record-level accountant amplifies by the clients' batches: a generator that is not a SecretGenerator (one
    derived from the public seed, say) is refused before any step."""
    x, y, mask = _clients([6, 5])
    template = _model()
    spec = FlatParams.of(template)
    with pytest.raises(TypeError, match="SECRET seed"):
        local_dp_sgd(template, spec, torch.zeros(2, spec.numel), x, y, mask, plans=[ClientPlan(1, 0.5, 1.0)] * 2,
                     generators=[torch.Generator().manual_seed(4), SecretGenerator().manual_seed(5)], batch_size=2,
                     max_grad_norm=1.0, lr=0.1, loss="cross_entropy")
