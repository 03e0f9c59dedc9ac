"""The argument checks every component shares (lightning_dp/checks.py)."""

import doctest
import math

import pytest
import torch

from lightning_dp import checks


def test_module_examples():
    assert doctest.testmod(checks).failed == 0


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "3", None])
def test_positive_int_refuses_what_is_not_one(value):
    with pytest.raises(ValueError, match=r"Owner: n=.* is not allowed: n must be a positive integer; fix"):
        checks.positive_int("n", value, owner="Owner", hint="fix")


def test_reals():
    assert checks.is_real(1) and checks.is_real(0.5) and not checks.is_real(True) and not checks.is_real("1")
    assert checks.is_real(torch.tensor(1.0).item()) and checks.is_real(math.nan)  # a type check; finiteness below
    assert checks.non_negative_real("x", 0) == 0.0
    for bad in (-1e-9, math.nan, math.inf):
        with pytest.raises(ValueError):
            checks.non_negative_real("x", bad)


def test_generator():
    g = torch.Generator().manual_seed(0)
    assert checks.generator("g", g) is g
    assert isinstance(checks.generator("g", None), torch.Generator)
    with pytest.raises(ValueError, match="must be a torch.Generator"):
        checks.generator("g", 0)
