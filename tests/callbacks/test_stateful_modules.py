"""Modules that keep state on themselves across training steps (issue 50, item 11).

Lightning's own ``LightningLSTM`` demo keeps its hidden state in ``self.hidden`` from one batch to the next: outside
per-example DP, refused before any step, and the batch probe leaves the module as it was. Caches the next step does
not read are accepted, and the probe leaves no trace in them either.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import LightningLSTM
from lightning.pytorch.demos.lstm import SimpleLSTM
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.callbacks import DPSGD
from lightning_dp.callbacks.batch_probe import BatchProbeError, ModuleState, _state_tensors
from tests.helpers import BlobsData, Classifier, trainer

VOCAB, T = 50, 6


class Tokens(L.LightningDataModule):
    """WikiText-2-like data at toy size: random token ids, each target the next token."""

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, VOCAB, (40, T + 1), generator=g)
        return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=8)


def demo_lstm(cls: type[LightningLSTM] = LightningLSTM) -> LightningLSTM:
    """The demo (or a subclass of it) as issue 50 ran it: dropout=0 (as DPSGD's dropout refusal advises), tiny, no
    download."""
    model = cls(vocab_size=VOCAB)
    model.model = SimpleLSTM(vocab_size=VOCAB, ninp=8, nhid=8, nlayers=2, dropout=0.0)
    model.prepare_data = lambda: None  # WikiText2(download=True)
    return model


def test_lightning_lstm_demo_is_refused_before_any_step_and_left_as_it_was():
    model = demo_lstm()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    before = {name: value for name, (_, _, value) in ModuleState(model).values.items()}
    fit = trainer(max_steps=2, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)])
    with pytest.raises(MisconfigurationException, match=r"keeps state from one batch for the next: self\.hidden "
                       r"\(holding a tensor of shape \(2, 3, 8\) after a batch of 3 examples, the examples along "
                       r"dimension 1\)") as info:
        fit.fit(model, Tokens())
    message = str(info.value)
    assert "beyond its clipped contribution" in message and "init_hidden(batch_size)" in message
    assert "Expected hidden" not in message
    assert fit.global_step == 0
    assert model.hidden is None  # the probe's hidden states are gone ...
    after = {name: value for name, (_, _, value) in ModuleState(model).values.items()}
    holding = {k for k, v in {**before, **after}.items() if _state_tensors(v)}  # _flat_weights holds parameters only
    assert holding == set() and after["self.hidden"] is before["self.hidden"] is None
    for n, p in model.named_parameters():  # ... and no step was taken
        assert torch.equal(p, params[n])


class CarriesAtEqualSizes(LightningLSTM):
    """Resets its hidden state only when the batch size changes: no crash in the probe, still carried."""

    def training_step(self, batch, batch_idx):
        if self.hidden is not None and self.hidden[0].size(1) != batch[0].size(0):
            self.hidden = None
        return super().training_step(batch, batch_idx)


def test_state_carried_between_batches_of_the_same_size_is_refused_too():
    model = demo_lstm(CarriesAtEqualSizes)
    with pytest.raises(MisconfigurationException,
                       match=r"CarriesAtEqualSizes\.training_step keeps state .*self\.hidden"):
        trainer(max_steps=2, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)]).fit(model, Tokens())
    assert model.hidden is None


class ResetsItsState(LightningLSTM):
    """The fix the refusal names: the initial hidden state computed for every batch."""

    def training_step(self, batch, batch_idx):
        self.hidden = None
        return super().training_step(batch, batch_idx)


def test_state_reset_in_every_step_trains():
    model = demo_lstm(ResetsItsState)
    fit = trainer(max_steps=2, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)])
    fit.fit(model, Tokens())
    assert fit.global_step == 2


class Caching(Classifier):
    """Harmless caches: the last loss (attached to the graph), the last predictions (one per example, detached),
    Lightning's list of step outputs for on_train_epoch_end, and a running count of examples (in place)."""

    def __init__(self):
        super().__init__()
        self.last_loss = None
        self.last_preds = None
        self.outputs: list[torch.Tensor] = []
        self.seen = torch.zeros((), dtype=torch.long)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.last_loss = loss
        self.last_preds = logits.argmax(1).detach()
        self.outputs.append(self.last_preds)
        self.seen += len(x)
        return loss


def test_caches_the_next_step_does_not_read_are_accepted_and_the_probe_leaves_no_trace_in_them():
    model = Caching()
    fit = trainer(max_steps=3, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)])
    fit.fit(model, BlobsData())
    assert fit.global_step == 3
    assert len(model.outputs) == 3  # the real steps' only: the probe's 3 appends were undone
    assert int(model.seen) == sum(len(p) for p in model.outputs)  # the in-place count too
    assert model.last_preds.shape == model.outputs[-1].shape


class Crashing(Classifier):
    def training_step(self, batch, batch_idx):
        if batch[0].shape[0] == 5:
            raise KeyError("no such feature")
        return super().training_step(batch, batch_idx)


def test_a_crash_of_the_modules_own_code_in_the_probe_says_where_with_the_original_chained():
    model = Crashing()
    with pytest.raises(BatchProbeError, match=r"KeyError: 'no such feature' -- raised by Crashing's own code in the "
                       r"batch probe \(DPSGD runs training_step on 3, 5 and 7 examples before the first step\), on a "
                       r"batch of 5 examples") as info:
        trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)]).fit(model, BlobsData())
    assert isinstance(info.value.__cause__, KeyError)


def test_module_state_puts_back_rebound_added_and_in_place_changed_tensors():
    m = nn.Linear(2, 2)
    m.kept = torch.ones(3)
    m.count = torch.zeros(())
    m.items = [torch.zeros(1)]
    state = ModuleState(m)
    kept = m.kept
    m.kept = torch.zeros(3)
    m.count += 1
    m.items.append(torch.ones(1))
    m.added = (torch.ones(2), torch.ones(2))
    m.plain = 3  # a Python number (a step counter): put back too; a string or a bool is not the probe's business
    m.label, m.flag = "x", True
    changed = state.changed()
    assert sorted(changed) == ["self.added", "self.count", "self.items", "self.kept", "self.plain"]
    state.restore(changed)
    assert m.kept is kept and float(m.count) == 0 and len(m.items) == 1 and not hasattr(m, "added")
    assert not hasattr(m, "plain") and m.label == "x" and m.flag is True
    assert state.changed() == {}
