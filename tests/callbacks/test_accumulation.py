"""Gradient accumulation is refused by DPSGD wherever Lightning can switch it on (issue 24, item 5).

With accumulation, Lightning runs several Poisson batches per optimizer step and DPSGD would clip, noise
and release the last one only, silently dropping the others. Each test checks that the refusal comes
before any accumulated batch is released: the number of released steps and the parameters are those of
the epochs before accumulation.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_dp.callbacks import DPSGD
from lightning_dp.callbacks import dp_sgd as dp_sgd_module
from tests.helpers import BlobsData, Classifier, trainer

STEPS_PER_EPOCH = 10  # ceil(200 / 20)


class Snapshot(L.Callback):
    """Records the parameters and the released-step count at the end of every epoch, and every optimizer step."""

    def __init__(self, dp: DPSGD):
        self.dp, self.epoch_params, self.steps = dp, [], []

    def on_train_epoch_end(self, trainer, pl_module):
        self.epoch_params.append([p.detach().clone() for p in pl_module.parameters()])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps.append((trainer.current_epoch, trainer.accumulate_grad_batches))


class SetAccumulation(L.Callback):
    """A user callback that sets ``trainer.accumulate_grad_batches`` directly at the start of an epoch."""

    def __init__(self, epoch: int, factor: int):
        self.epoch, self.factor = epoch, factor

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch >= self.epoch:
            trainer.accumulate_grad_batches = self.factor


def _assert_nothing_accumulated_was_released(dp, snap, model, epochs_done):
    assert dp._released == epochs_done * STEPS_PER_EPOCH  # only the steps of the plain epochs
    assert snap.steps == [(e, 1) for e in range(epochs_done) for _ in range(STEPS_PER_EPOCH)]
    if epochs_done:  # the model is the one of the end of the last plain epoch: no step after it
        for p, q in zip(model.parameters(), snap.epoch_params[-1]):
            torch.testing.assert_close(p.detach(), q, rtol=0, atol=0)


@pytest.mark.parametrize("scheduling", [{1: 4}, {0: 2}])
def test_a_gradient_accumulation_scheduler_is_refused_in_setup_with_its_schedule(scheduling):
    dp = DPSGD(noise_multiplier=1.0, seed=0)
    snap = Snapshot(dp)
    with pytest.raises(MisconfigurationException) as info:
        trainer(max_epochs=2, callbacks=[dp, GradientAccumulationScheduler(dict(scheduling)), snap]).fit(
            Classifier(), BlobsData())
    message = str(info.value)
    epoch, factor = next(iter(scheduling.items()))
    assert f"would set accumulate_grad_batches={factor} from epoch {epoch}" in message
    assert "GradientAccumulationScheduler(scheduling=" in message
    assert "silently dropping" in message and "larger batch_size" in message and "issue 25" in message
    assert dp._released == 0 and snap.steps == []  # refused before any step


def test_a_schedule_of_ones_only_is_accepted():
    dp = DPSGD(noise_multiplier=1.0, seed=0)
    t = trainer(max_epochs=2, callbacks=[dp, GradientAccumulationScheduler({0: 1, 1: 1})])
    t.fit(Classifier(), BlobsData())
    assert t.global_step == dp._released == 2 * STEPS_PER_EPOCH


@pytest.mark.parametrize("scheduler_first", [False, True])
def test_a_scheduler_setup_cannot_see_is_refused_before_the_first_batch_of_the_accumulated_epoch(
        monkeypatch, scheduler_first):
    """The setup check bypassed (as for a scheduler added after setup): the epoch-start hook (scheduler before
    DPSGD) or the batch-start hook (scheduler after DPSGD: it sets the value after DPSGD's epoch start) refuses,
    after the plain epoch 0 and before any step of epoch 1."""
    monkeypatch.setattr(dp_sgd_module, "_scheduled_accumulation", lambda callbacks: None)
    dp = DPSGD(noise_multiplier=1.0, seed=0)
    snap = Snapshot(dp)
    scheduler = GradientAccumulationScheduler({1: 4})
    callbacks = [scheduler, dp, snap] if scheduler_first else [dp, scheduler, snap]
    model = Classifier()
    where = "at the start of epoch 1" if scheduler_first else "before batch 0 of epoch 1"
    with pytest.raises(MisconfigurationException, match=f"accumulate_grad_batches=4 .*seen {where}"):
        trainer(max_epochs=3, callbacks=callbacks).fit(model, BlobsData())
    _assert_nothing_accumulated_was_released(dp, snap, model, epochs_done=1)


def test_a_callback_setting_accumulate_grad_batches_in_on_train_epoch_start_is_refused():
    dp = DPSGD(noise_multiplier=1.0, seed=0)
    snap = Snapshot(dp)
    model = Classifier()
    with pytest.raises(MisconfigurationException, match="accumulate_grad_batches=3 .*before batch 0 of epoch 1"):
        trainer(max_epochs=2, callbacks=[dp, SetAccumulation(epoch=1, factor=3), snap]).fit(model, BlobsData())
    _assert_nothing_accumulated_was_released(dp, snap, model, epochs_done=1)


@pytest.mark.parametrize("kind", ["OnlineSensitivity", "QuantileClipping"])
def test_the_adaptive_clipping_subclasses_refuse_it_the_same_way(kind):
    import lightning_dp.callbacks as callbacks

    dp = getattr(callbacks, kind)(noise_multiplier=1.1, seed=0)
    snap = Snapshot(dp)
    model = Classifier()
    with pytest.raises(MisconfigurationException, match="accumulate_grad_batches=2 .*before batch 0 of epoch 1"):
        trainer(max_epochs=2, callbacks=[dp, SetAccumulation(epoch=1, factor=2), snap]).fit(model, BlobsData())
    _assert_nothing_accumulated_was_released(dp, snap, model, epochs_done=1)
    with pytest.raises(MisconfigurationException, match="would set accumulate_grad_batches=2 from epoch 1"):
        trainer(max_epochs=2, callbacks=[getattr(callbacks, kind)(noise_multiplier=1.1, seed=0),
                                         GradientAccumulationScheduler({1: 2})]).fit(Classifier(), BlobsData())


def test_a_module_hook_setting_it_after_dpsgds_batch_start_is_refused_before_the_backward():
    class Sneaky(Classifier):
        def on_train_batch_start(self, batch, batch_idx):
            if self.trainer.current_epoch == 1:
                self.trainer.accumulate_grad_batches = 2

    dp = DPSGD(noise_multiplier=1.0, seed=0)
    snap = Snapshot(dp)
    model = Sneaky()
    with pytest.raises(MisconfigurationException, match="accumulate_grad_batches=2 .*before a backward in epoch 1"):
        trainer(max_epochs=2, callbacks=[dp, snap]).fit(model, BlobsData())
    _assert_nothing_accumulated_was_released(dp, snap, model, epochs_done=1)


def test_a_batch_whose_backward_was_never_released_stops_the_next_batch(monkeypatch):
    """The structural line: whatever switched accumulation on (here every value check is bypassed), a backward
    without a release is caught before the next batch, and nothing of the accumulated batches is released."""
    monkeypatch.setattr(DPSGD, "_refuse_accumulation", lambda self, trainer, when=None: None)
    dp = DPSGD(noise_multiplier=1.0, seed=0)
    snap = Snapshot(dp)
    model = Classifier()
    with pytest.raises(MisconfigurationException, match="ran backward without an optimizer step"):
        trainer(max_epochs=2, callbacks=[dp, SetAccumulation(epoch=1, factor=4), snap]).fit(model, BlobsData())
    _assert_nothing_accumulated_was_released(dp, snap, model, epochs_done=1)


def test_trainer_accumulate_grad_batches_is_still_refused_in_setup_and_by_plan():
    with pytest.raises(MisconfigurationException, match=r"accumulate_grad_batches=2 \(set on the Trainer\)"):
        trainer(max_steps=1, accumulate_grad_batches=2, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)]).fit(
            Classifier(), BlobsData())
    dp = DPSGD(noise_multiplier=1.0, seed=0, epochs=1)
    t = trainer(max_epochs=1, callbacks=[dp, GradientAccumulationScheduler({0: 2})])
    data = BlobsData()
    data.setup("fit")
    with pytest.raises(MisconfigurationException, match="would set accumulate_grad_batches=2 from epoch 0"):
        dp.plan(t, data.train_dataloader())


def test_the_plain_case_still_trains_every_epoch():
    dp = DPSGD(noise_multiplier=1.0, seed=0)
    snap = Snapshot(dp)
    t = trainer(max_epochs=2, callbacks=[dp, snap])
    t.fit(Classifier(), BlobsData())
    assert t.global_step == dp._released == 2 * STEPS_PER_EPOCH
    assert snap.steps == [(e, 1) for e in range(2) for _ in range(STEPS_PER_EPOCH)]
