"""The planning of a DP-SGD run (lightning_dp.privacy.planning), against hand-computed values."""

from __future__ import annotations

import math

import pytest

from lightning_dp.privacy.planning import (
    DataFacts,
    event_shape,
    own_planned_events,
    planned_events,
    trainer_events,
    trainer_steps,
)


def test_data_facts_of_a_poisson_and_a_shuffled_loader():
    facts = DataFacts.of(dataset_size=1000, batch_size=32, world_size=2, parts=3, poisson_sampling=True)
    assert facts.expected_batch_size == 192 and facts.sample_rate == 192 / 1000
    assert facts.steps_per_epoch == math.ceil(1000 / 192) == 6 and facts.parts == 3
    shuffled = DataFacts.of(dataset_size=1000, batch_size=32, world_size=1, parts=2, poisson_sampling=False,
                            batches_per_epoch=32)
    assert shuffled.steps_per_epoch == 16  # 32 batches in micro-batches of 2
    with pytest.raises(ValueError, match="exceeds the training set size N=100; lower batch_size or accumulate"):
        DataFacts.of(dataset_size=100, batch_size=40, world_size=1, parts=3, poisson_sampling=True)
    with pytest.raises(ValueError, match="accumulate_grad_batches=0"):
        DataFacts.of(dataset_size=100, batch_size=4, world_size=1, parts=0, poisson_sampling=True)
    with pytest.raises(ValueError, match="batches_per_epoch"):
        DataFacts.of(dataset_size=100, batch_size=4, world_size=1, parts=1, poisson_sampling=False)


def test_an_empty_training_set_is_named_as_such_not_as_a_batch_size_to_lower():
    """N = 0 (issue 50, item 12): no batch size can help, so the message says the data is empty and where to look."""
    for parts in (1, 2):
        with pytest.raises(ValueError, match=r"training set is empty \(N=0\).*check the DataModule's data_dir") as info:
            DataFacts.of(dataset_size=0, batch_size=10, world_size=1, parts=parts, poisson_sampling=True)
        assert "lower batch_size" not in str(info.value)


def test_one_event_shape_for_accounting_and_calibration():
    """Poisson: one subsampled Gaussian per step; shuffled: one Gaussian per epoch at sigma / 2 (a clipped sum moves
    by 2C under replacement): a sigma calibrated for the event is sigma_event / scale."""
    assert event_shape(True, 0.01) == (0.01, 1.0)
    assert event_shape(False, 0.01) == (1.0, 0.5)
    q, scale = event_shape(False, 0.01)
    assert 1.3 / scale == 2 * 1.3


@pytest.mark.parametrize("poisson, epochs, max_steps, expected", [
    (True, 3, None, 30), (True, None, 25, 25), (True, None, None, None),
    (False, 3, None, 3), (False, None, 25, 3),  # 25 steps of 10 per epoch touch 3 epochs
])
def test_own_planned_events(poisson, epochs, max_steps, expected):
    facts = DataFacts.of(dataset_size=100, batch_size=10, world_size=1, parts=1, poisson_sampling=poisson,
                         batches_per_epoch=10)
    assert own_planned_events(facts, poisson, epochs=epochs, max_steps=max_steps) == expected


def test_the_trainers_limits_and_the_choice_between_two_plans():
    facts = DataFacts.of(dataset_size=100, batch_size=10, world_size=1, parts=1, poisson_sampling=True)
    assert trainer_steps(facts, max_epochs=3, max_steps=-1) == 30
    assert trainer_steps(facts, max_epochs=3, max_steps=12) == 12
    assert trainer_steps(facts, max_epochs=None, max_steps=None) is None
    assert trainer_events(facts, False, max_epochs=3, max_steps=12) == 2  # 12 steps of 10 per epoch: 2 epochs
    assert planned_events(30, 12, "auto") == 12 and planned_events(30, 12, "callback") == 30
    assert planned_events(30, 12, "trainer") == 12 and planned_events(None, 12, "callback") == 12
    assert planned_events(None, None, "auto") is None
