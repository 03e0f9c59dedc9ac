"""The non-finite policy's one home (lightning_dp/privacy/finite.py; issue 49)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dp.privacy.finite import drop_non_finite, non_finite


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_row_with_one_non_finite_entry_becomes_its_origin(value):
    rows = torch.arange(12, dtype=torch.float64).reshape(4, 3)
    origin = -torch.ones(4, 3, dtype=torch.float64)
    rows[2, 1] = value
    kept, dropped = drop_non_finite(rows, origin)
    assert dropped.tolist() == [False, False, True, False]
    assert torch.equal(kept[2], origin[2]) and torch.equal(kept[[0, 1, 3]], rows[[0, 1, 3]])
    assert bool(torch.isfinite(kept).all())


def test_the_origin_broadcasts_and_defaults_to_zero():
    rows = torch.ones(2, 5, 3)  # (clients, examples, P): per-example gradients of two clients
    rows[1, 4, 0] = math.nan
    kept, dropped = drop_non_finite(rows)
    assert dropped.shape == (2, 5) and dropped.sum() == 1 and bool(dropped[1, 4])
    assert kept[1, 4].eq(0).all() and kept.sum() == 3 * 9
    start = torch.tensor([7.0, 8.0, 9.0])  # one start for every row (a view of the global model)
    kept, _ = drop_non_finite(rows[1], start)
    assert torch.equal(kept[4], start)


def test_finite_rows_are_returned_as_they_are():
    rows = torch.randn(5, 4)
    kept, dropped = drop_non_finite(rows, torch.zeros(4))
    assert kept is rows and not dropped.any()


def test_per_unit_values():
    norms = torch.tensor([1.0, math.inf, math.nan, 0.0])
    assert non_finite(norms).tolist() == [False, True, True, False]
    kept, dropped = drop_non_finite(norms)
    assert kept.tolist() == [1.0, 0.0, 0.0, 0.0] and dropped.tolist() == [False, True, True, False]


def test_a_finite_model_an_infinite_step_from_its_start_is_dropped():
    """float32 near its largest value: the model is finite, the update (trained - start) is not."""
    big = torch.finfo(torch.float32).max
    start = torch.tensor([[-big, 0.0], [1.0, 2.0]])
    trained = torch.tensor([[big, 0.0], [1.5, 2.5]])
    assert bool(torch.isfinite(trained).all()) and not bool(torch.isfinite(trained - start).all())
    kept, dropped = drop_non_finite(trained, start)
    assert dropped.tolist() == [True, False] and torch.equal(kept[0], start[0]) and torch.equal(kept[1], trained[1])
