"""Virtual batches (issue 25, item 1): a logical Poisson batch processed in micro-batches equals the unsplit step.

The reference is DPSGD on the unsplit batch (batch_size = k x micro-batch size), same seeds, in float64: the
split runs (Lightning's accumulate_grad_batches, DPSGD's max_physical_batch_size, both, a constant
GradientAccumulationScheduler) must release the same steps (same parameters to 1e-12, same accountant history,
same number of optimizer steps). Then every way the factor can change under a loader sampled for another is
refused before anything of the affected step is released, and so is a resume from the middle of a logical batch.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_dp.callbacks import DPSGD, OnlineSensitivity, QuantileClipping
from lightning_dp.callbacks import dp_sgd as dp_sgd_module
from lightning_dp.callbacks import virtual_batches
from lightning_dp.callbacks.private_step import PrivateStep
from tests.helpers import BlobsData, Classifier, blobs, trainer

N = 200


class DoubleBlobs(L.LightningDataModule):
    """The blobs in float64, ``batch_size`` examples expected per (micro-)batch."""

    def __init__(self, batch_size: int, n: int = N, shuffle: bool = True):
        super().__init__()
        self.batch_size, self.n, self.shuffle = batch_size, n, shuffle

    def setup(self, stage: str) -> None:
        x, y = blobs(self.n).tensors
        self.train_set = TensorDataset(x.double(), y)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle)


class Steps(L.Callback):
    """The batch sizes of every micro-batch and the number of each optimizer step (global_step before it)."""

    def __init__(self):
        self.sizes, self.steps = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.sizes.append(len(batch[0]))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps.append(trainer.global_step)


def _fit(batch_size, *, dp=None, epochs=2, callbacks=(), shuffle=True, **trainer_kwargs):
    torch.manual_seed(0)
    model = Classifier(lr=0.3).double()
    dp = dp if dp is not None else DPSGD(noise_multiplier=1.3, max_grad_norm=0.7, seed=17)
    steps = Steps()
    t = trainer(max_epochs=epochs, callbacks=[dp, steps, *callbacks], **trainer_kwargs)
    t.fit(model, DoubleBlobs(batch_size, shuffle=shuffle))
    return t, model, dp, steps


def _assert_same_run(a, b):
    (ta, ma, da, _), (tb, mb, db, _) = a, b
    assert ta.global_step == tb.global_step == da._released == db._released
    assert da.accountant.history == db.accountant.history
    assert da.epsilon == db.epsilon
    for p, q in zip(ma.parameters(), mb.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)


@pytest.fixture(scope="module")
def unsplit():
    """DPSGD on logical batches of expected size 40 (q = 0.2, 5 steps per epoch), 2 epochs."""
    return _fit(40)


def test_accumulate_grad_batches_equals_the_unsplit_step(unsplit):
    split = _fit(10, accumulate_grad_batches=4)
    _assert_same_run(unsplit, split)
    t, _, dp, steps = split
    assert dp.sample_rate == pytest.approx(0.2) and dp.data_facts.expected_batch_size == 40
    assert t.num_training_batches == 20 and len(steps.sizes) == 40  # 5 logical batches of 4 micro-batches per epoch
    assert steps.steps == list(range(10))  # one optimizer step per logical batch
    # the micro-batches of a logical batch are its split: together they are the unsplit batch's size
    logical = [sum(steps.sizes[i:i + 4]) for i in range(0, 40, 4)]
    assert logical == unsplit[3].sizes


def test_max_physical_batch_size_equals_the_unsplit_step(unsplit):
    seen = []

    class Passes(L.Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            seen.append(dp.private_step.batch_size)

    dp = DPSGD(noise_multiplier=1.3, max_grad_norm=0.7, seed=17, max_physical_batch_size=7)
    split = _fit(40, dp=dp, callbacks=[Passes()])
    _assert_same_run(unsplit, split)
    assert max(seen) <= 7 and sum(seen) == sum(unsplit[3].sizes)  # every example in one pass of at most 7
    assert len(seen) > len(unsplit[3].sizes)


def test_both_compose_and_equal_the_unsplit_step(unsplit):
    dp = DPSGD(noise_multiplier=1.3, max_grad_norm=0.7, seed=17, max_physical_batch_size=6)
    _assert_same_run(unsplit, _fit(20, dp=dp, accumulate_grad_batches=2))


def test_a_constant_gradient_accumulation_scheduler_equals_the_unsplit_step(unsplit):
    _assert_same_run(unsplit, _fit(10, callbacks=[GradientAccumulationScheduler({0: 4})]))


@pytest.mark.parametrize("kind", [OnlineSensitivity, QuantileClipping])
def test_the_adaptive_clipping_rules_release_the_same_steps(kind):
    make = lambda **kw: kind(noise_multiplier=1.3, seed=5, **kw)  # noqa: E731
    reference = _fit(40, dp=make())
    _assert_same_run(reference, _fit(10, dp=make(), accumulate_grad_batches=4))
    _assert_same_run(reference, _fit(40, dp=make(max_physical_batch_size=9)))
    assert reference[2].clipping.trace == _fit(10, dp=make(), accumulate_grad_batches=4)[2].clipping.trace


def test_shuffled_batches_accumulate_too():
    """poisson_sampling=False: k consecutive shuffled batches are one step (the permutation is the same)."""
    make = lambda: DPSGD(noise_multiplier=1.3, max_grad_norm=0.7, seed=3, poisson_sampling=False)  # noqa: E731
    reference = _fit(40, dp=make())
    split = _fit(10, dp=make(), accumulate_grad_batches=4)
    _assert_same_run(reference, split)
    assert split[2].data_facts.steps_per_epoch == 5
    # 30 batches of 7 per epoch (the last of 4): the last step of an epoch has 2 micro-batches, not 4
    t, _, dp, steps = _fit(7, dp=make(), accumulate_grad_batches=4, epochs=1)
    assert t.global_step == dp._released == 8 and dp.data_facts.expected_batch_size == 28


def test_an_empty_micro_batch_still_trains_and_releases():
    """A logical batch smaller than its number of parts gives empty micro-batches: they run (noise only)."""
    t, _, dp, steps = _fit(1, accumulate_grad_batches=8, epochs=1)  # q = 8 / 200, about 8 examples in 8 parts
    assert 0 in steps.sizes and t.global_step == dp._released == 25


def test_a_schedule_that_changes_without_reloading_the_data_is_refused_in_setup():
    with pytest.raises(MisconfigurationException) as info:
        _fit(10, callbacks=[GradientAccumulationScheduler({1: 4})])
    message = str(info.value)
    assert "changes accumulate_grad_batches from 1 to 4 at epoch 1" in message
    assert "reload_dataloaders_every_n_epochs=1" in message


def test_a_schedule_that_changes_where_the_data_is_reloaded_is_accounted_at_each_rate():
    t, _, dp, steps = _fit(10, callbacks=[GradientAccumulationScheduler({1: 4})], reload_dataloaders_every_n_epochs=1)
    # epoch 0: q = 10/200, 20 steps; epoch 1: q = 40/200, 5 steps
    rates = [q for _, q, count in dp.accountant.history for _ in range(count)]
    assert rates == [0.05] * 20 + [0.2] * 5
    assert t.global_step == 25 and len(steps.sizes) == 40


class SetAccumulation(L.Callback):
    """A user callback that sets ``trainer.accumulate_grad_batches`` at the start of an epoch."""

    def __init__(self, epoch: int, factor: int):
        self.epoch, self.factor = epoch, factor

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch >= self.epoch:
            trainer.accumulate_grad_batches = self.factor


def _released_only_epoch_zero(dp, model, reference):
    assert dp._released == 5  # the steps of epoch 0 (q = 0.2 at 4 x 10)
    for p, q in zip(model.parameters(), reference):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def _epoch_zero_params():
    _, model, _, _ = _fit(10, accumulate_grad_batches=4, epochs=1)
    return [p.detach().clone() for p in model.parameters()]


def test_a_callback_changing_the_factor_is_refused_before_the_first_micro_batch_of_the_epoch():
    reference = _epoch_zero_params()
    torch.manual_seed(0)
    model = Classifier(lr=0.3).double()
    dp = DPSGD(noise_multiplier=1.3, max_grad_norm=0.7, seed=17)
    with pytest.raises(MisconfigurationException, match="accumulate_grad_batches=2 .*before batch 0 of epoch 1"):
        trainer(max_epochs=2, accumulate_grad_batches=4, callbacks=[dp, SetAccumulation(1, 2)]).fit(
            model, DoubleBlobs(10))
    _released_only_epoch_zero(dp, model, reference)


def test_a_module_hook_changing_it_is_refused_before_the_backward():
    class Sneaky(Classifier):
        def on_train_batch_start(self, batch, batch_idx):
            if self.trainer.current_epoch == 1:
                self.trainer.accumulate_grad_batches = 2

    reference = _epoch_zero_params()
    torch.manual_seed(0)
    model = Sneaky(lr=0.3).double()
    dp = DPSGD(noise_multiplier=1.3, max_grad_norm=0.7, seed=17)
    with pytest.raises(MisconfigurationException, match="accumulate_grad_batches=2 .*before a backward in epoch 1"):
        trainer(max_epochs=2, accumulate_grad_batches=4, callbacks=[dp]).fit(model, DoubleBlobs(10))
    _released_only_epoch_zero(dp, model, reference)


def test_an_optimizer_step_in_the_middle_of_a_logical_batch_is_refused(monkeypatch):
    """The structural line, every value check bypassed: Lightning stepping before the last micro-batch (the factor
    lowered to 1 under data sampled for 4) is refused before the step, nothing of the partial batch released."""
    monkeypatch.setattr(PrivateStep, "check_accumulation", lambda self, trainer, when: None)
    reference = _epoch_zero_params()
    torch.manual_seed(0)
    model = Classifier(lr=0.3).double()
    dp = DPSGD(noise_multiplier=1.3, max_grad_norm=0.7, seed=17)
    with pytest.raises(MisconfigurationException, match="about to step after micro-batch 1 of 4"):
        trainer(max_epochs=2, accumulate_grad_batches=4, callbacks=[dp, SetAccumulation(1, 1)]).fit(
            model, DoubleBlobs(10))
    _released_only_epoch_zero(dp, model, reference)


def test_a_release_without_an_optimizer_step_is_refused_before_the_next_batch(monkeypatch):
    """The other structural line: the factor raised under data sampled for 1 micro-batch per step; the release of
    batch 0 is never applied, and the next batch is refused."""
    monkeypatch.setattr(PrivateStep, "check_accumulation", lambda self, trainer, when: None)
    torch.manual_seed(0)
    model = Classifier(lr=0.3).double()
    dp = DPSGD(noise_multiplier=1.3, max_grad_norm=0.7, seed=17)
    with pytest.raises(MisconfigurationException, match="released a step but the optimizer did not step"):
        trainer(max_epochs=2, callbacks=[dp, SetAccumulation(1, 4)]).fit(model, DoubleBlobs(40))
    assert dp._released == 5 + 1  # epoch 0, and the one release of epoch 1 that was never applied (accounted)


def test_limit_train_batches_that_cuts_a_logical_batch_is_refused():
    with pytest.raises(MisconfigurationException, match="not a multiple of accumulate_grad_batches=4"):
        _fit(10, accumulate_grad_batches=4, limit_train_batches=6)
    t, _, dp, _ = _fit(10, accumulate_grad_batches=4, limit_train_batches=8, epochs=1)
    assert t.global_step == dp._released == 2


def test_a_micro_batch_that_skips_its_backward_is_refused():
    class SkipsSome(Classifier):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                return None
            return super().training_step(batch, batch_idx)

    torch.manual_seed(0)
    dp = DPSGD(noise_multiplier=1.3, seed=1)
    with pytest.raises(MisconfigurationException, match="returned None for micro-batch 2 of 4"):
        trainer(max_epochs=1, accumulate_grad_batches=4, callbacks=[dp]).fit(SkipsSome().double(), DoubleBlobs(10))
    assert dp._released == 0


def test_resume_at_a_step_boundary_is_exact_and_in_the_middle_of_a_logical_batch_is_refused(tmp_path):
    full = _fit(10, accumulate_grad_batches=4, epochs=3)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=7, save_top_k=-1, filename="{step}")
    _fit(10, accumulate_grad_batches=4, epochs=3, callbacks=[ckpt], enable_checkpointing=True,
         default_root_dir=tmp_path)
    # step 7 is the third logical batch of epoch 1: a checkpoint in the middle of an epoch, at a step boundary
    torch.manual_seed(0)
    model = Classifier(lr=0.3).double()
    dp = DPSGD(noise_multiplier=1.3, max_grad_norm=0.7, seed=17)
    t = trainer(max_epochs=3, accumulate_grad_batches=4, callbacks=[dp])
    t.fit(model, DoubleBlobs(10), ckpt_path=str(tmp_path / "ckpts" / "step=7.ckpt"))
    _assert_same_run(full, (t, model, dp, None))

    class SaveInTheMiddle(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 5:  # micro-batch 2 of the second logical batch
                trainer.save_checkpoint(tmp_path / "middle.ckpt")

    _fit(10, accumulate_grad_batches=4, epochs=1, callbacks=[SaveInTheMiddle()])
    state = torch.load(tmp_path / "middle.ckpt", weights_only=False)
    assert next(v for k, v in state["callbacks"].items() if k.startswith("DPSGD"))["pending_micro_batches"] == 2
    with pytest.raises(MisconfigurationException, match="saved in the middle of a logical batch"):
        trainer(max_epochs=2, accumulate_grad_batches=4, callbacks=[DPSGD(noise_multiplier=1.3, seed=17)]).fit(
            Classifier().double(), DoubleBlobs(10), ckpt_path=str(tmp_path / "middle.ckpt"))


def test_the_plan_of_a_grid_run_uses_the_logical_rate_and_refuses_a_changing_schedule():
    data = DoubleBlobs(10)
    data.setup("fit")
    plan = DPSGD(noise_multiplier=1.0, seed=0, epochs=2).plan(trainer(max_epochs=2, accumulate_grad_batches=4),
                                                              data.train_dataloader())
    assert plan.sample_rate == pytest.approx(0.2) and plan.events == 10
    with pytest.raises(MisconfigurationException, match="lightning-dp grid plans one sampling rate per run"):
        DPSGD(noise_multiplier=1.0, seed=0, epochs=2).plan(
            trainer(max_epochs=2, callbacks=[GradientAccumulationScheduler({1: 2})]), data.train_dataloader())


def test_calibration_uses_the_logical_batch():
    """A target epsilon calibrates sigma for the logical rate and steps: equal to the unsplit run's sigma."""
    make = lambda **kw: DPSGD(target_epsilon=2.0, target_delta=1e-5, epochs=2, seed=1, **kw)  # noqa: E731
    a, b = make(), make()
    _fit(40, dp=a)
    _fit(10, dp=b, accumulate_grad_batches=4)
    assert a.noise_multiplier == b.noise_multiplier and a.epsilon == b.epsilon <= 2.0


class Texts(Dataset):
    """Examples with a string, a tensor and a shared (non-example) tensor in a dict."""

    def __init__(self, n: int = 60):
        x, y = blobs(n).tensors
        self.x, self.y = x.double(), y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "text": f"example {i}"}


class DictClassifier(Classifier):
    def training_step(self, batch, batch_idx):
        assert len(batch["text"]) == len(batch["x"])
        return F.cross_entropy(self(batch["x"]), batch["y"])


def test_chunks_keep_the_batch_structure():
    def fit(**kw):
        torch.manual_seed(0)
        model = DictClassifier(lr=0.3).double()
        dp = DPSGD(noise_multiplier=1.0, seed=4, **kw)
        trainer(max_epochs=1, callbacks=[dp]).fit(model, train_dataloaders=DataLoader(Texts(), batch_size=20))
        return [p.detach() for p in model.parameters()]

    for p, q in zip(fit(), fit(max_physical_batch_size=4)):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)


def test_a_batch_that_cannot_be_cut_is_refused_with_the_reason():
    class Folded(Classifier):
        """Adds a per-batch (B, B) matrix to the batch: no dimension of it is THE batch dimension."""

        def training_step(self, batch, batch_idx):
            x, y, _ = batch
            return F.cross_entropy(self(x), y)

    ds = TensorDataset(*blobs(60).tensors)

    def collate(items):
        x = torch.stack([i[0] for i in items])
        return x, torch.stack([i[1] for i in items]), torch.zeros(len(items), len(items))

    with pytest.raises(MisconfigurationException, match="cannot cut this batch of .* into chunks"):
        trainer(max_epochs=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0, max_physical_batch_size=4)]).fit(
            Folded(), train_dataloaders=DataLoader(ds, batch_size=20, collate_fn=collate))


def test_max_physical_batch_size_is_validated():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_physical_batch_size"):
            DPSGD(noise_multiplier=1.0, max_physical_batch_size=bad)


def test_params_and_summary_say_how_the_step_was_split(capsys):
    from tests.helpers import RecordingLogger

    logger = RecordingLogger()
    dp = DPSGD(noise_multiplier=1.0, seed=2, max_physical_batch_size=8)
    trainer(max_epochs=1, accumulate_grad_batches=2, logger=logger, callbacks=[dp]).fit(Classifier(), BlobsData())
    assert logger.params["privacy/accumulate_grad_batches"] == 2
    assert logger.params["privacy/max_physical_batch_size"] == 8
    assert logger.params["privacy/expected_batch_size"] == 40
    assert "2 micro-batch(es) per step, at most 8 examples per pass" in capsys.readouterr().out


def test_the_factor_read_for_the_data_is_the_schedulers_for_the_epoch():
    t = trainer(max_epochs=3, callbacks=[GradientAccumulationScheduler({0: 2, 2: 5})])
    assert virtual_batches.accumulation_factor(t) == 2
    assert dp_sgd_module.virtual_batches is virtual_batches
    assert virtual_batches.accumulation_factor(trainer(accumulate_grad_batches=3)) == 3
