"""The one registry helper (lightning_dp/privacy/registry.py) and the five registries built on it."""

import doctest

import pytest

from lightning_dp.audit.attacks import LossAttack, MembershipAttack, resolve_attacks
from lightning_dp.privacy import registry as registry_module
from lightning_dp.privacy.accounting import ACCOUNTANTS, Accountant, DisjointPairPLDAccountant, get_accountant
from lightning_dp.privacy.registry import Registry


class Confidence(MembershipAttack):
    """An attack no one registered, named by its class path."""


class Outer:
    class Inner(MembershipAttack):
        pass


def test_module_examples():
    assert doctest.testmod(registry_module).failed == 0


def test_register_by_decorator_and_by_call_in_order():
    things = Registry("thing")

    @things.register("a")
    class A:
        pass

    assert things.register("b", len) is len
    assert list(things) == ["a", "b"] and things["a"] is A and len(things) == 2 and dict(things) == {"a": A, "b": len}
    assert things.register("a", A) is A  # the same definition again (a module imported twice): fine


def test_a_taken_name_is_refused_naming_both():
    things = Registry("thing")

    class A:
        pass

    class B:
        pass

    things.register("a", A)
    with pytest.raises(ValueError, match=r"thing 'a' is already registered \(.*\.A\), so .*\.B cannot take it; "
                                         "choose another name"):
        things.register("a", B)
    assert things.register("a", B, replace=True) is B and things["a"] is B


def test_an_object_of_another_kind_is_refused():
    with pytest.raises(TypeError, match=r"membership attack 'x': builtins.int is not a membership attack \("):
        Registry("membership attack", base=MembershipAttack).register("x", int)


def test_an_unknown_name_lists_the_names_and_the_closest():
    things = Registry("clipping strategy", argument="clipping")
    things.register("fixed", 1)
    things.register("quantile", 2)
    assert things.resolve("quantile") == 2
    with pytest.raises(ValueError) as err:
        things.resolve("quantil", hint="See the docs.")
    assert str(err.value) == ("clipping='quantil' is not a registered clipping strategy; choose one of ['fixed', "
                              "'quantile'] or a class path (package.module.ClassName). Did you mean 'quantile'? "
                              "See the docs.")
    with pytest.raises(ValueError, match=r"x=3 is not a registered clipping strategy; choose one of \['fixed', "
                                         r"'quantile'\] or a class path \(package.module.ClassName\)\.$"):
        things.resolve(3, argument="x")


def test_a_class_path_is_imported_and_checked():
    accountants = Registry("accountant", base=Accountant)
    assert accountants.resolve("lightning_dp.privacy.accounting.DisjointPairPLDAccountant") is DisjointPairPLDAccountant
    attacks = Registry("membership attack", base=MembershipAttack)
    assert attacks.resolve(f"{__name__}.Outer.Inner") is Outer.Inner  # a nested class
    with pytest.raises(ValueError, match=r"names <class 'lightning_dp.privacy.registry.Registry'>, which is not a "
                                         r"membership attack \(a lightning_dp.audit.attacks.MembershipAttack\)"):
        attacks.resolve("lightning_dp.privacy.registry.Registry")
    with pytest.raises(ValueError, match=r"'lightning_dp.privacy.registry' has no attribute 'Nope'"):
        attacks.resolve("lightning_dp.privacy.registry.Nope")
    with pytest.raises(ValueError, match="nor an importable class path: no module 'no_such_package'"):
        attacks.resolve("no_such_package.module.Attack")
    with pytest.raises(ValueError, match=r"not a registered accountant; choose one of \[\]\.$"):
        Registry("accountant", base=Accountant, class_paths=False).resolve(
            "lightning_dp.privacy.accounting.DisjointPairPLDAccountant")


def test_every_registry_refuses_an_unknown_name_the_same_way():
    from lightning_dp.callbacks.clipping import resolve_clip_strategy
    from lightning_dp.federated.parts import resolve_part

    for call, text in [(lambda: resolve_clip_strategy("quantil"), "clipping='quantil' is not a registered clipping "
                                                                  "strategy; choose one of ['fixed', "),
                       (lambda: resolve_attacks(["shadw"]), "--attacks='shadw' is not a registered membership attack"),
                       (lambda: resolve_part("aggregator", "kmean"), "aggregator='kmean' is not a registered "
                                                                     "aggregator part"),
                       (lambda: get_accountant("pdl"), "accountant='pdl' is not a registered accountant; choose one "
                                                       "of ['pld', 'rdp']. Did you mean 'pld'? 'pld' (privacy loss")]:
        with pytest.raises(ValueError, match="Did you mean") as err:
            call()
        assert str(err.value).startswith(text)
    with pytest.raises(ValueError, match="choose at least one of"):
        resolve_attacks([])


def test_accountants_are_named_not_imported():
    """An accountant saves its name and is rebuilt from it, so a class path (an unregistered name) is refused."""
    assert isinstance(ACCOUNTANTS, Registry) and get_accountant("RDP").name == "rdp"
    with pytest.raises(ValueError, match=r"choose one of \['pld', 'rdp'\]\. 'pld'"):
        get_accountant("lightning_dp.privacy.accounting.DisjointPairPLDAccountant")


def test_an_attack_can_be_named_by_class_path():
    attacks = resolve_attacks([f"{__name__}.Confidence", "loss", "lightning_dp.audit.attacks.LossAttack"])
    assert [type(a) for a in attacks] == [LossAttack, Confidence]  # registered ones first, each once
    assert [a.name for a in attacks] == ["loss", f"{__name__}.Confidence"]
    with pytest.raises(ValueError, match="which is not a membership attack"):
        resolve_attacks(["lightning_dp.privacy.registry.Registry"])


def test_clip_strategies_and_parts_can_be_named_by_class_path():
    from lightning_dp.callbacks.clipping import QuantileClip, resolve_clip_strategy
    from lightning_dp.federated.parts import FedAvg, resolve_part

    assert type(resolve_clip_strategy("lightning_dp.callbacks.clipping.QuantileClip")) is QuantileClip
    assert type(resolve_part("aggregator", "lightning_dp.federated.parts.FedAvg")) is FedAvg
    with pytest.raises(ValueError, match="which is not an aggregator part"):
        resolve_part("aggregator", "lightning_dp.federated.parts.UniformSelection")


def test_federated_parts_cannot_replace_a_registered_one():
    from lightning_dp.federated.parts import Aggregator, register_part

    with pytest.raises(ValueError, match="aggregator part 'fedavg' is already registered"):
        register_part("aggregator", "fedavg")(type("Impostor", (Aggregator,), {"aggregate": lambda *a, **k: None}))


def test_a_layer_rule_may_replace_a_built_in_one():
    """Layer rules are chosen by the layer's type, and a user may override a built-in rule (documented)."""
    from torch import nn

    from lightning_dp.privacy.grad_sample import LayerRule, register_rule, rule_for
    from lightning_dp.privacy.grad_sample.registry import _RULES

    built_in = rule_for(nn.Linear(2, 2))
    try:
        @register_rule(nn.Linear)
        class Mine(LayerRule):
            pass

        assert type(rule_for(nn.Linear(2, 2))) is Mine
    finally:
        _RULES.register(nn.Linear, built_in, replace=True)
    assert rule_for(nn.Linear(2, 2)) is built_in
    with pytest.raises(TypeError, match="is not a layer rule"):
        register_rule(nn.Tanh)(int)
