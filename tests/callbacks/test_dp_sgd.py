"""End-to-end tests of the DPSGD callback on ordinary LightningModules."""

from __future__ import annotations

import copy
import math

import dp_accounting as dpa
import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.callbacks import DPSGD
from tests.helpers import BlobsData, Classifier, blobs, trainer


class GradProbe(L.Callback):
    """Records the batch and the gradients DPSGD hands to the optimizer."""

    def __init__(self):
        self.batches, self.grads = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append([t.clone() for t in batch])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append([p.grad.clone() for p in pl_module.parameters()])


class ParamsLogger(Logger):
    """Records the params and the names of the metrics a run logs."""

    def __init__(self):
        super().__init__()
        self.params, self.metric_names, self.metrics = {}, set(), []

    name, version = "params", 0

    def log_hyperparams(self, params, *args, **kwargs):
        self.params.update(params)

    def log_metrics(self, metrics, step=None):
        self.metric_names.update(metrics)
        self.metrics.append((step, dict(metrics)))


def library_epsilon(sigma, q, steps, delta=1e-5):
    acc = dpa.pld.PLDAccountant()
    acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps))
    return acc.get_epsilon(delta)


def test_epsilon_equals_library_value_and_is_logged():
    dp = DPSGD(noise_multiplier=1.1, max_grad_norm=1.0, seed=0)
    logged = {}

    class Capture(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            logged.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("privacy/", "nonprivate/"))})

    logger = ParamsLogger()
    t = trainer(max_epochs=2, callbacks=[dp, Capture()], log_every_n_steps=1, logger=logger)
    t.fit(Classifier(), BlobsData(n=200, batch_size=20))
    assert t.global_step == 20  # 2 epochs x ceil(200 / 20)
    expected = library_epsilon(1.1, 0.1, 20)
    assert dp.epsilon == pytest.approx(expected, rel=1e-9)
    assert logged["privacy/epsilon"] == pytest.approx(expected, rel=1e-9)
    # what is fixed for the run is a param, logged once; only what moves (epsilon) is a metric
    assert logger.params["privacy/noise_multiplier"] == 1.1 and logger.params["privacy/max_grad_norm"] == 1.0
    assert logger.params["privacy/target_delta"] == 1e-5 and logger.params["privacy/sample_rate"] == 0.1
    assert not {"privacy/delta", "privacy/noise_multiplier", "privacy/max_grad_norm", "privacy/sample_rate"} & (
        set(logged) | logger.metric_names)
    assert 0.0 <= logged["nonprivate/clipped_fraction"] <= 1.0

    # the writes before the last are the accountant's cheaper bound (the PLD at 1e-3), the last its own (1e-4)
    series = [(step, m["privacy/epsilon"]) for step, m in logger.metrics if "privacy/epsilon" in m]
    assert [step for step, _ in series] == list(range(20)) and series[-1][1] == pytest.approx(expected, rel=1e-9)
    coarse = dpa.pld.PLDAccountant(value_discretization_interval=1e-3)
    coarse.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.1)), 5))
    assert series[4][1] == pytest.approx(coarse.get_epsilon(1e-5), rel=1e-9)
    coarse = dpa.pld.PLDAccountant(value_discretization_interval=1e-3)
    coarse.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.1)), 10))
    assert series[9][1] == pytest.approx(coarse.get_epsilon(1e-5), rel=1e-9)  # an epoch's end: the same


def test_gradient_is_clipped_sum_over_expected_batch_size():
    """With negligible noise the released gradient equals the naive clipped sum / (q N)."""
    c = 0.05
    probe = GradProbe()
    model = Classifier()
    init = copy.deepcopy(model)
    # noise std sigma*C/(qN) = 2.5e-7 per coordinate; atol 4e-6 is 16 standard deviations
    dp = DPSGD(noise_multiplier=1e-4, max_grad_norm=c, seed=3, accountant="rdp")
    trainer(max_steps=1, callbacks=[dp, probe]).fit(model, BlobsData(n=200, batch_size=20))
    x, y = probe.batches[0]
    params = list(init.parameters())
    rows = []
    for i in range(x.shape[0]):
        g = torch.autograd.grad(F.cross_entropy(init(x[i:i + 1]), y[i:i + 1]), params)
        rows.append(torch.cat([t.reshape(-1) for t in g]))
    per = torch.stack(rows)
    assert per.norm(dim=1).min() > c  # every example is clipped
    factors = (c / (per.norm(dim=1) + 1e-6)).clamp(max=1)
    expected = (factors[:, None] * per).sum(0) / 20.0  # q N = 0.1 * 200
    got = torch.cat([t.reshape(-1) for t in probe.grads[0]])
    torch.testing.assert_close(got, expected, rtol=0, atol=4e-6)


def test_noise_std_matches_sigma_c_over_expected_batch():
    """Zero per-sample gradients: the released gradient is pure noise of std sigma*C/(qN).

    P = 10,100 coordinates; the sample std has relative standard error 1/sqrt(2P) = 0.7%, so a
    5% tolerance is 7 standard errors (false-failure rate < 1e-11).
    """

    class ZeroGrad(Classifier):
        def training_step(self, batch, batch_idx):
            x, _ = batch
            return (self.net(x) * 0).mean()

    probe = GradProbe()
    sigma, c = 2.0, 3.0
    dp = DPSGD(noise_multiplier=sigma, max_grad_norm=c, seed=7)
    model = ZeroGrad(d=100, classes=100, hidden=100, net=nn.Sequential(nn.Linear(100, 100)))
    trainer(max_steps=1, callbacks=[dp, probe]).fit(model, BlobsData(n=200, batch_size=20, d=100, classes=100))
    flat = torch.cat([g.reshape(-1) for g in probe.grads[0]])
    assert flat.numel() == 10100
    assert flat.std().item() == pytest.approx(sigma * c / 20.0, rel=0.05)
    assert flat.mean().abs().item() < 5 * sigma * c / 20.0 / math.sqrt(flat.numel())


def test_budget_stop_before_exceeding_target():
    target = 4.0
    dp = DPSGD(noise_multiplier=0.9, target_epsilon=target, max_grad_norm=1.0, seed=0)
    t = trainer(max_epochs=50, callbacks=[dp])
    t.fit(Classifier(), BlobsData(n=200, batch_size=20))
    steps = t.global_step
    assert 0 < steps < 500
    assert dp.epsilon <= target
    assert library_epsilon(0.9, 0.1, steps) <= target < library_epsilon(0.9, 0.1, steps + 1)


def test_calibrated_noise_meets_target_for_planned_epochs():
    dp = DPSGD(target_epsilon=2.0, target_delta=1e-3, max_grad_norm=1.0, epochs=3, seed=0)
    t = trainer(max_epochs=3, callbacks=[dp])
    t.fit(Classifier(), BlobsData(n=200, batch_size=20))
    assert t.global_step == 30
    assert dp.epsilon <= 2.0
    assert dp.epsilon > 1.9  # calibrated, not wastefully far below
    assert dp.noise_multiplier > 0


def test_budget_too_small_for_one_step_stops_before_training():
    dp = DPSGD(noise_multiplier=0.5, target_epsilon=1e-3, max_grad_norm=1.0, seed=0)
    model = Classifier()
    before = [p.detach().clone() for p in model.parameters()]
    t = trainer(max_epochs=1, callbacks=[dp])
    with pytest.warns(UserWarning, match="no further step fits"):
        t.fit(model, BlobsData())
    assert t.global_step == 0 and dp.epsilon == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _fit(tmp_path, epochs, ckpt=None, name="run"):
    torch.manual_seed(0)
    model = Classifier()
    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=0.5, seed=11)
    t = trainer(max_epochs=epochs, callbacks=[dp], default_root_dir=tmp_path / name)
    t.fit(model, BlobsData(n=150, batch_size=10), ckpt_path=ckpt)
    return t, model, dp


def test_exact_resume_from_checkpoint(tmp_path):
    _, full_model, full_dp = _fit(tmp_path, 3, name="full")
    t1, _, _ = _fit(tmp_path, 2, name="part")
    path = tmp_path / "mid.ckpt"
    t1.save_checkpoint(path)
    t2, resumed_model, resumed_dp = _fit(tmp_path, 3, ckpt=str(path), name="resumed")
    assert t2.global_step == 45
    assert resumed_dp.epsilon == full_dp.epsilon
    assert resumed_dp.accountant.history == full_dp.accountant.history
    for a, b in zip(full_model.parameters(), resumed_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_empty_poisson_batches_release_noise_only():
    probe = GradProbe()
    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    # q = 1/200: most batches are empty
    t = trainer(max_steps=30, callbacks=[dp, probe])
    t.fit(Classifier(), BlobsData(n=200, batch_size=1))
    sizes = [b[0].shape[0] for b in probe.batches]
    assert 0 in sizes and t.global_step == 30
    empty = sizes.index(0)
    assert all(torch.count_nonzero(g) > 0 for g in probe.grads[empty])  # noise was released


# --------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs,match", [
    (dict(noise_multiplier=0.0), "noise_multiplier=0.0"),
    (dict(noise_multiplier=-1.0), "noise_multiplier=-1.0"),
    (dict(noise_multiplier=1.0, max_grad_norm=0.0), "max_grad_norm=0.0"),
    (dict(noise_multiplier=1.0, max_grad_norm=float("inf")), "max_grad_norm=inf"),
    (dict(), "noise_multiplier=<sigma> or target_epsilon"),
    # the accountant's own checks (lightning_dp.privacy.accounting), with the argument's name
    (dict(target_epsilon=-1.0), "target_epsilon must be a number > 0, got -1.0"),
    (dict(target_epsilon=float("inf")), "target_epsilon must be finite, got inf: pass None for no budget"),
    (dict(noise_multiplier=1.0, target_delta=1.0), r"target_delta must be a number in \(0, 1\), got 1.0"),
    (dict(noise_multiplier=1.0, accountant="nope"), "nope"),
    (dict(target_epsilon=1.0, epochs=2, max_steps=3), "not both"),
    (dict(noise_multiplier=1.0, adjacency="swap"), "adjacency='swap' is not allowed"),
    (dict(noise_multiplier=1.0, adjacency="replace", accountant="rdp"), "adjacency='replace'.*needs accountant='pld'"),
    (dict(noise_multiplier=1.0, poisson_sampling=False, adjacency="add_remove"), "adjacency='replace' only"),
])
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPSGD(**kwargs)


def test_delta_not_below_one_over_n_warns():
    with pytest.warns(UserWarning, match="not below 1/N"):
        trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, target_delta=0.05, seed=0)]).fit(
            Classifier(), BlobsData(n=50, batch_size=5))


def test_the_delta_warning_comes_from_the_shared_function_and_delta_below_one_over_n_is_silent():
    """The same text as every accountant's (lightning_dp.privacy.delta), once; 1/N = 0.02 for N = 50."""
    import warnings

    from lightning_dp.privacy.delta import LargeDeltaWarning, check_delta_for_size

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, target_delta=0.02, seed=0)]).fit(
            Classifier(), BlobsData(n=50, batch_size=5))
    ours = [w for w in caught if issubclass(w.category, LargeDeltaWarning)]
    assert [str(w.message) for w in ours] == [str(check_delta_for_size(0.02, 50, unit="examples", who="DPSGD"))]
    assert str(ours[0].message).startswith(
        "DPSGD: target_delta=0.02 is not below 1/N = 0.02 (N = 50 training examples)")
    with warnings.catch_warnings():
        warnings.simplefilter("error", LargeDeltaWarning)  # delta < 1/N: no warning at all
        trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, target_delta=0.019, seed=0)]).fit(
            Classifier(), BlobsData(n=50, batch_size=5))


def test_batchnorm_is_refused_with_layer_name_and_fixed_on_request():
    net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    with pytest.raises(MisconfigurationException, match=r"net\.1 \(BatchNorm1d\).*GroupNorm"):
        trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)]).fit(Classifier(net=net), BlobsData())
    model = Classifier(net=nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)))
    with pytest.warns(UserWarning, match="GroupNorm"):
        trainer(max_steps=2, callbacks=[DPSGD(noise_multiplier=1.0, seed=0, replace_batchnorm=True)]).fit(
            model, BlobsData())
    assert isinstance(model.net[1], nn.GroupNorm)


def test_orthogonal_householder_is_refused_with_the_fix():
    """orthogonal()'s Householder map (torch's default on a matrix that is not square) keeps each column's sign in a
    diagonal without gradient, which DP-SGD's noise moves: torch then zeroes or scales columns at the first step
    (lightning_dp.privacy.validators.find_noise_broken_parametrizations). Refused before any data, with the map to
    use; matrix_exp trains."""
    from torch.nn.utils import parametrizations

    net = nn.Sequential(parametrizations.orthogonal(nn.Linear(6, 8)), nn.Tanh(), nn.Linear(8, 3))
    with pytest.raises(MisconfigurationException, match=r"0\.weight is parametrized by orthogonal\(\) with the "
                                                        r"Householder map.*orthogonal_map='matrix_exp'"):
        trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)]).fit(Classifier(net=net), BlobsData())
    frozen = nn.Sequential(parametrizations.orthogonal(nn.Linear(6, 8)), nn.Tanh(), nn.Linear(8, 3))
    frozen[0].requires_grad_(False)  # nothing of it trained: nothing noised
    model = Classifier(net=nn.Sequential(parametrizations.orthogonal(nn.Linear(6, 8), orthogonal_map="matrix_exp"),
                                         nn.Tanh(), nn.Linear(8, 3)))
    for ok in (Classifier(net=frozen), model):
        trainer(max_steps=2, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)]).fit(ok, BlobsData())
    w = model.net[0].weight
    torch.testing.assert_close(w.T @ w, torch.eye(6), atol=1e-5, rtol=0)


def test_a_householder_layer_made_in_configure_model_is_refused_when_training_starts():
    """configure_model (and the module's setup) run after the callbacks' setup: DPSGD checks the model again when
    training starts (a review: such a layer trained, two of its columns zeroed after 6 steps)."""
    from torch.nn.utils import parametrizations, parametrize

    class Late(Classifier):
        def configure_model(self):
            if not parametrize.is_parametrized(self.net[0]):
                parametrizations.orthogonal(self.net[0])

    with pytest.raises(MisconfigurationException, match=r"net\.0\.weight is parametrized by orthogonal\(\) with "
                                                        r"the Householder map"):
        trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)]).fit(Late(), BlobsData())

    class LateNorm(Classifier):  # the same gap for a layer that mixes the batch's examples
        def configure_model(self):
            if not isinstance(self.net[1], nn.BatchNorm1d):
                self.net[1] = nn.BatchNorm1d(16)

    with pytest.raises(MisconfigurationException, match=r"net\.1 \(BatchNorm1d\).*GroupNorm"):
        trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)]).fit(LateNorm(), BlobsData())


def test_several_optimizers_refused():
    class Two(Classifier):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = True

        def configure_optimizers(self):
            return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[2].parameters(), lr=0.1)]

    with pytest.raises(Exception, match="optimizer"):
        trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)]).fit(Two(), BlobsData())


def test_model_without_trainable_parameters_refused():
    model = Classifier()
    model.net.requires_grad_(False)
    with pytest.raises(Exception, match="no trainable parameters"):
        trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)]).fit(model, BlobsData())


@pytest.mark.parametrize("reduce,match", [("none", "shape"), ("sum", "summed loss"), ("reduction=sum", "summed loss"),
                                          ("mse reduction=sum", "summed loss")])
def test_loss_must_be_scalar_mean(reduce, match):
    class Bad(Classifier):
        def training_step(self, batch, batch_idx):
            x, y = batch
            if reduce == "reduction=sum":
                return F.cross_entropy(self(x), y, reduction="sum") / 2  # through a scaling
            if reduce == "mse reduction=sum":
                return F.mse_loss(self(x), F.one_hot(y, 3).float(), reduction="sum")
            return F.cross_entropy(self(x), y, reduction="none") if reduce == "none" else \
                F.cross_entropy(self(x), y, reduction="none").sum()

    with pytest.raises(MisconfigurationException, match=match):
        trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)]).fit(Bad(), BlobsData())


@pytest.mark.parametrize("mean", ["sum / len", "reduction=sum / len", "sum * (1 / len)"])
def test_a_sum_divided_by_the_batch_size_is_a_mean(mean):
    class HandMean(Classifier):
        def training_step(self, batch, batch_idx):
            x, y = batch
            if mean == "reduction=sum / len":
                return F.cross_entropy(self(x), y, reduction="sum") / len(x)
            total = F.cross_entropy(self(x), y, reduction="none").sum()
            return total / x.shape[0] if mean == "sum / len" else total * (1 / len(x))

    t = trainer(max_steps=2, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)])
    t.fit(HandMean(), BlobsData())
    assert t.global_step == 2


def test_from_datasets_datamodule_works():
    dm = L.LightningDataModule.from_datasets(train_dataset=blobs(), batch_size=10)
    dp = DPSGD(noise_multiplier=1.0, seed=0)
    t = trainer(max_steps=3, callbacks=[dp])
    t.fit(Classifier(), datamodule=dm)
    assert t.global_step == 3 and dp.epsilon > 0


def test_shuffled_batches_are_accounted_per_epoch_without_amplification():
    dp = DPSGD(noise_multiplier=4.0, max_grad_norm=1.0, poisson_sampling=False, seed=0)
    t = trainer(max_epochs=2, callbacks=[dp])
    t.fit(Classifier(), BlobsData(n=200, batch_size=20))
    assert t.global_step == 20
    assert dp.accountant.history == [(2.0, 1.0, 2)]
    acc = dpa.pld.PLDAccountant()
    acc.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(2.0), 2))
    assert dp.epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)


def test_model_flattening_the_batch_dimension_is_refused():
    """(B, T, d) -> (B*T, d) before every layer would clip tokens instead of examples."""

    class Tokens(Classifier):
        def __init__(self):
            super().__init__(net=nn.Linear(3, 3))

        def forward(self, x):
            return self.net(x.reshape(-1, 3)).reshape(x.shape[0], 2, 3).mean(1)

    with pytest.raises(MisconfigurationException, match=r"without a batch dimension.*clip tokens instead of examples"):
        trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)]).fit(Tokens(), BlobsData(d=6))


def test_custom_sampler_replacement_is_announced():
    class Weighted(BlobsData):
        def train_dataloader(self):
            sampler = torch.utils.data.WeightedRandomSampler(torch.ones(len(self.train_set)), len(self.train_set))
            return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler)

    with pytest.warns(UserWarning, match="WeightedRandomSampler"):
        trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)]).fit(Classifier(), Weighted())


def test_exact_resume_from_mid_epoch_checkpoint(tmp_path):
    """A checkpoint written in the middle of an epoch (step 23 of 45, epoch = 15 steps) resumes the same
    batches and noise, ending with the epsilon and parameters of the uninterrupted run."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    full_model = Classifier()
    full_dp = DPSGD(noise_multiplier=1.0, max_grad_norm=0.5, seed=11)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=23, save_top_k=-1,
                           filename="{step}")
    t1 = trainer(max_epochs=3, callbacks=[full_dp, ckpt], enable_checkpointing=True, default_root_dir=tmp_path)
    t1.fit(full_model, BlobsData(n=150, batch_size=10))
    assert t1.global_step == 45
    t2, resumed_model, resumed_dp = _fit(tmp_path, 3, ckpt=str(tmp_path / "ckpts" / "step=23.ckpt"), name="resumed")
    assert t2.global_step == 45
    assert resumed_dp.accountant.history == full_dp.accountant.history
    assert resumed_dp.epsilon == full_dp.epsilon
    for a, b in zip(full_model.parameters(), resumed_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_second_fit_with_the_same_callback_draws_fresh_noise_and_keeps_accounting():
    """Trainer.global_step restarts in a new fit; reusing step-keyed noise would cancel in differences."""

    class ZeroGrad(Classifier):
        def training_step(self, batch, batch_idx):
            return (self.net(batch[0]) * 0).mean()

    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=5)
    probe = GradProbe()
    model = ZeroGrad()
    for _ in range(2):
        trainer(max_steps=1, callbacks=[dp, probe]).fit(model, BlobsData())
    first, second = (torch.cat([g.reshape(-1) for g in grads]) for grads in probe.grads)
    assert not torch.allclose(first, second)
    assert dp.accountant.history == [(1.0, 0.1, 2)]


def test_replacement_adjacency_is_accounted_with_the_library_replace_one_analysis():
    """The same release (Poisson batches, clipped sum, noise); epsilon is the library's for REPLACE_ONE."""
    dp = DPSGD(noise_multiplier=1.1, max_grad_norm=1.0, seed=0, adjacency="replace")
    t = trainer(max_epochs=1, callbacks=[dp])
    t.fit(Classifier(), BlobsData(n=200, batch_size=20))
    acc = dpa.pld.PLDAccountant(dpa.NeighboringRelation.REPLACE_ONE)
    acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.1)), 10))
    assert dp.accountant.history == [(1.1, 0.1, 10)] and dp.accountant.adjacency == "replace"
    assert dp.epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    assert dp.epsilon > library_epsilon(1.1, 0.1, 10)


# ----------------------------------------------- a Trainer whose length disagrees with DPSGD's epochs/max_steps
def _infos(monkeypatch):
    """The rank-zero info lines of the callback and of its length planning."""
    import lightning_dp.callbacks.dp_sgd_plan as dp_sgd_plan
    import lightning_dp.callbacks.private_step as private_step
    import lightning_dp.callbacks.run_length as run_length

    messages = []
    for module in (dp_sgd_plan, private_step, run_length):
        monkeypatch.setattr(module, "rank_zero_info", lambda message, *args, **kwargs: messages.append(message))
    return messages


def _sigma_for(steps, target=2.0, q=0.1):
    from lightning_dp.privacy.calibration import calibrate_noise_multiplier

    return calibrate_noise_multiplier(target_epsilon=target, target_delta=1e-3, sample_rate=q, steps=steps,
                                      accountant="pld")


def test_shorter_trainer_recalibrates_to_the_target_and_says_so(monkeypatch, capsys):
    """A YAML's epochs=6 with --trainer.max_epochs=2: the noise is calibrated for the 2 epochs that run.

    Before, sigma stayed calibrated for 6 epochs and the run ended at about half its budget, silently.
    """
    infos = _infos(monkeypatch)
    dp = DPSGD(target_epsilon=2.0, target_delta=1e-3, epochs=6, seed=0)
    t = trainer(max_epochs=2, callbacks=[dp])
    t.fit(Classifier(), BlobsData(n=200, batch_size=20))
    assert t.global_step == 20 and dp.accountant.history == [(dp.noise_multiplier, 0.1, 20)]
    assert dp.noise_multiplier == _sigma_for(20)
    # never above the target; close to it (calibration: sigma (1 - 2 * 0.01) would exceed it)
    assert 0.95 * 2.0 <= dp.epsilon <= 2.0
    assert library_epsilon(dp.noise_multiplier, 0.1, 20, delta=1e-3) == pytest.approx(dp.epsilon, rel=1e-9)
    (message,) = [m for m in infos if "the Trainer stops" in m]
    assert message.startswith("DPSGD: the Trainer stops after 2 epochs (Trainer max_epochs=2, 20 steps), DPSGD "
                              "planned 6 epochs (epochs=6, 60 steps): calibrating the noise for the Trainer's length")
    assert "pass calibrate_for='callback'" in message and "DPSGD(epochs=2)" in message
    out = capsys.readouterr().out
    assert "DPSGD: 20 private steps (2 epochs of 10 steps)" in out
    assert f"noise multiplier  {dp.noise_multiplier:.4g} (calibrated for 20 steps)" in out


def test_calibrate_for_callback_keeps_the_callbacks_plan_for_a_shorter_trainer(monkeypatch):
    """One run trained over several fits: sigma for DPSGD's 6 epochs; this 2-epoch fit spends less."""
    infos = _infos(monkeypatch)
    dp = DPSGD(target_epsilon=2.0, target_delta=1e-3, epochs=6, seed=0, calibrate_for="callback")
    t = trainer(max_epochs=2, callbacks=[dp])
    t.fit(Classifier(), BlobsData(n=200, batch_size=20))
    assert t.global_step == 20 and dp.noise_multiplier == _sigma_for(60)
    assert dp.epsilon < 0.75 * 2.0
    assert any("calibrate_for='callback'" in m and "spends less than target_epsilon" in m for m in infos)


def test_longer_trainer_is_refused_before_any_step_with_both_values_and_the_fixes():
    probe = GradProbe()
    dp = DPSGD(target_epsilon=2.0, target_delta=1e-3, epochs=2, seed=0)
    t = trainer(max_epochs=6, callbacks=[dp, probe])
    with pytest.raises(MisconfigurationException) as err:
        t.fit(Classifier(), BlobsData(n=200, batch_size=20))
    assert probe.batches == [] and t.global_step == 0 and len(dp.accountant) == 0
    assert str(err.value) == (
        "DPSGD plans 2 epochs (epochs=2, 20 steps) but the Trainer runs up to 6 epochs (Trainer max_epochs=6, 60 "
        "steps): the noise would be calibrated for the plan and target_epsilon=2.0 would stop training there. Make them "
        "agree (Trainer(max_epochs=2) or DPSGD(epochs=6); in lightning-dp --trainer.max_epochs=2 or, for the last "
        "callback, --trainer.callbacks.init_args.epochs=6), or pass calibrate_for='trainer' (noise for the Trainer's "
        "length) or 'callback' (stop at the plan).")
    assert len(str(err.value)) < 480  # was 900 characters; names the fix for a script and for the command line


def test_the_progress_bar_epsilon_is_current_at_every_epoch_end():
    """10 steps per epoch never reach a logging interval of 50: the bar still shows each epoch's final spend."""
    seen = []

    class Bar(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            seen.append((float(trainer.progress_bar_metrics["privacy/epsilon"]),
                         dp.accountant.interim_epsilon(1e-3), dp.epsilon))

    dp = DPSGD(target_epsilon=2.0, target_delta=1e-3, epochs=3, seed=0)
    t = trainer(max_epochs=3, log_every_n_steps=50, callbacks=[dp, Bar()])
    t.fit(Classifier(), BlobsData(n=200, batch_size=20))
    # the epochs before the last show the current spend's cheaper bound (interim_epsilon), the last the final spend
    assert len(seen) == 3 and all(bar == pytest.approx(interim, rel=1e-9) for bar, interim, _ in seen[:2]), seen
    assert seen[2][0] == pytest.approx(seen[2][2], rel=1e-9)
    assert all(bar == pytest.approx(now, rel=1e-3) for bar, _, now in seen)


def test_longer_trainer_is_refused_from_the_settings_alone():
    """The epochs-against-epochs refusal needs no data: check_fit (called by lightning-dp before Trainer.fit and
    by setup) refuses from the Trainer and the module alone."""
    dp = DPSGD(target_epsilon=2.0, target_delta=1e-3, epochs=2, seed=0)
    with pytest.raises(MisconfigurationException, match=r"plans 2 epochs \(epochs=2\) but the Trainer runs up to 6"):
        dp.check_fit(trainer(max_epochs=6, callbacks=[dp]), Classifier())
    dp.check_fit(trainer(max_epochs=2, callbacks=[dp]), Classifier())  # agreeing lengths pass
    dp.check_fit(trainer(max_epochs=6, callbacks=[dp]), Classifier(), ckpt_path="last.ckpt")  # resume: at train start
    given = DPSGD(noise_multiplier=1.0, epochs=2, seed=0)  # no calibration: nothing to disagree about
    given.check_fit(trainer(max_epochs=6, callbacks=[given]), Classifier())


def test_longer_trainer_with_calibrate_for_trainer_or_callback(capsys):
    """'trainer': the noise is spread over the Trainer's 4 epochs; 'callback': the budget stops training after 2."""
    for choice, steps in (("trainer", 40), ("callback", 20)):
        dp = DPSGD(target_epsilon=2.0, target_delta=1e-3, epochs=2, seed=0, calibrate_for=choice)
        t = trainer(max_epochs=4, callbacks=[dp])
        t.fit(Classifier(), BlobsData(n=200, batch_size=20))
        assert t.global_step == steps and dp.noise_multiplier == _sigma_for(steps), choice
        assert 0.95 * 2.0 <= dp.epsilon <= 2.0, choice
    assert "stopped           after step 20: DPSGD's planned length is done" in capsys.readouterr().out


def test_max_steps_and_train_dataloaders_follow_the_same_rule(monkeypatch):
    """DPSGD(max_steps=40) with Trainer(max_steps=15) and fit(train_dataloaders=...): calibrated for 15 steps."""
    infos = _infos(monkeypatch)
    dp = DPSGD(target_epsilon=2.0, target_delta=1e-3, max_steps=40, seed=0)
    t = trainer(max_steps=15, max_epochs=-1, callbacks=[dp])
    t.fit(Classifier(), train_dataloaders=DataLoader(blobs(200), batch_size=20))
    assert t.global_step == 15 and dp.noise_multiplier == _sigma_for(15)
    assert 0.95 * 2.0 <= dp.epsilon <= 2.0
    (message,) = [m for m in infos if "the Trainer stops" in m]
    assert "after 15 steps (Trainer max_steps=15), DPSGD planned 40 steps (max_steps=40)" in message
    assert "--trainer.callbacks.init_args.max_steps=15" in message
    with pytest.raises(MisconfigurationException, match=r"DPSGD plans 40 steps \(max_steps=40\) but the Trainer runs "
                                                        r"up to 60 steps \(Trainer max_steps=60\)"):
        trainer(max_steps=60, max_epochs=-1, callbacks=[DPSGD(target_epsilon=2.0, max_steps=40, seed=0)]).fit(
            Classifier(), train_dataloaders=DataLoader(blobs(200), batch_size=20))


def test_a_given_noise_multiplier_is_never_recalibrated():
    """With noise_multiplier given, the lengths only bound the budget: nothing is refused or changed."""
    dp = DPSGD(noise_multiplier=1.0, target_epsilon=50.0, epochs=2, seed=0)
    t = trainer(max_epochs=3, callbacks=[dp])
    t.fit(Classifier(), BlobsData(n=200, batch_size=20))
    assert dp.noise_multiplier == 1.0 and dp.accountant.history == [(1.0, 0.1, 20)]  # DPSGD's plan of 2 epochs


def test_resume_keeps_the_sigma_it_was_trained_with(tmp_path, monkeypatch):
    """The checkpoint's sigma wins over any length: a resumed run is never recalibrated, and never exceeds its target.

    (a) a run planned for 4 epochs, trained as two fits (calibrate_for='callback'), resumed with a Trainer that
    now disagrees (3 epochs): the first fit's sigma. (b) a run recalibrated for a 2-epoch Trainer, resumed with a
    longer Trainer: its sigma again; the budget is spent, so no further step is taken.
    """
    infos = _infos(monkeypatch)
    first = DPSGD(target_epsilon=2.0, target_delta=1e-3, epochs=4, seed=3, calibrate_for="callback")
    t1 = trainer(max_epochs=2, callbacks=[first], default_root_dir=tmp_path)
    t1.fit(Classifier(), BlobsData(n=200, batch_size=20))
    t1.save_checkpoint(tmp_path / "a.ckpt")
    sigma = first.noise_multiplier
    assert sigma == _sigma_for(40) and first.state_dict()["noise_multiplier"] == sigma
    infos.clear()
    resumed = DPSGD(target_epsilon=2.0, target_delta=1e-3, epochs=4)
    t2 = trainer(max_epochs=3, callbacks=[resumed], default_root_dir=tmp_path)
    t2.fit(Classifier(), BlobsData(n=200, batch_size=20), ckpt_path=str(tmp_path / "a.ckpt"))
    assert t2.global_step == 30 and resumed.noise_multiplier == sigma
    assert resumed.accountant.history == [(sigma, 0.1, 30)] and resumed.epsilon <= 2.0
    assert not any("calibrat" in m for m in infos)

    short = DPSGD(target_epsilon=2.0, target_delta=1e-3, epochs=4, seed=3)  # auto: recalibrated for 2 epochs
    t3 = trainer(max_epochs=2, callbacks=[short], default_root_dir=tmp_path)
    t3.fit(Classifier(), BlobsData(n=200, batch_size=20))
    t3.save_checkpoint(tmp_path / "b.ckpt")
    assert short.noise_multiplier == _sigma_for(20)
    longer = DPSGD(target_epsilon=2.0, target_delta=1e-3, epochs=4)
    t4 = trainer(max_epochs=4, callbacks=[longer], default_root_dir=tmp_path)
    t4.fit(Classifier(), BlobsData(n=200, batch_size=20), ckpt_path=str(tmp_path / "b.ckpt"))
    assert longer.noise_multiplier == short.noise_multiplier and t4.global_step == 20
    assert longer.accountant.history == short.accountant.history and longer.epsilon <= 2.0
    # (c) a resume whose Trainer runs longer than the callback's epochs (6 > 4): the restored sigma decides, so it is
    # not refused (setup cannot tell a resume from a fresh fit: Lightning sets ckpt_path after it)
    beyond = DPSGD(target_epsilon=2.0, target_delta=1e-3, epochs=4)
    t5 = trainer(max_epochs=6, callbacks=[beyond], default_root_dir=tmp_path)
    t5.fit(Classifier(), BlobsData(n=200, batch_size=20), ckpt_path=str(tmp_path / "a.ckpt"))
    assert beyond.noise_multiplier == sigma and beyond.epsilon <= 2.0 and t5.global_step > 20


def test_final_epsilon_is_written_when_lightning_writes_no_step_metrics():
    """log_every_n_steps=0 and a budget stop: Lightning writes nothing at the stop, so on_train_end writes the spend
    (found by review: the stop was taken for a write)."""
    from tests.helpers import RecordingLogger

    logger = RecordingLogger()
    dp = DPSGD(noise_multiplier=0.8, target_epsilon=2.0, target_delta=1e-3, seed=0)
    t = trainer(max_epochs=50, log_every_n_steps=0, logger=logger, callbacks=[dp])
    t.fit(Classifier(), BlobsData(n=200, batch_size=20))
    assert dp.calibration.budget.stopped_at is not None and t.global_step < 500  # stopped by the budget
    assert logger.series("privacy/epsilon")[-1] == pytest.approx(dp.epsilon)


def test_calibrate_for_is_checked():
    with pytest.raises(ValueError, match="calibrate_for='steps' is not allowed: pass one of auto, trainer, callback"):
        DPSGD(target_epsilon=1.0, calibrate_for="steps")


def test_a_sampling_rate_that_changes_becomes_a_metric():
    """q is a param at fit start; a reloaded loader with another batch size makes privacy/sample_rate a metric."""

    class Growing(BlobsData):
        def train_dataloader(self):
            size = self.batch_size * (2 if self.trainer.current_epoch else 1)
            return DataLoader(self.train_set, batch_size=size, shuffle=True)

    logger = ParamsLogger()
    dp = DPSGD(noise_multiplier=1.0, seed=0)
    t = trainer(max_epochs=2, callbacks=[dp], logger=logger, log_every_n_steps=1, reload_dataloaders_every_n_epochs=1)
    t.fit(Classifier(), Growing(n=200, batch_size=20))
    assert logger.params["privacy/sample_rate"] == 0.1
    rates = [m["privacy/sample_rate"] for _, m in logger.metrics if "privacy/sample_rate" in m]
    assert rates and set(rates) == {0.2}
    assert "privacy/noise_multiplier" not in logger.metric_names


def test_lightnings_implicit_max_epochs_leaves_the_callbacks_plan_in_charge(monkeypatch):
    """Trainer() without max_epochs (Lightning sets 1000, a safeguard) and DPSGD(epochs=2): calibrated for 2 epochs,
    the run ends there at the target (as the README's first example does it), not refused."""
    infos = _infos(monkeypatch)
    dp = DPSGD(target_epsilon=2.0, target_delta=1e-3, epochs=2, seed=0)
    t = trainer(max_epochs=None, callbacks=[dp])
    t.fit(Classifier(), BlobsData(n=200, batch_size=20))
    assert dp.noise_multiplier == _sigma_for(20) and t.global_step == 20
    assert 0.95 * 2.0 <= dp.epsilon <= 2.0
    assert any("Lightning's default max_epochs=1000" in m for m in infos)


class PackedClassifier(Classifier):
    """Sequences of unequal lengths through an LSTM fed a PackedSequence (unsorted): the layer the engine replays
    through the packing (issue 25, item 4)."""

    def __init__(self):
        super().__init__(net=nn.Linear(5, 3))
        self.lstm = nn.LSTM(6, 5, batch_first=True)

    def forward(self, x):
        lengths = (x.abs().sum(-1) > 0).sum(1).clamp_min(1)  # zero rows are padding
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        return self.net(h[-1])


def test_packed_sequences_and_sparse_max_norm_embeddings_train_and_sparse_adam_is_refused():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 7, 6, generator=g)
    for i in range(120):  # lengths 1..7, padded with zero rows
        x[i, 1 + i % 7:] = 0
    y = torch.randint(0, 3, (120,), generator=g)
    model = PackedClassifier()
    dp = DPSGD(noise_multiplier=1.0, seed=0)
    t = trainer(max_epochs=1, callbacks=[dp])
    t.fit(model, train_dataloaders=DataLoader(TensorDataset(x, y), batch_size=20))
    assert t.global_step == dp._released == 6

    class Tokens(Classifier):
        def __init__(self, optimizer):
            super().__init__(net=nn.Sequential(nn.Embedding(50, 4, sparse=True, max_norm=1.0), nn.Flatten(),
                                               nn.Linear(12, 3)))
            self.optimizer = optimizer

        def configure_optimizers(self):
            return self.optimizer(self.parameters(), lr=0.1)

    ids = torch.randint(0, 50, (100, 3), generator=g)
    labels = torch.randint(0, 3, (100,), generator=g)
    tokens = Tokens(torch.optim.Adam)
    t = trainer(max_steps=3, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)])
    t.fit(tokens, train_dataloaders=DataLoader(TensorDataset(ids, labels), batch_size=20))
    assert t.global_step == 3 and (tokens.net[0].weight.norm(dim=1) <= 1.0 + 0.5).all()
    with pytest.raises(MisconfigurationException, match="SparseAdam needs sparse gradients.*Use torch.optim.Adam"):
        trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)]).fit(
            Tokens(torch.optim.SparseAdam), train_dataloaders=DataLoader(TensorDataset(ids, labels), batch_size=20))


def test_the_loader_runs_the_planned_steps_per_epoch():
    """ceil(1/q) and ceil(N / expected batch) differ in floating point for some sizes (N = 49, batch 1: 50 vs 49):
    the Poisson loader runs the plan's count, which calibration and the budget assumed."""
    dp = DPSGD(noise_multiplier=1.0, seed=0)
    ds = TensorDataset(torch.randn(49, 6), torch.randint(0, 3, (49,)))
    t = trainer(max_epochs=1, callbacks=[dp])
    t.fit(Classifier(), train_dataloaders=DataLoader(ds, batch_size=1))
    assert dp.data_facts.steps_per_epoch == 49 == t.global_step == dp._released


def test_the_householder_check_sees_every_way_it_is_trained():
    """find_noise_broken_parametrizations: a subclass of torch's orthogonal parametrization (a review found it
    missed), nested modules; not the matrix exponential, Cayley, or a frozen original."""
    from torch.nn.utils import parametrizations, parametrize
    from torch.nn.utils.parametrizations import _Orthogonal, _OrthMaps

    from lightning_dp.privacy.validators import find_noise_broken_parametrizations

    class Mine(_Orthogonal):
        pass

    sub = nn.Linear(6, 4)
    parametrize.register_parametrization(sub, "weight", Mine(sub.weight, _OrthMaps.householder))
    nested = nn.Sequential(nn.Sequential(parametrizations.orthogonal(nn.Linear(6, 4))))
    frozen = parametrizations.orthogonal(nn.Linear(6, 4))
    frozen.requires_grad_(False)
    assert find_noise_broken_parametrizations(sub) == ["weight"]
    assert find_noise_broken_parametrizations(nested) == ["0.0.weight"]
    for fine in (frozen, parametrizations.orthogonal(nn.Linear(6, 4), orthogonal_map="matrix_exp"),
                 parametrizations.orthogonal(nn.Linear(6, 4), orthogonal_map="cayley")):
        assert find_noise_broken_parametrizations(fine) == []
