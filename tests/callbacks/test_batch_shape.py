"""DPSGD(max_batch_size=...): batches of one shape (issue 53). Padded rows add nothing; the release equals the
dynamic mode's; the spend is dp-accounting's truncated event; a compiled model compiles once."""

from __future__ import annotations

import dp_accounting as dpa
import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.callbacks import DPSGD, OneRunAudit
from tests.callbacks.test_dp_sgd import GradProbe, ParamsLogger
from tests.helpers import BlobsData, Classifier, blobs, trainer


def truncated_epsilon(size, q, bound, sigma, steps, delta=1e-5):
    event = dpa.SelfComposedDpEvent(dpa.TruncatedSubsampledGaussianDpEvent(size, q, bound, sigma), steps)
    return dpa.pld.PLDAccountant().compose(event).get_epsilon(delta)


def fit(max_batch_size=None, *, seed=3, epochs=1, loader=None, dp_kwargs=None, **trainer_kwargs):
    torch.manual_seed(0)
    model = Classifier().double()
    dp = DPSGD(noise_multiplier=1.1, max_grad_norm=1.0, seed=seed, max_batch_size=max_batch_size, **(dp_kwargs or {}))
    probe, logger = GradProbe(), ParamsLogger()
    t = trainer(max_epochs=epochs, callbacks=[dp, probe], logger=logger, log_every_n_steps=1, **trainer_kwargs)
    x, y = blobs(200).tensors
    t.fit(model, train_dataloaders=loader or DataLoader(TensorDataset(x.double(), y), batch_size=20))
    return dp, probe, logger, model


@pytest.mark.parametrize("split", [{}, {"accumulate_grad_batches": 2}, {"max_physical_batch_size": 7}],
                         ids=["whole", "micro-batches", "chunks"])
def test_release_equals_the_dynamic_modes(split):
    """The blank rows still have gradients (the biases: zero inputs, a class-0 label), so a mask that let one
    through would move the release; padded or not, the same sampled examples give the same gradient."""
    loader_kwargs = {"batch_size": 10} if "accumulate_grad_batches" in split else {"batch_size": 20}
    x, y = blobs(200).tensors
    loader = DataLoader(TensorDataset(x.double(), y), **loader_kwargs)
    dp_kwargs = {"max_physical_batch_size": split["max_physical_batch_size"]} if "max_physical_batch_size" in split \
        else {}
    trainer_kwargs = {k: v for k, v in split.items() if k == "accumulate_grad_batches"}
    dyn, dyn_probe, _, dyn_model = fit(None, loader=loader, dp_kwargs=dp_kwargs, **trainer_kwargs)
    static, probe, logger, model = fit(48, loader=loader, dp_kwargs=dp_kwargs, **trainer_kwargs)
    rows = 48 // (2 if trainer_kwargs else 1)
    assert {b[0].shape[0] for b in probe.batches} == {rows}  # one shape every step
    assert len(probe.grads) == len(dyn_probe.grads) == 10
    for g_static, g_dyn in zip(probe.grads, dyn_probe.grads):
        for a, b in zip(g_static, g_dyn):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    for a, b in zip(model.parameters(), dyn_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # the blank rows are blank, and they follow the sampled ones
    for batch, dyn_batch in zip(probe.batches, dyn_probe.batches):
        n = dyn_batch[0].shape[0]
        assert torch.equal(batch[0][:n], dyn_batch[0]) and not batch[0][n:].any() and not batch[1][n:].any()
    # accounted as the truncated event over N + 1 = 201 records (a neighbour holds one more), bound 48
    assert static.accountant.history == dyn.accountant.history == [(1.1, 0.1, 10)]
    assert static.epsilon == pytest.approx(truncated_epsilon(201, 0.1, 48, 1.1, 10), rel=1e-9)
    assert static.epsilon >= dyn.epsilon
    assert logger.params["privacy/max_batch_size"] == 48 and logger.params["privacy/truncated_batch_size"] == 48
    assert logger.params["privacy/truncated_dataset_size"] == 201
    # nonprivate/clipped_fraction counts the sampled examples only: the dynamic run's value
    fractions = [m["nonprivate/clipped_fraction"] for _, m in logger.metrics if "nonprivate/clipped_fraction" in m]
    assert fractions and all(0.0 <= f <= 1.0 for f in fractions)


def test_a_tight_bound_truncates_to_a_uniform_subset_and_is_accounted():
    """q = 0.1 of 200, bound 24: a Poisson batch exceeds it with probability 0.15 per step; every batch holds at
    most 24 sampled rows and the spend is the library's truncated event at that bound."""
    static, probe, _, _ = fit(24, epochs=2)
    real = [int((b[0].abs().sum(1) > 0).sum()) for b in probe.batches]
    assert max(real) <= 24 and len(real) == 20
    assert real.count(24) >= 2  # truncated (P(Binomial(200, 0.1) > 24) = 0.13 per step: this seed's draws)
    assert static.epsilon == pytest.approx(truncated_epsilon(201, 0.1, 24, 1.1, 20), rel=1e-9)


def test_auto_bound_and_calibration_for_a_budget():
    torch.manual_seed(0)
    dp = DPSGD(target_epsilon=2.0, target_delta=1e-5, max_grad_norm=1.0, epochs=2, seed=0, max_batch_size="auto",
               batch_overflow_probability=1e-3)
    logger = ParamsLogger()
    trainer(max_epochs=2, callbacks=[dp], logger=logger).fit(Classifier(), BlobsData(n=200, batch_size=20))
    bound = logger.params["privacy/max_batch_size"]
    assert 20 < bound < 200 and logger.params["privacy/batch_overflow_probability"] <= 1e-3
    assert dp.epsilon <= 2.0
    sigma = logger.params["privacy/noise_multiplier"]
    assert truncated_epsilon(201, 0.1, bound, sigma, 20) == pytest.approx(dp.epsilon, rel=1e-9)


def _checkpointed_fit(tmp_path, epochs, bound, ckpt=None, name="run"):
    torch.manual_seed(0)
    model = Classifier()
    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=0.5, seed=11, max_batch_size=bound)
    t = trainer(max_epochs=epochs, callbacks=[dp], default_root_dir=tmp_path / name)
    t.fit(model, BlobsData(n=150, batch_size=10), ckpt_path=ckpt)
    return t, model, dp


def test_exact_resume_and_a_changed_bound_refused(tmp_path):
    _, full_model, full_dp = _checkpointed_fit(tmp_path, 3, 20, name="full")
    t1, _, _ = _checkpointed_fit(tmp_path, 2, 20, name="part")
    path = tmp_path / "mid.ckpt"
    t1.save_checkpoint(path)
    _, resumed_model, resumed_dp = _checkpointed_fit(tmp_path, 3, 20, ckpt=str(path), name="resumed")
    assert resumed_dp.epsilon == full_dp.epsilon and resumed_dp.accountant.history == full_dp.accountant.history
    for a, b in zip(full_model.parameters(), resumed_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for bound in (30, None):
        with pytest.raises((ValueError, MisconfigurationException), match="mid-run"):
            _checkpointed_fit(tmp_path, 3, bound, ckpt=str(path), name=f"changed{bound}")


def test_a_compiled_model_compiles_once():
    """With one shape, torch.compile (dynamic=False) compiles the model's forward and backward for the first
    step and never again; Poisson batches of varying size recompile for new sizes."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    frames = {}
    for bound in (48, None):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        seen: list[int] = []

        class Compiled(Classifier):
            def __init__(self):
                super().__init__()
                self.compiled = torch.compile(self.net, backend=counter, dynamic=False)

            def training_step(self, batch, batch_idx):
                x, y = batch
                return F.cross_entropy(self.compiled(x), y)

        class Count(L.Callback):
            def on_train_batch_end(self, *args):
                seen.append(counter.frame_count)

        dp = DPSGD(noise_multiplier=1.1, max_grad_norm=1.0, seed=3, max_batch_size=bound)
        trainer(max_epochs=2, callbacks=[dp, Count()]).fit(Compiled(), BlobsData(n=200, batch_size=20))
        frames[bound] = seen
    assert len(set(frames[48])) == 1  # compiled before the first step ended, never after
    assert frames[None][-1] > frames[None][0]  # new batch sizes recompiled


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_batch_size=0), "max_batch_size=0 is not allowed"),
    (dict(max_batch_size="big"), "max_batch_size='big' is not allowed"),
    (dict(max_batch_size=64, batch_overflow_probability=0.0), "batch_overflow_probability=0.0"),
    (dict(max_batch_size=64, accountant="rdp"), "accountant='rdp'"),
    (dict(max_batch_size=64, poisson_sampling=False), "poisson_sampling=False"),
    (dict(max_batch_size=64, privacy_unit="user", max_examples_per_user=2), "privacy_unit='user'"),
    (dict(accountant_kwargs={"truncated_batch_size": 10, "dataset_size": 100}), "pass max_batch_size instead"),
])
def test_constructor_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPSGD(noise_multiplier=1.0, **kwargs)


@pytest.mark.parametrize("bound,match", [(30, "multiple of 4"), (36, "below the expected batch size 40")])
def test_data_refusals(bound, match):
    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=0, max_batch_size=bound)
    with pytest.raises(MisconfigurationException, match=match):
        trainer(max_epochs=1, callbacks=[dp], accumulate_grad_batches=4).fit(Classifier(),
                                                                             BlobsData(n=200, batch_size=10))


def test_one_run_audit_refused():
    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=0, max_batch_size=64)
    with pytest.raises(MisconfigurationException, match="max_batch_size=None"):
        dp.attach_audit(OneRunAudit(num_canaries=10))


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_mixed_precision_and_frozen_layers_follow_the_dynamic_release(precision):
    """A half-precision forward and an adapter-like model (the first layer frozen): the padded step still releases
    what the dynamic one releases (to bfloat16's rounding of the forward under bf16-mixed)."""
    grads = {}
    for bound in (None, 48):
        torch.manual_seed(0)
        model = Classifier()
        model.net[0].requires_grad_(False)  # only the head trains, as with adapters
        dp = DPSGD(noise_multiplier=1.1, max_grad_norm=1.0, seed=3, max_batch_size=bound)
        seen: list[list[torch.Tensor]] = []

        class HeadGrads(L.Callback):
            def on_before_optimizer_step(self, trainer, pl_module, optimizer):
                assert pl_module.net[0].weight.grad is None  # frozen: never trained
                seen.append([p.grad.clone() for p in pl_module.net[2].parameters()])

        trainer(max_epochs=1, callbacks=[dp, HeadGrads()], precision=precision).fit(model,
                                                                                     BlobsData(n=200, batch_size=20))
        grads[bound] = seen
    tolerance = 2e-2 if precision == "bf16-mixed" else 1e-6
    assert len(grads[48]) == len(grads[None]) == 10
    for g_static, g_dyn in zip(grads[48], grads[None]):
        for a, b in zip(g_static, g_dyn):  # the head's weight and bias
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, rtol=0, atol=tolerance)


@pytest.mark.parametrize("strategy", ["quantile", "oso"])
def test_adaptive_clipping_counts_and_dot_products_leave_the_padding_out(strategy):
    """QuantileClipping's unclipped count and OSO's dot products see only the sampled rows: their released
    thresholds follow the dynamic mode's step for step."""
    from lightning_dp.callbacks import OnlineSensitivity, QuantileClipping

    traces = {}
    for bound in (None, 48):
        torch.manual_seed(0)
        cb = (QuantileClipping(noise_multiplier=1.0, count_noise_std=2.0, seed=6, max_batch_size=bound)
              if strategy == "quantile" else
              OnlineSensitivity(noise_multiplier=1.0, clip_lr=0.2, lr_lr=0.1, seed=5, max_batch_size=bound))
        x, y = blobs(200).tensors
        trainer(max_epochs=1, callbacks=[cb]).fit(Classifier().double(), train_dataloaders=DataLoader(
            TensorDataset(x.double(), y), batch_size=20))
        traces[bound] = [c for _, c, *_ in cb.clipping.trace]
    assert len(traces[48]) == len(traces[None]) == 10
    assert traces[48] == pytest.approx(traces[None], rel=1e-9)


class Sequences(torch.utils.data.Dataset):
    """Examples of different lengths: example 0 is 50 steps long, the others 5."""

    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x = [torch.randn(50 if i == 0 else 5, 2, generator=g, dtype=torch.float64) for i in range(200)]
        self.y = torch.randint(0, 3, (200,), generator=g)

    def __len__(self):
        return 200

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def pad_to_longest(samples):
    xs, ys = zip(*samples)
    return torch.nn.utils.rnn.pad_sequence(list(xs), batch_first=True), torch.stack(list(ys))


class MeanOverTime(Classifier):
    """Averages over the padded time axis, so the batch's length changes every example's gradient."""

    def __init__(self):
        super().__init__(d=2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x.mean(1)), y)


def test_the_blank_rows_take_a_sampled_examples_shape_not_example_0s():
    """A collate that pads to the longest example: a blank shaped like example 0 would stretch every batch to 50
    steps whether example 0 was sampled or not (a release that depends on an unsampled record); the blanks take the
    first sampled example's shape, so the release is the dynamic mode's."""
    grads, lengths = {}, {}
    for bound in (None, 48):
        torch.manual_seed(0)
        dp = DPSGD(noise_multiplier=1.1, max_grad_norm=1.0, seed=3, max_batch_size=bound)
        probe = GradProbe()
        loader = DataLoader(Sequences(), batch_size=20, collate_fn=pad_to_longest)
        trainer(max_epochs=1, callbacks=[dp, probe]).fit(MeanOverTime().double(), train_dataloaders=loader)
        grads[bound], lengths[bound] = probe.grads, [b[0].shape[1] for b in probe.batches]
    assert lengths[48] == lengths[None] and 5 in lengths[48]
    for g_static, g_dyn in zip(grads[48], grads[None]):
        for a, b in zip(g_static, g_dyn):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


class Normalized(Classifier):
    """Normalizes each input: a blank (all-zero) row gives 0/0, a non-finite loss and gradient."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x / x.norm(dim=1, keepdim=True)), y)


def test_non_finite_blank_rows_are_dropped_and_masked_and_the_counts_are_the_dynamic_modes():
    runs = {}
    for bound in (None, 48):
        torch.manual_seed(0)
        dp = DPSGD(noise_multiplier=1.1, max_grad_norm=1.5, seed=3, max_batch_size=bound)
        probe, logger = GradProbe(), ParamsLogger()
        x, y = blobs(200).tensors
        trainer(max_epochs=1, callbacks=[dp, probe], logger=logger, log_every_n_steps=1).fit(
            Normalized().double(), train_dataloaders=DataLoader(TensorDataset(x.double(), y), batch_size=20))
        runs[bound] = probe.grads, [m.get("nonprivate/clipped_fraction") for _, m in logger.metrics
                                    if "nonprivate/clipped_fraction" in m]
    (g_static, f_static), (g_dyn, f_dyn) = runs[48], runs[None]
    assert f_static == f_dyn and len(f_static) == 10 and any(0 < f < 1 for f in f_static)
    for a_step, b_step in zip(g_static, g_dyn):
        for a, b in zip(a_step, b_step):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_a_bound_often_exceeded_is_warned_about():
    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=0, max_batch_size=22)  # expected 20: overflow 0.28
    with pytest.warns(UserWarning, match="exceeds the bound with probability 0.28 per step"):
        trainer(max_steps=2, callbacks=[dp]).fit(Classifier(), BlobsData(n=200, batch_size=20))
