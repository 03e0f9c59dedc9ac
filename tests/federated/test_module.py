"""The federated round module on the seed's synthetic mixture."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_dp.datamodules import SyntheticLinearMixtureDataModule
from lightning_dp.federated import PersonalizedFederatedModule
from lightning_dp.models import LinearRegression
from tests.helpers import ACCELERATORS, BlobsData, DeviceProbe

THETAS = torch.tensor([[5.0, 6.0], [4.0, -4.5]])


def module(**kwargs):
    defaults = dict(num_hypotheses=2, clients_per_round=7, local_epochs=1, local_lr=0.1, local_batch_size=10,
                    noise_multiplier=5.0, loss="rmse", seed=0, noise_seed=1)
    defaults.update(kwargs)
    return PersonalizedFederatedModule(LinearRegression(), **defaults)


def trainer(**kwargs):
    defaults = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    accelerator="cpu", devices=1, max_epochs=10)
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def test_synthetic_hypotheses_converge_and_every_participation_costs_n_over_nu():
    """The seed's setting (U=7, E=1, s=0.1, B_s=10, nu=5): the hypotheses of the best validation check are within
    0.5 of theta* (examples/fl_synthetic.yaml: within 0.50 over noise seeds 1-15)."""
    m = module()
    checks = []

    class Best(L.Callback):
        def on_validation_epoch_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                checks.append((float(trainer.callback_metrics["val/loss"]), pl_module.hypotheses.detach().clone()))

    trainer(max_epochs=300, check_val_every_n_epoch=10, callbacks=[Best()]).fit(m, SyntheticLinearMixtureDataModule(seed=0))
    dist = torch.cdist(min(checks, key=lambda c: c[0])[1], THETAS)
    assert dist.min(dim=0).values.max() < 0.5, m.hypotheses
    assert set(dist.argmin(dim=0).tolist()) == {0, 1}  # one hypothesis per true cluster
    assert m.participation_cost() == 0.4
    assert len(m.ledger) > 0
    for cid, spent in m.ledger.as_dict().items():
        assert spent == pytest.approx(0.4 * m.ledger.participations(cid), rel=1e-12)
    assert sum(m.ledger.participations(c) for c in m.ledger.as_dict()) == 7 * 300


def test_resume_equals_uninterrupted_run(tmp_path):
    full = module()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    trainer(max_epochs=20, callbacks=[ckpt], enable_checkpointing=True).fit(full, SyntheticLinearMixtureDataModule(seed=0))
    resumed = module(seed=123)  # the checkpoint's seed wins
    trainer(max_epochs=20).fit(resumed, SyntheticLinearMixtureDataModule(seed=0), ckpt_path=str(tmp_path / "epoch=9.ckpt"))
    assert int(resumed.rounds) == int(full.rounds) == 20
    assert torch.equal(resumed.hypotheses, full.hypotheses)
    assert resumed.ledger.state_dict() == full.ledger.state_dict()


@pytest.mark.parametrize("policy", ["replace", "skip"])
def test_privacy_cap_is_never_exceeded(policy):
    m = module(client_privacy_cap=0.85, cap_policy=policy)  # 0.4 per participation: two participations
    trainer(max_epochs=40).fit(m, SyntheticLinearMixtureDataModule(num_clients=30, seed=1))
    spend = m.ledger.as_dict()
    assert max(spend.values()) <= 0.85
    assert max(m.ledger.participations(c) for c in spend) == 2
    if policy == "replace":  # 30 clients x 2 participations = 60 = 8 full rounds of 7, then fewer
        assert len(spend) == 30


def test_validation_and_early_stopping():
    """Validation every 5 rounds, patience 6 checks: stops by itself once val/loss plateaus."""
    m = module()
    stop = EarlyStopping(monitor="val/loss", patience=6, mode="min")
    t = trainer(max_epochs=1000, callbacks=[stop], check_val_every_n_epoch=5)
    t.fit(m, SyntheticLinearMixtureDataModule(seed=0))
    assert 0 < stop.stopped_epoch < 999
    assert float(stop.best_score) < 1.0
    assert 0.0 <= float(t.callback_metrics["val/chose_0"]) <= 1.0


def test_non_private_baseline_has_no_ledger():
    m = module(noise_multiplier=0.0)
    trainer(max_epochs=5).fit(m, SyntheticLinearMixtureDataModule(seed=0))
    assert len(m.ledger) == 0 and m.participation_cost() == float("inf")


@pytest.mark.parametrize("kwargs,match", [
    (dict(noise_multiplier=-1.0), "noise_multiplier=-1.0"),
    (dict(loss="mse"), "loss='mse'"),
    (dict(num_hypotheses=0), "num_hypotheses=0"),
    (dict(client_privacy_cap=1.0, noise_multiplier=0.0), "needs a sanitizer that charges the clients"),
    (dict(cap_policy="wait"), "cap_policy='wait'"),
    (dict(client_engine="gpu"), "client_engine='gpu'"),
])
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        module(**kwargs)


def test_needs_a_federated_datamodule_and_enough_clients():
    with pytest.raises(MisconfigurationException, match="FederatedDataModule"):
        trainer(max_epochs=1).fit(module(), BlobsData())
    with pytest.raises(MisconfigurationException, match="clients_per_round=7"):
        trainer(max_epochs=1).fit(module(), SyntheticLinearMixtureDataModule(num_clients=5, seed=0))


def test_engines_agree():
    a, b, c = module(client_engine="vmap"), module(client_engine="loop"), module(client_engine="dense")
    for m in (a, b, c):
        trainer(max_epochs=5).fit(m, SyntheticLinearMixtureDataModule(seed=0))
    torch.testing.assert_close(a.hypotheses, b.hypotheses, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(c.hypotheses, a.hypotheses, rtol=1e-4, atol=1e-5)


def test_restore_best_weights_keeps_the_ledger_and_round_counter(tmp_path):
    """The best-validation hypotheses come back; the ledger keeps every round's spend (no under-reporting)."""
    from lightning_dp.callbacks import RestoreBestWeights

    m = module()
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="val/loss", mode="min", save_top_k=1)
    t = trainer(max_epochs=60, check_val_every_n_epoch=10, enable_checkpointing=True,
                callbacks=[ckpt, RestoreBestWeights()])
    t.fit(m, SyntheticLinearMixtureDataModule(seed=0))
    best = torch.load(ckpt.best_model_path, weights_only=False)
    assert torch.equal(m.hypotheses, best["state_dict"]["hypotheses"])
    assert int(m.rounds) == 60 and best["federated"]["rounds"] <= 60
    assert sum(m.ledger.participations(c) for c in m.ledger.as_dict()) == 7 * 60


def test_validation_checks_subsample_but_test_evaluates_every_client():
    from lightning_dp.federated import client_losses

    m = module(val_clients_per_check=3)
    data = SyntheticLinearMixtureDataModule(num_val_clients=20, seed=0)
    t = trainer(max_epochs=5, check_val_every_n_epoch=5, num_sanity_val_steps=0)
    t.fit(m, data)
    x, y, mask = data.padded("val")
    best = client_losses(m.template, m.spec, m.hypotheses, x, y, mask, "rmse").min(dim=1).values.double()
    from lightning_dp.federated.round import _VAL
    from lightning_dp.privacy.noise import derive_generator

    g = derive_generator(m.seed, _VAL, 5)
    picked = torch.randperm(20, generator=g)[:3]
    assert float(t.callback_metrics["val/loss"]) == pytest.approx(float(best[picked].mean()), rel=1e-6)
    (result,) = t.test(m, data, verbose=False)
    assert result["test/loss"] == pytest.approx(float(best.mean()), rel=1e-6)


def test_module_and_data_seeds_may_differ_in_logged_hyperparameters(tmp_path):
    """Lightning refuses to merge module and DataModule hparams with equal names and different values;
    our DataModules log theirs as data/<name>."""
    from lightning.pytorch.loggers import CSVLogger

    t = trainer(max_epochs=1, logger=CSVLogger(tmp_path), num_sanity_val_steps=0, limit_val_batches=0)
    t.fit(module(seed=2), SyntheticLinearMixtureDataModule(seed=0))
    hparams = t.logger.experiment.hparams
    assert hparams["seed"] == 2 and hparams["data/seed"] == 0


def test_per_layer_sanitizes_each_tensor_with_its_own_size(monkeypatch):
    """per_layer=True hands the sanitizer the tensor sizes n_l; the ledger still charges sum n_l / nu = n / nu."""
    import lightning_dp.federated.parts.sanitizers as mod
    from lightning_dp.models import HospitalMLP

    seen = []
    real = mod.sanitize_update

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append((kwargs["per_layer_sizes"], out.layer_costs, out.cost))
        return out

    monkeypatch.setattr(mod, "sanitize_update", spy)
    data = SyntheticLinearMixtureDataModule(seed=0, thetas=[[5.0, 6.0, 1.0], [4.0, -4.5, 0.0]])
    m = PersonalizedFederatedModule(HospitalMLP(), num_hypotheses=2, clients_per_round=5, noise_multiplier=2.0,
                                    per_layer=True, seed=0)
    trainer(max_epochs=2).fit(m, data)
    assert len(seen) == 10
    for sizes, layer_costs, cost in seen:
        assert sizes == [6, 2, 2, 1]  # Linear(3, 2) weight and bias, Linear(2, 1) weight and bias
        assert layer_costs == pytest.approx([3.0, 1.0, 1.0, 0.5]) and cost == pytest.approx(5.5)
    assert set(m.ledger.as_dict().values()) <= {5.5, 11.0}


def test_accuracy_and_group_fairness_of_the_chosen_hypotheses_match_fairlearn():
    """Every test client picks its best hypothesis; test/acc and test/fairness/* are fairlearn's values on the
    pooled predictions of those choices (the personalized model), against the sensitive groups."""
    from fairlearn.metrics import demographic_parity_difference, equal_opportunity_difference, equalized_odds_difference

    from lightning_dp.datamodules import SyntheticFairnessDataModule
    from lightning_dp.federated import client_losses

    m = PersonalizedFederatedModule(LinearRegression(bias=True), num_hypotheses=2, clients_per_round=20,
                                    local_lr=0.5, noise_multiplier=1.0, loss="binary_cross_entropy", seed=0)
    data = SyntheticFairnessDataModule(num_clients=100, num_val_clients=10, num_test_clients=30, seed=0)
    t = trainer(max_epochs=30, num_sanity_val_steps=0, check_val_every_n_epoch=10)
    t.fit(m, data)
    assert "val/fairness/demographic_parity_difference" in t.callback_metrics and "val/acc" in t.callback_metrics
    (result,) = t.test(m, data, verbose=False)
    x, y, mask = data.padded("test")
    choice = client_losses(m.template, m.spec, m.hypotheses, x, y, mask, m.loss_name).argmin(dim=1)
    preds, labels, groups = [], [], []
    for c, client in enumerate(data.test_clients):
        model = LinearRegression(bias=True)
        torch.nn.utils.vector_to_parameters(m.hypotheses[choice[c]], model.parameters())
        preds += (model(client.x) >= 0).long().tolist()
        labels += client.y.tolist()
        groups += client.sensitive.tolist()
    preds_t, labels_t = torch.tensor(preds), torch.tensor(labels)
    assert result["test/acc"] == pytest.approx(float((preds_t == labels_t).double().mean()), abs=1e-9)
    for name, fn in (("demographic_parity_difference", demographic_parity_difference),
                     ("equalized_odds_difference", equalized_odds_difference),
                     ("equal_opportunity_difference", equal_opportunity_difference)):
        expected = fn(labels, preds, sensitive_features=groups)
        assert result[f"test/fairness/{name}"] == pytest.approx(expected, abs=1e-6), name
    for g in (0, 1):
        rate = float(preds_t[torch.tensor(groups) == g].double().mean())
        assert result[f"test/fairness/selection_rate/group_{g}"] == pytest.approx(rate, abs=1e-9)


def test_test_every_check_logs_the_test_clients_at_each_check_and_changes_nothing_else():
    """test_every_check: a test/* learning curve during fit (issue 27: PDP-FL Fig. 4 on a label-skewed partition);
    the run is otherwise the same run, and the last check's test/acc is what trainer.test gives."""
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_dp.datamodules import SyntheticFairnessDataModule

    class Checks(Callback):
        def __init__(self):
            self.seen = []

        def on_validation_end(self, trainer, pl_module):
            self.seen.append({k: float(v) for k, v in trainer.callback_metrics.items() if k[:4] in ("val/", "test")})

    runs = {}
    for flag in (False, True):
        m = PersonalizedFederatedModule(torch.nn.Linear(2, 2), num_hypotheses=2, clients_per_round=20, local_lr=0.5,
                                        noise_multiplier=1.0, loss="cross_entropy", seed=0, noise_seed=1,
                                        test_every_check=flag)
        data = SyntheticFairnessDataModule(num_clients=100, num_val_clients=10, num_test_clients=20, seed=0)
        checks = Checks()
        t = trainer(max_epochs=6, num_sanity_val_steps=0, check_val_every_n_epoch=3, callbacks=[checks])
        t.fit(m, data)
        runs[flag] = (checks.seen, m.hypotheses.clone(), t.test(m, data, verbose=False)[0])
    (plain, h0, r0), (curve, h1, r1) = runs[False], runs[True]
    assert torch.equal(h0, h1) and r0 == r1
    assert len(curve) == 2 and all("test/acc" in c and "test/loss" in c for c in curve)
    assert all(not any(k.startswith("test") for k in c) for c in plain)
    assert [{k: v for k, v in c.items() if k.startswith("val/")} for c in curve] == plain
    assert curve[-1]["test/acc"] == pytest.approx(r1["test/acc"], abs=1e-12)

    with pytest.raises(MisconfigurationException, match="test_every_check=True but SyntheticLinearMixtureDataModule has no test"):
        trainer(max_epochs=1).fit(module(test_every_check=True), SyntheticLinearMixtureDataModule(num_clients=20, seed=0))


def test_regression_data_logs_no_accuracy_and_no_fairness():
    m = module()
    t = trainer(max_epochs=2, num_sanity_val_steps=0, check_val_every_n_epoch=1)
    t.fit(m, SyntheticLinearMixtureDataModule(num_clients=20, seed=0))
    assert "val/loss" in t.callback_metrics
    assert not any(k.startswith(("val/acc", "val/fairness")) for k in t.callback_metrics)


@pytest.mark.parametrize("loss", ["rmse", "cross_entropy"])
def test_class_score_models_log_argmax_accuracy_and_fairness(loss):
    """Two class scores trained with cross-entropy or the RMSE (root Brier) loss: predictions are the argmax."""
    from lightning_dp.datamodules import SyntheticFairnessDataModule
    from lightning_dp.federated import client_losses

    m = PersonalizedFederatedModule(torch.nn.Linear(2, 2), num_hypotheses=2, clients_per_round=20, local_lr=0.5,
                                    noise_multiplier=1.0, loss=loss, seed=0)
    data = SyntheticFairnessDataModule(num_clients=100, num_val_clients=10, num_test_clients=20, seed=0)
    t = trainer(max_epochs=30, num_sanity_val_steps=0, check_val_every_n_epoch=30)
    t.fit(m, data)
    (result,) = t.test(m, data, verbose=False)
    x, y, mask = data.padded("test")
    choice = client_losses(m.template, m.spec, m.hypotheses, x, y, mask, loss).argmin(dim=1)
    correct = total = 0
    for c, client in enumerate(data.test_clients):
        weight, bias = m.spec.unflatten(m.hypotheses[choice[c]]).values()
        correct += int(((client.x @ weight.T + bias).argmax(1) == client.y).sum())
        total += len(client)
    assert result["test/acc"] == pytest.approx(correct / total, abs=1e-9)
    assert result["test/acc"] > 0.75 and "test/fairness/equalized_odds_difference" in result


def test_noise_seed_is_a_secret_kept_apart_from_the_public_seed(tmp_path):
    """seed (initialization, client sampling) is logged; noise_seed regenerates every release's noise: it is
    kept out of hyperparameters, under "secret" in local checkpoints, out of public ones and logged configs."""
    from lightning_dp.cli import redact_secrets
    from lightning_dp.tracking import public_checkpoint

    m = module(noise_seed=123)
    assert "noise_seed" not in m.hparams and m.hparams["seed"] == 0
    t = trainer(max_epochs=2)
    t.fit(m, SyntheticLinearMixtureDataModule(seed=0))
    t.save_checkpoint(tmp_path / "local.ckpt")
    local = torch.load(tmp_path / "local.ckpt", weights_only=False)
    assert local["federated"]["secret"] == {"noise_seed": 123} and local["federated"]["seed"] == 0
    assert "secret" not in public_checkpoint(local)["federated"]
    text = ("model:\n  class_path: lightning_dp.federated.PersonalizedFederatedModule\n  init_args:\n"
            "    seed: 0\n    noise_seed: 123\n")
    redacted = redact_secrets(text)
    assert "noise_seed: null" in redacted and "seed: 0" in redacted and "123" not in redacted

    other = module(noise_seed=None)
    resumed = trainer(max_epochs=3)
    resumed.fit(other, SyntheticLinearMixtureDataModule(seed=0), ckpt_path=str(tmp_path / "local.ckpt"))
    assert other._noise_seed == 123  # a local resume without a given noise seed continues the same noise streams


def test_checkpoints_without_a_secret_noise_seed_resume_with_a_fresh_one(tmp_path):
    """A public checkpoint, or one of version 2 whose noise came from the logged seed: the resumed rounds must not
    draw noise derivable from the record."""
    t = trainer(max_epochs=1)
    t.fit(module(noise_seed=123), SyntheticLinearMixtureDataModule(seed=0))
    t.save_checkpoint(tmp_path / "c.ckpt")
    ckpt = torch.load(tmp_path / "c.ckpt", weights_only=False)
    del ckpt["federated"]["secret"]
    ckpt["federated"]["version"] = 2
    torch.save(ckpt, tmp_path / "old.ckpt")
    resumed = module(noise_seed=None)
    with pytest.warns(UserWarning, match="no secret noise seed"):
        trainer(max_epochs=2).fit(resumed, SyntheticLinearMixtureDataModule(seed=0), ckpt_path=str(tmp_path / "old.ckpt"))
    assert resumed._noise_seed not in (0, 123) and int(resumed.rounds) == 2
    branched = module(noise_seed=9)  # a given noise seed wins over the checkpoint's (grid branches)
    trainer(max_epochs=2).fit(branched, SyntheticLinearMixtureDataModule(seed=0), ckpt_path=str(tmp_path / "c.ckpt"))
    assert branched._noise_seed == 9


def test_progress_bar_shows_round_clients_and_client_epsilon_and_the_run_ends_with_a_summary(capsys):
    """Item 7 of issue 17: the federated run is not silent, and says at the end what it did and spent."""

    class Bar(L.Callback):
        def __init__(self):
            self.seen, self.ledger_max = [], []

        def on_train_batch_end(self, trainer, pl_module, *args):
            self.seen.append(dict(trainer.progress_bar_callback.get_metrics(trainer, pl_module)))
            self.ledger_max.append(pl_module.ledger.max())

    bar = Bar()
    m = module()
    t = trainer(max_epochs=4, enable_progress_bar=True, callbacks=[bar])
    t.fit(m, SyntheticLinearMixtureDataModule(num_clients=30, num_val_clients=5, seed=0))
    assert [s["round"] for s in bar.seen] == [1.0, 2.0, 3.0, 4.0]
    assert all(s["clients"] == 7.0 for s in bar.seen)
    assert [s["client_eps_max"] for s in bar.seen] == pytest.approx(bar.ledger_max)
    assert bar.seen[-1]["client_eps_med"] == pytest.approx(m.ledger.median())
    assert not {"round", "clients", "client_eps_max"} & set(t.logged_metrics)  # the bar's names stay off the loggers
    out = capsys.readouterr().out
    lines = out[out.index("PersonalizedFederatedModule: 4 rounds"):].splitlines()
    assert lines[:4] == [
        "PersonalizedFederatedModule: 4 rounds",
        "  clients         7 per round (28 participations this fit; 30 training clients, uniform selection)",
        f"  client epsilon  median {m.ledger.median():.4g}, max {m.ledger.max():.4g} (client epsilon spent "
        "(d-privacy, per ||delta||-neighbourhood))",
        f"  val/loss        {float(t.callback_metrics['val/loss']):.4g} (last validation)"]


def test_summary_of_a_resumed_and_of_a_non_private_run(tmp_path, capsys):
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    trainer(max_epochs=3, callbacks=[ckpt], enable_checkpointing=True).fit(module(), SyntheticLinearMixtureDataModule(seed=0))
    trainer(max_epochs=5).fit(module(), SyntheticLinearMixtureDataModule(seed=0), ckpt_path=str(tmp_path / "epoch=2.ckpt"))
    assert "PersonalizedFederatedModule: 5 rounds, 2 in this fit\n" in capsys.readouterr().out
    trainer(max_epochs=2).fit(module(noise_multiplier=0.0), SyntheticLinearMixtureDataModule(seed=0))
    out = capsys.readouterr().out
    assert "  privacy   none: the clients' releases are not sanitized and nothing is accounted" in out
    assert "client epsilon" not in out


@pytest.mark.skipif("gpu" not in ACCELERATORS, reason="needs a CUDA GPU")
def test_on_a_gpu_the_personalized_round_picks_the_same_clients_and_spends_the_same():
    """The IFCA round with d-privacy on the GPU and the CPU, the same seeds and negligible noise (nu = 1e-6): the
    same clients (selection on the CPU), the same ledger, and hypotheses within rounding (stated tolerance 1e-4 of
    their norm; the Laplace draws and the local shuffles come from the GPU's own generator: full local batches
    here, so the order does not matter)."""
    runs = []
    for accelerator in ("cpu", "gpu"):
        m, probe = module(noise_multiplier=1e-6, local_batch_size=1000), DeviceProbe()
        trainer(max_epochs=12, accelerator=accelerator, callbacks=[probe]).fit(m, SyntheticLinearMixtureDataModule(seed=0))
        runs.append(m)
    cpu, gpu = runs
    assert probe.devices == {"cuda"}
    assert gpu.ledger.as_dict() == cpu.ledger.as_dict() and len(cpu.ledger) > 0
    assert torch.linalg.vector_norm(gpu.hypotheses.cpu() - cpu.hypotheses) <= 1e-4 * torch.linalg.vector_norm(
        cpu.hypotheses)
