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


def test_lookup_is_the_one_refusal_of_every_registry():
    from lightning_dp.audit.attacks import resolve_attacks
    from lightning_dp.callbacks.clipping import resolve_clip_strategy
    from lightning_dp.federated.parts import resolve_part

    assert checks.lookup("x", "a", {"a": 1}, what="thing") == 1
    for call, text in [(lambda: resolve_clip_strategy("quantil"), "clipping='quantil' is not a registered clipping "
                                                                  "strategy; choose one of ['fixed', "),
                       (lambda: resolve_attacks(["shadw"]), "--attacks='shadw' is not a registered membership attack"),
                       (lambda: resolve_part("aggregator", "kmean"), "aggregator='kmean' is not a registered "
                                                                     "aggregator part")]:
        with pytest.raises(ValueError, match="Did you mean") as err:
            call()
        assert str(err.value).startswith(text)
    with pytest.raises(ValueError, match="choose at least one of"):
        resolve_attacks([])


def test_free_name_refuses_another_class_under_a_taken_name():
    class A:
        pass

    class B:
        pass

    checks.free_name("thing", "a", A, {"a": A})  # the same class again: fine
    with pytest.raises(ValueError, match=r"thing 'a' is already registered \(.*A\); choose another name"):
        checks.free_name("thing", "a", B, {"a": A})


def test_federated_parts_cannot_replace_a_registered_one():
    from lightning_dp.federated.parts import Aggregator, register_part

    with pytest.raises(ValueError, match="aggregator part 'fedavg' is already registered"):
        register_part("aggregator", "fedavg")(type("Impostor", (Aggregator,), {"aggregate": lambda *a, **k: None}))


def test_generator():
    g = torch.Generator().manual_seed(0)
    assert checks.generator("g", g) is g
    assert isinstance(checks.generator("g", None), torch.Generator)
    with pytest.raises(ValueError, match="must be a torch.Generator"):
        checks.generator("g", 0)
