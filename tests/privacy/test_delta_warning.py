"""The ``delta < 1/N`` rule (lightning_dp.privacy.delta): one function, one wording, for every accountant.

The components' own tests check that each one warns through this function (DPSGD in
tests/callbacks/test_dp_sgd.py, CentralGaussian in tests/federated/test_dp_fedavg.py, LocalDPSGD in
tests/federated/test_local_dp_round.py, ``lightning-dp epsilon`` in tests/commands/test_epsilon.py).
"""

from __future__ import annotations

import math
import re
import warnings

import pytest

import lightning_dp.privacy as privacy
from lightning_dp.privacy.delta import LargeDeltaWarning, check_delta_for_size


def _suggested(message):
    return float(re.search(r"e\.g\. ([0-9.e+-]+)\.$", message).group(1))


@pytest.mark.parametrize("delta, n, warns", [
    (0.3, 10, True),         # the reproduction: 10 clients, delta 0.3
    (0.1, 10, True),         # delta = 1/N exactly: publishing one of the N at random meets it
    (0.0999, 10, False),
    (1e-5, 60_000, False),
    (1e-4, 60_000, True),
    (0.5, 0, False),         # N unknown (0): nothing to say
])
def test_it_warns_exactly_when_delta_is_not_below_one_over_n(delta, n, warns):
    w = check_delta_for_size(delta, n)
    assert (w is not None) == warns
    if warns:
        assert isinstance(w, LargeDeltaWarning) and isinstance(w, UserWarning)
        message = str(w)
        assert message.startswith(f"DPSGD: target_delta={delta:g} is not below 1/N = {1 / n:.3g} (N = {n} training "
                                  "examples)")
        assert "one random example whole" in message and "even 0" in message
        assert _suggested(message) < 1 / n  # the advice is a delta that is below 1/N


@pytest.mark.parametrize("unit, counted, published", [
    ("examples", "training examples", "one random example"),
    ("clients", "training clients", "one random client's data"),
])
def test_the_unit_and_the_component_name_the_message(unit, counted, published):
    message = str(check_delta_for_size(0.3, 10, unit=unit, who="Someone", name="delta"))
    assert message.startswith(f"Someone: delta=0.3 is not below 1/N = 0.1 (N = 10 {counted})")
    assert f"publishes {published} whole" in message


def test_per_client_sizes_give_one_warning_naming_how_many_clients_and_the_largest():
    """delta >= 1/n_c exactly when n_c >= 1/delta: the LARGEST clients are exposed, and the advice is below
    1/max n_c."""
    w = check_delta_for_size(1e-3, [5000, 40, 1200, 12, 0], unit="records", who="LocalDPSGD", name="delta")
    message = str(w)
    assert message.startswith("LocalDPSGD: delta=0.001 is not below 1/N for 2 of 4 clients, those with N >= 1200 "
                              "(N = records of a client; the largest has N = 5000, 1/N = 0.0002)")
    assert _suggested(message) < 1 / 5000
    assert check_delta_for_size(1e-3, [999, 40, 12], unit="records") is None
    assert check_delta_for_size(1e-3, [], unit="records") is None


def test_an_unknown_unit_is_refused():
    with pytest.raises(ValueError, match="unit='rows' is not allowed"):
        check_delta_for_size(0.1, 10, unit="rows")


def test_it_is_exported_and_can_be_turned_into_a_refusal():
    assert privacy.check_delta_for_size is check_delta_for_size and privacy.LargeDeltaWarning is LargeDeltaWarning
    with warnings.catch_warnings():
        warnings.simplefilter("error", LargeDeltaWarning)
        with pytest.raises(LargeDeltaWarning, match="not below 1/N"):
            warnings.warn(check_delta_for_size(0.5, 4))


def test_the_suggestion_is_a_power_of_ten_an_order_below_one_over_n():
    for n in (3, 10, 50, 999, 60_000):
        suggested = _suggested(str(check_delta_for_size(0.99, n)))
        assert suggested < 1 / n <= 100 * suggested and math.log10(suggested) == round(math.log10(suggested))
