"""The personalized round reproduces, seed for seed, the runs stored before it was split into parts (issue 14)."""

from __future__ import annotations

import json

import pytest

from tests.federated.reference_runs import CONFIGS, STORE, run

STORED = json.loads(STORE.read_text())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_stored_run_is_reproduced_exactly(name):
    got = run(name)
    assert got == STORED[name]  # hypotheses (float32 values), per-client ledger, validation losses, rounds
