"""Fixtures of the privacy tests."""

from __future__ import annotations

import pytest

import lightning_dp.privacy.grad_sample.contributions as contributions


@pytest.fixture
def exact_norms(monkeypatch):
    """The engine's norms without the floor on examples whose positions' terms cancel (``term_floor``): tests that
    compare per-sample gradients with autograd's take it. An honest example whose terms cancel by construction (a
    convolution's bias before a GroupNorm, a few channels before a mean over positions) is clipped as if its norm were
    its floor, 1e-4 to 2e-3 above its own in these tests' batches; what the floor does to honest batches is
    test_layer_matrix.py::test_the_floor_moves_honest_norms_little, what it is for
    tests/privacy/test_cancellation.py."""
    monkeypatch.setattr(contributions, "CANCELLATION_RATIO", 1e300)
