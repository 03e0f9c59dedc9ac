"""Tests of the per-client d-privacy ledger: summation, caps, statistics, checkpointing."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch

from lightning_dp.privacy.ledger import PrivacyLedger


def _filled() -> PrivacyLedger:
    ledger = PrivacyLedger()
    for client_id, cost in [("alice", 2.5), (3, 1.0), ("alice", 2.5), ("bob", 4.0), (3, 1.0), (3, 1.0)]:
        ledger.charge(client_id, cost)
    return ledger


def test_charges_sum_per_client() -> None:
    ledger = _filled()
    assert ledger.spent("alice") == 5.0 and ledger.spent(3) == 3.0 and ledger.spent("bob") == 4.0
    assert ledger.participations("alice") == 2 and ledger.participations(3) == 3 and ledger.participations("bob") == 1
    assert ledger.spent("carol") == 0.0 and ledger.participations("carol") == 0
    assert len(ledger) == 3 and "alice" in ledger and "carol" not in ledger
    assert ledger.as_dict() == {"alice": 5.0, 3: 3.0, "bob": 4.0}
    # str and int ids are different clients: "3" was never charged.
    assert ledger.spent("3") == 0.0
    ledger.as_dict()["alice"] = 0.0  # a copy
    assert ledger.spent("alice") == 5.0


def test_zero_and_infinite_costs() -> None:
    ledger = PrivacyLedger()
    ledger.charge("a", 0.0)
    assert ledger.spent("a") == 0.0 and ledger.participations("a") == 1 and len(ledger) == 1
    ledger.charge("a", math.inf)  # a release without noise (noise_multiplier = 0)
    assert ledger.spent("a") == math.inf
    assert ledger.would_exceed("a", 0.0, cap=1e300)
    assert not ledger.would_exceed("a", 0.0, cap=math.inf)


def test_cap_logic() -> None:
    ledger = _filled()  # alice spent 5.0
    assert not ledger.would_exceed("alice", 5.0, cap=10.0)  # exactly at the cap is allowed
    assert ledger.would_exceed("alice", 5.0 + 1e-12, cap=10.0)
    assert ledger.would_exceed("alice", 0.0, cap=4.9)
    assert not ledger.would_exceed("carol", 10.0, cap=10.0)  # unseen clients start at 0
    assert ledger.would_exceed("carol", 10.5, cap=10.0)
    assert ledger.spent("alice") == 5.0 and ledger.participations("alice") == 2  # nothing was recorded


def test_median_and_max() -> None:
    empty = PrivacyLedger()
    assert empty.median() == 0.0 and empty.max() == 0.0 and len(empty) == 0
    ledger = _filled()  # 5.0, 3.0, 4.0
    assert ledger.median() == 4.0 and ledger.max() == 5.0
    ledger.charge("dave", 1.0)  # 5, 3, 4, 1: even count, mean of the middle two
    assert ledger.median() == 3.5 and ledger.max() == 5.0
    assert isinstance(ledger.median(), float)


def test_state_dict_round_trips_through_json_and_keeps_id_types() -> None:
    ledger = _filled()
    ledger.charge(10**12, 0.1)
    ledger.charge("inf-client", math.inf)
    text = json.dumps(ledger.state_dict())
    restored = PrivacyLedger()
    restored.load_state_dict(json.loads(text))
    assert restored.as_dict() == ledger.as_dict()
    assert [type(k) for k in restored.as_dict()] == [type(k) for k in ledger.as_dict()]
    assert all(restored.participations(k) == ledger.participations(k) for k in ledger.as_dict())
    assert restored.state_dict() == ledger.state_dict()
    # The resumed ledger continues with exactly the numbers of the uninterrupted one.
    ledger.charge("alice", 0.1)
    restored.charge("alice", 0.1)
    assert restored.spent("alice") == ledger.spent("alice")


def test_state_dict_is_safe_for_torch_checkpoints() -> None:
    ledger = _filled()
    buffer = io.BytesIO()
    torch.save({"ledger": ledger.state_dict()}, buffer)
    buffer.seek(0)
    restored = PrivacyLedger()
    restored.load_state_dict(torch.load(buffer, weights_only=True)["ledger"])
    assert restored.as_dict() == ledger.as_dict()


def test_load_replaces_the_state() -> None:
    ledger = _filled()
    other = PrivacyLedger()
    other.charge("zoe", 7.0)
    ledger.load_state_dict(other.state_dict())
    assert ledger.as_dict() == {"zoe": 7.0} and ledger.spent("alice") == 0.0 and len(ledger) == 1
    ledger.load_state_dict({"clients": []})
    assert len(ledger) == 0 and ledger.max() == 0.0


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ([], "must be a dict"),
        ({"clients": "alice"}, "must be a dict"),
        ({"clients": [["alice", 1.0]]}, r"\[client_id, spent, participations\]"),
        ({"clients": [["alice", -1.0, 1]]}, r"cost=-1.0"),
        ({"clients": [["alice", 1.0, 0]]}, r"participations of client 'alice'"),
        ({"clients": [[1.5, 1.0, 1]]}, r"client_id=1.5"),
        ({"clients": [["a", 1.0, 1], ["a", 2.0, 1]]}, "appears twice"),
    ],
)
def test_load_rejects_malformed_states_and_keeps_the_ledger(state: object, message: str) -> None:
    ledger = _filled()
    before = ledger.state_dict()
    with pytest.raises(ValueError, match=message):
        ledger.load_state_dict(state)
    assert ledger.state_dict() == before


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda ledger: ledger.charge("a", -0.5), r"cost=-0.5 .*>= 0"),
        (lambda ledger: ledger.charge("a", math.nan), r"cost=nan"),
        (lambda ledger: ledger.charge("a", "1"), r"cost='1'"),
        (lambda ledger: ledger.charge(1.0, 1.0), r"client_id=1.0 .*str or an int"),
        (lambda ledger: ledger.charge(True, 1.0), r"client_id=True"),
        (lambda ledger: ledger.charge(("a",), 1.0), r"client_id=\('a',\)"),
        (lambda ledger: ledger.would_exceed("a", 1.0, cap=0.0), r"cap=0.0 .*> 0"),
        (lambda ledger: ledger.would_exceed("a", 1.0, cap=-2), r"cap=-2"),
        (lambda ledger: ledger.would_exceed("a", 1.0, cap=math.nan), r"cap=nan"),
        (lambda ledger: ledger.would_exceed("a", -1.0, cap=1.0), r"cost=-1.0"),
    ],
)
def test_invalid_arguments(call, message: str) -> None:
    ledger = PrivacyLedger()
    with pytest.raises(ValueError, match=message):
        call(ledger)
    assert len(ledger) == 0
